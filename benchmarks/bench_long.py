"""Causal training at long context: peak memory and step time of the fused attention path
(what the trainer takes: no mask, no T x T matrix) against the same step with a
materialised mask (what any padding mask forces), at T = 4096 and 8192.

    python benchmarks/bench_long.py                                   # T = 4096, 8192
    python benchmarks/bench_long.py --lengths 512 --layers 1 --d-model 64 --heads 2   # smoke

Memory is counted two ways: the live tensors between ops (``probes.memory.TensorMemory``,
deterministic, any device) and, on CUDA, the allocator's peak. One training step is
forward, cross-entropy, backward and an AdamW update, at batch 1, in the precision
``auto`` resolves to. Timings taken on a shared machine are noisy; memory is not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import cpu_kind, device_and_precision

from blockformer import TransformerConfig, build_model
from blockformer.probes.memory import TensorMemory
from blockformer.precision import autocast

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant (after one warm-up)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-masked", action="store_true", help="only the fused path")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "long")
    return p.parse_args()


def step_fn(model, opt, tokens, precision, device, masked: bool):
    mask = torch.ones_like(tokens, dtype=torch.bool) if masked else None

    def step() -> None:
        with autocast(precision, device):
            logits = model(tokens, attention_mask=mask)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(args, T: int, masked: bool, precision: str, device: torch.device) -> dict:
    cfg = TransformerConfig(arch="decoder", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, max_seq_len=T, position="rope", dropout=0.0)
    model = build_model(cfg, seed=0, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (1, T), device=device)
    step = step_fn(model, opt, tokens, precision, device, masked)
    step()  # warm-up: optimizer state exists from here on, as in a run
    with TensorMemory() as mem:
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    row = {"T": T, "path": "materialised mask" if masked else "fused (trainer default)",
           "peak_live_bytes": mem.peak, "largest_tensor_bytes": mem.largest,
           "largest_shape": list(mem.largest_shape), "step_s": seconds, "tokens_per_s": T / seconds}
    if device.type == "cuda":
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return row


def main() -> int:
    args = parse_args()
    device, precision = device_and_precision(args)
    rows = []
    for T in [int(x) for x in args.lengths.split(",") if x.strip()]:
        for masked in (False,) if args.skip_masked else (False, True):
            rows.append(measure(args, T, masked, precision, device))
            print(json.dumps(rows[-1]), flush=True)
    mib = 2**20
    lines = [f"causal training step at batch 1: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
             f"{precision} ({args.precision}), {device}, threads {torch.get_num_threads()}, torch {torch.__version__}"
             + (f", CPU {cpu_kind()}" if device.type == "cpu" else "") + f" (`{' '.join(sys.argv)}`)", "",
             "| T | attention path | peak live tensors | largest tensor | step s | tokens/s |"
             + (" CUDA peak |" if device.type == "cuda" else ""),
             "| ---: | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if device.type == "cuda" else "")]
    for r in rows:
        cuda = f" {r['cuda_peak_bytes'] / mib:,.0f} MiB |" if "cuda_peak_bytes" in r else ""
        lines.append(f"| {r['T']} | {r['path']} | {r['peak_live_bytes'] / mib:,.1f} MiB | "
                     f"{r['largest_tensor_bytes'] / mib:,.1f} MiB {tuple(r['largest_shape'])} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |{cuda}")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "cpu_kind": cpu_kind(),
                                                         "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
