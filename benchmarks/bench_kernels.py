"""The decode matmuls one by one: blockformer's C kernels (``csrc/``) against torch's ops on the
same weights, at the rows a decode step (1) or a short prompt (16) has. A pass is every matmul
weight of GPT-2 small once (12 blocks of qkv, out, up and down), each weight its own tensor
(85M weights, larger than any cache), as one decode step reads them; the table gives the
best pass's time and the weight bytes per second it drew, beside the machine's streaming-read
bandwidth (``blockformer info --peak``). A last row times one call on a 64x64 weight: the
fixed cost each of a step's 49 products pays.

    OMP_NUM_THREADS=2 python benchmarks/bench_kernels.py --threads 2 --out benchmarks/results/kernels.md
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockformer.generate.packed import PackedLinear, can_pack, f32_matmul
from blockformer.generate.quantize import (Int4Linear, Int8Linear, int4_a8_matmul, int4_matmul, int8_a8_matmul,
                                           int8_matmul)
from blockformer.train.throughput import format_bytes_per_s, memory_bandwidth

from common import cpu_kind, report


def shapes(d: int = 768, n_layers: int = 12) -> list[tuple[int, int]]:
    """(in, out) of GPT-2 small's block matmuls."""
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * n_layers


def variants(linears: list[nn.Linear]) -> dict[str, tuple[int, list[Callable]]]:
    """name -> (weight bytes a pass reads, one product per weight taking x)."""
    int8 = [Int8Linear(m) for m in linears]
    int4 = [Int4Linear(m) for m in linears]
    fp32_bytes = sum(m.weight.numel() * 4 for m in linears)
    int8_bytes = sum(q.weight.numel() + q.scales.numel() * 4 for q in int8)
    int4_bytes = sum(q.codes.numel() + (q.scales.numel() + q.zeros.numel()) * 4 for q in int4)
    table = {
        "fp32, torch F.linear": (fp32_bytes, [lambda x, m=m: F.linear(x, m.weight, m.bias) for m in linears]),
        "fp32, csrc/f32_matmul.c": (fp32_bytes, [lambda x, m=m: f32_matmul(x, m.weight, m.bias) for m in linears]),
        "int8, torch _weight_int8pack_mm": (int8_bytes, [
            lambda x, q=q: torch.ops.aten._weight_int8pack_mm(x, q.weight, q.scales) for q in int8]),
        "int8, csrc/int8_matmul.c": (int8_bytes, [lambda x, q=q: int8_matmul(x, q.weight, q.scales) for q in int8]),
        "int8, activations rounded to int8, csrc/int8_a8_matmul.c": (int8_bytes, [  # --quantize int8-a8
            lambda x, q=q: int8_a8_matmul(x, q.weight, q.scales) for q in int8]),
        "int8, dequantized + F.linear": (int8_bytes, [lambda x, q=q: F.linear(x, q.dequantized(x.dtype)) for q in int8]),
        "int4, torch _weight_int4pack_mm_for_cpu": (int4_bytes, [
            lambda x, q=q: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q.packed, q.group_size, q.scales_and_zeros)
            for q in int4]),
        "int4, csrc/int4_matmul.c": (int4_bytes, [
            lambda x, q=q: int4_matmul(x, q.codes, q.scales, q.zeros, q.group_size) for q in int4]),
        "int4, activations rounded to int8, csrc/int4_a8_matmul.c": (int4_bytes, [  # --quantize int4-a8
            lambda x, q=q: int4_a8_matmul(x, q.codes, q.scales, q.zeros, q.group_size) for q in int4]),
    }
    if can_pack(torch.float32):  # where kernels.packs_on_this_cpu picks oneDNN's blocked layout for fp32
        table["fp32, oneDNN packed (PackedLinear)"] = (fp32_bytes, [PackedLinear(m) for m in linears])
    return table


def best_pass(products: list[Callable], xs: dict[int, torch.Tensor], ins: list[int], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` passes (after one to warm up)."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        for product, k in zip(products, ins):
            product(xs[k])
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def call_cost(product: Callable, x: torch.Tensor, calls: int = 2000) -> float:
    """Microseconds per call of a product too small to take any time itself."""
    for _ in range(100):
        product(x)
    start = time.perf_counter()
    for _ in range(calls):
        product(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16", help="rows per product")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bandwidth = memory_bandwidth(torch.device("cpu"), refresh=True)
    ins = [i for i, _ in shapes()]
    with torch.inference_mode():
        linears = [nn.Linear(i, o) for i, o in shapes()]
        table = variants(linears)
        rows = [int(r) for r in args.rows.split(",")]
        header = "| matmul | weight MiB a pass | " + " | ".join(f"{r} row(s): ms, weight GB/s" for r in rows) + " |"
        lines = [f"# Decode matmuls, GPT-2 small's 48 block weights ({cpu_kind()} CPU, {args.threads} thread(s), "
                 f"torch {torch.__version__})", "",
                 f"streaming-read bandwidth: {format_bytes_per_s(bandwidth)}", "",
                 header, "|---|---:|" + "---:|" * len(rows)]
        for name, (nbytes, products) in table.items():
            cells = []
            for r in rows:
                xs = {k: torch.randn(r, k) for k in set(ins)}
                seconds = best_pass(products, xs, ins, args.repeats)
                cells.append(f"{seconds * 1e3:.1f} ms, {nbytes / seconds / 1e9:.1f} GB/s")
            lines.append(f"| {name} | {nbytes / 2**20:.0f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        small = nn.Linear(64, 64)
        q = Int8Linear(small)
        x = torch.randn(1, 64)
        lines += ["", "One call on a 64x64 weight, 1 row (the fixed cost of a product):", "",
                  "| call | us per call |", "|---|---:|"]
        for name, product in (("F.linear", lambda x: F.linear(x, small.weight, small.bias)),
                              ("csrc/f32_matmul.c", lambda x: f32_matmul(x, small.weight, small.bias)),
                              ("torch _weight_int8pack_mm", lambda x: torch.ops.aten._weight_int8pack_mm(
                                  x, q.weight, q.scales)),
                              ("csrc/int8_matmul.c", lambda x: int8_matmul(x, q.weight, q.scales)),
                              ("csrc/int8_matmul.c, with the bias", lambda x: int8_matmul(x, q.weight, q.scales,
                                                                                          q.bias)),
                              # what a compiled step calls, through the dispatcher
                              ("torch.ops.blockformer.int8_matmul, with the bias",
                               lambda x: torch.ops.blockformer.int8_matmul(x, q.weight, q.scales, q.bias)),
                              ("Int8Linear, the whole layer (what an eager step calls)", q)):
            lines.append(f"| {name} | {call_cost(product, x):.1f} |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
