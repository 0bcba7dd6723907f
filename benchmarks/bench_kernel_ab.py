"""One C kernel of ``csrc/`` at two revisions, on the same weights in one process: the
working tree's against ``--base``'s (a git revision), both built with the flags
``blockformer.native`` uses on this machine (so ``ATEN_CPU_CAPABILITY=avx2`` gives AVX2 builds
of both), their passes alternated so that the machine's drift falls on both alike. A pass is
GPT-2 small's 48 block weights once, as in ``bench_kernels.py``; the table gives each
revision's best pass, the weight bytes it drew per second, the speedup, and each one's
largest difference from torch's product on the first weight.

    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel f32_matmul --base HEAD~1
    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 python benchmarks/bench_kernel_ab.py --kernel int8_matmul --base main
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

REPO = Path(__file__).resolve().parents[1]
# kernel -> (its symbol, the dtype of its weight): the second pointer after x is a per-output
# bias (f32) or scale (int8)
KERNELS = {"f32_matmul": ("f32_matmul_f32", torch.float32), "int8_matmul": ("int8_matmul_f32", torch.int8)}


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
    fn = getattr(ctypes.CDLL(str(lib)), KERNELS[kernel][0])
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    fn.restype = None
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=list(KERNELS), default="f32_matmul")
    p.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    p.add_argument("--rows", default="1,2,3,4,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=6, help="timed passes per revision and row count")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = KERNELS[args.kernel][1]
    weights = [torch.randn(o, i) if dtype == torch.float32 else torch.randint(-127, 128, (o, i), dtype=dtype)
               for i, o in shapes()]
    per_out = [torch.randn(o) if dtype == torch.float32 else torch.rand(o) / 100 for _, o in shapes()]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    with tempfile.TemporaryDirectory() as tmp:
        fns = {"base": build(args.kernel, args.base, Path(tmp)), "tree": build(args.kernel, None, Path(tmp))}
        print(f"{args.kernel}: working tree against {args.base}, {cpu_kind()} CPU, {args.threads} thread(s), "
              f"flags {' '.join(native.arch_flags())}, best of {args.passes} alternated passes over "
              f"{nbytes / 2**20:.0f} MiB of weights\n")
        print(f"| rows | {args.base}: ms, GB/s | working tree: ms, GB/s | speedup | largest difference from torch |")
        print("| ---: | ---: | ---: | ---: | --- |")
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k, _ in shapes()}
            ys = [torch.empty(rows, o) for _, o in shapes()]
            calls = [(xs[i].data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), rows, i, o, args.threads)
                     for (i, o), w, s, y in zip(shapes(), weights, per_out, ys)]
            best = dict.fromkeys(fns, float("inf"))
            for n in range(2 * args.passes + 1):  # the first pass warms up
                for name in (("base", "tree") if n % 2 else ("tree", "base")):
                    start = time.perf_counter()
                    for call in calls:
                        fns[name](*call)
                    if n:
                        best[name] = min(best[name], time.perf_counter() - start)
            x, w, s = xs[weights[0].shape[1]], weights[0], per_out[0]
            ref = F.linear(x, w, s) if dtype == torch.float32 else F.linear(x, w.float()) * s
            errors = []
            for name, fn in fns.items():
                fn(*calls[0])
                errors.append(f"{name} {(ys[0] - ref).abs().max().item():.1e}")
            print(f"| {rows} | {best['base'] * 1e3:.2f}, {nbytes / best['base'] / 1e9:.1f} | "
                  f"{best['tree'] * 1e3:.2f}, {nbytes / best['tree'] / 1e9:.1f} | "
                  f"{best['base'] / best['tree']:.3f}x | {', '.join(errors)} |", flush=True)


if __name__ == "__main__":
    main()
