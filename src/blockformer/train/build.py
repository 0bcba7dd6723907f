"""The model a run config describes, before any weights are loaded into it.

``build_run_model(cfg)`` is the one place a run's model is put together: the body
``[model]`` describes; a task head if ``[head]`` asks for one; LoRA adapters if ``[lora]``
has a rank (the body frozen, adapters and head trainable); then ``train.freeze``. Loading
weights into it is ``checkpoint``'s job; starting from ``train.init_from`` is ``finetune``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from ..models import build_model
from ..models.embedding import Embedding
from ..models.heads import TaskModel, build_head
from ..models.inputs import InputAdapter
from ..nn.lora import LORA_MARK, apply_lora
from ..parallel.meta import build_on_meta
from ..run_config import RunConfig
from .adapter import HEAD


def pooling_for(cfg: RunConfig) -> str:
    """``head.pooling``, with ``auto`` resolved: ``last`` for a causal decoder (only the last
    position has read the whole text), ``cls`` otherwise."""
    if cfg.head.pooling != "auto":
        return cfg.head.pooling
    if cfg.model.input != "tokens" and not cfg.model.cls_token:
        return "mean"  # patches or frames without a class token: no position summarises the rest
    return "last" if cfg.model.arch == "decoder" else "cls"


def body_pooler(cfg: RunConfig, body: nn.Module):
    """The body's own pooler for ``head.pooling = "pooler"`` (BERT's dense + tanh on [CLS]),
    else None; refused, naming the field, where it cannot apply."""
    if cfg.head.task == "tokens" and not cfg.head.bias:
        raise UsageError("head.bias=false: only a sequence head drops its bias; expected head.bias=true "
                         "with head.task='tokens'")
    if cfg.head.task == "tokens" or pooling_for(cfg) != "pooler":
        return None
    if not cfg.model.pooler:
        raise UsageError("head.pooling='pooler': the body has no pooler; expected model.pooler=true (a BERT "
                         "imported with its pooler) or head.pooling cls, mean or last")
    return body.pool


def build_run_model(cfg: RunConfig, *, seed: int | None = None, meta: bool = False) -> nn.Module:
    """Body, task head, adapters and frozen parts of ``cfg``'s model, freshly initialised
    (from ``seed`` when given, without touching the global random stream). ``meta``: built
    on the meta device, its init recorded for ``parallel.meta.materialize`` to replay into
    each rank's shards (the same weights)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return build_on_meta(lambda: _build(cfg)) if meta else _build(cfg)


def _build(cfg: RunConfig) -> nn.Module:
    """The model of ``cfg`` from the current random stream."""
    model = build_model(cfg.model)
    if cfg.head.task != "none":
        n_out = 1 if cfg.head.task == "regress" else len(cfg.head.labels)
        if n_out < 1:
            raise UsageError(f"head.labels: empty; expected the labels of head.task={cfg.head.task!r}")
        model = TaskModel(model, build_head(cfg.head.task, cfg.model.d_model, n_out, pooling_for(cfg),
                                            cfg.head.dropout, bias=cfg.head.bias, pooler=body_pooler(cfg, model)))
    if cfg.lora.rank > 0:
        if not cfg.train.init_from:
            raise UsageError("lora.rank: adapters adapt a trained model; expected train.init_from=CKPT "
                             "(blockformer train --init-from CKPT)")
        apply_lora(model, cfg.lora)  # shares the base's Parameters: their names do not change
        for name, p in model.named_parameters():  # adapters, and a task head, train
            p.requires_grad_(LORA_MARK in name or (isinstance(model, TaskModel) and name.startswith(HEAD)))
    freeze(model, cfg.train.freeze)
    return model


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
