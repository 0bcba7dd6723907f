"""Sizing a parallel run on paper: per-rank memory and communication per step for a mesh.

Parameters are counted exactly from the model built on the ``meta`` device, each
assigned to where this package puts it: block matmuls and the vocabulary tables split
over ``tp`` (norms, biases of row-split projections and gates replicated), blocks split
into pipeline stages (the embedding on the first, final norm and head on the last; the
heaviest stage is reported), then everything split over ``dp_shard`` by FSDP.

Memory per rank, in bytes (``P`` = this rank's parameters after TP and PP):
- weights ``4P / dp_shard`` and gradients ``4P / dp_shard`` (fp32 master copies; bf16/fp16
  only inside autocast; ``precision = "auto"`` is planned as bf16, which every current GPU
  has), AdamW moments ``8P / dp_shard``; FSDP also holds one block's gathered weights (in
  the compute dtype) at a time, and the next one prefetched;
- activations per block, in the compute dtype's bytes ``e`` per value (Korthikanti et al.
  2022, for ``s`` tokens, ``b`` rows, width ``h``, ``a`` heads): ``e/2 * s*b*h * 34`` in
  all, ``10`` of it outside the tensor-parallel matmuls and ``24`` inside (attention's
  ``8`` and a ``4h`` GELU FFN's ``16``; an FFN of width ``f`` keeps ``4f/h``, a gated one
  ``8f/h``: its fused gate/up output, the activation and the product; written ``24`` below), plus
  ``5*a*s/h`` where attention scores are materialised (ALiBi, relative bias, attention
  dropout; the flash kernel keeps none). Tensor parallelism splits the ``24`` and the scores
  over ``tp``; sequence parallelism (always on with ``tp > 1``, ``sequence.py``) splits the
  ``10`` too, except the two sublayer inputs that autograd keeps gathered for the weight
  gradients of the column-wise matmuls (``4`` of the ``10``):
  ``e/2 * s*b*h * (4 + 30/tp + 5*a*s/(h*tp))`` for ``tp > 1`` (eq. 2's ``10 + 24`` at
  ``tp = 1``). ``full`` checkpointing keeps each block's input ``e*s*b*h`` (``/tp``: it is a
  sequence shard) plus one block's activations while it is recomputed; ``selective``
  drops the score term. A pipeline stage keeps the activations of the micro-batches in
  flight: all of them under GPipe, at most ``pp`` under 1F1B. Logits and their gradient:
  ``8 * s*b*V`` in fp32, ``/tp`` under loss parallel (``loss.py``: the training loss reads
  the vocabulary shards; gathered with label smoothing or a pipeline).

Under gradient accumulation the gradients cross ranks once a step, in the last
micro-batch's backward (``fsdp.gradient_sync``); until then FSDP keeps them unsharded,
``4P`` on top of the ``4P / dp_shard`` shards.

Communication per optimizer step, bytes sent per rank (ring collectives move
``2(n-1)/n`` of the buffer for an all-reduce and ``(n-1)/n`` for an all-gather or a
reduce-scatter), the activations' and weights' repeated for each of the ``grad_accum``
micro-batches, the gradients' once:
- FSDP: all-gather of the weights in forward and again in backward, reduce-scatter of the
  fp32 gradients; HSDP adds an all-reduce of the gradient shards across replicas; DDP an
  all-reduce of the fp32 gradients;
- TP with sequence parallelism: per sublayer (two a block, three with cross-attention) an
  all-gather of the ``(b, s, h)`` stream in and a reduce-scatter out, forward, and the same
  two backward (the bytes of two all-reduces); ``full`` checkpointing runs the forward's
  again in the backward's recompute; each stack gathers its output forward (reduce-scatter
  backward) and its input's gradient; the vocabulary-split embedding all-reduces its output;
  loss parallel all-reduces two ``(b, s)`` fp32 tensors (max and sum of exponentials) where
  the logits are not gathered;
- PP: each stage boundary sends a micro-batch's activations forward and its gradient back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..config import GATED_FFNS, TransformerConfig
from ..models import build_model
from ..nn.attention import Attention
from ..nn.feedforward import FeedForward
from ..run_config import ParallelConfig, RunConfig, TrainConfig
from ..stats import EXACT_LAYERS

from .mesh import Degrees, resolve_degrees
from .pipeline import STAGES_PER_RANK, check_pp, stage_bounds
from .tensor import check_tp

GIB = 2**30


@dataclass
class Counts:
    """Parameters by where they go: per block (split, replicated), and the ends of the model."""

    block_split: list[int]  # per block: split over tp
    block_replicated: list[int]  # per block: kept whole on every tp rank
    first: int  # embeddings (split over tp) + learned positions
    last_split: int  # head (split over tp; 0 when tied)
    last_replicated: int  # final norm(s)
    cross: list[bool]  # per block: has cross-attention


def count(model: nn.Module) -> Counts:
    split_ids = set()
    for m in model.modules():
        if isinstance(m, Attention):
            for lin in ((m.q, m.kv) if m.cross else (m.qkv,)):
                split_ids.update(id(p) for p in lin.parameters())
            split_ids.add(id(m.out.weight))
        elif isinstance(m, FeedForward):
            split_ids.update(id(p) for p in m.up.parameters())
            split_ids.add(id(m.down.weight))
    blocks = [b for name in ("encoder", "decoder") if hasattr(model, name) for b in getattr(model, name).blocks]
    in_block = set()
    split, rep = [], []
    for b in blocks:
        ps = list(b.parameters())
        in_block.update(id(p) for p in ps)
        split.append(sum(p.numel() for p in ps if id(p) in split_ids))
        rep.append(sum(p.numel() for p in ps if id(p) not in split_ids))
    first = last_split = last_rep = 0
    for name, p in model.named_parameters():
        if id(p) in in_block:
            continue
        if "embed" in name.split(".")[0]:
            first += p.numel()
        elif name.startswith("head"):
            last_split += p.numel()
        else:
            last_rep += p.numel()
    return Counts(split, rep, first, last_split, last_rep, [b.cross_attn is not None for b in blocks])


def count_at_depth(m: TransformerConfig) -> Counts:
    """``count`` of the model ``m`` describes, built on the meta device. A config deeper than
    ``EXACT_LAYERS`` is built with 2 blocks a stack and each stack's second block repeated:
    past the first (which may own a shared position bias) a stack's blocks are alike."""
    if m.total_layers <= EXACT_LAYERS:
        with torch.device("meta"):
            return count(build_model(m))
    names = ("n_encoder_layers", "n_decoder_layers") if m.arch == "encoder-decoder" else ("n_layers",)
    with torch.device("meta"):
        c = count(build_model(dataclasses.replace(m, **dict.fromkeys(names, 2))))
    depths = [getattr(m, name) for name in names]

    def tile(per_block: list) -> list:  # [first, second] of each stack -> first + second * (depth - 1)
        return [x for i, depth in enumerate(depths) for x in [per_block[2 * i]] + [per_block[2 * i + 1]] * (depth - 1)]

    return dataclasses.replace(c, block_split=tile(c.block_split), block_replicated=tile(c.block_replicated),
                               cross=tile(c.cross))


