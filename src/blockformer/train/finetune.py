"""Fine-tuning: a run's model started from a checkpoint, with its own learning rates.

``build_model_for(cfg)`` builds the run's model (``build.build_run_model``: body, task
head, adapters, frozen parts) and copies in the weights of ``train.init_from``, matched by
name and shape: the head is new where the task differs, and every tensor not carried over
is named. A sharded run (built on the meta device, materialised shard by shard) does the
same matching on shapes alone and then each rank reads only its own part of the base
(``init_sharded``): loading it whole would put the whole base on every rank. A LoRA
checkpoint is composed in parts: each rank's block of its base, plus its block of each
adapter's ``scale * B A``, the base checked against the adapter's fingerprint by one rank
reading it a few rows at a time (``_read_adapted``); a LoRA checkpoint over another one is
composed down the chain, from the bottom base up. A resume of a one-process checkpoint
into a sharded layout reads its weights and moments in parts the same way
(``resume_in_parts``). ``lr_scale`` gives each parameter its share of ``train.lr``: layer-wise decay (Clark et al. 2020,
ELECTRA; ``decay ** (depth from the top)``) and a separate head rate.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..nn.lora import LORA_MARK, LoRALinear
from ..parallel.checkpoint import DCP_DIR, add_parts, dcp_reader, read_parts
from ..parallel.tensor import RowOrder
from ..paths import WEIGHTS
from ..run_config import RunConfig
from .adapter import (ADAPTER, HEAD, LowRankRows, adapter_base, base_names, check_adapter_names, fingerprint_of,
                      marked_ties, recorded_fingerprint, refuse_changed_base)
from .build import build_run_model
from .checkpoint import resolve_checkpoint
from .load import InitReport, check_base_arch, load_matching, match_weights, read_config
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


@dataclass
class InitParts:
    """How a sharded run reads an ``init_from`` checkpoint in parts (``parts_of``)."""
    source: Path  # the checkpoint directory, resolved
    adapted: _Adapted | None  # a LoRA checkpoint: its base and its adapters, composed


def parts_of(source: str | Path) -> InitParts | None:
    """How a sharded run can read checkpoint ``source`` in parts, or None where it is merged
    whole: it holds its weights itself (``model.safetensors`` or ``dcp/``), or it is a LoRA
    checkpoint whose base does and gives every base tensor (``_adapted``)."""
    path = resolve_checkpoint(source)
    adapted = _adapted(path)
    if adapted is None and not (path / WEIGHTS).is_file() and not (path / DCP_DIR).is_dir():
        return None
    return InitParts(path, adapted)


def init_sharded(model: nn.Module, cfg: RunConfig, parts: InitParts, rows: RowOrder | None, log: Any = print
                 ) -> InitReport:
    """``init_from`` for this rank's shards of the materialised ``model`` (FSDP/TP DTensors, or
    a pipeline rank's stages) from ``parts`` (``parts_of`` of ``cfg.train.init_from``): the
    one-process matching, on shapes, then each rank reads its part of the base only
    (``parallel.checkpoint.read_parts``; a collective for a ``dcp/``). A LoRA checkpoint's
    merged weights are composed in parts the same way (``_read_adapted``)."""
    base_cfg = check_base_arch(parts.source, cfg)
    base, aliases = _shapes(base_cfg)
    report, keys = match_weights(_shapes(cfg)[0], base, base_cfg, cfg, target_is_task=False)
    wanted, rows = _held(model, keys, aliases), rows or RowOrder()
    if parts.adapted is None:
        read_parts(parts.source, wanted, rows)
    else:
        _read_adapted(parts.adapted, {name: (target, keys[name]) for name, (target, _) in wanted.items()}, rows)
    if log is not None:
        log(report.describe(cfg.train.init_from))
    return report


@dataclass
class _Adapted:
    """Where each tensor of a LoRA checkpoint, merged (``scale * B A`` folded into its base
    weights), comes from, found on meta builds of it and of its base."""
    directory: Path  # the LoRA checkpoint: adapter.safetensors holds its adapters and a task head
    base: Path  # the checkpoint its adapter was trained on, with model.safetensors or dcp/, or a LoRA one
    under: _Adapted | None  # the base's own plan where the base is a LoRA checkpoint too
    keys: dict[str, str]  # its name -> the base model's name for it
    aliases: dict[str, list[str]]  # a base model name -> the names its file may hold it under (ties)
    stored: set[str]  # the names its adapter.safetensors holds
    layers: dict[str, LoRALinear]  # an adapted weight's name -> its (meta) layer: parts, scale, factor names
    fingerprinted: list[tuple[str, torch.dtype, torch.Size, bool]]  # base_fingerprint's entries, no values

    def chain(self) -> list[_Adapted]:
        """This plan and the plans below it, down to the one whose base holds weights."""
        return [self] + (self.under.chain() if self.under is not None else [])


_MAX_CHAIN = 16  # LoRA checkpoints over LoRA checkpoints: past this many, merged whole (a cycle, surely)


def _adapted(source: Path, depth: int = 0) -> _Adapted | None:
    """``source`` read in parts as a LoRA checkpoint, or None where it is not one, or a base
    tensor of the LoRA model is not in the base (its value would be that run's random draw),
    or its base is neither weights (``model.safetensors``, ``dcp/``) nor a LoRA checkpoint that
    reads in parts itself: those merge whole. A LoRA checkpoint over a LoRA checkpoint is
    composed from the bottom base up, each adapter's update added in turn."""
    if not (source / ADAPTER).is_file() or depth >= _MAX_CHAIN:
        return None
    lora_cfg = read_config(source)
    base = resolve_checkpoint(adapter_base(source))
    under = None
    if not (base / WEIGHTS).is_file() and not (base / DCP_DIR).is_dir():
        under = _adapted(base, depth + 1)
        if under is None:
            return None
    base_cfg = check_base_arch(base, lora_cfg)
    with torch.device("meta"):
        lora_model, base_model = build_run_model(lora_cfg), build_run_model(base_cfg)
    shapes, aliases = _shapes_of(base_model)
    tensors = lora_model.state_dict(keep_vars=True)
    _, keys = match_weights({n: t.shape for n, t in tensors.items()}, shapes, base_cfg, lora_cfg,
                            isinstance(lora_model, TaskModel))
    names = base_names(lora_model)
    if any(n not in keys for n in names):
        return None
    with safe_open(str(source / ADAPTER), framework="pt") as f:
        stored = set(f.keys())
    check_adapter_names(source / ADAPTER, stored, lora_model)
    entries = [(n, t.dtype, t.shape, tied) for n, t, tied in marked_ties(((n, tensors[n]) for n in names), id)]
    layers = {f"{prefix}.weight": m for prefix, m in lora_model.named_modules() if isinstance(m, LoRALinear)}
    return _Adapted(source, base, under, keys, aliases, stored, layers, entries)


def _read_adapted(adapted: _Adapted, wanted: dict[str, tuple[torch.Tensor, str]], rows: RowOrder) -> None:
    """This rank's part of a LoRA checkpoint's merged weights into ``wanted`` (name -> its
    target, and the LoRA model's name for it). The base is checked against the adapter's
    fingerprint first, on rank 0, a streamed read, told to all."""
    _check_base_once(adapted)
    _compose(adapted, wanted, rows)


def _compose(adapted: _Adapted, wanted: dict[str, tuple[torch.Tensor, str]], rows: RowOrder) -> None:
    """Its block of the base (from the base's file, or composed the same way where the base is
    a LoRA checkpoint), its block of ``scale * B A`` added to an adapted weight (from the rank-r
    factors), a task head from adapter.safetensors."""
    stored = {n: (t, [k]) for n, (t, k) in wanted.items() if k in adapted.stored}
    read_parts(adapted.directory, stored, rows, weights=ADAPTER)
    rest = {n: (t, k) for n, (t, k) in wanted.items() if n not in stored}
    if adapted.under is None:
        read_parts(adapted.base, {n: (t, adapted.aliases[adapted.keys[k]]) for n, (t, k) in rest.items()}, rows)
    else:
        _compose(adapted.under, {n: (t, adapted.keys[k]) for n, (t, k) in rest.items()}, rows)
    add_parts({n: (t, _low_rank(adapted, k)) for n, (t, k) in wanted.items() if k in adapted.layers}, rows)


def _low_rank(adapted: _Adapted, weight: str) -> LowRankRows:
    layer, prefix = adapted.layers[weight], weight[: -len("weight")]
    with safe_open(str(adapted.directory / ADAPTER), framework="pt") as f:
        factors = {p: (f.get_tensor(f"{prefix}lora_A.{p}"), f.get_tensor(f"{prefix}lora_B.{p}")) for p in layer.parts}
    return LowRankRows(layer, factors)


def _check_base_once(adapted: _Adapted) -> None:
    """``check_base_fingerprint`` without the base in memory: rank 0 hashes the base a few
    rows at a time in the LoRA model's names and dtypes, and every rank raises its verdict.
    Down a chain of LoRA checkpoints, the topmost fingerprint recorded is the one checked: the
    merged values it covers are those that adapter was trained on, whatever lies below."""
    checked = next(((a, r) for a in adapted.chain() if (r := recorded_fingerprint(a.directory)) is not None), None)
    if checked is None:
        return
    level, recorded = checked
    verdict: list[str | None] = [None]
    group = None
    if dist.is_initialized():  # the others wait while rank 0 reads it all: a wait that grows with the base
        size = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in level.fingerprinted)
        group = dist.new_group(timeout=timedelta(seconds=_HASH_WAIT_S + size / _HASH_BYTES_PER_S))
    if group is None or dist.get_rank() == 0:
        try:
            refuse_changed_base(level.directory, level.base, _streamed_fingerprint(level), recorded)
        except (UsageError, OSError) as e:
            verdict = [str(e)]
    if group is not None:
        dist.broadcast_object_list(verdict, src=0, group=group)
        dist.destroy_process_group(group)
    if verdict[0] is not None:
        raise UsageError(verdict[0])


