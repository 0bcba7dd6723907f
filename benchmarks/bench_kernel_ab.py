"""One C kernel of ``csrc/`` at two revisions, on the same weights in one process: the
working tree's against ``--base``'s (a git revision), both built with the flags
``blockformer.native`` uses on this machine (so ``ATEN_CPU_CAPABILITY=avx2`` gives AVX2 builds
of both), their passes alternated so that the machine's drift falls on both alike. A pass is
GPT-2 small's 48 block weights once, as in ``bench_kernels.py``; the table gives each
revision's best pass, the weight bytes it drew per second, the speedup, and each one's
largest difference from torch's product on the first weight. ``--hot`` takes one weight of each
shape, read 12 times a pass, so it stays in the caches: the kernel's arithmetic alone, without
the memory.

    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel f32_matmul --base HEAD~1
    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel int8_matmul --base main
    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel int4_matmul --rows 1,4
    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel int4_a8_matmul --base HEAD~1
    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel int8_a8_matmul --base HEAD~1
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_kernels import shapes
from common import cpu_kind

from blockformer import native
from blockformer.generate.quantize import dequantize_int4, pack_int4, round_activations

REPO = Path(__file__).resolve().parents[1]
GROUP = 128  # int4: inputs per scale and offset, as Int4Linear's default


def f32_case(i: int, o: int, rows: int):
    """One weight's (tensors, the kernel's arguments but the thread count, torch's product, weight bytes)."""
    x, w, b, y = torch.randn(rows, i), torch.randn(o, i), torch.randn(o), torch.empty(rows, o)
    return (x, w, b, y), [x, w, b, y, rows, i, o], lambda: F.linear(x, w, b), w.numel() * 4


def int8_case(i: int, o: int, rows: int):
    x, w, s, y = torch.randn(rows, i), torch.randint(-127, 128, (o, i), dtype=torch.int8), torch.rand(o) / 100, \
        torch.empty(rows, o)
    return (x, w, s, y), [x, w, s, 0, y, rows, i, o], lambda: F.linear(x, w.float()) * s, w.numel()