@dataclass
class _Pipeline:
    """How a batch and the blocks spread over the pipeline, seen from its heaviest rank."""

    n_stages: int
    n_micro: int  # micro-batches per batch in the pipeline
    b_dp: float  # rows per data-parallel rank per micro-batch
    b: float  # rows per pipeline micro-batch
    bounds: list[tuple[int, int]]  # per stage: its blocks [lo, hi)
    worst: int  # the pipeline rank holding the most parameters
    stages: list[int]  # that rank's stages
    P: float  # that rank's parameters after TP and PP

    @property
    def layers(self) -> int:
        return sum(self.bounds[st][1] - self.bounds[st][0] for st in self.stages)

    @property
    def blocks(self) -> list[int]:
        return [i for st in self.stages for i in range(*self.bounds[st])]

    @property
    def has_head(self) -> bool:
        return (self.n_stages - 1) in self.stages


def _params_of(c: Counts, tp: int, bounds: list[tuple[int, int]], n_stages: int, stages: list[int]) -> float:
    """Parameters of one pipeline rank holding ``stages``, after the TP split."""
    total = 0.0
    for st in stages:
        lo, hi = bounds[st]
        total += sum(c.block_split[lo:hi]) / tp + sum(c.block_replicated[lo:hi])
        if st == 0:
            total += c.first / tp
        if st == n_stages - 1:
            total += c.last_split / tp + c.last_replicated
    return total


