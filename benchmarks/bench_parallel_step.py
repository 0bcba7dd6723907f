"""Step time of FSDP2 and DDP on 2 gloo processes, before and after issue 26 item 5, in one run:
gradients reduced on every micro-batch against only the last, AdamW per-tensor against
foreach and fused on the DTensor shards, and the gradient norm reduced per parameter against
once per group of shards.

    python benchmarks/bench_parallel_step.py                  # d_model 256, 4 layers, accumulation 4
    python benchmarks/bench_parallel_step.py --steps 3 --rounds 1 --d-model 64   # smoke

A byte-level decoder on the stdlib corpus, global batch ``--batch`` rows of ``--seq-len``
tokens in ``--accum`` micro-batches, one thread per process. The variants are interleaved
round by round (``--rounds`` x ``--steps`` timed steps each, after one warm-up step), so
that other load on the machine falls on all of them alike; figures are the median step time
of rank 0 (from a barrier to the step's loss on the host) and the median AdamW step alone,
and their ratios to the new path (sync on the last micro-batch, build_optimizer's kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

VARIANTS = [  # name, layout, sync every micro-batch, AdamW kernel, gradient norm
    ("FSDP  before: sync every micro-batch, per-tensor AdamW, per-parameter norm", "parallel.dp_shard=2", True,
     "per-tensor", "per-parameter"),
    ("FSDP  sync last micro-batch,  per-tensor AdamW", "parallel.dp_shard=2", False, "per-tensor", "grouped"),
    ("FSDP  sync last micro-batch,  foreach AdamW", "parallel.dp_shard=2", False, "foreach", "grouped"),
    ("FSDP  after: sync last micro-batch, fused AdamW, grouped norm", "parallel.dp_shard=2", False, "fused", "grouped"),
    ("FSDP  after, but the per-parameter norm", "parallel.dp_shard=2", False, "fused", "per-parameter"),
    ("DDP   sync every micro-batch", "parallel.dp_replicate=2", True, "fused", "grouped"),
    ("DDP   sync last micro-batch", "parallel.dp_replicate=2", False, "fused", "grouped"),
    ("TP    grouped norm", "parallel.tp=2", False, "fused", "grouped"),
    ("TP    per-parameter norm", "parallel.tp=2", False, "fused", "per-parameter"),
]


def per_parameter_norm(runtime, params, max_norm: float):
    """The gradient norm as it was before: each DTensor gradient's square reduced on its own."""
    import torch  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from blockformer.parallel.runtime import _sum_partial_grads  # noqa: PLC0415

    _sum_partial_grads(params)
    squares = torch.zeros(())
    for p in params:
        if p.grad is not None:
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
            squares += sq.full_tensor() if isinstance(sq, DTensor) else sq
    total = squares.sqrt()
    groups = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm if max_norm > 0 else float("inf"), total)
    return total


def overrides(args) -> list[str]:
    return [
        "data.text=stdlib", "data.max_bytes=300000", f"data.seq_len={args.seq_len}", "data.tokenizer=byte",
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
        f"model.max_seq_len={args.seq_len}", f"train.batch_size={args.batch}", f"train.grad_accum={args.accum}",
        "train.eval_every=0", "train.progress=false", "train.precision=fp32", f"data.cache_dir={args.cache}",
    ]


def _setup(args, layout: str, kernel: str, every: bool):
    import torch  # noqa: PLC0415

    from blockformer import parallel  # noqa: PLC0415
    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.train.compile import resolve_compile  # noqa: PLC0415
    from blockformer.train.optim import build_optimizer  # noqa: PLC0415
    from blockformer.train.setup import build_run  # noqa: PLC0415

    cfg = load_run_config(overrides=overrides(args) + [layout] + ["parallel.grad_sync=every"] * every)
    cfg.train = dataclasses.replace(cfg.train, compile=resolve_compile(cfg.train.compile, cfg.model))  # as the loop
    runtime = parallel.start(cfg, torch.device("cpu"))
    built = build_run(cfg, runtime.device, log=lambda *a: None)
    model, fwd = parallel.parallelize(built.model, built.config, runtime, cfg.train)
    optimizer = build_optimizer(model, cfg.train)
    for group in optimizer.param_groups:
        group["foreach"], group["fused"] = kernel == "foreach", kernel == "fused"
    return cfg, runtime, model, fwd, built.objective, optimizer


