"""Fine-tuning: a run's model started from a checkpoint, with its own learning rates.

``build_model_for(cfg)`` builds the run's model (``build.build_run_model``: body, task
head, adapters, frozen parts) and copies in the weights of ``train.init_from``, matched by
name and shape: the head is new where the task differs, and every tensor not carried over
is named. A sharded run (built on the meta device, materialised shard by shard) does the
same matching on shapes alone and then each rank reads only its own part of the base
(``init_sharded``): loading it whole would put the whole base on every rank. A resume of a
one-process checkpoint into a sharded layout reads its weights and moments in parts the
same way (``resume_in_parts``). ``lr_scale``
gives each parameter its share of ``train.lr``: layer-wise decay (Clark et al. 2020,
ELECTRA; ``decay ** (depth from the top)``) and a separate head rate.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..parallel.checkpoint import DCP_DIR, read_parts
from ..parallel.tensor import RowOrder
from ..paths import WEIGHTS
from ..run_config import RunConfig
from .adapter import HEAD
from .build import build_run_model
from .checkpoint import InitReport, check_base_arch, load_matching, match_weights, resolve_checkpoint
from .optim import param_groups

_BLOCK = re.compile(r"(?:^|\.)(encoder|decoder)\.blocks\.(\d+)\.")


def build_model_for(cfg: RunConfig, *, seed: int | None = None, device: Any = None, log: Any = print,
                    load_init: bool = True) -> nn.Module:
    """The model of a run, with the weights of ``train.init_from`` unless ``load_init=False``
    (a checkpoint that holds all its weights is loaded next anyway)."""
    model = build_run_model(cfg, seed=seed)
    if load_init and cfg.train.init_from:
        init_from(model, cfg, log)
    return model if device is None else model.to(device)


def init_from(model: nn.Module, cfg: RunConfig, log: Any = print) -> InitReport:
    """Copy the weights of checkpoint ``cfg.train.init_from`` into ``model`` by name and shape,
    and log what was and was not carried over."""
    report = load_matching(model, cfg.train.init_from, cfg)
    if log is not None:
        log(report.describe(cfg.train.init_from))
    return report


def reads_in_parts(source: str | Path) -> bool:
    """Whether checkpoint ``source`` holds its weights itself (``model.safetensors`` or ``dcp/``),
    so that a sharded run can read them in parts; a LoRA checkpoint (an adapter over a base
    elsewhere) is merged whole instead."""
    path = resolve_checkpoint(source)
    return (path / WEIGHTS).is_file() or (path / DCP_DIR).is_dir()


def init_sharded(model: nn.Module, cfg: RunConfig, rows: RowOrder | None, log: Any = print) -> InitReport:
    """``init_from`` for this rank's shards of the materialised ``model`` (FSDP/TP DTensors, or
    a pipeline rank's stages): the one-process matching, on shapes, then each rank reads its
    part of the base only (``parallel.checkpoint.read_parts``; a collective for a ``dcp/``)."""
    source = resolve_checkpoint(cfg.train.init_from)
    base_cfg = check_base_arch(source, cfg)
    base, aliases = _shapes(base_cfg)
    report, keys = match_weights(_shapes(cfg)[0], base, base_cfg, cfg, target_is_task=False)
    read_parts(source, _held(model, keys, aliases), rows or RowOrder())
    if log is not None:
        log(report.describe(cfg.train.init_from))
    return report


def resumes_in_parts(runtime: Any, checkpoint: Path | None, state: dict | None) -> bool:
    """Whether a parallel run resumes a checkpoint that one process wrote (weights in
    ``model.safetensors``, the optimizer state in ``trainer_state.pt``): readable in parts."""
    return (checkpoint is not None and runtime.parallel and "optimizer" in state
            and (checkpoint / WEIGHTS).is_file())


def resume_in_parts(model: nn.Module, cfg: RunConfig, checkpoint: Path, state: dict, rows: RowOrder | None) -> dict:
    """A resume of this run's one-process ``checkpoint`` into a sharded layout: each rank reads
    its part of ``model.safetensors`` into its shards of the materialised ``model``; returns the
    optimizer state (``state``'s, tensors mapped from the file) keyed by parameter name, for
    ``parallel.checkpoint.load_optimizer_state`` to copy each rank's part of the moments from."""
    with torch.device("meta"):  # its names, and the parameters' order as the one process's optimizer numbered them
        whole = build_run_model(cfg)
    aliases = _shapes_of(whole)[1]
    read_parts(checkpoint, _held(model, {name: name for name in aliases}, aliases), rows or RowOrder())
    saved = state["optimizer"]
    names = {id(p): name for name, p in whole.named_parameters()}
    order = [names[id(p)] for g in param_groups(whole, cfg.train.weight_decay, lr_scale(whole, cfg), cfg.train.lr)
             for p in g["params"]]
    held = sorted(i for g in saved["param_groups"] for i in g["params"])
    if held != list(range(len(order))):
        raise UsageError(f"{checkpoint / 'trainer_state.pt'}: an optimizer over {len(held)} parameters; expected "
                         f"{len(order)}, this run's (the checkpoint written with its config.json)")
    return {"state": {order[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}


def _held(model: nn.Module, keys: dict[str, str], aliases: dict[str, list[str]]
          ) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """name -> (this rank's tensor, the names the checkpoint may hold it under) for the names of
    ``keys`` (name -> the base's key) this rank holds: sharded DTensors, or its stages' tensors."""
    held = model.state_dict(keep_vars=True)
    wanted: dict[str, tuple[torch.Tensor, list[str]]] = {}
    for name, key in keys.items():
        if name in held and not any(held[name] is t for t, _ in wanted.values()):  # a tied table once
            wanted[name] = (held[name], aliases[key])
    return wanted


def _shapes(cfg: RunConfig) -> tuple[dict[str, torch.Size], dict[str, list[str]]]:
    """name -> shape of every tensor in the state dict of ``cfg``'s run model (built on the
    meta device: no storage), and name -> the names of its tied table (a file holds one)."""
    with torch.device("meta"):
        return _shapes_of(build_run_model(cfg))


def _shapes_of(model: nn.Module) -> tuple[dict[str, torch.Size], dict[str, list[str]]]:
    tensors = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(id(t), []).append(name)
    return {name: t.shape for name, t in tensors.items()}, {name: groups[id(t)] for name, t in tensors.items()}


# ---------------------------------------------------------------------- learning rates
def lr_scale(model: nn.Module, cfg: RunConfig) -> Callable[[str], float]:
    """Parameter name -> multiplier of ``train.lr``. Layer-wise decay counts depth in blocks
    from the top (an encoder-decoder's decoder sits above its encoder): the embeddings get
    ``decay ** (L + 1)``, block ``i`` of ``L`` gets ``decay ** (L - i)``, the rest 1; the task
    head gets ``train.head_lr / train.lr`` when ``head_lr`` is set."""
    tc, mc = cfg.train, cfg.model
    n_below = {"encoder": 0, "decoder": mc.n_encoder_layers or 0} if mc.arch == "encoder-decoder" else {}
    total = mc.total_layers
    head_scale = tc.head_lr / tc.lr if tc.head_lr > 0 else 1.0
    is_task = isinstance(model, TaskModel)

    def scale(name: str) -> float:
        if is_task and name.startswith(HEAD):
            return head_scale
        if tc.layer_lr_decay == 1.0:
            return 1.0
        m = _BLOCK.search(name)
        if m:
            depth = n_below.get(m.group(1), 0) + int(m.group(2)) + 1  # 1..L
        elif "embed." in name:
            depth = 0
        else:
            depth = total + 1
        return tc.layer_lr_decay ** (total + 1 - depth)

    return scale


