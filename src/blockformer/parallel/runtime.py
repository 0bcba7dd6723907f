"""The one object the training loop asks about the processes it runs on, and the wrapping
of a finished model.

``start(cfg, device)`` returns a runtime: ``Local`` for a plain one-process run, or a
``Parallel`` (the mesh, this rank's place in it). Both answer the same few questions the
loop asks (its slice of the batch, the global loss and gradient norm, whether every rank's
weights are finite, how to save and restore a checkpoint's optimizer state), so the loop
has no branch for either. ``parallelize`` wraps the model in torchtitan's order: tensor
parallel, activation checkpointing, compile, then FSDP or DDP.
"""

from __future__ import annotations


import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..run_config import RunConfig, TrainConfig
from . import meta
from .activation import apply_activation_checkpointing
from .checkpoint import lays_out_rows_by_model, load_optimizer_state, load_sharded, save_sharded
from .data import shard_batch
from .fsdp import apply_ddp, apply_fsdp, blocks_of
from .loss import loss_context
from ..errors import UsageError
from .mesh import Degrees, env_world_size, init_mesh, local_device, resolve_degrees
from .pipeline import Pipeline, build_pipeline, describe_stages
from .tensor import RowOrder, apply_tp, check_tp


class Local:
    """One process, no process group: each answer is the plain one-process computation."""

    parallel = False
    is_main = True
    world_size = 1
    pipeline = None
    grad_scale = 1.0
    grad_sync = "last"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def describe(self) -> str:
        return "one process"

    def on_main(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def local_batch(self, batch: Any) -> Any:
        return batch

    def loss_context(self, label_smoothing: float) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def loss_total(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The gradients' global norm, clipped to ``max_norm`` first when it is > 0."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def any_rank(self, flag: bool) -> bool:
        return flag

    def reads_own_shards(self, state: dict[str, Any] | None) -> bool:
        return False

    def save(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any,
             cfg: RunConfig, trainer_state: dict[str, Any], write: Callable[..., Path]) -> Path:
        """``write`` (the checkpoint writer) with the optimizer state in the trainer state."""
        return write(directory, model, tokenizer, cfg, {**trainer_state, "optimizer": optimizer.state_dict()})

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path,
                       state: dict[str, Any], full: dict | None) -> None:
        """The checkpoint's optimizer state: its own, or ``full`` (one written by a parallel run)."""
        if full is None:
            optimizer.load_state_dict(state["optimizer"])
        else:
            load_optimizer_state(None, model, optimizer, full)

    def close(self) -> None:
        pass



@dataclass
class Parallel:
    degrees: Degrees
    mesh: DeviceMesh
    device: torch.device
    owns_group: bool  # this process group was created here and is destroyed by ``close``
    rows: RowOrder = field(default_factory=RowOrder)  # tensor parallelism's reordered rows
    pipeline: Any = None  # a pipeline.Pipeline when pp > 1
    pp_schedule: str = "1f1b"
    n_layers: int = 0
    grad_sync: str = "last"  # parallel.grad_sync: which micro-batches' backward reduces gradients

    parallel = True

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0 alone (owning the run directory, say), its result returned on every
        rank; if it raises a usage or file error there, every rank raises one, so no rank waits
        for a collective that never comes."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except (UsageError, OSError) as e:
                error = e
        message = [None if error is None else str(error), result]
        dist.broadcast_object_list(message, src=0)
        if error is not None:
            raise error
        if message[0] is not None:
            raise UsageError(f"rank 0: {message[0]}")
        return message[1]

    def loss_context(self, label_smoothing: float) -> contextlib.AbstractContextManager:
        """Under TP, the logits stay split by vocabulary in the training loss."""
        return loss_context(self, label_smoothing)

    def loss_total(self, total: torch.Tensor) -> torch.Tensor:
        """The global batch's summed loss from each data-parallel rank's share."""
        return self.sum_over(total)

    def grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank holds other weights; all must agree)."""
        t = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(t)
        return bool(t)

    def reads_own_shards(self, state: dict[str, Any] | None) -> bool:
        """Whether each rank reads only its own shards of the weights and optimizer state from
        the checkpoint's ``dcp/``: any parallel run's in the model's row order, whatever its
        layout, or an older one written by ranks laid out as these."""
        if state is None or "parallel" not in state:
            return False
        return lays_out_rows_by_model(state) or state["parallel"] == self.layout()

    def save(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any,
             cfg: RunConfig, trainer_state: dict[str, Any], write: Callable[..., Path]) -> Path:
        """A checkpoint from every rank (a collective): the optimizer state sharded in ``dcp/``."""
        return save_sharded(self, directory, model, optimizer, tokenizer, cfg, trainer_state, write)

    def load_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path,
                       state: dict[str, Any], full: dict | None) -> None:
        if full is None:  # a sharded checkpoint: each rank reads its shards (the weights too)
            load_sharded(self, model, optimizer, checkpoint, model_rows=lays_out_rows_by_model(state))
        else:
            load_optimizer_state(self, model, optimizer, full)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes metrics and files, shows the progress bar."""
        return self.rank == 0

    def coordinate(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which slice of each batch it reads."""
        return self.coordinate("dp_replicate") * self.degrees.dp_shard + self.coordinate("dp_shard")

    def local_batch(self, batch: Any) -> Any:
        return shard_batch(batch, self.dp_rank, self.degrees.dp)

    @property
    def grad_scale(self) -> float:
        """FSDP and DDP average gradients over the data-parallel ranks; the loss already divides
        by the global batch's targets, so each rank's loss is scaled back up by their number."""
        return float(self.degrees.dp)

    def sum_over(self, t: torch.Tensor, dims: tuple[str, ...] = ("dp_replicate", "dp_shard")) -> torch.Tensor:
        for dim in dims:
            if self.mesh[dim].size() > 1:
                dist.all_reduce(t, group=self.mesh[dim].get_group())
        return t

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of all gradients of the model, whatever shard each rank holds. TP's
        Partial gradients are first summed in one batch (``_sum_partial_grads``); then each
        rank adds up the squares of its local shards, grouped by the mesh dimensions the
        shards are split over, and each group's sum is all-reduced over those dimensions
        once (a replicated gradient is not reduced at all): one all-reduce per group, where
        reducing each DTensor's norm (``full_tensor``) made one per parameter. The squares are
        summed over the pipeline stages last."""
        _sum_partial_grads(params)
        sums: dict[tuple, torch.Tensor] = {}
        for p in params:
            g = p.grad
            if g is None:
                continue
            key: tuple = (None, ())
            if isinstance(g, DTensor):
                key = (g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, SHARDS)))
                g = g.to_local()
            sq = torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
            sums[key] = sums[key] + sq if key in sums else sq
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        for (mesh, dims), sq in sums.items():
            for i in dims:
                dist.all_reduce(sq, group=mesh.get_group(i))
            squares += sq
        if self.degrees.pp > 1:  # each stage holds different parameters
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        total = squares.sqrt()
        groups: dict[Any, list[torch.Tensor]] = {}  # one fused multiply per mesh (FSDP x TP mixes 1-D and 2-D)
        for p in params:
            if p.grad is not None:
                groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def barrier(self) -> None:
        dist.barrier()

    def layout(self) -> dict[str, int]:
        d = self.degrees
        return {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp}

    def describe(self) -> str:
        d = self.degrees
        text = (f"{d.world_size} processes: dp_shard {d.dp_shard} x dp_replicate {d.dp_replicate} x "
                f"tp {d.tp} x pp {d.pp} ({dist.get_backend()})")
        if d.pp > 1:
            text += f"; {self.pp_schedule}: " + describe_stages(self.n_layers, d.pp, self.pp_schedule)
        return text

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


