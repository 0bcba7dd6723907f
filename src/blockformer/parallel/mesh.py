"""The process group and the one ``DeviceMesh`` a parallel run lays its ranks out on.

``torchrun`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous address. The mesh has four named dims, outermost
first, ``("pp", "dp_replicate", "dp_shard", "tp")`` (torchtitan's order): tensor-parallel
ranks are neighbours, so their frequent all-reduces stay on the fastest links (one node's
NVLink), and pipeline stages, which only pass activations, span the slowest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import UsageError
from ..run_config import ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Degrees:
    """The size of each mesh dim, resolved against the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.tp


def resolve_degrees(pc: ParallelConfig, world_size: int) -> Degrees:
    """The degrees of ``pc`` for ``world_size`` processes; their product must be the world size."""
    fixed = pc.dp_replicate * pc.tp * pc.pp
    hint = "; launch the processes with torchrun --nproc_per_node=N" if world_size == 1 else ""
    dp_shard = pc.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            raise UsageError(
                f"parallel: dp_replicate={pc.dp_replicate} x tp={pc.tp} x pp={pc.pp} = {fixed} does not divide "
                f"the world size {world_size}; expected a divisor (dp_shard=-1 takes the rest){hint}"
            )
        dp_shard = world_size // fixed
    degrees = Degrees(pc.pp, pc.dp_replicate, dp_shard, pc.tp)
    if degrees.world_size != world_size:
        raise UsageError(
            f"parallel: dp_shard={dp_shard} x dp_replicate={pc.dp_replicate} x tp={pc.tp} x pp={pc.pp} = "
            f"{degrees.world_size}, but the world size is {world_size}; expected their product to equal it{hint}"
        )
    return degrees


def env_world_size() -> int:
    """Processes in this job: ``WORLD_SIZE`` as torchrun sets it, 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_mesh(degrees: Degrees, device: torch.device) -> DeviceMesh:
    """Join the process group (if this process has not yet) and build the named mesh."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    if dist.get_world_size() != degrees.world_size:  # pragma: no cover - resolve_degrees checked it
        raise UsageError(f"parallel: the process group has {dist.get_world_size()} ranks, expected {degrees.world_size}")
    return init_device_mesh(device.type, degrees.as_tuple(), mesh_dim_names=DIMS)


def local_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on GPUs (set as the current one), else ``device``."""
    if device.type != "cuda":
        return device
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(local)
    return local
