"""What a call to one of blockformer's C kernels costs around the kernel: the same int8 product
(``generate.quantize.int8_matmul``) registered as a ``torch.library.custom_op`` and as a plain
CPU kernel of a ``torch.library.Library`` (what ``native.matmul_op`` does), 49 calls in a row
(a GPT-2-small decode step's quantized products) on 64x64 weights with a bias and one row, so
the kernel itself is a small part: called eagerly, compiled as ``generate --compile`` compiles
a CPU step (``cpp_wrapper``), as the Python function, as ``csrc/ops.cpp``'s C++ operator, and
as the bare ctypes calls. Every way
is timed in one process, the passes alternated; best of ``--passes``.

``--layers`` times instead what an eager decode step calls: one layer of each kind on a
``(1, 1, in)`` input (64 -> 64; int4 128 -> 64), the layer's whole cost per call. It uses only
the layers' classes, so ``PYTHONPATH=<an older tree>/src`` times that tree's layers too; where the
tree has them, the C++ operators (``native.load_cpp_ops``) are loaded first, as preparing a model
for decoding does, unless ``--python-ops``.

    OMP_NUM_THREADS=2 python benchmarks/bench_op_calls.py --threads 2
    OMP_NUM_THREADS=2 PYTHONPATH=<tree>/src python benchmarks/bench_op_calls.py --threads 2 --layers
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from common import cpu_kind

from blockformer import native
from blockformer.generate.packed import StreamedLinear
from blockformer.generate.quantize import Int4Linear, Int8Linear, _int8_matmul, int8_matmul

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


def best_of(fns: dict, x: dict, passes: int, calls: int) -> dict:
    """Each function's best time a call over ``passes`` alternated passes of ``calls`` calls."""
    for name, fn in fns.items():  # compile and warm up
        fn(x[name]), fn(x[name])
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(passes):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(x[name])
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def eager_layers(args) -> None:
    """One eager layer of each kind, its whole cost a call at a decode step's one row."""
    torch.manual_seed(0)
    kinds = {"Int8Linear, 64 -> 64": (Int8Linear(nn.Linear(64, 64)), 64),
             "Int4Linear, 128 -> 64": (Int4Linear(nn.Linear(128, 64)), 128),
             "StreamedLinear (fp32), 64 -> 64": (StreamedLinear.of(nn.Linear(64, 64)), 64)}
    load = getattr(native, "load_cpp_ops", None)
    if load is not None and not args.python_ops:
        load()
    with torch.inference_mode():
        best = best_of({name: layer for name, (layer, _) in kinds.items()},
                       {name: torch.randn(1, 1, k) for name, (_, k) in kinds.items()}, args.passes, 20 * args.calls)
    ops = "C++" if getattr(native, "CPP_OPS", False) else "Python"
    print(f"One eager layer, a (1, 1, in) input, the decode products' {ops} operators, {cpu_kind()} CPU, "
          f"{args.threads} thread(s), torch "
          f"{torch.__version__}, best of {args.passes} alternated passes\n")
    print("| layer | us a call |\n| --- | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="chains of 49 products a timed pass")
    p.add_argument("--layers", action="store_true", help="time one eager layer of each kind instead")
    p.add_argument("--python-ops", action="store_true", help="--layers: without the C++ operators")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.layers:
        return eager_layers(args)
    torch.manual_seed(0)
    custom, library, _lib = register()
    if not native.load_cpp_ops():
        raise SystemExit("the C++ operators (csrc/ops.cpp) could not be built here")
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
            "C++ operator (ops.cpp), compiled (cpp_wrapper)":
                compile_(chain(torch.ops.blockformer_c.int8_matmul)),
            "C++ operator (ops.cpp), called eagerly": chain(torch.ops.blockformer_c.int8_matmul),
            "the ctypes calls alone": ctypes_calls}
    best = best_of(ways, dict.fromkeys(ways, torch.randn(1, 64)), args.passes, args.calls)
    print(f"{CALLS} int8 products of one row by 64x64 weights with a bias, {cpu_kind()} CPU, {args.threads} "
          f"thread(s), torch {torch.__version__}, best of {args.passes} alternated passes\n")
    print(f"| {CALLS} products called as | us | us per product |\n| --- | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.0f} | {seconds * 1e6 / CALLS:.1f} |")


if __name__ == "__main__":
    main()
