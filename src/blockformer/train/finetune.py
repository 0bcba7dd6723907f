"""Fine-tuning: a run's model from its config, started from a checkpoint, partly frozen.

``build_model_for(cfg)`` is the one place a run's model is made: the body ``[model]``
describes; a task head if ``[head]`` asks for one; the weights of ``train.init_from``
(matched by name and shape: the head is new where the task differs, and every tensor not
carried over is named); LoRA adapters if ``[lora]`` has a rank; then ``train.freeze``.
``lr_scale`` gives each parameter its share of ``train.lr``: layer-wise decay (Clark et al.
2020, ELECTRA; ``decay ** (depth from the top)``) and a separate head rate.

A LoRA run saves only its adapters and head (``adapter.safetensors``, which names its base
checkpoint) instead of ``model.safetensors``; loading one rebuilds the base and lays the
adapters over it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models import build_model
from ..models.embedding import Embedding
from ..models.heads import TaskModel, build_head
from ..models.inputs import InputAdapter
from ..nn.lora import LORA_MARK, adapter_state, apply_lora, lora_layers
from ..run_config import RunConfig

ADAPTER = "adapter.safetensors"
HEAD = "head."  # a TaskModel's head parameters
_BLOCK = re.compile(r"(?:^|\.)(encoder|decoder)\.blocks\.(\d+)\.")


def pooling_for(cfg: RunConfig) -> str:
    """``head.pooling``, with ``auto`` resolved: ``last`` for a causal decoder (only the last
    position has read the whole text), ``cls`` otherwise."""
    if cfg.head.pooling != "auto":
        return cfg.head.pooling
    if cfg.model.input != "tokens" and not cfg.model.cls_token:
        return "mean"  # patches or frames without a class token: no position summarises the rest
    return "last" if cfg.model.arch == "decoder" else "cls"


def build_model_for(cfg: RunConfig, *, seed: int | None = None, device: Any = None, log: Any = print,
                    load_init: bool = True) -> nn.Module:
    """The model of a run (see the module docstring). ``load_init=False`` skips loading
    ``train.init_from`` (a checkpoint that holds all its weights is loaded next anyway)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = build_model(cfg.model)
        if cfg.head.task != "none":
            n_out = 1 if cfg.head.task == "regress" else len(cfg.head.labels)
            if n_out < 1:
                raise UsageError(f"head.labels: empty; expected the labels of head.task={cfg.head.task!r}")
            model = TaskModel(model, build_head(cfg.head.task, cfg.model.d_model, n_out, pooling_for(cfg),
                                                cfg.head.dropout))
        if load_init and cfg.train.init_from:
            init_from(model, cfg, log)
        if cfg.lora.rank > 0:
            if not cfg.train.init_from:
                raise UsageError("lora.rank: adapters adapt a trained model; expected train.init_from=CKPT "
                                 "(blockformer train --init-from CKPT)")
            apply_lora(model, cfg.lora)
            for name, p in model.named_parameters():  # adapters, and a task head, train
                p.requires_grad_(LORA_MARK in name or (isinstance(model, TaskModel) and name.startswith(HEAD)))
    freeze(model, cfg.train.freeze)
    return model if device is None else model.to(device)


# ---------------------------------------------------------------------- init-from
@dataclass
class InitReport:
    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)  # in this model, not in the base
    skipped: list[str] = field(default_factory=list)  # in both, shapes differ (or the head's task differs)
    unused: list[str] = field(default_factory=list)  # in the base, not used here

    def describe(self, source: str) -> str:
        parts = [f"init-from {source}: {len(self.loaded)} tensors loaded"]
        for what, names in (("new (not in the base)", self.new), ("skipped (shape or task differs)", self.skipped),
                            ("unused from the base", self.unused)):
            if names:
                parts.append(f"{what}: {', '.join(names)}")
        return "; ".join(parts)


def _base_key(name: str, target_is_task: bool, base_is_task: bool) -> str:
    if target_is_task and not base_is_task:
        return name[len("body."):] if name.startswith("body.") else name
    if base_is_task and not target_is_task:
        return "body." + name
    return name


