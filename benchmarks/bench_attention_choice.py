"""The figure behind ``kernels.UNFUSED_SHORT_BF16``: forward + backward of one causal attention
layer in bf16 training, torch's fused kernel (``F.scaled_dot_product_attention``) against the
written-out one (``nn.attention._unfused``, what ``sdpa`` takes over short keys where the flag
is on), at nanoGPT's CPU shape (batch 12, 4 heads of 32) over several key lengths.

    OMP_NUM_THREADS=2 python benchmarks/bench_attention_choice.py --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=2 python benchmarks/bench_attention_choice.py --threads 2
    ... --dtype fp32   # the same choice for fp32 training (what ``auto`` picks without bf16 units)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from blockformer import kernels
from blockformer.nn.attention import _unfused

from common import cpu_kind


def fwd_bwd_ms(fn, q, k, v, repeats: int) -> float:
    """Best of ``repeats`` forward + backward passes, in ms (after two to warm up)."""
    best = float("inf")
    for i in range(repeats + 2):
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="64,128,256,512")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    unfused = lambda q, k, v: _unfused(q, k, v, None, True, 0.0, None, 1)  # noqa: E731
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"# {args.dtype} training attention, fused vs written out ({cpu_kind()} CPU, {args.threads} thread(s), "
          f"torch {torch.__version__}; UNFUSED_SHORT_BF16 = {kernels.UNFUSED_SHORT_BF16} here)\n")
    print(f"batch {args.batch}, {args.heads} heads of {args.head_dim}, causal; forward + backward, best of "
          f"{args.repeats}\n")
    print("| keys | fused (ms) | written out (ms) | fused / written out |")
    print("|---:|---:|---:|---:|")
    for t in (int(n) for n in args.lengths.split(",")):
        q, k, v = (torch.randn(args.batch, args.heads, t, args.head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        torch.testing.assert_close(fused(q, k, v), unfused(q, k, v), atol=2e-2, rtol=2e-2)
        a, b = fwd_bwd_ms(fused, q, k, v, args.repeats), fwd_bwd_ms(unfused, q, k, v, args.repeats)
        print(f"| {t} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