_HASH_WAIT_S, _HASH_BYTES_PER_S = 300.0, 50e6  # slack, and a slow disk's read rate (sha256 runs ~20x faster)


def _streamed_fingerprint(adapted: _Adapted, block_elements: int = 1 << 22) -> str:
    """``base_fingerprint`` of the LoRA model, its base values read a few rows at a time
    (``_base_blocks``)."""
    with contextlib.ExitStack() as files:
        blocks = _base_blocks(adapted, files, block_elements)
        return fingerprint_of((n, dtype, shape, tied, lambda n=n, shape=shape: blocks(n, shape))
                              for n, dtype, shape, tied in adapted.fingerprinted)


def _base_blocks(adapted: _Adapted, files: contextlib.ExitStack, block_elements: int
                 ) -> Callable[[str, torch.Size], Iterator[torch.Tensor]]:
    """name (in the LoRA model) -> the row blocks of its base value: from ``model.safetensors``
    a few rows at a time (read, not mapped: no file pages stay resident), from ``dcp/`` a tensor
    at a time, or, for a LoRA base, its own base's blocks with its update added."""
    if adapted.under is not None:
        return _merged_blocks(adapted, files, block_elements)
    file = adapted.base / WEIGHTS
    if file.is_file():
        f = files.enter_context(safe_open(str(file), framework="pt", backend="pread"))
        where, present = file, set(f.keys())

        def read(key: str, shape: torch.Size):
            return _row_blocks(f.get_slice(key), shape, block_elements) if len(shape) else [f.get_tensor(key)]
    else:
        present, whole = dcp_reader(adapted.base)
        where, read = adapted.base / DCP_DIR, lambda key, shape: [whole(key)]

    def blocks(name: str, shape: torch.Size):
        key = next((k for k in adapted.aliases[adapted.keys[name]] if k in present), None)
        if key is None:
            raise UsageError(f"{where}: holds no {name}; expected the weights written with its config.json")
        yield from read(key, shape)

    return blocks


