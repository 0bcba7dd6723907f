"""GELU for fp32 training on a CPU, exact or in its tanh form, keeping its derivative from the forward.

torch's GELU backward computes erf and exp (or tanh) a second time. ``csrc/gelu.c`` computes GELU
and its derivative in one pass (one exponential serves both) and saves the derivative for the
backward instead of the input: the backward is one product. ``nn/feedforward.py`` takes
it where ``kernels.gelu_kernel`` says so (fp32 on a CPU, with a gradient to take, eager); where
the kernel cannot be built, ``F.gelu`` runs as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .. import kernels, native


SYMBOLS = {"none": "gelu_f32", "tanh": "gelu_tanh_f32"}  # F.gelu's ``approximate``: its kernel


@functools.cache
def kernel(approximate: str = "none"):
    """The compiled GELU of form ``approximate`` (``gelu_f32``, ``gelu_tanh_f32``), or None where it cannot be built."""
    return native.function("gelu", SYMBOLS[approximate], 3, 2)


class GeluKeepingDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        x = x.contiguous()
        y, dy = torch.empty_like(x), torch.empty_like(x)
        threads = native.pieces(x.numel() // 65536 + 1)  # a thread a 64K values at most (~50 us each, AVX2)
        kernel(approximate)(x.data_ptr(), y.data_ptr(), dy.data_ptr(), x.numel(), threads)
        ctx.save_for_backward(dy)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        dy, = ctx.saved_tensors
        return grad * dy, None


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)``, through the kernel where ``kernels.gelu_kernel`` chooses it."""
    if kernels.gelu_kernel(x) and kernel(approximate) is not None:
        return GeluKeepingDerivative.apply(x, approximate)
    return F.gelu(x, approximate=approximate)
