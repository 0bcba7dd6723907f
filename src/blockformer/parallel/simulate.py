"""Jobs no machine here holds, simulated in one process: torch's fake process group.

``fake_group(N, rank)`` makes this process rank ``rank`` of an ``N``-rank job whose
collectives do nothing; ``simulate(cfg, N)`` builds ``cfg``'s model on the meta device and
parallelises it exactly as a training run would, then measures what that rank holds from
the sharded tensors themselves (``benchmarks/bench_fake_pg.py``: 7B and 70B shapes on up to
512 ranks, beside the planner's figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

from ..errors import UsageError
from ..models import build_model
from .meta import META
from .runtime import parallelize, start


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` in torch's fake process group: meshes,
    FSDP and TP build as on a real job; collectives do nothing."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    if dist.is_initialized():
        raise UsageError("simulate.fake_group: a process group is already running here; expected none")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate(cfg: Any, world_size: int, rank: int = 0) -> dict[str, Any]:
    """The parameters rank ``rank`` of a ``world_size``-rank job of ``cfg`` holds, measured on the
    sharded tensors themselves: the model built on meta and parallelised as a training run
    would be, in this one process, over torch's fake process group. Ranks other than 0 want
    a process each: torch keeps mesh state from one group to the next in a process."""
    with fake_group(world_size, rank):
        par = start(cfg, torch.device("cpu"))
        with torch.device(META):
            model = build_model(cfg.model)
        tc = cfg.train  # "auto" precision planned as bf16, as plan.py does; nothing compiled
        tc = dataclasses.replace(tc, precision="bf16" if tc.precision == "auto" else tc.precision, compile=False)
        model, _ = parallelize(model, cfg, par, tc)
        params = dict(model.named_parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params.values()]
        return {"world_size": world_size, "rank": rank, "layout": par.layout(),
                "parameters": sum(p.numel() for p in params.values()),
                "parameters_per_rank": sum(t.numel() for t in local),
                "bytes_per_rank": sum(t.numel() * t.element_size() for t in local)}


__all__ = ["fake_group", "simulate"]
