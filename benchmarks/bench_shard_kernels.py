"""What the two non-matmul kernels of a split training step cost, timed alone at one shard's
shapes (``train.batch_threads``: each thread runs half the rows on one thread of its own):
exact GELU forward and backward, torch's against blockformer's (``csrc/gelu.c``, which keeps the
derivative from its forward, so its backward is a product by a saved tensor), the same for GELU's
tanh form (GPT-2's), and causal
attention forward + backward: torch's fused kernel, one written as batched matmuls that keeps
its softmax for the backward, and blockformer's (``csrc/causal_attention.c``), the last two's
gradients checked against the fused ones. nanoGPT's CPU shape by default: 6 rows of 64 tokens,
4 heads of 32, FFN width 512.

    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 \\
        python benchmarks/bench_shard_kernels.py --out benchmarks/results/shard-kernels-avx2cap.md
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common import cpu_kind, report

from blockformer.nn.causal_attention import causal_attention
from blockformer.nn.gelu import GeluKeepingDerivative


def us(fn, repeats: int) -> float:
    """Mean of ``repeats`` calls after 20 to warm up, in microseconds."""
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


class SavedSoftmaxAttention(torch.autograd.Function):
    """Causal attention as batched matmuls; the backward reuses the forward's softmax."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        mask = torch.full((T, T), float("-inf"), dtype=q.dtype).triu(1)
        p = torch.baddbmm(mask.expand(B * H, T, T), q.reshape(-1, T, D), k.reshape(-1, T, D).transpose(1, 2),
                          alpha=D**-0.5).softmax(-1)
        o = torch.bmm(p, v.reshape(-1, T, D))
        ctx.save_for_backward(q, k, v, p, o)
        return o.view(B, H, T, D)

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o = ctx.saved_tensors
        B, H, T, D = q.shape
        do = do.reshape(-1, T, D)
        dv = torch.bmm(p.transpose(1, 2), do)
        ds = p * (torch.bmm(do, v.reshape(-1, T, D).transpose(1, 2)) - (do * o).sum(-1, keepdim=True))
        dq = torch.bmm(ds, k.reshape(-1, T, D)).mul_(D**-0.5)
        dk = torch.bmm(ds.transpose(1, 2), q.reshape(-1, T, D)).mul_(D**-0.5)
        return dq.view(B, H, T, D), dk.view(B, H, T, D), dv.view(B, H, T, D)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="one shard's threads (1 on two cores)")
    p.add_argument("--rows", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    small = [name for name in ("threads", "rows", "tokens", "heads", "head_dim", "ffn", "repeats") if getattr(args, name) < 1]
    if small:
        p.error(", ".join("--" + n.replace("_", "-") for n in small) + ": expected at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, dy, g = (torch.randn(args.rows * args.tokens, args.ffn) for _ in range(3))
    q, k, v = (torch.randn(args.rows, args.heads, args.tokens, args.head_dim, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def grads(attend):
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(do)
        return [t.grad.clone() for t in (q, k, v)]

    fused = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    kernel = lambda q, k, v: causal_attention(q, k, v, args.head_dim ** -0.5)  # noqa: E731
    error = max((a - b).abs().max().item() for other in (SavedSoftmaxAttention.apply, kernel)
                for a, b in zip(grads(fused), grads(other)))
    xg = x.clone().requires_grad_()
    rows = [
        ("exact GELU, forward", us(lambda: F.gelu(x), args.repeats)),
        ("exact GELU, backward", us(lambda: torch.ops.aten.gelu_backward(dy, x), args.repeats)),
        ("a product by a saved tensor (a backward that kept the derivative)", us(lambda: dy * g, args.repeats)),
        ("exact GELU keeping its derivative (csrc/gelu.c), forward", us(lambda: GeluKeepingDerivative.apply(xg),
                                                                        args.repeats)),
        ("exact GELU, torch's, forward + backward through autograd",
         us(lambda: torch.autograd.grad(F.gelu(xg), xg, g), args.repeats)),
        ("exact GELU keeping its derivative, forward + backward through autograd",
         us(lambda: torch.autograd.grad(GeluKeepingDerivative.apply(xg), xg, g), args.repeats)),
        ("tanh GELU (GPT-2's), torch's, forward + backward through autograd",
         us(lambda: torch.autograd.grad(F.gelu(xg, approximate="tanh"), xg, g), args.repeats)),
        ("tanh GELU keeping its derivative (csrc/gelu.c), forward + backward through autograd",
         us(lambda: torch.autograd.grad(GeluKeepingDerivative.apply(xg, "tanh"), xg, g), args.repeats)),
        ("causal attention, fused SDPA, forward + backward", us(lambda: grads(fused), args.repeats)),
        ("causal attention, batched matmuls keeping the softmax, forward + backward",
         us(lambda: grads(SavedSoftmaxAttention.apply), args.repeats)),
        ("causal attention, blockformer's kernel (csrc/causal_attention.c), forward + backward",
         us(lambda: grads(kernel), args.repeats)),
    ]
    lines = [f"# One shard's GELU and attention ({cpu_kind()} CPU, {args.threads} thread(s), torch {torch.__version__})",
             "", f"GELU over {args.rows * args.tokens} x {args.ffn}; attention over {args.rows} x {args.heads} heads x "
             f"{args.tokens} tokens x {args.head_dim}; mean of {args.repeats} calls. The other attentions' gradients "
             f"differ from the fused one's by at most {error:.1e}.", "", "| kernel | us per layer |", "|---|---:|"]
    lines += [f"| {name} | {t:.0f} |" for name, t in rows]
    report(lines, args.out)


if __name__ == "__main__":
    main()
