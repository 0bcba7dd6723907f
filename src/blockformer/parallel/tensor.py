"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each matmul's weight split over ``tp`` ranks.

Per block: the fused QKV and the FFN's up (and gate) projections are split by output rows
(``ColwiseParallel``), so each rank computes whole heads and a slice of the hidden units
with no communication; the attention and FFN output projections are split by input
columns (``RowwiseParallel``) and their partial sums are reduce-scattered over the
sequence: between sublayers the norms and residual sums run on sequence shards
(``sequence.py``). One all-gather and one reduce-scatter per sublayer forward, the same
backward. The embedding table is split by vocabulary rows and the head by vocabulary
columns; its logits stay split in the training loss (``loss.py``) and are gathered elsewhere.

A fused weight ``[q; k; v]`` split into ``tp`` contiguous slices would hand a rank the
queries of some heads and the keys of others. Its rows are first reordered to
``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (rank ``r``'s share of each part, in turn), so the
contiguous slice of rank ``r`` is a fused weight of ``n_heads / tp`` query heads and
``n_kv_heads / tp`` key/value heads, and the unchanged attention code runs on it with
its head counts set to the local ones. ``ROW_ORDER`` keeps each reordering so checkpoints
are written in the model's own order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..config import TransformerConfig
from ..errors import UsageError
from ..nn.attention import Attention
from ..nn.feedforward import FeedForward
from .loss import shard_head
from .sequence import SEQUENCE, apply_sequence_parallel, regions


@dataclass
class RowOrder:
    """The row permutations applied to fused weights: parameter name -> order (row i of the
    sharded weight is row ``order[i]`` of the model's)."""

    orders: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_model(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A full tensor in sharded order -> the model's order (for writing checkpoints)."""
        order = self.orders.get(name)
        if order is None or value.dim() == 0:
            return value
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return value[inverse.to(value.device)]

    def to_sharded(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A full tensor in the model's order -> the sharded order (for loading)."""
        order = self.orders.get(name)
        if order is None or value.dim() == 0:
            return value
        return value[order.to(value.device)]


def check_tp(cfg: TransformerConfig, tp: int) -> None:
    """The shapes tensor parallelism of degree ``tp`` needs; one-line errors otherwise."""
    if tp == 1:
        return
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        if getattr(cfg, name) % tp:
            raise UsageError(f"model.{name}={getattr(cfg, name)}: expected a multiple of parallel.tp={tp} "
                             "(each tensor-parallel rank holds an equal share)")
    if cfg.position in ("alibi", "relative"):
        raise UsageError(f"model.position={cfg.position!r}: its per-head score bias is not split over heads; "
                         "expected parallel.tp=1 or position 'rope', 'learned', 'sinusoidal' or 'none'")


def rank_major_order(sizes: list[int], tp: int) -> torch.Tensor:
    """Rows of a fused weight of parts ``sizes`` reordered so each of ``tp`` contiguous slices
    holds a ``1/tp`` share of every part, in the parts' order."""
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist()
    order = []
    for r in range(tp):
        for start, size in zip(starts, sizes):
            share = size // tp
            order.extend(range(start + r * share, start + (r + 1) * share))
    return torch.tensor(order)


def fused_parts(model: nn.Module) -> list[tuple[str, nn.Linear, list[int]]]:
    """The fused projections whose rows are reordered: (name, linear, sizes of its parts)."""
    cfg: TransformerConfig = model.cfg
    out = []
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
            if module.cross:
                out.append((f"{prefix}.kv", module.kv, [kv, kv]))
            else:
                out.append((f"{prefix}.qkv", module.qkv, [q, kv, kv]))
        elif isinstance(module, FeedForward) and module.gated:  # rows [gate; up]
            out.append((f"{prefix}.up", module.up, [cfg.d_ff, cfg.d_ff]))
    return out


def row_order(model: nn.Module, tp: int) -> RowOrder:
    """The reorderings ``apply_tp`` makes for degree ``tp`` (none at 1), by parameter name."""
    rows = RowOrder()
    if tp > 1:
        for prefix, linear, sizes in fused_parts(model):
            for pname, _ in linear.named_parameters():
                rows.orders[f"{prefix}.{pname}"] = rank_major_order(sizes, tp)
    return rows


def apply_tp(model: nn.Module, mesh: DeviceMesh, tp: int) -> RowOrder:
    """Shard ``model``'s matmuls over the 1-D ``mesh`` in place; returns the row reorderings."""
    check_tp(model.cfg, tp)
    rows = row_order(model, tp)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in rows.orders:
                param.copy_(rows.to_sharded(name, param.detach().clone()))
    block_ffns = {id(block.ffn) for blocks, _ in regions(model) for block in blocks}
    for module in list(model.modules()):
        if isinstance(module, Attention):
            # the input comes whole (gathered by sequence.py, which the attention's reshapes need)
            plan = {"out": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False)}
            plan.update({"q": ColwiseParallel(), "kv": ColwiseParallel()} if module.cross else {"qkv": ColwiseParallel()})
            parallelize_module(module, mesh, plan)
            module.n_heads, module.n_kv_heads = module.n_heads // tp, module.n_kv_heads // tp  # local heads
        elif isinstance(module, FeedForward) and id(module) in block_ffns:
            parallelize_module(module, mesh, {"up": ColwiseParallel(input_layouts=SEQUENCE),
                                              "down": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False)})
        elif isinstance(module, FeedForward):  # an MoE's shared expert: it reads and writes whole sequences
            parallelize_module(module, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    apply_sequence_parallel(model, mesh)
    _shard_vocabulary(model, mesh)
    return rows


def _shard_vocabulary(model: nn.Module, mesh: DeviceMesh) -> None:
    """Embedding tables split by vocabulary rows, the head by vocabulary columns."""
    done: set[int] = set()
    for name in ("embed", "tgt_embed", "src_embed"):
        embedding = getattr(model, name, None)
        if embedding is None or id(embedding.tokens) in done:
            continue
        done.add(id(embedding.tokens))
        parallelize_module(embedding.tokens, mesh, RowwiseParallel(input_layouts=Replicate()))
        embedding.tokens.register_forward_hook(_waited)
    if getattr(model, "head", None) is None:  # a pipeline stage without the head
        return
    shard_head(model.head, mesh)  # its logits gathered, but inside the training loss (loss.py)
    if model.cfg.tie_embeddings:  # the head reads the (now sharded) embedding table: re-point it at the same parameter
        table = (getattr(model, "embed", None) or model.tgt_embed).tokens
        model.head.weight = table.weight


def _waited(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The table's all-reduced rows as a plain tensor. ``RowwiseParallel`` hands out an
    ``AsyncCollectiveTensor`` (the all-reduce not yet waited on); reaching a compiled block
    as is (``train.compile``, no additive position signal in between), AOTAutograd unwraps it
    with ``trigger_wait()``, whose result does not require grad: the table got no gradient
    (torch 2.13; pytorch/pytorch#191113). ``clone``, like any op that is not a view, waits
    and keeps the autograd edge."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