def _row_blocks(whole: Any, shape: torch.Size, block_elements: int):
    step = max(1, block_elements // max(1, math.prod(shape[1:])))
    for first in range(0, shape[0], step):
        yield whole[first: min(first + step, shape[0])]  # safetensors' pread backend refuses a slice past the end


def _merged_blocks(adapted: _Adapted, files: contextlib.ExitStack, block_elements: int
                   ) -> Callable[[str, torch.Size], Iterator[torch.Tensor]]:
    """``_base_blocks`` where the base is a LoRA checkpoint: its merged values, row block by
    row block (its base's blocks, plus the same rows of its adapter's ``scale * B A``)."""
    under = adapted.under
    inner = _base_blocks(under, files, block_elements)

    def blocks(name: str, shape: torch.Size):
        key = adapted.keys[name]
        if key in under.stored:  # a task head of the base's own adapter file
            with safe_open(str(under.directory / ADAPTER), framework="pt") as f:
                yield f.get_tensor(key)
            return
        update, first = _low_rank(under, key) if key in under.layers else None, 0
        for block in inner(key, shape):
            if update is not None:
                block = block + update[first: first + len(block), :]
                first += len(block)
            yield block

    return blocks


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
    """Its tensors' shapes and tied names (``_shapes``); a LoRA model's as merged: no adapters."""
    tensors = {n: t for n, t in model.state_dict(keep_vars=True).items() if LORA_MARK not in n}
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


