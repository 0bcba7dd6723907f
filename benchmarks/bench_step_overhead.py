"""What an eager decode step costs outside its matmuls: GPT-2 small (random weights), batch 1,
greedy, fp32 activations, prepared as the CLI prepares it (fp32 weights packed or streamed,
or quantized). Each round times ``--tokens`` new tokens of ``generate``, then the model's
linear layers alone, each called once per token on a one-row input as the step calls it;
the difference is what the step spends around them (Python, norms, attention, the cache,
sampling). The table gives each scheme's median round.

    OMP_NUM_THREADS=2 python benchmarks/bench_step_overhead.py --threads 2 --schemes fp32 int8 int4
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from common import add_shape_args, cpu_kind, gpt2_config, report

from blockformer import build_model
from blockformer.generate import generate
from blockformer.generate.packed import pack_linears
from blockformer.generate.quantize import SCHEMES, quantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--schemes", nargs="+", choices=["fp32", *SCHEMES], default=["fp32", "int8", "int4"])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.tokens < 1 or args.rounds < 1:
        p.error("--tokens and --rounds: expected at least 1")
    torch.set_num_threads(args.threads)
    cfg = gpt2_config(args.layers, args.d_model, args.heads, args.vocab)
    float_model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    n = args.tokens
    lines = [f"eager greedy decode, batch 1, prompt 16, {n} new tokens, {args.layers} layers, d_model {args.d_model}, "
             f"fp32 activations, threads {torch.get_num_threads()}, median of {args.rounds} rounds, "
             f"torch {torch.__version__}, CPU {cpu_kind()}", "",
             "| scheme | step, ms/token | its linears alone, ms/token | the rest, ms/token | the rest, share |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for scheme in args.schemes:
        model = copy.deepcopy(float_model)
        model = pack_linears(model) if scheme == "fp32" else quantize(model, scheme)
        linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]  # any kind
        inputs = [torch.randn(1, 1, m.in_features) for m in linears]
        generate(model, prompt, 8, temperature=0)  # warm-up: kernels built, caches allocated
        steps, alone = [], []
        with torch.inference_mode():
            for _ in range(args.rounds):
                t = time.perf_counter()
                generate(model, prompt, n, temperature=0)
                steps.append((time.perf_counter() - t) / n * 1e3)
                t = time.perf_counter()
                for _ in range(n):
                    for m, x in zip(linears, inputs):
                        m(x)
                alone.append((time.perf_counter() - t) / n * 1e3)
        step, lin = statistics.median(steps), statistics.median(alone)
        lines.append(f"| {scheme} ({len(linears)} linears) | {step:.2f} | {lin:.2f} | {step - lin:.2f} | "
                     f"{(step - lin) / step:.0%} |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
