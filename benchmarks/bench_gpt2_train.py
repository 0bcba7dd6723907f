"""Training at GPT-2 small's shape: blockformer's training step against Hugging Face
``GPT2LMHeadModel`` (SDPA attention) on the same batches, with the same optimizer, in the
same run; MFU against this machine's measured matmul peak.

    python benchmarks/bench_gpt2_train.py                       # 12 layers, 768 wide, context 512, bf16
    python benchmarks/bench_gpt2_train.py --compile             # both compiled as well
    python benchmarks/bench_gpt2_train.py --layers 2 --d-model 128 --heads 4 --vocab 1000 --seq-len 64 \\
        --batch 4 --steps 3 --warmup 1                          # smoke

blockformer runs its trainer's own step (``train.loop.train_step``: token-weighted loss,
grad clipping, fused AdamW, and under ``--compile`` the model and loss as one compiled
graph); Hugging Face runs the plain loop people write around it (logits, cross-entropy,
backward, clip, the same AdamW with the same decay groups). Both autocast to
``--precision`` (default bf16; ``auto`` resolves for the device). Tokens/s is the median
over ``--steps`` timed steps after ``--warmup``; MFU uses ``flops_per_token`` (forward +
backward) over ``blockformer info --peak``'s figure for the precision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import (add_shape_args, blockformer_gpt2, cpu_kind, device_and_precision, gpt2_config, hf_gpt2, sync,
                    synthetic_lm)

from blockformer.run_config import TrainConfig
from blockformer.stats import flops_per_token
from blockformer.train.compile import compile_loss
from blockformer.train.loop import train_step
from blockformer.train.optim import build_optimizer, fused_available, param_groups
from blockformer.precision import autocast, grad_scaler
from blockformer.train.throughput import format_flops, peak_flops

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--precision", default="bf16", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="also time both compiled")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpt2-train")
    return p.parse_args()


def step_times(step, n_warmup: int, n_steps: int, device: torch.device) -> list[float]:
    for _ in range(n_warmup):
        step()
    times = []
    for _ in range(n_steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    args = parse_args()
    device, precision = device_and_precision(args)
    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab, max(1024, args.seq_len))
    tc = TrainConfig(lr=6e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0, precision=precision)
    objective = synthetic_lm(args.vocab, args.seq_len, args.batch, device)
    tokens_per_step = args.batch * args.seq_len
    rows = []

    for compile in (False, True) if args.compile else (False,):
        torch._dynamo.reset()
        model = blockformer_gpt2(cfg, device)
        opt = build_optimizer(model, tc)
        scaler, params = grad_scaler(precision, device), list(model.parameters())
        loss_fn = compile_loss(objective) if compile else None

        def ours() -> None:
            train_step(model, objective, [objective.next_batch()], opt, scaler, params, tc, device, loss_fn=loss_fn)

        rows.append(("blockformer", compile, step_times(ours, args.warmup, args.steps, device)))
        del model, opt

        if args.skip_hf:
            continue
        torch._dynamo.reset()
        hf = hf_gpt2(cfg, device).train()
        kind = "fused" if fused_available(device) else "foreach"
        hf_opt = torch.optim.AdamW(param_groups(hf, tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                                   **{kind: True})
        forward = torch.compile(hf) if compile else hf

        def theirs() -> None:
            x, y = objective.next_batch()
            with autocast(precision, device):
                logits = forward(input_ids=x).logits
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.grad_clip)
            hf_opt.step()
            hf_opt.zero_grad(set_to_none=True)

        rows.append(("hf GPT2LMHeadModel (sdpa)", compile, step_times(theirs, args.warmup, args.steps, device)))
        del hf, hf_opt

    peak = peak_flops(device, precision)
    fpt = flops_per_token(cfg, args.seq_len)
    results = []
    for name, compile, times in rows:
        tok_s = tokens_per_step / statistics.median(times)
        results.append({"variant": name, "mode": "compiled" if compile else "eager", "tokens_per_s": tok_s,
                        "median_step_s": statistics.median(times), "mfu": fpt * tok_s / peak})
    for r in results:
        peer = next((p for p in results if p["variant"].startswith("hf") and p["mode"] == r["mode"]), None)
        r["ratio_vs_hf"] = r["tokens_per_s"] / peer["tokens_per_s"] if peer else None
    lines = [f"training step, {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
             f"batch {args.batch} x {args.seq_len}, {precision} autocast ({args.precision}), {device}, threads "
             f"{torch.get_num_threads()}, {precision} matmul peak {format_flops(peak)}, median of {args.steps} steps "
             f"after {args.warmup}, torch {torch.__version__}" + (f", CPU {cpu_kind()}" if device.type == "cpu" else "")
             + f" (`{' '.join(sys.argv)}`)", "",
             "| variant | mode | tokens/s | MFU | vs HF (same mode) |", "| --- | --- | ---: | ---: | ---: |"]
    for r in results:
        ratio = f"{r['ratio_vs_hf']:.2f}x" if r["ratio_vs_hf"] else "-"
        lines.append(f"| {r['variant']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {ratio} |")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "peak_flops": peak,
                                                         "flops_per_token": fpt, "cpu_kind": cpu_kind(),
                                                         "rows": results}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