def _pipeline(c: Counts, d: Degrees, pc: ParallelConfig, B: int) -> _Pipeline:
    b_dp = B / d.dp  # rows per data-parallel rank per micro-batch
    n_stages = d.pp * (STAGES_PER_RANK[pc.pp_schedule] if d.pp > 1 else 1)
    n_micro = (pc.pp_microbatches or 2 * d.pp) if d.pp > 1 else 1
    layers = len(c.block_split)
    bounds = stage_bounds(layers, n_stages) if d.pp > 1 else [(0, layers)]
    rank_stages = [list(range(r, n_stages, d.pp)) for r in range(d.pp)]
    per_rank = [_params_of(c, d.tp, bounds, n_stages, st) for st in rank_stages]
    worst = max(range(d.pp), key=lambda r: per_rank[r])
    return _Pipeline(n_stages, n_micro, b_dp, b_dp / n_micro, bounds, worst, rank_stages[worst], per_rank[worst])


def _activations(m: TransformerConfig, tc: TrainConfig, pc: ParallelConfig, d: Degrees, pl: _Pipeline,
                 s: int, e: int) -> float:
    """Activation bytes the heaviest rank keeps: its blocks' (as checkpointing leaves them) for
    each micro-batch in flight, and the logits where it holds the head."""
    b, layers_here, t = pl.b, pl.layers, d.tp
    V = m.vocab_size
    no_scores, per_block = _block_activations(m, d, s, b, e)
    if tc.activation_checkpointing == "full":
        kept = e * s * b * m.d_model / t * layers_here + per_block
    elif tc.activation_checkpointing == "selective":
        kept = no_scores * layers_here
    else:
        kept = per_block * layers_here
    in_flight = 1 if d.pp == 1 else (pl.n_micro if pc.pp_schedule == "gpipe" else min(d.pp, pl.n_micro))
    logits = 8 * s * b * V / (t if _loss_parallel(tc, d) else 1) if pl.has_head else 0.0
    return kept * in_flight + logits


def _block_activations(m: TransformerConfig, d: Degrees, s: int, b: float, e: int) -> tuple[float, float]:
    """One block's activation bytes for backward, without and with the attention scores."""
    h, a, t = m.d_model, m.n_heads, d.tp
    scores = m.position in ("alibi", "relative") or m.attention_dropout > 0
    # outside the TP matmuls: 10 (sequence parallel: 4 kept gathered, 6 sharded); inside: attention's 8
    # and the FFN's hidden units (d_ff values a tensor): 2 tensors (4h: Korthikanti's 16), 4 when gated
    outside = 10 if t == 1 else 4 + 6 / t
    ffn = 2 * (4 if m.ffn in GATED_FFNS else 2) * (m.expert_d_ff if m.ffn_experts else m.d_ff) / h
    no_scores = e / 2 * s * b * h * (outside + (8 + ffn) / t)
    return no_scores, no_scores + (e / 2 * s * b * 5 * a * s / t if scores else 0)


