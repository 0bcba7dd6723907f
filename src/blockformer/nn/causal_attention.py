"""Causal self-attention for fp32 training over short sequences, through a small C kernel.

torch's fused CPU attention is built for long sequences: it works in blocks of keys and
recomputes the softmax in its backward. At nanoGPT's CPU shape (64 tokens, heads of 32) a
(row, head) pair's queries, keys, values and scores fit in a core's caches many times over, and
``csrc/causal_attention.c`` computes them whole: the forward keeps its softmax (T x T a pair),
and the backward reuses it. ``nn/attention.py`` takes it where ``kernels.causal_training_kernel``
says so (fp32 training on a CPU, causal, no mask, no dropout, up to
``kernels.CAUSAL_KERNEL_MAX_TOKENS`` tokens, eager); where the kernel cannot be built, SDPA runs
as before.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native


@functools.cache
def kernels():
    """The compiled forward and backward, or None where they cannot be built."""
    forward = native.function("causal_attention", "causal_attention_forward_f32", 6, 4, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_float)
    backward = native.function("causal_attention", "causal_attention_backward_f32", 9, 4, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_float)
    return None if forward is None or backward is None else (forward, backward)


def _strides(*tensors: torch.Tensor) -> ctypes.Array:
    """Each (B, H, T, D) tensor's first three strides, as the kernel reads them."""
    return (ctypes.c_int64 * (3 * len(tensors)))(*(s for t in tensors for s in t.stride()[:3]))


def _scratch(B: int, H: int, T: int, D: int) -> tuple[torch.Tensor, int]:
    """Each thread's scratch (csrc/causal_attention.c's SCRATCH), and how many threads."""
    threads = native.pieces(B * H)
    ld = (T + 7) // 8 * 8
    return torch.empty(threads * (D * ld + 2 * ld + T * T)), threads


def _heads_last(B: int, H: int, T: int, D: int) -> torch.Tensor:
    """A (B, H, T, D) view of a contiguous (B, T, H, D) tensor: what the caller reshapes to (B, T, H * D) for free."""
    return torch.empty(B, T, H, D).transpose(1, 2)


class CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        B, H, T, D = q.shape
        out, p = _heads_last(B, H, T, D), torch.empty(B, H, T, T)
        scratch, threads = _scratch(B, H, T, D)
        kernels()[0](q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), p.data_ptr(), scratch.data_ptr(),
                     B, H, T, D, _strides(q, k, v, out), threads, scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, p = ctx.saved_tensors
        B, H, T, D = q.shape
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = (_heads_last(B, H, T, D) for _ in range(3))
        scratch, threads = _scratch(B, H, T, D)
        kernels()[1](q.data_ptr(), k.data_ptr(), v.data_ptr(), p.data_ptr(), dout.data_ptr(), dq.data_ptr(),
                     dk.data_ptr(), dv.data_ptr(), scratch.data_ptr(), B, H, T, D,
                     _strides(q, k, v, dout, dq, dk, dv), threads, ctx.scale)
        return dq, dk, dv, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T, causal) v for fp32 ``q``, ``k``, ``v`` (B, H, T, D) on the CPU, each token's D
    values contiguous (views of one fused projection are fine); (B, H, T, D), differentiable."""
    if q.shape != k.shape or k.shape != v.shape or {q.dtype, k.dtype, v.dtype} != {torch.float32}:
        raise ValueError(f"q, k, v: expected fp32 of one shape (B, H, T, D); got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v: expected each token's values contiguous (stride 1 along the last dimension)")
    return CausalAttention.apply(q, k, v, scale)
