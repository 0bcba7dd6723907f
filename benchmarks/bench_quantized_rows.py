"""Where a quantized layer's product should go at many rows (a prompt, a server's prefill): its C
kernel (``layer.kernel``) against its dense path (``layer.dense``: the rows (rounded, for the a8
schemes) times the whole weight dequantized to the rows' dtype, one ``F.linear``), on GPT-2
small's 48 block weights, in fp32 and in bf16, at each ``--rows``. Both alternate in one process
and the table keeps each one's best pass, so the machine's drift falls on both alike.
``kernels.a8_kernel_rows`` sends fp32 rows (and bf16 ones on CPUs without AMX) to the a8 kernels
at any count on these figures, and fp32 rows to the weight-only ones; those schemes' bf16 limits
(``kernels.NATIVE_QUANTIZED_ROWS``, ``BF16_INT8_NATIVE_ROWS``) are lifted here so that their kernels
are timed past them too (``--rows`` should be past torch's few bf16 rows, which go to its kernels).

    OMP_NUM_THREADS=2 python benchmarks/bench_quantized_rows.py --rows 128,512,2048 --out benchmarks/results/a8-rows-zen4.md
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=2 \\
        python benchmarks/bench_quantized_rows.py --rows 128,512 --schemes int8,int4
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from bench_kernels import shapes
from common import cpu_kind, report

from blockformer import kernels
from blockformer.generate.quantize import Int4A8Linear, Int4Linear, Int8A8Linear, Int8Linear

SCHEMES = {"int8": Int8Linear, "int4": lambda m: Int4Linear(m, group_size=128),
           "int8-a8": Int8A8Linear, "int4-a8": lambda m: Int4A8Linear(m, group_size=128)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="128,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=3, help="timed passes per path, alternated")
    p.add_argument("--schemes", default="int8-a8,int4-a8", help=f"of {','.join(SCHEMES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help="of fp32, bf16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if unknown := set(args.schemes.split(",")) - set(SCHEMES):
        p.error(f"--schemes: {', '.join(sorted(unknown))} is not one of {', '.join(SCHEMES)}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if unknown := set(args.dtypes.split(",")) - set(dtypes):
        p.error(f"--dtypes: {', '.join(sorted(unknown))} is not one of fp32, bf16")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels.NATIVE_QUANTIZED_ROWS = kernels.BF16_INT8_NATIVE_ROWS = 1 << 30  # the kernels at every --rows
    linears = [nn.Linear(i, o) for i, o in shapes()]
    schemes = {name: [SCHEMES[name](m) for m in linears] for name in args.schemes.split(",")}
    lines = [f"# the C kernel against the dense path, GPT-2 small's 48 block weights ({cpu_kind()} CPU, "
             f"{args.threads} thread(s), best of {args.passes} alternated passes, torch {torch.__version__})", "",
             "| rows | dtype | scheme | kernel, ms | dense, ms | dense / kernel |",
             "| ---: | --- | --- | ---: | ---: | ---: |"]
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            for dtype in [dtypes[d] for d in args.dtypes.split(",")]:
                xs = {k: torch.randn(rows, k, dtype=dtype) for k in (768, 3072)}
                for name, layers in schemes.items():
                    best = {"kernel": float("inf"), "dense": float("inf")}
                    for i in range(args.passes + 1):  # the first pass warms both up
                        for path in best:
                            start = time.perf_counter()
                            for q in layers:
                                getattr(q, path)(xs[q.in_features])
                            if i:
                                best[path] = min(best[path], time.perf_counter() - start)
                    kernel, dense = best["kernel"] * 1e3, best["dense"] * 1e3
                    lines.append(f"| {rows} | {str(dtype)[6:]} | {name} | {kernel:.1f} | {dense:.1f} | "
                                 f"{dense / kernel:.2f}x |")
                    print(lines[-1], flush=True)
    report(lines, args.out)


if __name__ == "__main__":
    main()