def init_from(model: nn.Module, cfg: RunConfig, log: Any = print) -> InitReport:
    """Copy the weights of checkpoint ``cfg.train.init_from`` into ``model`` by name and shape.
    The base's own head (LM head, or a task head for other labels) is not carried over to a
    head of a different task; everything not carried over is named in the log line."""
    from .checkpoint import load_checkpoint, read_config  # noqa: PLC0415 - checkpoint imports this module

    source = cfg.train.init_from
    base_cfg = read_config(source)
    if base_cfg.model.arch != cfg.model.arch:
        raise UsageError(f"train.init_from={source}: a {base_cfg.model.arch} checkpoint; expected "
                         f"model.arch={cfg.model.arch!r} to match it")
    base_state = load_checkpoint(source).model.state_dict()
    base_is_task = any(k.startswith("body.") for k in base_state)
    target_is_task = isinstance(model, TaskModel)
    same_task = base_cfg.head.task == cfg.head.task and base_cfg.head.labels == cfg.head.labels
    report, used, state = InitReport(), set(), {}
    for name, tensor in model.state_dict().items():
        if LORA_MARK in name:
            continue
        key = _base_key(name, target_is_task, base_is_task)
        if key not in base_state:
            report.new.append(name)
        elif base_state[key].shape != tensor.shape:
            report.skipped.append(f"{name} {tuple(base_state[key].shape)}->{tuple(tensor.shape)}")
            used.add(key)
        elif name.startswith(HEAD) and target_is_task and not same_task:
            report.skipped.append(f"{name} (other labels)")
            used.add(key)
        else:
            state[name] = base_state[key]
            report.loaded.append(name)
            used.add(key)
    report.unused = sorted(k for k in base_state if k not in used)
    model.load_state_dict(state, strict=False)
    if log is not None:
        log(report.describe(source))
    return report


# ---------------------------------------------------------------------- freezing and lr
def freeze(model: nn.Module, what: str) -> None:
    """``train.freeze``: ``embeddings`` (token and position tables and a head tied to them, or
    the input adapter of patches or frames)
    or ``body`` (everything but the task head)."""
    if what == "none":
        return
    if what == "embeddings":
        for module in model.modules():
            if isinstance(module, (Embedding, InputAdapter)):  # token tables, or a patch/frame adapter
                module.requires_grad_(False)
    elif what == "body":
        if not isinstance(model, TaskModel):
            raise UsageError("train.freeze='body': nothing would train; expected a task head ([head] task)")
        model.body.requires_grad_(False)


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


# ---------------------------------------------------------------------- adapter checkpoints
def is_adapted(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def _trained_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Besides the adapters, what a LoRA checkpoint stores: a task head (never the LM head)."""
    return (HEAD,) if isinstance(model, TaskModel) else ()


def save_weights(model: nn.Module, directory: Path, config: RunConfig, weights_name: str) -> None:
    """The weights file of a checkpoint: all weights (``weights_name``), or, for a LoRA run,
    only the adapters and the head in ``adapter.safetensors``, with the base named."""
    if not is_adapted(model):
        # save_model drops the duplicate names of tied tensors, which safetensors refuses.
        safetensors.torch.save_model(model, str(directory / weights_name))
        return
    tensors = {k: v.contiguous() for k, v in adapter_state(model, _trained_prefixes(model)).items()}
    base = os.path.abspath(config.train.init_from)  # abspath keeps a `best` link unresolved
    safetensors.torch.save_file(tensors, str(directory / ADAPTER), metadata={"base": base, "format": "blockformer-lora"})


def read_adapter_base(directory: Path) -> str:
    with safetensors.safe_open(str(directory / ADAPTER), framework="pt") as f:
        return (f.metadata() or {}).get("base", "")


def load_adapter(model: nn.Module, directory: Path, config: RunConfig, device: Any = "cpu") -> None:
    """Base weights from the checkpoint the adapter names, then the adapter and head tensors."""
    file = directory / ADAPTER
    base = read_adapter_base(directory)
    if not base or not Path(base).exists():
        raise UsageError(f"{file}: its base checkpoint {base or '(none recorded)'} is missing; expected the "
                         f"checkpoint this adapter was trained on")
    import dataclasses  # noqa: PLC0415

    cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, init_from=base))
    init_from(model, cfg, log=None)
    tensors = safetensors.torch.load_file(str(file), device=str(device))
    expected = set(adapter_state(model, _trained_prefixes(model)))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise UsageError(f"{file}: adapter tensors do not match the config (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); expected the file written with this checkpoint's config.json")
    model.load_state_dict(tensors, strict=False)
