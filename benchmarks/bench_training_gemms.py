"""Could a different fp32 GEMM make a small training step faster? The products of one
training step at nanoGPT's CPU shape (``char-lm-tiny``: batch 12 x 64 positions, d_model 128,
FFN 512, 4 blocks, 65 classes), forward and both backward products of every linear, timed
through the kernel both training loops call (``torch.mm``: MKL's sgemm in torch's CPU wheel)
and through oneDNN's (``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU
templates call). Same inputs, results checked equal; the ways alternated, best of ``--passes``.

    OMP_NUM_THREADS=2 python benchmarks/bench_training_gemms.py --threads 2
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 \\
        python benchmarks/bench_training_gemms.py --threads 2   # both libraries capped at AVX2

(``ATEN_CPU_CAPABILITY`` alone does not cap MKL: ``MKL_ENABLE_INSTRUCTIONS`` does.)
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import cpu_kind


def products(rows: int, k: int, n: int) -> dict[str, list]:
    """The three products of a linear ``k -> n`` on ``rows`` rows, as each library is called."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    wt, dyt, xt = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
    linear = torch.ops.mkldnn._linear_pointwise
    return {"MKL (torch.mm)": [lambda: torch.mm(x, w.t()), lambda: torch.mm(dy, w), lambda: torch.mm(dy.t(), x)],
            "oneDNN": [lambda: linear(x, w, None, "none", [], ""), lambda: linear(dy, wt, None, "none", [], ""),
                       lambda: linear(dyt, xt, None, "none", [], "")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=12 * 64, help="batch x positions")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    d = args.d_model
    linears = {f"{d} -> {3 * d} (qkv)": (d, 3 * d, args.layers), f"{d} -> {d} (out)": (d, d, args.layers),
               f"{d} -> {args.ff} (ffn in)": (d, args.ff, args.layers),
               f"{args.ff} -> {d} (ffn out)": (args.ff, d, args.layers), f"{d} -> {args.vocab} (head)": (d, args.vocab, 1)}
    table, totals = [], {}
    for name, (k, n, count) in linears.items():
        ways = products(args.rows, k, n)
        for ours, theirs in zip(*(ways.values())):  # the same products
            torch.testing.assert_close(theirs(), ours(), atol=1e-3, rtol=1e-4)
        for fns in ways.values():
            for fn in fns:
                fn(), fn()
        best = {way: [float("inf")] * 3 for way in ways}
        for _ in range(args.passes):
            for way, fns in ways.items():
                for i, fn in enumerate(fns):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    best[way][i] = min(best[way][i], (time.perf_counter() - start) / args.calls)
        flops = 3 * 2 * args.rows * k * n
        row = [name, str(count)]
        for way, seconds in best.items():
            totals[way] = totals.get(way, 0.0) + count * sum(seconds)
            row.append(f"{' / '.join(f'{s * 1e6:.0f}' for s in seconds)} ({flops / sum(seconds) / 1e9:.0f} GFLOP/s)")
        table.append(row)
    caps = ", ".join(f"{v}={os.environ[v]}" for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
                     if os.environ.get(v))
    print(f"fp32 products of a training step, {args.rows} rows, {cpu_kind()} CPU{', ' + caps if caps else ''}, "
          f"{args.threads} thread(s), torch {torch.__version__}, best of {args.passes} alternated passes\n")
    ways = list(totals)
    print(f"| linear | per step | {' | '.join(f'{w}: us fwd / dX / dW' for w in ways)} |")
    print(f"| --- | ---: | {' | '.join('---:' for _ in ways)} |")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print(f"| **a step's products** | | {' | '.join(f'**{totals[w] * 1e3:.2f} ms**' for w in ways)} |")
    print(f"\n{ways[0]} / {ways[1]}: {totals[ways[0]] / totals[ways[1]]:.3f}")


if __name__ == "__main__":
    main()
