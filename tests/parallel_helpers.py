"""Running a function on N gloo processes (one thread each) for the parallel tests.

The processes come from a fork server, a fresh interpreter started at the first `run_ranks`
that imports torch and blockformer once: a rank no longer spends the ~3 s a spawned
interpreter took to import them (a few hundred process starts in the suite). Each rank is
still a child of a clean single-threaded process, never a fork of pytest itself, whose
threads and OpenMP pool a fork would copy half-made.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "blockformer.train", "blockformer.parallel"]
_SESSION_ENV = dict(os.environ)  # as this module is first imported (at collection)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fork_server() -> None:
    """The server keeps the environment it starts with: start it with the session's own, so a
    test's monkeypatched variables never reach later tests' ranks."""
    mp.set_forkserver_preload(_PRELOAD)
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
        # Leave together: a rank that tears gloo down while its peer still talks to it can
        # abort the peer ("terminate called without an active exception"), seen once in CI.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> None:
    """``fn(rank, *args)`` on ``world`` processes joined in one gloo group (from the fork server,
    never a fork of this process)."""
    start_processes(_worker, (world, free_port(), fn, args), world)


def start_processes(fn: Callable, args: tuple, nprocs: int) -> None:
    """``fn(index, *args)`` on ``nprocs`` processes from the fork server; raises if one fails."""
    _start_fork_server()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data), encoding="utf-8")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