def int4_case(i: int, o: int, rows: int):
    q = torch.randint(0, 16, (o, i), dtype=torch.uint8)
    scales, zeros = torch.rand(o, i // GROUP) / 100, torch.randn(o, i // GROUP) / 100
    x, y, sums, codes = torch.randn(rows, i), torch.empty(rows, o), torch.empty(rows, i // GROUP), pack_int4(q)
    dense = ((q.float() - 8).reshape(o, -1, GROUP) * scales[..., None] + zeros[..., None]).reshape(o, i)
    return (x, codes, scales, zeros, y, sums), [x, codes, scales, zeros, 0, y, sums, rows, i, GROUP, o], \
        lambda: F.linear(x, dense), codes.numel() + (scales.numel() + zeros.numel()) * 4


def int4_a8_case(i: int, o: int, rows: int):
    """As int4_case, the scratch sized for the rounded rows; the reference rounds x as the kernel does."""
    tensors, args, _, nbytes = int4_case(i, o, rows)
    x, codes, scales, zeros, y, _ = tensors
    scratch = torch.empty(rows * (i // 4 + i // 8 + i // 32 + i // GROUP))
    args[6] = scratch
    dense = dequantize_int4(codes, scales, zeros, GROUP, torch.float32)
    return (x, codes, scales, zeros, y, scratch), args, lambda: F.linear(round_activations(x), dense), nbytes


def int8_a8_case(i: int, o: int, rows: int):
    """As int8_case, with the scratch for the rounded rows; the reference rounds x as the kernel does."""
    (x, w, s, y), args, _, nbytes = int8_case(i, o, rows)
    scratch = torch.empty(rows * (i // 32 + i // 4))
    args = [x, w, s, 0, y, scratch, rows, i, o]
    return (x, w, s, y, scratch), args, lambda: F.linear(round_activations(x), w.float()) * s, nbytes


# kernel -> (its symbol, how many pointer and integer arguments it takes, one weight's case, the index
# of the output among the case's tensors). The quantized kernels take a bias (0: none) since 2026-12-04:
# a --base before that has the old arguments and cannot be compared with these cases.
KERNELS = {"f32_matmul": ("f32_matmul_f32", (4, 4), f32_case, 3),
           "int8_matmul": ("int8_matmul_f32", (5, 4), int8_case, 3),
           "int4_matmul": ("int4_matmul_f32", (7, 5), int4_case, 4),
           "int4_a8_matmul": ("int4_a8_matmul_f32", (7, 5), int4_a8_case, 4),
           "int8_a8_matmul": ("int8_a8_matmul_f32", (6, 4), int8_a8_case, 3)}


def build(kernel: str, base: str | None, folder: Path) -> Callable:
    """``kernel``'s entry point, built from ``base``'s sources (None: the working tree's)."""
    src = folder / ("base" if base else "tree")  # a revision may hold slashes (origin/main)
    src.mkdir()
    for path in native.SOURCES.iterdir():  # the kernel and every header it may include
        if path.name == f"{kernel}.c" or path.suffix == ".h":
            rel = path.relative_to(REPO).as_posix()
            text = path.read_bytes() if base is None else subprocess.run(
                ["git", "-C", str(REPO), "show", f"{base}:{rel}"], capture_output=True, check=True).stdout
            (src / path.name).write_bytes(text)
    lib = src / f"{kernel}.so"
    flags = [*native.CFLAGS, *native.arch_flags(), "-fopenmp"]  # as native.load builds it
    subprocess.run(native.compile_command(src / f"{kernel}.c", lib, flags), check=True)
    symbol, (pointers, ints), *_ = KERNELS[kernel]
    fn = getattr(ctypes.CDLL(str(lib)), symbol)
    fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * ints
    fn.restype = None
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=list(KERNELS), default="f32_matmul")
    p.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    p.add_argument("--rows", default="1,2,3,4,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=6, help="timed passes per revision and row count")
    p.add_argument("--hot", action="store_true",
                   help="one weight of each of the 4 shapes, 12 times a pass (in cache: the arithmetic alone)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    _, _, case, out = KERNELS[args.kernel]
    nbytes = sum(case(i, o, 1)[3] for i, o in shapes())
    with tempfile.TemporaryDirectory() as tmp:
        fns = {"base": build(args.kernel, args.base, Path(tmp)), "tree": build(args.kernel, None, Path(tmp))}
        print(f"{args.kernel}: working tree against {args.base}, {cpu_kind()} CPU, {args.threads} thread(s), "
              f"flags {' '.join(native.arch_flags())}, best of {args.passes} alternated passes over "
              f"{nbytes / 2**20:.0f} MiB of weights{' (one layer, 12 times: in cache)' if args.hot else ''}\n")
        print(f"| rows | {args.base}: ms, GB/s | working tree: ms, GB/s | speedup | largest difference from torch |")
        print("| ---: | ---: | ---: | ---: | --- |")
        for rows in (int(r) for r in args.rows.split(",")):
            cases = [case(i, o, rows) for i, o in shapes(n_layers=1)] * 12 if args.hot else \
                [case(i, o, rows) for i, o in shapes()]  # each weight its own tensors, as in a decode step
            calls = [tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in c[1]) + (args.threads,)
                     for c in cases]
            best = dict.fromkeys(fns, float("inf"))
            for n in range(2 * args.passes + 1):  # the first pass warms up
                for name in (("base", "tree") if n % 2 else ("tree", "base")):
                    start = time.perf_counter()
                    for call in calls:
                        fns[name](*call)
                    if n:
                        best[name] = min(best[name], time.perf_counter() - start)
            tensors, _, reference, _ = cases[0]
            errors = []
            for name, fn in fns.items():
                fn(*calls[0])
                errors.append(f"{name} {(tensors[out] - reference()).abs().max().item():.1e}")
            print(f"| {rows} | {best['base'] * 1e3:.2f}, {nbytes / best['base'] / 1e9:.1f} | "
                  f"{best['tree'] * 1e3:.2f}, {nbytes / best['tree'] / 1e9:.1f} | "
                  f"{best['base'] / best['tree']:.3f}x | {', '.join(errors)} |", flush=True)


if __name__ == "__main__":
    main()
