"""Matmul weights laid out for the CPU kernel once, before decoding.

A CPU ``nn.Linear`` hands oneDNN a plain row-major weight on every call. Packed once into
oneDNN's blocked layout, the same product runs about twice as fast at the few rows a decode
step has, with outputs equal to the last bit (figures: BENCHMARKS.md "Kernel choices").
``torch.compile`` packs the same way only with inductor's ``freezing``, which bakes the
weights into the graph (a later weight update would go unseen); packing in eager mode gives
the gain without that hazard.

A packed weight is an opaque oneDNN tensor: the model can decode but not train, be copied
or be saved, and a compiled decode step cannot read it. Like ``quantize``, this is the last
step before generation (``prepare_for_decoding(..., pack=True)``, which the CLI uses).
Packing is used only where ``kernels.packs_on_this_cpu`` says it was measured to pay, with
a torch built with oneDNN and a probe product equal to ``F.linear``'s.

Where fp32 weights are not packed on a CPU without AMX (AVX2 always; AVX-512 for a compiled
step, which cannot read packed weights, or for steps known to have a few rows, such as
``generate``'s one prompt: ``pack_linears(..., rows=1)``), ``StreamedLinear`` takes the few-row products
instead: ``csrc/f32_matmul.c`` streams the plain weight once for all the rows, at about twice the bandwidth torch's matmul draws at one row there. Its weight stays a plain
tensor, so it can be compiled (the kernel is then ``torch.ops.blockformer.f32_matmul``). On
an AMX CPU fp32 weights are neither packed nor streamed: torch's own ``F.linear`` was faster.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels, native
from ..models.checks import check_int, check_model
from .linears import load_operators_for, swap_linears


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack ``dtype`` weights and give ``F.linear``'s result."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    measured = kernels.packs_on_this_cpu(dtype)
    if not measured:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 40, generator=g).to(dtype), torch.randn(3, 40, generator=g).to(dtype)
        with torch.inference_mode():
            packed = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
            return torch.allclose(packed.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, NotImplementedError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # laid out for few rows


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for the CPU kernel (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", _pack(linear.weight), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("PackedLinear is for inference: its weight cannot take gradients")
        return torch.ops.mkldnn._linear_pointwise(x.to(self.weight.dtype), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The kernel takes any rows; up to this many it beat torch's matmul (1.3-2.3x at 5 to 16 rows on a Zen 5 EPYC,
# native and capped at AVX2, 1.5x at 16 on a Zen 4; level at 32, behind at 64: BENCHMARKS.md "Decoding on an
# AVX512-BF16 EPYC"), and more go to torch's matmul.
STREAM_ROWS = 16


@functools.cache
def _f32_matmul():
    return native.function("f32_matmul", "f32_matmul_f32", 4, 4)


def f32_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 rows (any leading dimensions) by ``csrc/f32_matmul.c``
    (``F.linear`` itself if the kernel is not built)."""
    if _f32_matmul() is None:
        return F.linear(x, weight, bias)
    x, k, n = x.contiguous(), x.shape[-1], weight.shape[0]
    y = x.new_empty(*x.shape[:-1], n)
    _f32_matmul()(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                  x.numel() // k, k, n, native.pieces(n))
    return y


native.matmul_op(f32_matmul)


class StreamedLinear(nn.Linear):
    """An ``nn.Linear`` whose fp32 products of up to ``STREAM_ROWS`` rows (inference, on the CPU)
    go through ``csrc/f32_matmul.c``; anything else is ``F.linear``. Same weights, same module
    tree: it can be compiled, saved and quantized as the ``nn.Linear`` it replaces."""

    @classmethod
    def of(cls, linear: nn.Linear) -> StreamedLinear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # shared, not copied
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu" and rows <= STREAM_ROWS
                and not torch.is_grad_enabled() and native.ready(_f32_matmul)):
            return native.call(f32_matmul, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, compiled: bool = False, rows: int | None = None) -> nn.Module:
    """Replace every plain ``nn.Linear`` of a CPU ``model`` in place by a ``PackedLinear``
    where its dtype packs (``can_pack``; not if the step will be ``compiled``: it could not
    read the packed weight), else (compiled steps too) by a ``StreamedLinear`` where
    ``kernels.streams_decode_matmuls`` picks it (and its C++ operator is loaded); others are
    left as they are. ``rows``: the most rows a decode step will have, where the caller knows
    (``generate``'s one prompt: 1); at a few, weights that stream do so rather than pack
    (``kernels.streams_rather_than_packs``). Returns ``model``, in eval mode."""
    check_model(model)
    if rows is not None:
        check_int(rows, "rows", 1)

    def make(linear: nn.Linear) -> nn.Module | None:  # not subclasses: LoRA adds adapters to its product
        if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
            return None
        dtype = linear.weight.dtype
        if can_pack(dtype) and not compiled and not kernels.streams_rather_than_packs(dtype, rows):
            return PackedLinear(linear)
        return StreamedLinear.of(linear) if kernels.streams_decode_matmuls(dtype) else None

    swap_linears(model, make)
    load_operators_for(model, StreamedLinear)
    return model.eval()


def is_packed(model: nn.Module) -> bool:
    """Whether any matmul of ``model`` holds a packed weight (a compiled step cannot read it)."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