def _worker(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from blockformer.train.step import train_step  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    runs = []
    for i, (name, layout, every, kernel, norm) in enumerate(VARIANTS):
        cfg, runtime, model, fwd, objective, optimizer = _setup(args, layout, kernel, every)
        if norm == "per-parameter":
            runtime.grad_norm = functools.partial(per_parameter_norm, runtime)
        runs.append({"name": name, "every": every, "setup": (cfg, runtime, model, fwd, objective, optimizer),
                     "adamw": optimizer.step, "norm": runtime.grad_norm, "steps": [], "opt": [], "norms": []})
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def one_step(run, timed: bool) -> None:
        cfg, runtime, model, fwd, objective, optimizer = run["setup"]
        params = [p for p in model.parameters() if p.requires_grad]
        opt_times = []

        def timed_adamw(*a, **k):
            t = time.perf_counter()
            out = run["adamw"](*a, **k)
            opt_times.append(time.perf_counter() - t)
            return out

        def timed_norm(*a, **k):
            t = time.perf_counter()
            out = run["norm"](*a, **k)
            norm_times.append(time.perf_counter() - t)
            return out

        norm_times = []
        optimizer.step, runtime.grad_norm = timed_adamw, timed_norm
        batches = [objective.next_batch() for _ in range(cfg.train.grad_accum)]
        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(fwd, objective, batches, optimizer, scaler, params, cfg.train, runtime.device,
                          check_finite=True, runtime=runtime)
        float(loss)
        if timed:
            run["steps"].append(time.perf_counter() - t0)
            run["opt"].extend(opt_times)
            run["norms"].extend(norm_times)

    for run in runs:
        one_step(run, timed=False)  # optimizer state allocated, first-call costs paid
    for _ in range(args.rounds):
        for run in runs:
            for _ in range(args.steps):
                one_step(run, timed=True)
    if rank == 0:
        med = {r["name"]: (statistics.median(r["steps"]), statistics.median(r["opt"]), statistics.median(r["norms"]))
               for r in runs}
        from common import cpu_kind  # noqa: PLC0415

        print(f"{args.d_model=} {args.layers=} {args.seq_len=} {args.batch=} accum={args.accum}, 2 gloo processes, "
              f"{args.rounds} rounds x {args.steps} steps per variant, interleaved, CPU {cpu_kind()}")
        print(f"{'variant':76s} {'step ms':>9s} {'AdamW ms':>9s} {'norm ms':>9s}")
        for name, (s, o, n) in med.items():
            print(f"{name:76s} {1e3 * s:9.1f} {1e3 * o:9.2f} {1e3 * n:9.2f}")
        v = [med[r["name"]] for r in runs]
        print(f"FSDP sync every / last micro-batch (per-tensor AdamW):  step x{v[0][0] / v[1][0]:.2f}")
        print(f"FSDP AdamW per-tensor / foreach:  AdamW x{v[1][1] / v[2][1]:.2f}, step x{v[1][0] / v[2][0]:.2f}")
        print(f"FSDP AdamW per-tensor / fused:  AdamW x{v[1][1] / v[3][1]:.2f}, step x{v[1][0] / v[3][0]:.2f}")
        print(f"FSDP before / after (both changes):  step x{v[0][0] / v[3][0]:.2f}")
        print(f"DDP sync every / last micro-batch:  step x{v[5][0] / v[6][0]:.2f}")
        print(f"FSDP norm per-parameter / grouped:  norm x{v[4][2] / v[3][2]:.2f}, step x{v[4][0] / v[3][0]:.2f}")
        print(f"TP norm per-parameter / grouped:  norm x{v[8][2] / v[7][2]:.2f}, step x{v[8][0] / v[7][0]:.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    import torch.multiprocessing as mp  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        args.cache = str(Path(tmp) / "cache")
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(_worker, args=(args, port), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
