"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019/2021) for the decoder.

The decoder's blocks are cut into consecutive stages, balanced by block count: the
embedding goes with the first, the final norm and the head with the last. Each step's
(data-parallel) batch is cut into micro-batches that flow through the stages, so the
stages work on different micro-batches at once; ``torch.distributed.pipelining`` runs
the schedule (``gpipe``: all forwards then all backwards; ``1f1b``: one forward, one
backward, at most ``pp`` micro-batches' activations alive; ``interleaved-1f1b``: two
smaller stages per rank, looped, which shrinks the pipeline bubble by half).

This rank's stages live in one ``PipelineRank`` module whose parameter names are the
full model's (``decoder.blocks.7.attn.qkv.weight``), so the optimizer, checkpoints and
consolidated weights need nothing special. Its ``forward`` runs the stages without a
schedule (for evaluation) and hands every rank the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..config import TransformerConfig
from ..errors import UsageError
from ..models.base import TransformerModel, default_positions
from ..nn.stack import Stack
from ..nn.loss import token_loss
from ..precision import autocast
from .data import rows_of

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}


def check_pp(cfg: TransformerConfig, pp: int, schedule: str) -> None:
    """Whether ``cfg`` can be cut into the stages of ``schedule`` over ``pp`` ranks."""
    if cfg.arch != "decoder":
        raise UsageError(f"parallel.pp={pp}: pipeline stages are built for the decoder only (model.arch="
                         f"{cfg.arch!r}); expected parallel.pp=1, and dp_shard/tp to scale it")
    if cfg.tie_embeddings:
        raise UsageError(f"model.tie_embeddings=true: with parallel.pp={pp} the embedding and the head sit on "
                         "different stages; expected model.tie_embeddings=false")
    if cfg.position == "relative":
        raise UsageError(f"model.position='relative': its learned bias is shared by every stage; expected "
                         f"another position with parallel.pp={pp}")
    n_stages = pp * STAGES_PER_RANK[schedule]
    if cfg.n_layers < n_stages:
        raise UsageError(f"model.n_layers={cfg.n_layers}: {schedule} over pp={pp} needs {n_stages} stages of at "
                         f"least one block; expected n_layers >= {n_stages}")


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Block ranges ``[first, last)`` of each stage, sizes differing by at most one."""
    return [(s.start, s.stop) for s in (rows_of(n_layers, i, n_stages) for i in range(n_stages))]


class _StackPart(nn.Module):
    """Some blocks of a stack (keyed by their index in it), with what they share."""

    def __init__(self, stack: Stack, blocks: dict[int, nn.Module], final: bool) -> None:
        super().__init__()
        self.causal, self.window = stack.causal, stack.window
        self.blocks = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.rotary, self.bias = stack.rotary, stack.bias  # parameter-free (rope, alibi) or absent
        self.final_norm = stack.final_norm if final else None

    _self_inputs = Stack._self_inputs  # the same masks and position signals as the whole stack


class Stage(nn.Module):
    """Blocks ``[first, last)`` of a decoder, plus the embedding (first stage) or head (last)."""

    def __init__(self, model: nn.Module, first: int, last: int, n_layers: int) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.embed = model.embed if first == 0 else None
        self.decoder = _StackPart(model.decoder, {i: model.decoder.blocks[i] for i in range(first, last)},
                                  final=last == n_layers)
        self.head = model.head if last == n_layers else None
        self.head_transform = model.head_transform if last == n_layers else None

    _logits = TransformerModel._logits  # the model's own way from hidden states to logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) on the first stage, else the residual stream (B, T, d_model)."""
        positions = default_positions(x if self.embed is not None else x[..., 0], None)
        h = self.embed(x, positions) if self.embed is not None else x
        ctx = self.decoder._self_inputs(positions, None, None, None)
        for block in self.decoder.blocks.values():
            h = block(h, ctx, None)
        if self.head is None:
            return h
        return self._logits(self.decoder.final_norm(h))


