"""The step's communication, counted on 2 gloo processes: under gradient accumulation only the
last micro-batch's backward reduces gradients (FSDP2: one reduce-scatter per unit per step;
DDP: one bucketed all-reduce pass), the global gradient norm is one all-reduce per group of
shards, and AdamW's
foreach/fused kernels on DTensor parameters make no collective; losses, norms and weights
equal those of syncing every micro-batch, of the per-tensor AdamW and of one process."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from blockformer import parallel
from blockformer.train.compile import resolve_compile
from blockformer.train.optim import build_optimizer
from blockformer.train.setup import build_run
from blockformer.train.step import train_step

from parallel_helpers import read_json, run_ranks, write_json
from test_parallel_dp import assert_same_run, lm_config, reference

ACCUM = 4
C10D = ("all_reduce", "reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor",
        "all_gather_into_tensor", "broadcast", "all_gather", "reduce_scatter")


class Collectives:
    """Calls of ``torch.distributed``'s collectives (what FSDP2 and our code call), DTensor's
    functional collectives (``CommDebugMode``; its ``c10d.*`` entries are the calls already
    counted) and DDP's bucket all-reduces (a comm hook: its reducer calls the process group
    from C++), counted under the phase the step is in: ``backward``, ``norm`` or ``adamw``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.phase = "backward"
        self._saved = {name: getattr(dist, name) for name in C10D}
        for name in C10D:
            setattr(dist, name, self._counted(name, self._saved[name]))

    def _counted(self, name: str, fn: Any) -> Any:
        def call(*args, **kwargs):
            self.counts[self.phase, name] += 1
            return fn(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        self.phase = phase
        with CommDebugMode() as mode:
            yield
        for op, n in mode.get_comm_counts().items():
            if not str(op).startswith("c10d."):
                self.counts[phase, f"dtensor {op}"] += n
        self.phase = "backward"

    def ddp_buckets(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: PLC0415

        def hook(state, bucket):
            self.counts[self.phase, "ddp bucket"] += 1
            return allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)

    def of(self, phase: str) -> dict[str, int]:
        return {name: n for (p, name), n in self.counts.items() if p == phase}

    def close(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _setup(tmp: str, overrides: list[str], kernel: str | None = None):
    """What the loop builds: runtime, model, forward module, objective, AdamW, and the train
    config with ``compile = "auto"`` resolved as the loop resolves it (off for this model)."""
    cfg = lm_config(Path(tmp), f"train.grad_accum={ACCUM}", "train.grad_clip=1.0", *overrides)
    cfg.train = dataclasses.replace(cfg.train, compile=resolve_compile(cfg.train.compile, cfg.model))
    runtime = parallel.start(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.train.seed)
    built = build_run(cfg, runtime.device, log=lambda *a: None)
    model, fwd = parallel.parallelize(built.model, built.config, runtime, cfg.train)
    optimizer = build_optimizer(model, cfg.train)
    if kernel is not None:  # "per-tensor", "foreach" or "fused" instead of build_optimizer's choice
        for group in optimizer.param_groups:
            group["foreach"], group["fused"] = kernel == "foreach", kernel == "fused"
    return cfg, runtime, model, fwd, built.objective, optimizer


def _full(model: torch.nn.Module, runtime) -> dict[str, list]:
    """Every weight whole, its rows in the model's order (TP reorders fused rows)."""
    rows = getattr(runtime, "rows", None)
    out = {}
    for name, p in model.named_parameters():
        w = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        out[name] = (rows.to_model(name, w) if rows is not None else w).tolist()
    return out


def _old_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The norm as it was computed before: one collective per DTensor gradient."""
    squares = torch.zeros(())
    for p in params:
        if p.grad is not None:
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
            squares += sq.full_tensor() if isinstance(sq, DTensor) else sq
    return squares.sqrt()


def _steps(rank: int, tmp: str, overrides: list[str], out: str, every: bool, kernel: str | None = None,
           n_steps: int = 2) -> None:
    """``n_steps`` optimizer steps of ``ACCUM`` micro-batches; the losses, norms (new and old
    formula), final weights and per-step collectives of rank 0 go to ``out.json``."""
    cfg, runtime, model, fwd, objective, optimizer = _setup(tmp, overrides + ["parallel.grad_sync=every"] * every,
                                                            kernel)
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    counter = Collectives()
    if isinstance(fwd, torch.nn.parallel.DistributedDataParallel):
        counter.ddp_buckets(fwd)
    norm_fn, step_fn = runtime.grad_norm, optimizer.step
    old_norms: list[float] = []

    def grad_norm(ps, max_norm):
        old_norms.append(float(_old_norm(ps)))  # before: clipping scales the gradients
        with counter.during("norm"):
            return norm_fn(ps, max_norm)

    def adamw(*a, **k):
        with counter.during("adamw"):
            return step_fn(*a, **k)

    runtime.grad_norm, optimizer.step = grad_norm, adamw
    losses, norms = [], []
    try:
        for _ in range(n_steps):
            batches = [objective.next_batch() for _ in range(ACCUM)]
            loss = train_step(fwd, objective, batches, optimizer, scaler, params, cfg.train, runtime.device,
                              check_finite=True, runtime=runtime, norms=norms)
            losses.append(float(loss))
    finally:
        counter.close()
    weights = _full(model, runtime)
    if rank == 0:
        counts = {phase: counter.of(phase) for phase in ("backward", "norm", "adamw")}
        counts = {phase: {k: v / n_steps for k, v in c.items()} for phase, c in counts.items()}
        units = sum(isinstance(m, FSDPModule) for m in model.modules())
        write_json(Path(tmp) / f"{out}.json", {"losses": losses, "norms": [float(n) for n in norms],
                                                "old_norms": old_norms, "weights": weights,
                                                "counts": counts, "fsdp_units": units})


def _layouts(rank: int, tmp: str, runs: list[tuple[str, list[str], bool, str | None]]) -> None:
    for out, overrides, every, kernel in runs:
        _steps(rank, tmp, overrides, out, every, kernel)


def _same(a: dict, b: dict, rtol: float) -> None:
    """Same losses (``rtol``), norms (1e-6) and weights (``rtol`` of each tensor's norm)."""
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=1e-6, atol=0)
    assert a["weights"].keys() == b["weights"].keys()
    for name, w in a["weights"].items():
        w, v = torch.tensor(w), torch.tensor(b["weights"][name])
        assert torch.linalg.norm(w - v) <= rtol * torch.linalg.norm(v), name


FSDP, DDP, TP = ["parallel.dp_shard=2"], ["parallel.dp_replicate=2"], ["parallel.tp=2"]
RUNS = [  # name, layout, sync every micro-batch (the path before), AdamW kernel (None: build_optimizer's)
    ("fsdp", FSDP, False, None), ("fsdp_before", FSDP, True, "per-tensor"), ("fsdp_foreach", FSDP, False, "foreach"),
    ("ddp", DDP, False, None), ("ddp_before", DDP, True, None),
    ("tp", TP, False, None), ("tp_per_tensor", TP, False, "per-tensor"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every run of ``RUNS`` on 2 gloo processes, and one process (``one``)."""
    tmp = tmp_path_factory.mktemp("comm")
    run_ranks(2, _layouts, str(tmp), RUNS)
    _steps(0, str(tmp), [], "one", False)
    return {out: read_json(tmp / f"{out}.json") for out in [r[0] for r in RUNS] + ["one"]}


@pytest.mark.slow
def test_fsdp_accumulation_of_four_micro_batches_reduce_scatters_once_per_unit_per_step(runs):
    units = runs["fsdp"]["fsdp_units"]
    assert units == 3  # a unit per block and the root (the tied embedding and head live in it)
    assert runs["fsdp"]["counts"]["backward"]["reduce_scatter_single"] == units
    assert runs["fsdp_before"]["counts"]["backward"]["reduce_scatter_single"] == ACCUM * units
    assert runs["fsdp"]["counts"]["backward"]["all_reduce"] == 1  # the step's loss, for the log
    _same(runs["fsdp"], runs["fsdp_before"], rtol=1e-6)


@pytest.mark.slow
def test_ddp_accumulation_all_reduces_the_buckets_once_per_step(runs):
    buckets = runs["ddp"]["counts"]["backward"]["ddp bucket"]
    assert buckets >= 1 and runs["ddp_before"]["counts"]["backward"]["ddp bucket"] == ACCUM * buckets
    _same(runs["ddp"], runs["ddp_before"], rtol=1e-6)


@pytest.mark.slow
def test_the_gradient_norm_is_one_all_reduce_per_shard_group_not_one_per_parameter(runs):
    # FSDP: every gradient is a Shard(0) of the same mesh: one all-reduce; DDP: already all-reduced,
    # none; TP: one for the Partial norm gains (summed in one batch) and one for the sharded rest
    assert runs["fsdp"]["counts"]["norm"] == {"all_reduce": 1}
    assert runs["ddp"]["counts"]["norm"] == {}
    assert runs["tp"]["counts"]["norm"] == {"all_reduce": 2}


@pytest.mark.slow
def test_the_norm_with_tps_partial_gradients_summed_in_one_batch_equals_the_norm_without(runs):
    # the sequence-parallel norms' Partial gradients are summed in one all-reduce before the norm;
    # the norm equals one computed on the unsummed gradients, each reduced on its own
    for out in ("fsdp", "ddp", "tp"):
        torch.testing.assert_close(torch.tensor(runs[out]["norms"]), torch.tensor(runs[out]["old_norms"]),
                                   rtol=1e-6, atol=0)


@pytest.mark.slow
def test_fused_and_foreach_adamw_on_dtensors_make_no_collective_and_match_the_per_tensor_path(runs):
    for out in ("fsdp", "fsdp_foreach", "ddp", "tp"):
        assert runs[out]["counts"]["adamw"] == {}, out
    _same(runs["fsdp_foreach"], runs["fsdp_before"], rtol=1e-6)
    _same(runs["tp"], runs["tp_per_tensor"], rtol=1e-6)


@pytest.mark.slow
def test_the_new_step_matches_one_process(runs):
    for out in ("fsdp", "ddp", "tp"):
        _same(runs[out], runs["one"], rtol=1e-5)
