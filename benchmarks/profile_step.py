"""Where a training step's time goes: ``torch.profiler`` over the trainer's own step
(``train.loop.train_step``) at each benchmark shape, top ops by self time, one file per
shape in ``benchmarks/results/`` (``profile-<shape>-<device>.txt``).

    python benchmarks/profile_step.py                                  # all shapes
    python benchmarks/profile_step.py --shapes char-lm-tiny --steps 1 --out-dir /tmp/p   # smoke

Shapes: ``char-lm-tiny`` (nanoGPT's CPU shape, batch 12 x 64), ``gpt2-small`` (12 x 768,
vocabulary 50257, batch ``--gpt2-batch`` x 512) and ``translate-small`` (the preset's
encoder-decoder, a bucketed batch of ``max_tokens`` 3000 of random pairs). Data is random
tokens: the time per op does not depend on them. The gap between the matmul rows
(``aten::mm``/``addmm``/``bmm``, attention) and the total is what MFU does not count.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from common import device_and_precision, gpt2_config, synthetic_lm

from blockformer import build_model
from blockformer.data.batcher import TokenBatcher
from blockformer.data.buckets import length_buckets
from blockformer.run_config import load_run_config
from blockformer.train.compile import compile_loss
from blockformer.train.loop import train_step
from blockformer.train.objective import Seq2Seq
from blockformer.train.optim import build_optimizer
from blockformer.precision import grad_scaler

REPO = Path(__file__).resolve().parents[1]
SHAPES = ("char-lm-tiny", "gpt2-small", "translate-small")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after two warm-up steps)")
    p.add_argument("--gpt2-batch", type=int, default=8)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="profile the compiled step")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def setup(shape: str, device: torch.device, args):
    """(model, objective, train config) for ``shape``."""
    if shape == "gpt2-small":
        cfg = gpt2_config()
        tc = load_run_config(overrides=["train.lr=6e-4", "train.beta2=0.95"]).train
        return build_model(cfg, seed=0, device=device), synthetic_lm(cfg.vocab_size, 512, args.gpt2_batch, device), tc
    run_cfg = load_run_config(preset=shape)
    if shape == "char-lm-tiny":
        cfg = run_cfg.model.__class__(**{**run_cfg.model.__dict__, "vocab_size": 65})  # tinyshakespeare's
        objective = synthetic_lm(65, run_cfg.data.seq_len, run_cfg.train.batch_size, device)
        return build_model(cfg, seed=0, device=device), objective, run_cfg.train
    cfg = run_cfg.model.__class__(**{**run_cfg.model.__dict__, "vocab_size": run_cfg.data.vocab_size})
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(4, cfg.vocab_size, rng.integers(8, 40)).tolist(),
              rng.integers(4, cfg.vocab_size, rng.integers(8, 40)).tolist()) for _ in range(2000)]
    buckets = length_buckets(cfg.max_seq_len) if args.compile else None
    batcher = TokenBatcher(pairs, run_cfg.train.max_tokens, seed=0, buckets=buckets)
    return build_model(cfg, seed=0, device=device), Seq2Seq(batcher, [], device), run_cfg.train


def main() -> int:
    args = parse_args()
    device, precision = device_and_precision(args)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        torch._dynamo.reset()
        model, objective, tc = setup(shape, device, args)
        tc = tc.__class__(**{**tc.__dict__, "precision": precision})
        opt, scaler, params = build_optimizer(model, tc), grad_scaler(precision, device), list(model.parameters())
        loss_fn = compile_loss(objective) if args.compile else None

        def step() -> None:
            batches = [objective.next_batch() for _ in range(tc.grad_accum)]
            train_step(model, objective, batches, opt, scaler, params, tc, device, loss_fn=loss_fn)

        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.steps
        header = (f"{shape}: one training step, {precision} ({args.precision}), {device}, threads "
                  f"{torch.get_num_threads()}, {'compiled' if args.compile else 'eager'}, {seconds:.3f} s per "
                  f"profiled step (profiler overhead included), top {args.rows} ops by {sort}, "
                  f"torch {torch.__version__}\n(`{' '.join(sys.argv)}`)\n\n")
        table = prof.key_averages().table(sort_by=sort, row_limit=args.rows)
        suffix = "-compiled" if args.compile else ""
        out = args.out_dir / f"profile-{shape}-{device.type}{suffix}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + table + "\n")
        print(header + table)
        del model, opt
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