# FSDP's shard of a tensor-parallel weight is a _StridedShard, which is not a Shard (torch 2.13)
SHARDS = (Shard, _StridedShard)


def _sum_partial_grads(params: list[torch.Tensor]) -> None:
    """Under sequence parallelism a replicated weight (a norm's gain) gets a ``Partial`` gradient,
    each tp rank's share of the sum. Sum them in place, one all-reduce per mesh for all of them,
    so that neither the norm nor AdamW reduces each gradient on its own."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(p)
    for (mesh, placements), group in groups.items():
        if any(pl.is_partial() and pl.reduce_op != "sum" for pl in placements):
            for p in group:
                p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in placements])
            continue
        local = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in local])
        for i, pl in enumerate(placements):
            if pl.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(i))
        summed = [Replicate() if pl.is_partial() else pl for pl in placements]
        for p, t, part in zip(group, local, flat.split([t.numel() for t in local])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, summed, run_check=False,
                                        shape=p.grad.shape, stride=p.grad.stride())


def start(cfg: RunConfig, device: torch.device) -> Local | Parallel:
    """Join the job ``torchrun`` started; ``Local`` for one process with the default section."""
    pc, world = cfg.parallel, env_world_size()
    if world == 1 and not dist.is_initialized() and (pc.tp, pc.pp, pc.dp_replicate) == (1, 1, 1) \
            and pc.dp_shard in (-1, 1):
        return Local(device)
    head, lora = getattr(cfg, "head", None), getattr(cfg, "lora", None)
    if (head is not None and head.task != "none") or (lora is not None and lora.rank > 0):
        raise UsageError("parallel: task heads and LoRA adapters train on one process; expected head.task='none' "
                         "and lora.rank=0 with a [parallel] layout or torchrun")
    world = dist.get_world_size() if dist.is_initialized() else world
    degrees = resolve_degrees(pc, world)
    check_tp(cfg.model, degrees.tp)
    owns = not dist.is_initialized()
    device = local_device(device)
    mesh = init_mesh(degrees, device, pc.timeout)
    return Parallel(degrees=degrees, mesh=mesh, device=device, owns_group=owns, pp_schedule=pc.pp_schedule,
                    n_layers=cfg.model.n_layers, grad_sync=pc.grad_sync)


def parallelize(
    model: nn.Module, cfg: RunConfig, par: Local | Parallel | None, train: TrainConfig | None = None
) -> tuple[nn.Module, nn.Module]:
    """Wrap the finished ``model`` (pipeline stages, TP, activation checkpointing, compile,
    FSDP/DDP). Returns the module holding this rank's parameters (the whole model but under
    pipeline parallelism) and the module to call for the forward pass. ``train`` overrides
    ``cfg.train`` (the loop's, with ``precision = "auto"`` resolved)."""
    tc = train or cfg.train
    if par is None or not par.parallel:
        _materialize(model, getattr(par, "device", "cpu"))
        apply_activation_checkpointing(model, tc.activation_checkpointing)
        return model, model  # one process: the loop compiles model + loss together (train.compile)
    d, pc = par.degrees, cfg.parallel
    roots = [model]  # the modules whose forward the training step calls
    if d.pp > 1:
        n_micro = pc.pp_microbatches or 2 * d.pp
        check_microbatches(tc.batch_size // d.dp, n_micro)
        built, model = model, build_pipeline(model, par, pc.pp_schedule, n_micro)
        meta.hand_over(built, model)  # a meta build: this rank fills in its own stages only
        roots = model.stages
    if d.tp > 1:
        par.rows = apply_tp(model, par.mesh["tp"], d.tp)
    apply_activation_checkpointing(model, tc.activation_checkpointing)
    if tc.compile:
        for block in blocks_of(model):  # per block, in place: names stay, FSDP wraps compiled blocks
            block.compile()
    fwd_model = model
    if d.dp_shard > 1 or (d.dp_replicate > 1 and (d.tp > 1 or d.pp > 1)):
        dims = ("dp_replicate", "dp_shard") if d.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, par.mesh[dims], tc.precision, roots)
    elif d.dp_replicate > 1:
        _materialize(model, par.device, par.rows)  # DDP broadcasts real weights when it wraps
        fwd_model = apply_ddp(model, par.mesh["dp_replicate"])
    _materialize(model, par.device, par.rows)  # built on meta: now each rank's shards, filled in
    if d.pp > 1:
        par.pipeline = Pipeline(par, model, pc.pp_schedule, n_micro)
    return model, fwd_model


def _materialize(model: nn.Module, device: Any, rows: RowOrder | None = None) -> None:
    if meta.pending(model):
        meta.materialize(model, device, rows)


def check_microbatches(rows: int, n_micro: int) -> None:
    if rows < n_micro:
        raise UsageError(f"parallel.pp_microbatches={n_micro}: each data-parallel rank has {rows} rows per batch; "
                         f"expected train.batch_size / (dp_shard * dp_replicate) >= pp_microbatches")


__all__ = ["Local", "Parallel", "start", "parallelize"]
