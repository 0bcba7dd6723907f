"""The roofline of a serving step on this CPU: GPT-2-small's matmuls (12 blocks of qkv, out,
up, down and the 8000-token head), packed as ``blockformer serve`` packs them, timed at the
row counts a step has (1 decoding row up to a 512-token budget), one after the other as a
step runs them; GFLOP/s and the fraction of the machine's fp32 peak (``blockformer info
--peak``, a large square matmul). A step cannot run faster than its matmuls at its rows.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/bench_step_matmuls.py --threads 1 \\
        --out benchmarks/results/step-matmuls.md
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from blockformer.generate.packed import PackedLinear, can_pack
from blockformer.train.throughput import peak_flops

from common import cpu_kind


def layers(d: int = 768, n_layers: int = 12, vocab: int = 8000) -> list[nn.Module]:
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layers + [(d, vocab)]
    linears = [nn.Linear(i, o) for i, o in shapes]
    return [PackedLinear(m) if can_pack(torch.float32) else m for m in linears]


def rate(modules: list[nn.Module], rows: int, repeats: int) -> float:
    """GFLOP/s of one pass through ``modules`` at ``rows`` rows."""
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in modules}
    flops = sum(2 * rows * m.in_features * m.out_features for m in modules)
    with torch.inference_mode():
        for m in modules:
            m(xs[m.in_features])
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for m in modules:
                m(xs[m.in_features])
            best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kind = cpu_kind()
    peak = peak_flops(torch.device("cpu"), "fp32", refresh=True) / 1e9
    modules = layers()
    lines = [f"# A serving step's matmuls, GPT-2-small, fp32 ({kind} CPU, {args.threads} thread(s), torch "
             f"{torch.__version__}, packed: {can_pack(torch.float32)})", "",
             f"fp32 peak (large square matmul): {peak:.0f} GFLOP/s", "",
             "| rows | GFLOP/s | of the peak |", "|---:|---:|---:|"]
    for rows in (1, 16, 32, 64, 128, 256, 512):
        r = rate(modules, rows, args.repeats)
        lines.append(f"| {rows} | {r:.1f} | {r / peak:.0%} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
