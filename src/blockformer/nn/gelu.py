"""Exact GELU for fp32 training on a CPU, keeping its derivative from the forward.

torch's GELU backward computes erf and exp a second time. ``csrc/gelu.c`` computes GELU and
its derivative in one pass (one exponential serves both) and keeps the derivative in place of
the input, which nothing else needs: the backward is one product. ``nn/feedforward.py`` takes it
where ``kernels.gelu_kernel`` says so (fp32 on a CPU, with a gradient to take, eager); where the
kernel cannot be built, ``F.gelu`` runs as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .. import kernels, native


@functools.cache
def kernel():
    """The compiled ``gelu_f32``, or None where it cannot be built."""
    return native.function("gelu", "gelu_f32", 3, 2)


class GeluKeepingDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y, dy = torch.empty_like(x), torch.empty_like(x)
        threads = native.pieces(x.numel() // 65536 + 1)  # a thread a 64K values at most (~50 us each, AVX2)
        kernel()(x.data_ptr(), y.data_ptr(), dy.data_ptr(), x.numel(), threads)
        ctx.save_for_backward(dy)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        dy, = ctx.saved_tensors
        return grad * dy


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x)`` (exact), through the kernel where ``kernels.gelu_kernel`` chooses it."""
    if kernels.gelu_kernel(x) and kernel() is not None:
        return GeluKeepingDerivative.apply(x)
    return F.gelu(x)