def _loss_parallel(tc: TrainConfig, d: Degrees) -> bool:
    """Whether the training loss reads the logits' vocabulary shards (``loss.py``)."""
    return d.tp > 1 and d.pp == 1 and tc.label_smoothing == 0


def _memory(m: TransformerConfig, tc: TrainConfig, pc: ParallelConfig, c: Counts, d: Degrees, pl: _Pipeline,
            s: int, e: int, fsdp: bool) -> dict[str, float]:
    P, shard = pl.P, d.dp_shard
    biggest_block = max(sp / d.tp + rp for sp, rp in zip(c.block_split, c.block_replicated))
    # under accumulation FSDP keeps each micro-batch's gradients unsharded until the last one's
    # backward reduce-scatters them (fsdp.gradient_sync): the rank's whole fp32 gradients
    unsharded = fsdp and shard > 1 and tc.grad_accum > 1 and pc.grad_sync == "last"
    memory = {
        "weights": 4 * P / shard,
        "gradients": 4 * P * (1 + 1 / shard) if unsharded else 4 * P / shard,
        "optimizer": 8 * P / shard,
        "gathered_weights": 2 * biggest_block * e if fsdp else 0.0,
        "activations": _activations(m, tc, pc, d, pl, s, e),
    }
    memory["total"] = sum(memory.values())
    return memory


def _ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring all-gather or reduce-scatter of ``n``."""
    return (n - 1) / n


def _communication(m: TransformerConfig, tc: TrainConfig, pc: ParallelConfig, c: Counts, d: Degrees,
                   pl: _Pipeline, s: int, e: int, fsdp: bool) -> dict[str, float]:
    """Bytes the heaviest rank sends per optimizer step, by collective (the zero ones left out)."""
    P, shard, b_dp, accum = pl.P, d.dp_shard, pl.b_dp, tc.grad_accum
    h, V = m.d_model, m.vocab_size
    comm = {}
    if fsdp:
        comm["fsdp_all_gather"] = 2 * P * e * _ring(shard) * accum if shard > 1 else 0.0
        # gradients cross ranks once a step, in the last micro-batch's backward (parallel.grad_sync)
        grads = accum if pc.grad_sync == "every" else 1
        comm["fsdp_reduce_scatter"] = 4 * P * _ring(shard) * grads if shard > 1 else 0.0
        comm["hsdp_all_reduce"] = 2 * 4 * (P / shard) * _ring(d.dp_replicate) * grads
    elif d.dp_replicate > 1:
        comm["ddp_all_reduce"] = 2 * 4 * P * _ring(d.dp_replicate) * (accum if pc.grad_sync == "every" else 1)
    if d.tp > 1:
        stream = b_dp * s * h * e * _ring(d.tp)  # one all-gather or reduce-scatter of the (b, s, h) stream
        recompute = tc.activation_checkpointing == "full"
        sublayers = sum(3 if c.cross[i] else 2 for i in pl.blocks)
        regions = len({_stack_of(c, i) for i in pl.blocks})  # stacks (or stage slices of one) on this rank
        # per sublayer: gather in + scatter out, forward and backward (+ the forward again under full recompute)
        per_kind = sublayers * (2 + (1 if recompute else 0)) + regions * 2  # + each region's output and input grads
        comm["tp_all_gather"] = per_kind * stream * accum
        comm["tp_reduce_scatter"] = per_kind * stream * accum
        comm["tp_all_reduce"] = (2 * stream * (1 if 0 in pl.stages else 0)  # the embedding's partial sums
                                 + (2 * 2 * b_dp * s * 4 * _ring(d.tp) if pl.has_head and _loss_parallel(tc, d) else 0)
                                 ) * accum
        gathered = pl.has_head and not _loss_parallel(tc, d)
        comm["tp_logits_all_gather"] = (b_dp * s * V * 4 * _ring(d.tp) * accum) if gathered else 0.0
    if d.pp > 1:
        # activations forward out of every stage but the last, gradients back out of every stage but the first
        sends = sum(st < pl.n_stages - 1 for st in pl.stages) + sum(st > 0 for st in pl.stages)
        comm["pp_send"] = b_dp * s * h * 4 * sends * accum
    return {k: v for k, v in comm.items() if v}


def _stack_of(c: Counts, block: int) -> int:
    """0 for an encoder's (or a decoder-only model's) blocks, 1 for an encoder-decoder's decoder."""
    return int(c.cross[block])