class PipelineRank(nn.Module):
    """This rank's stages under the full model's parameter names; ``forward`` = evaluation."""

    def __init__(self, model: nn.Module, stages: list[Stage], stage_ids: list[int], n_stages: int, group) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.stage_ids, self.n_stages, self.group = stage_ids, n_stages, group
        blocks = {int(k): b for s in stages for k, b in s.decoder.blocks.items()}
        last = next((s for s in stages if s.head is not None), None)
        if stages[0].embed is not None:
            self.embed = stages[0].embed
        self.decoder = _StackPart(model.decoder, blocks, final=last is not None)
        if last is not None:
            self.head, self.head_transform = last.head, last.head_transform
        self.stages = stages  # a plain list: the stages' modules are registered above, once

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """Logits (B, T, vocab) on every rank of the pipeline: activations sent stage to stage;
        with ``targets``, their summed loss (the models' contract, for evaluation)."""
        logits = self._logits_everywhere(tokens)
        return logits if targets is None else token_loss(logits, targets, label_smoothing)

    def _logits_everywhere(self, tokens: torch.Tensor) -> torch.Tensor:
        pp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        B, T = tokens.shape
        h = None
        for stage, s in zip(self.stages, self.stage_ids):
            if s == 0:
                x = tokens
            else:
                x = torch.empty(B, T, self.cfg.d_model, device=tokens.device)
                dist.recv(x, group_src=(s - 1) % pp, group=self.group)
            h = stage(x).float()
            if s < self.n_stages - 1:
                dist.send(h.contiguous(), group_dst=(s + 1) % pp, group=self.group)
        logits = h if self.n_stages - 1 in self.stage_ids else torch.empty(B, T, self.cfg.vocab_size,
                                                                            device=tokens.device)
        dist.broadcast(logits, group_src=(self.n_stages - 1) % pp, group=self.group)
        return logits


class Pipeline:
    """The schedule of this rank's stages; ``step`` is one optimizer step's forward and backward."""

    def __init__(self, par: Any, rank_module: PipelineRank, schedule: str, n_microbatches: int) -> None:
        self.par, self.module = par, rank_module
        self._n_targets, self._label_smoothing = 1, 0.0
        group, device, n = par.mesh["pp"].get_group(), par.device, rank_module.n_stages
        stages = [PipelineStage(st, s, n, device, group=group)
                  for st, s in zip(rank_module.stages, rank_module.stage_ids)]
        self.has_first, self.has_last = 0 in rank_module.stage_ids, n - 1 in rank_module.stage_ids
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._loss, "scale_grads": False}
        if schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, **kwargs)
        else:
            self.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], **kwargs)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the global batch's token average (as train_step), scaled up for the data-parallel average
        return token_loss(logits, targets, self._label_smoothing) * (self.par.grad_scale / self._n_targets)

    def step(self, batches: list[Any], n_targets: int, tc: Any) -> torch.Tensor:
        """Forward and backward of the global ``batches``; returns their summed loss (every rank)."""
        self._n_targets, self._label_smoothing = n_targets, tc.label_smoothing
        losses: list[torch.Tensor] = []  # the last stage's loss of each micro-batch
        for batch in batches:
            x, y = self.par.local_batch(batch)
            args = (x,) if self.has_first else ()
            these: list[torch.Tensor] = []  # (step() empties the list it is given)
            with autocast(tc.precision, self.par.device):
                self.schedule.step(*args, target=y if self.has_last else None, losses=these,
                                   return_outputs=False)
            losses.extend(these)
        total = torch.zeros((), device=self.par.device)
        if losses:
            total = torch.stack([t.detach() for t in losses]).sum() * (n_targets / self.par.grad_scale)
        return self.par.sum_over(total, ("pp", "dp_replicate", "dp_shard"))


def build_pipeline(model: nn.Module, par: Any, schedule: str, n_microbatches: int) -> PipelineRank:
    """Cut ``model`` into stages and keep this rank's (looped: rank r holds stages r, r + pp, ...)."""
    pp = par.degrees.pp
    check_pp(model.cfg, pp, schedule)
    n_stages = pp * STAGES_PER_RANK[schedule]
    bounds = stage_bounds(model.cfg.n_layers, n_stages)
    rank = par.coordinate("pp")
    ids = list(range(rank, n_stages, pp))
    stages = [Stage(model, *bounds[s], model.cfg.n_layers) for s in ids]
    return PipelineRank(model, stages, ids, n_stages, par.mesh["pp"].get_group())


def describe_stages(n_layers: int, pp: int, schedule: str) -> str:
    bounds = stage_bounds(n_layers, pp * STAGES_PER_RANK[schedule])
    return ", ".join(f"stage {i} (rank {i % pp}): blocks {a}-{b - 1}" for i, (a, b) in enumerate(bounds))
