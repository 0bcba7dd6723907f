"""What a call to one of blockformer's C kernels costs around the kernel: the same int8 product
(``generate.quantize.int8_matmul``) registered as a ``torch.library.custom_op`` and as a plain
CPU kernel of a ``torch.library.Library`` (what ``native.matmul_op`` does), 49 calls in a row
(a GPT-2-small decode step's quantized products) on 64x64 weights with a bias and one row, so
the kernel itself is a small part: called eagerly, compiled as ``generate --compile`` compiles
a CPU step (``cpp_wrapper``), as the Python function, and as the bare ctypes calls. Every way
is timed in one process, the passes alternated; best of ``--passes``.

    OMP_NUM_THREADS=2 python benchmarks/bench_op_calls.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from common import cpu_kind

from blockformer.generate.quantize import Int8Linear, _int8_matmul, int8_matmul

CALLS = 49  # GPT-2 small: 48 block products and the head


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    return int8_matmul(x, weight, scales, bias)


def register() -> tuple:
    """The product as a custom_op and as a plain Library CPU kernel (kept alive with the Library)."""
    custom = torch.library.custom_op("bench_custom_op::int8", product, mutates_args=())
    custom.register_fake(lambda x, w, *rest: x.new_empty(x.shape[0], w.shape[0]))
    lib = torch.library.Library("bench_library", "DEF")
    lib.define("int8" + torch.library.infer_schema(product, mutates_args=()))
    lib.impl("int8", product, "CPU")
    torch.library.register_fake("bench_library::int8", lambda x, w, *rest: x.new_empty(x.shape[0], w.shape[0]),
                                lib=lib)
    return torch.ops.bench_custom_op.int8, torch.ops.bench_library.int8, lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="chains of 49 products a timed pass")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    custom, library, _lib = register()
    layers = [Int8Linear(nn.Linear(64, 64)) for _ in range(CALLS)]

    def chain(fn):
        def run(x):
            for q in layers:
                x = fn(x, q.weight, q.scales, q.bias)
            return x
        return run

    out = torch.empty(1, 64)
    kernel = _int8_matmul()
    pointers = [(q.weight.data_ptr(), q.scales.data_ptr(), q.bias.data_ptr()) for q in layers]

    def ctypes_calls(x):
        for w, s, b in pointers:
            kernel(x.data_ptr(), w, s, b, out.data_ptr(), 1, 64, 64, args.threads)

    compile_ = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})  # noqa: E731
    ways = {"torch.library.custom_op, compiled (cpp_wrapper)": compile_(chain(custom)),
            "plain Library CPU kernel, compiled (cpp_wrapper)": compile_(chain(library)),
            "torch.library.custom_op, called eagerly": chain(custom),
            "plain Library CPU kernel, called eagerly": chain(library),
            "the Python function, no op": chain(int8_matmul),
            "the ctypes calls alone": ctypes_calls}
    x = torch.randn(1, 64)
    for fn in ways.values():  # compile and warm up
        fn(x), fn(x)
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.passes):
        for name, fn in ways.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
    print(f"{CALLS} int8 products of one row by 64x64 weights with a bias, {cpu_kind()} CPU, {args.threads} "
          f"thread(s), torch {torch.__version__}, best of {args.passes} alternated passes\n")
    print(f"| {CALLS} products called as | us | us per product |\n| --- | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.0f} | {seconds * 1e6 / CALLS:.1f} |")


if __name__ == "__main__":
    main()