def plan(cfg: RunConfig, world_size: int, batch_size: int | None = None, seq_len: int | None = None) -> dict:
    """Per-rank memory and per-step communication of ``cfg`` on ``world_size`` ranks (bytes)."""
    m, tc, pc = cfg.model, cfg.train, cfg.parallel
    d: Degrees = resolve_degrees(pc, world_size)
    check_tp(m, d.tp)
    if d.pp > 1:
        check_pp(m, d.pp, pc.pp_schedule)
    c = count_at_depth(m)
    s = seq_len or (cfg.data.seq_len if m.arch == "decoder" else m.max_seq_len)
    B = batch_size or tc.batch_size
    pl = _pipeline(c, d, pc, B)
    e = 4 if tc.precision == "fp32" else 2  # "auto": bf16 on the GPUs a plan is for
    fsdp = d.dp_shard > 1 or (d.dp_replicate > 1 and (d.tp > 1 or d.pp > 1))
    return {
        "degrees": {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp},
        "world_size": world_size,
        "parameters": sum(c.block_split) + sum(c.block_replicated) + c.first + c.last_split + c.last_replicated,
        "parameters_per_rank": pl.P / d.dp_shard,
        "parameters_before_fsdp": pl.P,
        "stage_of_rank": pl.worst,
        "batch_size": B,
        "rows_per_microbatch": pl.b,
        "microbatches": pl.n_micro,
        "seq_len": s,
        "bytes_per_activation": e,
        "activation_checkpointing": tc.activation_checkpointing,
        "memory_bytes": _memory(m, tc, pc, c, d, pl, s, e, fsdp),
        "activations_per_block_bytes": _block_activations(m, d, s, pl.b, e)[1],  # kept without checkpointing
        "comm_bytes_per_step": _communication(m, tc, pc, c, d, pl, s, e, fsdp),
    }


def format_plan(p: dict) -> list[str]:
    d = p["degrees"]
    mem, comm = p["memory_bytes"], p["comm_bytes_per_step"]
    lines = [
        f"mesh         {p['world_size']} ranks: pp {d['pp']} x dp_replicate {d['dp_replicate']} x dp_shard "
        f"{d['dp_shard']} x tp {d['tp']}",
        f"per rank     {p['parameters_per_rank']:,.0f} parameters ({p['parameters_before_fsdp']:,.0f} before FSDP"
        + (f", on pipeline rank {p['stage_of_rank']}, the heaviest" if d["pp"] > 1 else "")
        + f"); micro-batches of {p['rows_per_microbatch']:g} x {p['seq_len']} tokens"
        + (f", {p['microbatches']} per batch in the pipeline" if d["pp"] > 1 else ""),
        f"memory/rank  {_g(mem['total'])}: weights {_g(mem['weights'])}, gradients {_g(mem['gradients'])}, "
        f"AdamW {_g(mem['optimizer'])}, gathered {_g(mem['gathered_weights'])}, activations "
        f"{_g(mem['activations'])} ({p['activation_checkpointing']} checkpointing, {p['bytes_per_activation']}-byte "
        "values)",
        "comm/step    " + (", ".join(f"{k.replace('_', ' ')} {_g(v)}" for k, v in comm.items()) or "none")
        + " (sent per rank)",
    ]
    return lines


def _g(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


__all__ = ["plan", "format_plan", "count", "Counts"]
