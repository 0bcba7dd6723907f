"""Sequence parallelism (Korthikanti et al. 2022): what tensor parallelism leaves replicated
(norms, residual sums, dropout) runs on a ``1/tp`` slice of the sequence.

Under plain tensor parallelism every rank holds the whole ``(B, T, d_model)`` residual stream
and computes the same norms on it. Here the stream between sublayers is a ``DTensor``
sharded on the sequence dim (``Shard(1)``): each rank keeps, normalises and adds ``T / tp``
positions. Entering attention or the FFN the stream is all-gathered (the column-wise
projections' input layout is ``Shard(1)``); leaving, the row-wise projections reduce-scatter
their partial sums back to ``Shard(1)`` instead of all-reducing them. The communication
volume is TP's (an all-reduce is a reduce-scatter plus an all-gather); the activations
between sublayers take ``1/tp`` of the memory. The parameters the stream meets (norm
weights, residual gates) become replicated ``DTensor`` s, so their gradients, each rank's
sum over its own positions, are all-reduced over ``tp``.

The stream stays a ``DTensor`` (torchtitan hands local tensors between modules) so that a
length that is not a multiple of ``tp`` (seq2seq buckets, one-token decoding steps) shards
unevenly and still gathers right: a ``DTensor`` knows its global shape. Each stack (encoder,
decoder, a pipeline stage's blocks) is one region: its first block's input is split (each
rank keeps its slice, no communication) and its output, after the final norm, gathered, so
the embeddings, the cross-attention memory and the head see whole sequences as under TP.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

from ..nn.block import Block
from ..nn.moe import MoEFeedForward
from ..nn.residual import Residual

SEQUENCE = Shard(1)  # (B, T, d_model): the T dim


def regions(model: nn.Module) -> Iterator[tuple[list[nn.Module], nn.Module | None]]:
    """The runs of consecutive blocks whose stream is sequence-sharded: (blocks, final norm or
    ``None``) for every stack of ``model``, or every pipeline stage this rank holds."""
    stages = getattr(model, "stages", None)
    parts = [s.decoder for s in stages] if stages is not None else \
        [getattr(model, n) for n in ("encoder", "decoder") if getattr(model, n, None) is not None]
    for part in parts:
        blocks = part.blocks
        blocks = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        if blocks:
            yield blocks, part.final_norm


def apply_sequence_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard ``model``'s residual streams on the sequence dim over the 1-D ``mesh``, in place.
    Called by ``apply_tp`` after the projections are split, which it completes: the row-wise
    ones then end in ``Shard(1)``, the column-wise ones start from it."""
    for blocks, final_norm in regions(model):
        blocks[0].register_forward_pre_hook(_split_hook(mesh))
        for block in blocks:
            _shard_block(block, mesh)
        if final_norm is not None:
            _shard_norm(final_norm, mesh)
        (final_norm if final_norm is not None else blocks[-1]).register_forward_hook(_gather_hook)


def _shard_block(block: Block, mesh: DeviceMesh) -> None:
    for name in ("attn_norm", "cross_norm", "ffn_norm"):
        if getattr(block, name, None) is not None:
            _shard_norm(getattr(block, name), mesh)
    for name in ("attn", "cross_attn"):  # attention reshapes by T: it reads the whole sequence
        if getattr(block, name, None) is not None:
            parallelize_module(getattr(block, name), mesh, PrepareModuleInput(
                input_layouts=(SEQUENCE, None), desired_input_layouts=(Replicate(), None), use_local_output=True))
    if isinstance(block.ffn, MoEFeedForward):  # not split by TP: every rank routes the whole sequence
        block.ffn.register_forward_pre_hook(_whole_sequence_hook)
        block.ffn.register_forward_hook(_split_hook(mesh, replicated_output=True))
    for name in ("attn_residual", "cross_residual", "ffn_residual"):
        residual: Residual | None = getattr(block, name, None)
        if residual is not None:
            _replicate_parameters(residual, mesh)


def _shard_norm(norm: nn.Module, mesh: DeviceMesh) -> None:
    if any(True for _ in norm.parameters()):
        parallelize_module(norm, mesh, SequenceParallel())  # weights replicated, input Shard(1) kept


def _replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """A module's own parameters (a residual gate) as replicated ``DTensor`` s: it then computes
    on the sequence-sharded stream, and its gradient is summed over every rank's positions."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(DTensor.from_local(param.detach(), mesh, [Replicate()],
                                                                        run_check=False)))


def _split_hook(mesh: DeviceMesh, replicated_output: bool = False):
    """A hook turning a whole sequence, the same on every rank, into this rank's slice: the
    pre-hook of a region's first block (on its input) or, with ``replicated_output``, the
    forward hook of a module that computed the whole sequence (on its output)."""

    def split(x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [SEQUENCE])

    if replicated_output:
        return lambda module, args, output: split(output)

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (split(args[0]), *args[1:])

    return pre_hook


def _whole_sequence_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0].full_tensor(), *args[1:])  # an all-gather, its backward a slice


def _gather_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor:
    return output.full_tensor() if isinstance(output, DTensor) else output
