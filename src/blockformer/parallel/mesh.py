"""The process group and the one ``DeviceMesh`` a parallel run lays its ranks out on.

``torchrun`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous address. The mesh has four named dims, outermost
first, ``("pp", "dp_replicate", "dp_shard", "tp")`` (torchtitan's order): tensor-parallel
ranks are neighbours, so their frequent all-reduces stay on the fastest links (one node's
NVLink), and pipeline stages, which only pass activations, span the slowest.

Every group of the mesh waits ``parallel.timeout`` seconds for a rank (torch's default is
30 minutes). When a collective gives up (a rank hangs, was stopped, or died), gloo's error
names no rank: ``stopped_ranks`` has each surviving rank report to the job's key-value
store and names the ranks never heard from. ``dist.monitored_barrier`` would name them,
but after a timeout gloo has closed the pairs it needs ("Application timeout caused pair
closure"). On CUDA each process drives the GPU ``LOCAL_RANK`` names, NCCL is bound to it
(``device_id``) and its watchdog tears the process down on a timed-out collective.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
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


def init_mesh(degrees: Degrees, device: torch.device, timeout: float = 300.0) -> DeviceMesh:
    """Join the process group (if this process has not yet) and build the named mesh; a
    collective waits ``timeout`` seconds for a rank, then raises (NCCL: ends the process)."""
    global _generation
    backend, wait = backend_for(device), timedelta(seconds=timeout)
    if not dist.is_initialized():
        if backend == "nccl":  # the watchdog ends the process on a failed collective (torchrun sets it too)
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        try:
            dist.init_process_group(backend, timeout=wait, device_id=device if backend == "nccl" else None,
                                    **_attempt_store(wait))
        except RuntimeError as e:  # a rank that never came ("1/2 clients joined"): one line, not a trace
            if not _PEER_LOST.search(str(e)):
                raise
            raise StoppedRanks(f"parallel: the {degrees.world_size} ranks did not all join within parallel.timeout="
                               f"{timeout:g}s ({str(e).strip().splitlines()[0]}); expected every rank started "
                               f"(torchrun --nproc_per_node, --nnodes) and the rendezvous address reachable") from None
    if dist.get_world_size() != degrees.world_size:  # pragma: no cover - resolve_degrees checked it
        raise UsageError(f"parallel: the process group has {dist.get_world_size()} ranks, expected {degrees.world_size}")
    _generation += 1
    return init_device_mesh(device.type, degrees.as_tuple(), mesh_dim_names=DIMS,
                            backend_override=_group_timeouts(degrees, backend, wait))


def _attempt_store(wait: timedelta) -> dict[str, Any]:
    """Under torchrun's shared store, this attempt's keys apart from an earlier attempt's.
    torchrun keeps one store server for the whole job and a restarted attempt's process group
    would read the dead attempt's addresses there (gloo: "connectFullMesh failed ... Connection
    refused"; pytorch/pytorch#135712); the attempt number scopes them. One agent counts its
    attempts exactly; agents on several nodes may not (a restart that another node's failure
    caused is not counted), so there launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=wait)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"blockformer/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _group_timeouts(degrees: Degrees, backend: str, wait: timedelta) -> dict[str, Any]:
    """The mesh's sub-groups (a dim wider than one rank, narrower than the world) with the
    timeout: ``new_group`` would give them torch's 30 minutes, not the default group's."""
    # A simulated job (parallel/simulate.py, torch's fake backend): its groups never wait.
    if dist.is_initialized() and dist.get_backend() == "fake":
        return {}
    dims = [name for name, n in zip(DIMS, degrees.as_tuple()) if 1 < n < degrees.world_size]
    return {name: (backend, _options(backend, wait)) for name in dims}


def _options(backend: str, wait: timedelta) -> Any:
    """One group's options (one object each: torch writes the group's name and ranks into them)."""
    if backend != "nccl":
        return C10dBackend.Options(backend, wait)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = wait
    return options


def local_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on GPUs (set as the current one), else ``device``."""
    if device.type != "cuda":
        return device
    index, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if index >= count:
        raise UsageError(f"parallel: LOCAL_RANK={index} but {count} GPU{'s' * (count != 1)} visible; expected "
                         f"torchrun --nproc_per_node <= the GPUs of a node (CUDA_VISIBLE_DEVICES)")
    local = torch.device("cuda", index)
    torch.cuda.set_device(local)
    return local


class StoppedRanks(UsageError):
    """A collective gave up on a rank (``parallel.timeout``, or a lost connection): the job
    ends with one line naming the ranks that stopped answering."""

    exit_code = 4


_generation = 0  # meshes built by this process: keys in the store are per mesh (a second train() call)
_PEER_LOST = re.compile(r"timed out|timeout|connection (closed|reset) by peer|pair closure", re.IGNORECASE)


def stopped_ranks(error: BaseException, timeout: float) -> StoppedRanks | None:
    """The error to end the job with when ``error`` is a collective that timed out or lost
    its peer; None for any other error. Each surviving rank reports to the job's store; the
    first to report waits (up to half the timeout, 2 to 10 s) for the others, then names
    the ranks never heard from: they hang, were stopped or died."""
    if not isinstance(error, RuntimeError) or not _PEER_LOST.search(str(error)) or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    first = str(error).strip().splitlines()[0]
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # without gloo's [file.cc:78]
    timed_out = re.search("timed out|timeout", reason, re.IGNORECASE)
    what = (f"waited parallel.timeout={timeout:g}s in a collective" if timed_out
            else "lost a connection in a collective")
    grace = min(max(timeout / 2, 2.0), 10.0)
    try:
        silent = _silent_ranks(rank, world, grace)
    except Exception:  # noqa: BLE001 - the store is gone too (it lived in a rank that died)
        silent = None
    if silent:
        many, names = len(silent) > 1, ", ".join(map(str, silent))
        return StoppedRanks(f"parallel: rank{'s' * many} {names} of {world} stopped answering: "
                            f"rank {rank} {what} ({reason}) and no word came from {'them' if many else 'it'} "
                            f"within {grace:g}s (hung, stopped or dead); the job ends, its checkpoints kept")
    heard = "every rank reported" if silent == [] else "the job store did not answer"
    return StoppedRanks(f"parallel: rank {rank} {what} ({reason}); {heard}, so no rank is named; "
                        f"the job ends, its checkpoints kept")


def _silent_ranks(rank: int, world: int, grace: float) -> list[int]:
    """Ranks that did not report to the store within ``grace`` seconds of the first report."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=grace + 5))
    prefix = f"blockformer/stopped/{_generation}"
    store.set(f"{prefix}/{rank}", "1")
    if store.add(f"{prefix}/count", 1) == 1:  # the first to fail names the silent ones for all
        deadline = time.monotonic() + grace
        while store.add(f"{prefix}/count", 0) < world and time.monotonic() < deadline:
            time.sleep(0.2)
        silent = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        store.set(f"{prefix}/silent", json.dumps(silent))
        return silent
    store.wait([f"{prefix}/silent"])
    return json.loads(store.get(f"{prefix}/silent"))
