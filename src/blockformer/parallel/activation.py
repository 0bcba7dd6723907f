"""Activation checkpointing (Chen et al. 2016): keep fewer activations, recompute them in backward.

``full`` keeps only each block's input and recomputes the whole block in the backward
pass (about one more forward: ~33% more compute, activation memory of one block instead
of all). ``selective`` (Korthikanti et al. 2022) keeps the outputs of the matmuls and of
attention, which are expensive to recompute, and recomputes the cheap element-wise ops
and norms in between, whose outputs are most of the activation memory per FLOP.
The blocks' ``forward`` is replaced on the instance, so parameter names do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .fsdp import blocks_of

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the matmuls and the attention kernel.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed(forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to recompute
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of ``model`` in place: ``mode`` is ``none``, ``full`` or ``selective``."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.activation_checkpointing={mode!r}: expected 'none', 'full' or 'selective'")
    context_fn = _selective_context if mode == "selective" else None
    for block in blocks_of(model):
        block.forward = functools.partial(_checkpointed, block.forward, context_fn)
