"""Per-rank memory and tokens/s of one training run at the same global batch on 1 and 2
processes: FSDP2 (dp_shard=2), tensor parallel (tp=2) and DDP (dp_replicate=2) against one process.

    python benchmarks/bench_parallel.py                 # d_model 384, 6 layers, 10 steps
    python benchmarks/bench_parallel.py --steps 3 --d-model 64 --layers 2   # smoke

Each layout is launched with ``torchrun --standalone --nproc_per_node=N -m`` this file's
worker, which trains a byte-level decoder on the stdlib corpus for ``--steps`` steps
(``train.batch_size`` rows of ``seq_len`` tokens per step, the global batch, the same for
every layout). Figures per rank: the bytes of the parameters, gradients and AdamW moments
this rank holds (exact, from the local shards), the growth of its peak RSS during
training (those plus activations, buffers, communication), and the global tokens/s the
loop logs. On a machine with 2 shared cores, expect no speed-up from 2 processes: the
point is the memory each rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "1 process": (1, []),
    "FSDP dp_shard=2": (2, ["parallel.dp_shard=2"]),
    "TP tp=2": (2, ["parallel.tp=2"]),
    "DDP dp_replicate=2": (2, ["parallel.dp_replicate=2"]),
}


def overrides(args) -> list[str]:
    return [
        "data.text=stdlib", "data.max_bytes=2000000", f"data.seq_len={args.seq_len}", "data.tokenizer=byte",
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
        f"model.max_seq_len={args.seq_len}", "model.tie_embeddings=false", f"train.batch_size={args.batch}",
        f"train.steps={args.steps}", "train.eval_every=0", "train.eval_batches=1", "train.progress=false",
        f"train.log_every={args.steps}", "train.warmup=1", f"data.cache_dir={args.cache}",
    ]


def worker(args) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from blockformer import parallel  # noqa: PLC0415
    from blockformer.models import build_model  # noqa: PLC0415
    from blockformer.run_config import load_run_config  # noqa: PLC0415
    from blockformer.train.loop import train  # noqa: PLC0415
    from blockformer.train.optim import build_optimizer  # noqa: PLC0415

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # joined once: train() and the count below share it
        dist.init_process_group("gloo")
    cfg = load_run_config(overrides=overrides(args) + args.set)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = train(cfg, Path(args.out), log=lambda *a: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    par = parallel.start(cfg, torch.device("cpu"))  # the same layout again, to count this rank's state
    cfg.model.vocab_size = 260
    model = build_model(cfg.model, seed=0)
    model, _ = parallel.parallelize(model, cfg, par)
    opt = build_optimizer(model, cfg.train)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    tok_s = [json.loads(line) for line in open(Path(args.out) / "metrics.jsonl")] if rank == 0 else []
    record = {"rank": rank, "state_bytes": 16 * local, "rss_growth": peak - base_rss,
              "tokens_per_s": next((r["tokens_per_s"] for r in tok_s if r["split"] == "train"), None),
              "loss": result.losses[-1]}
    Path(args.report).with_suffix(f".{rank}.json").write_text(json.dumps(record))
    del opt
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "blockformer-bench-cache"))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (n, sets) in LAYOUTS.items():
            report = Path(tmp) / name.split()[0]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   __file__, "--worker", "--out", str(Path(tmp) / f"run-{n}-{len(rows)}"), "--report", str(report),
                   "--steps", str(args.steps), "--d-model", str(args.d_model), "--layers", str(args.layers),
                   "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
                   "--cache", args.cache] + [f"--set={s}" for s in sets]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            ranks = [json.loads(report.with_suffix(f".{r}.json").read_text()) for r in range(n)]
            rows.append((name, ranks))
    from common import cpu_kind  # noqa: PLC0415

    print(f"decoder d_model {args.d_model}, {args.layers} layers, global batch {args.batch} x {args.seq_len} "
          f"tokens, {args.steps} steps, fp32, 1 thread per process, CPU {cpu_kind()}\n")
    print("| layout | processes | state per rank (weights+grads+AdamW) | peak RSS growth per rank | tokens/s "
          "| final loss |")
    print("|---|---|---|---|---|---|")
    for name, ranks in rows:
        state = " / ".join(f"{r['state_bytes'] / 2**20:.0f} MiB" for r in ranks)
        rss = " / ".join(f"{r['rss_growth'] / 2**20:.0f} MiB" for r in ranks)
        print(f"| {name} | {len(ranks)} | {state} | {rss} | {ranks[0]['tokens_per_s']:,.0f} | {ranks[0]['loss']:.4f} |")


if __name__ == "__main__":
    main()
