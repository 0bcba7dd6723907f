"""Weight-only quantization for decoding (as gpt-fast does): int8 and int4.

At batch 1 a decode step is bound by reading every weight from memory once per token, so
storing the matmul weights in fewer bits makes it faster. Activations stay in floating
point; only the weights are rounded.

- ``int8``: one scale per output channel, ``q = round(w / s)``, ``s = max|w_row| / 127``.
  A decode step reads 4x fewer weight bytes than fp32, 2x fewer than bf16.
- ``int4``: groups of ``group_size`` consecutive input weights share a scale and an offset
  (asymmetric, 16 levels spanning the group's min..max). A decode step reads 8x fewer
  weight bytes than fp32, at a larger rounding error.
- ``int4-a8``: the same int4 weights against activations rounded to int8 as they arrive
  (blocks of 32 inputs, each with its own scale: llama.cpp's 4-bit-by-8-bit products, torchao's
  "8da4w"), so that the CPU kernel multiplies integers: the same bytes as ``int4``, less
  arithmetic per byte, and a small extra rounding of the activations.
- ``int8-a8``: ``int8``'s weights against activations rounded the same way (llama.cpp's
  8-bit-by-8-bit products): ``int8``'s bytes, with integer arithmetic in the kernel.

With fp32 activations PyTorch's packed low-bit CPU kernels are slower than the float model,
so a decode step uses blockformer's own (``csrc/int8_matmul.c``, ``csrc/int4_matmul.c``, built
by ``native``), which read each weight byte once for all of the step's rows. bf16 activations
(``--precision bf16``) are widened to fp32 for these kernels where ``kernels.native_quantized_matmul``
says so (past a few rows; for int8, on CPUs without AMX), and take PyTorch's kernels elsewhere. This is for inference: a
quantized model cannot be trained, and its outputs differ from the float model's (int4 more
than int8; ``blockformer eval --quantize`` measures the cost).

``prepare_for_decoding`` is the last step before decoding: the decoding dtype, then either
quantized here or packed for the CPU kernel (``packed.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels, native
from ..models.checks import check_model
from ..precision import DTYPES, cast
from .linears import load_operators_for, swap_linears
from .packed import pack_linears

KERNEL_MAX_ROWS = kernels.TORCH_PACKED_MAX_ROWS  # torch's packed CPU kernels (bf16) pay only for a few rows


class QuantizedLinear(nn.Module):
    """What the int8 and int4 layers share: ``y = x W^T + b`` computed in the activation's
    dtype (the autocast dtype under autocast). On the CPU, fp32 products of any number of rows
    (decode steps, prompts, a server's batch) go through blockformer's C kernels, and so do bf16
    ones (widened) past ``KERNEL_MAX_ROWS`` rows up to ``kernels.native_quantized_matmul``'s limit
    and, where it says so, int8 ones of fewer; other bf16 ones of at most ``KERNEL_MAX_ROWS`` rows go
    through PyTorch's packed low-bit kernels; both read only the quantized bytes. More bf16 rows
    (a long prompt, evaluation) are faster as the dequantized weight in one dense bf16 matmul."""

    in_features: int
    out_features: int
    bits: int  # of a stored weight

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """What the dense path multiplies by the dequantized weight: ``x`` itself (weight-only schemes)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x = cast(x, dtype)
        # Inductor cannot hand a freshly cast input to the packed kernels (torch 2.13), so under
        # torch.compile with autocast the dense path runs: store the model in bf16 instead.
        cast_in_graph = torch.compiler.is_compiling() and torch.is_autocast_enabled(device)
        if device == "cpu" and self.takes_kernel(dtype, self._rows(x)) and not cast_in_graph:
            return self.kernel(x)
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """``activations(x) W^T + b`` with the whole weight dequantized to ``x``'s dtype: one dense matmul."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(self.activations(x), self.dequantized(x.dtype), bias)

    def takes_kernel(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether a CPU product of ``rows`` rows in ``dtype`` goes to ``kernel`` (else the dense path)."""
        return rows <= KERNEL_MAX_ROWS or kernels.native_quantized_matmul(dtype, rows, self.bits)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` for a few rows ``x`` (any leading dimensions: the C kernels take them
        as they are, where two reshapes cost more than a decode step's product) by a kernel that
        reads the quantized bytes."""
        raise NotImplementedError

    def _rows(self, x: torch.Tensor) -> int:
        return x.numel() // self.in_features

    def _in_2d(self, product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``product`` (of a 2-d input, bias added) for ``x`` of any leading dimensions."""
        return product(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def _plus_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out_features, in_features) weight this layer stands for."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """``W = scales[:, None] * int8_weight``, one scale per output channel."""

    bits = 8

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.native_quantized_matmul(x.dtype, self._rows(x), self.bits) and native.ready(_int8_matmul):
            return cast(native.call(int8_matmul, cast(x, torch.float32), self.weight, self.scales, self.bias), x.dtype)
        if self.in_features % 16:  # torch 2.13's AVX-512 bf16 kernel gives garbage or crashes (200, 216)
            return self.dense(x)
        return self._in_2d(lambda x2: self._plus_bias(torch.ops.aten._weight_int8pack_mm(
            x2, self.weight, self.scales.to(x.dtype))), x)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scales.to(dtype)[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@functools.cache
def _int8_matmul():
    return native.function("int8_matmul", "int8_matmul_f32", 5, 4)


@functools.cache
def _int4_matmul():
    return native.function("int4_matmul", "int4_matmul_f32", 7, 5)


@functools.cache
def _int4_a8_matmul():
    return native.function("int4_a8_matmul", "int4_a8_matmul_f32", 7, 5)


@functools.cache
def _int8_a8_matmul():
    return native.function("int8_a8_matmul", "int8_a8_matmul_f32", 6, 4)


# The C kernels as functions of tensors, and as custom ops (``native.matmul_op``) so that a
# compiled decode step calls them too. fp32 rows, any number; output channels split
# over torch's threads inside the kernel.
def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (scales[:, None] * weight).T + bias`` by ``csrc/int8_matmul.c`` (torch's kernel if it is not
    built), for ``x`` of any leading dimensions."""
    k, n = x.shape[-1], weight.shape[0]
    if _int8_matmul() is None:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, k), weight, scales.to(x.dtype)).reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias
    x, scales = x.contiguous(), scales.float().contiguous()
    y, bias = x.new_empty(*x.shape[:-1], n), _fp32(bias)  # held until the call returns
    _int8_matmul()(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), _pointer(bias), y.data_ptr(), x.numel() // k, k,
                   n, native.pieces(n))
    return y


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``Int4Linear``'s codes, scales and zeros, by ``csrc/int4_matmul.c``
    (the dequantized weight if it is not built), for ``x`` of any leading dimensions."""
    if _int4_matmul() is None:
        return F.linear(x, dequantize_int4(codes, scales, zeros, group_size, x.dtype), bias)
    x, k, n = x.contiguous(), x.shape[-1], codes.shape[0]
    rows, scales, zeros = x.numel() // k, scales.float().contiguous(), zeros.float().contiguous()
    y, sums, bias = x.new_empty(*x.shape[:-1], n), x.new_empty(rows, k // group_size), _fp32(bias)
    _int4_matmul()(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), _pointer(bias), y.data_ptr(),
                   sums.data_ptr(), rows, k, group_size, n, native.pieces(n))
    return y


def int4_a8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``round_activations(x) @ W.T + bias`` for ``Int4Linear``'s codes, scales and zeros, by
    ``csrc/int4_a8_matmul.c`` (the same in torch if it is not built), for ``x`` of any leading dimensions."""
    if _int4_a8_matmul() is None:
        return F.linear(round_activations(x), dequantize_int4(codes, scales, zeros, group_size, x.dtype), bias)
    x, k, n = x.contiguous(), x.shape[-1], codes.shape[0]
    rows, scales, zeros = x.numel() // k, scales.float().contiguous(), zeros.float().contiguous()
    y, bias = x.new_empty(*x.shape[:-1], n), _fp32(bias)
    scratch = x.new_empty(rows * (k // 4 + k // 8 + k // ACTIVATION_BLOCK + k // group_size))  # the rounded rows
    _int4_a8_matmul()(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), _pointer(bias),
                      y.data_ptr(), scratch.data_ptr(), rows, k, group_size, n, native.pieces(n))
    return y


def int8_a8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``round_activations(x) @ (scales[:, None] * weight).T + bias`` by ``csrc/int8_a8_matmul.c``
    (the same in torch if it is not built), for ``x`` of any leading dimensions."""
    if _int8_a8_matmul() is None:
        w = weight.to(x.dtype) * scales.to(x.dtype)[:, None]
        return F.linear(round_activations(x), w, None if bias is None else bias.to(x.dtype))
    x, k, n = x.contiguous(), x.shape[-1], weight.shape[0]
    rows, scales = x.numel() // k, scales.float().contiguous()
    y, bias = x.new_empty(*x.shape[:-1], n), _fp32(bias)
    scratch = x.new_empty(rows * (k // ACTIVATION_BLOCK + k // 4))  # the rounded rows: scales, then int8s
    _int8_a8_matmul()(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), _pointer(bias), y.data_ptr(),
                      scratch.data_ptr(), rows, k, n, native.pieces(n))
    return y


ACTIVATION_BLOCK = 32  # inputs per int8 scale in the a8 schemes, as llama.cpp's 8-bit blocks


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each run of ``ACTIVATION_BLOCK`` values along its last dimension rounded to
    one of 255 levels, ``d * round(x / d)`` for ``d = max|x| / 127`` over the run (0 stays 0):
    what the a8 kernels multiply the weights by. Computed in fp32, as the kernel does."""
    blocks = x.float().reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return ((blocks * inverse).round() * (amax / 127.0)).reshape(x.shape).to(x.dtype)


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def _pointer(bias: torch.Tensor | None) -> int:
    """Where a kernel reads the bias: NULL for none."""
    return 0 if bias is None else bias.data_ptr()


native.matmul_op(int8_matmul)
native.matmul_op(int4_matmul)
native.matmul_op(int4_a8_matmul)
native.matmul_op(int8_a8_matmul)


class RoundedActivations:
    """What an a8 layer adds to its weight-only parent: activations rounded to int8
    (``round_activations``) on every path, by its own C kernel on the CPU in any dtype (bf16
    rows widened to fp32; torch has no kernel for these schemes, and the dense path dequantizes
    the whole weight every call) for as many rows as ``kernels.a8_kernel_rows`` allows (a
    prompt's too), as the rounded activations times the dequantized weight elsewhere."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return round_activations(x)

    def takes_kernel(self, dtype: torch.dtype, rows: int) -> bool:
        return kernels.a8_kernel_rows(dtype, rows)


class Int8A8Linear(RoundedActivations, Int8Linear):
    """``Int8Linear``'s weights against rounded activations (``RoundedActivations``), by
    ``csrc/int8_a8_matmul.c``. Rows are rounded in blocks of 32, so ``in_features`` must be a
    multiple of 32."""

    def __init__(self, linear: nn.Linear) -> None:
        if linear.in_features % ACTIVATION_BLOCK:
            raise ValueError(f"int8-a8: in_features={linear.in_features} is not a multiple of {ACTIVATION_BLOCK}; "
                             "its activations are rounded in blocks of that many")
        super().__init__(linear)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if native.ready(_int8_a8_matmul):
            return cast(native.call(int8_a8_matmul, cast(x, torch.float32), self.weight, self.scales, self.bias),
                        x.dtype)
        return self.dense(x)

    def extra_repr(self) -> str:
        return super().extra_repr().replace("int8", "int8-a8", 1)


class Int4Linear(QuantizedLinear):
    """4-bit weights: within each group of ``group_size`` inputs, ``W = (q - 8) * scale +
    zero`` for ``q`` in 0..15. A row that ``group_size`` does not divide gets the largest
    smaller group size that does. The codes are kept twice: two per byte for the dense
    path, and (on the CPU) in the layout of PyTorch's int4 kernel for decode steps."""

    GROUP_SIZES = (32, 64, 128, 256)  # what the kernel accepts
    bits = 4
    torch_layout = True  # also keep the codes in the layout of torch's int4 kernel (CPU)

    def __init__(self, linear: nn.Linear, group_size: int = 128) -> None:
        super().__init__(linear)
        k, n = linear.in_features, linear.out_features
        if group_size not in self.GROUP_SIZES:
            raise ValueError(f"int4 group_size={group_size}: expected one of {self.GROUP_SIZES}")
        fits = [g for g in self.GROUP_SIZES if g <= group_size and k % g == 0]
        if not fits:
            raise ValueError(f"int4: in_features={k} is not a multiple of 32; int4 groups need one")
        self.group_size = g = fits[-1]  # the largest group, up to the one asked for, that divides the row
        groups = linear.weight.detach().float().reshape(n, k // g, g)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        zero = low + 8 * scale  # the weight that q = 8 stands for
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
        dtype = linear.weight.dtype
        self.register_buffer("codes", pack_int4(q))  # (n, k / 2)
        self.register_buffer("scales", scale.to(dtype))  # (n, k / g)
        self.register_buffer("zeros", zero.to(dtype))
        if self.torch_layout and linear.weight.device.type == "cpu":  # that kernel takes channels in 16s
            pad = -n % 16
            padded = torch.cat([q.to(torch.int32), q.new_zeros(pad, k, dtype=torch.int32)])
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1))
            both = torch.stack([scale, zero], -1)
            both = torch.cat([both, both.new_zeros(pad, k // g, 2)]).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", both.to(dtype))  # (k / g, n + pad, 2)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.native_quantized_matmul(x.dtype, self._rows(x), self.bits) and native.ready(_int4_matmul):
            y = native.call(int4_matmul, cast(x, torch.float32), self.codes, self.scales, self.zeros, self.group_size,
                            self.bias)
            return cast(y, x.dtype)
        if not hasattr(self, "packed"):  # quantized off the CPU: no kernel layout to use
            return self.dense(x)
        return self._in_2d(lambda x2: self._plus_bias(torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros.to(x.dtype))[:, : self.out_features]), x)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.codes, self.scales, self.zeros, self.group_size, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group_size={self.group_size}"


class Int4A8Linear(RoundedActivations, Int4Linear):
    """``Int4Linear``'s weights against rounded activations (``RoundedActivations``), by
    ``csrc/int4_a8_matmul.c``. Torch's int4 kernel never runs, so its copy of the codes is not kept."""

    torch_layout = False

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if native.ready(_int4_a8_matmul):
            y = native.call(int4_a8_matmul, cast(x, torch.float32), self.codes, self.scales, self.zeros,
                            self.group_size, self.bias)
            return cast(y, x.dtype)
        return self.dense(x)

    def extra_repr(self) -> str:
        return super().extra_repr().replace("int4", "int4-a8", 1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q`` (n, k) in 0..15, k a multiple of 16, two per byte: in each run of 16 inputs,
    byte j holds input j (low nibble) and input 8 + j (high), the order in which the C kernel
    widens 8 bytes to 16 floats with one shuffle."""
    runs = q.reshape(q.shape[0], -1, 16)
    return (runs[..., :8] | (runs[..., 8:] << 4)).reshape(q.shape[0], -1)


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """The (n, k) codes that ``pack_int4`` packed."""
    runs = codes.reshape(codes.shape[0], -1, 8)
    return torch.cat([runs & 15, runs >> 4], -1).reshape(codes.shape[0], -1)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The (out_features, in_features) weight that int4 ``codes`` (``pack_int4``) stand for."""
    n, k, g = codes.shape[0], 2 * codes.shape[1], group_size
    q = unpack_int4(codes).reshape(n, k // g, g).to(dtype)
    return ((q - 8) * scales.to(dtype)[..., None] + zeros.to(dtype)[..., None]).reshape(n, k)


SCHEMES = ("int8", "int4", "int4-a8", "int8-a8")
LAYERS = {"int8": Int8Linear, "int4": Int4Linear, "int4-a8": Int4A8Linear, "int8-a8": Int8A8Linear}


def quantize(model: nn.Module, scheme: str | None, group_size: int = 128) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (attention, FFN, output head) in place by an
    ``Int8Linear``, ``Int4Linear``, ``Int4A8Linear`` or ``Int8A8Linear`` (``scheme=None``: leave the
    model as it is).
    Embeddings, norms and MoE routers keep their dtype; stacked MoE experts are stored in
    int8 under either scheme; a head tied to the embedding gets its own quantized copy.
    Quantize after moving the model to its device: on a CPU, the C++ operators of the
    quantized products are loaded (``native.load_cpp_ops``). Returns ``model``, in eval mode."""
    check_model(model)
    if scheme is None:
        return model
    if scheme not in SCHEMES:
        raise ValueError(f"quantize scheme={scheme!r}: expected one of {SCHEMES}")
    layer = LAYERS[scheme]
    swap_linears(model, lambda lin: layer(lin) if issubclass(layer, Int8Linear) else layer(lin, group_size))
    for module in model.modules():
        if hasattr(module, "quantize_experts"):  # stacked MoE experts: int8 under either scheme
            module.quantize_experts()
    load_operators_for(model, QuantizedLinear)
    return model.eval()


def prepare_for_decoding(
    model: nn.Module, precision: str = "fp32", scheme: str | None = None, pack: bool = False, compiled: bool = False,
    rows: int | None = None,
) -> nn.Module:
    """``model`` as decoding wants it, in place: its weights stored in the decoding dtype
    (``bf16``/``fp16`` halve the bytes each step reads; autocast would instead re-cast every
    weight on every step), then quantized with ``scheme`` if given, else, with ``pack`` on a
    CPU, its matmul weights laid out for the CPU's few-row kernels (``pack_linears``; with
    ``compiled``, only where a compiled step can still read them; ``rows``, the most rows a
    step will have where known, as ``pack_linears`` takes it)."""
    check_model(model)
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(DTYPES)}")
    if DTYPES[precision] != torch.float32:
        model.to(DTYPES[precision])
    if scheme is None and pack:
        return pack_linears(model, compiled, rows)
    return quantize(model, scheme)
