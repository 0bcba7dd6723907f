"""Every kernel choice that depends on the hardware, made here and nowhere else.

Each choice is a small function or constant with one line saying what it chooses and the
measured reason; the figures (timings, shapes, the CPU kinds they came from) are in
BENCHMARKS.md, section "Kernel choices". The call sites (``nn/attention.py``, ``nn/loss.py``,
``nn/dropout.py``, ``generate/packed.py``, ``precision.py``, ``serve/runner.py``) look these
names up here when they run, so patching a constant of this module changes what they do. CPU features are read
through ``hardware.cpu_has``, so ``ATEN_CPU_CAPABILITY=avx2`` makes an AVX-512 machine choose
as an AVX2-only one does. CPU kinds that were not measured keep torch's own choice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .hardware import cpu_has

# --- attention (nn/attention.py) ---------------------------------------------------------


def avx512_bf16_units() -> bool:
    """AVX512-BF16, with or without AMX: the CPU kinds the short-key attention choice below was measured on."""
    return cpu_has("_is_avx512_bf16_supported")


# Unfused bf16 training attention up to this many keys: the fused bf16 backward is slower over short keys
# on AVX512-BF16 CPUs, with AMX (3.5x at 64 keys, 2.1x at 128, level at 256) and without (BENCHMARKS.md
# "Kernel choices").
CPU_BF16_UNFUSED_MAX_KEYS = 128
# Whether this CPU takes that choice: probed once, at import (a compiled graph guards on it as a constant).
UNFUSED_SHORT_BF16 = avx512_bf16_units()


def unfused_attention(device: torch.device, dtype: torch.dtype, n_keys: int, dropout: float,
                      grad: bool) -> bool:
    """Unfused attention for CPU training with dropout (torch's leaves its fused kernel too, dearer mask) or
    in bf16 over short keys where ``UNFUSED_SHORT_BF16`` (fused bf16 backward slower; BENCHMARKS.md)."""
    return device.type == "cpu" and grad and (dropout > 0 or (
        dtype == torch.bfloat16 and n_keys <= CPU_BF16_UNFUSED_MAX_KEYS and UNFUSED_SHORT_BF16))


# Causal self-attention in fp32 training over up to this many tokens goes through csrc/causal_attention.c
# (nn/causal_attention.py), which keeps each (row, head) pair's softmax for its backward, rather than SDPA's
# fused kernel, which recomputes it. Forward + backward on a 2-core Zen 4 EPYC capped at AVX2: 1.4x at one
# shard's shape of nanoGPT's (6 x 4 heads x 64 tokens x 32, one thread), 2.6x over its 12 rows on two threads,
# 1.6x at 128 and 256 tokens with heads of 64, 1.3x at 512. It keeps T x T floats a pair where SDPA keeps T:
# hence the limit (BENCHMARKS.md "Causal attention and GELU for fp32 training").
CAUSAL_TRAINING_KERNEL = True
CAUSAL_KERNEL_MAX_TOKENS = 256


def causal_training_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           is_causal: bool, dropout: float) -> bool:
    """Whether causal self-attention of ``q`` over ``k``/``v`` (B, H, T, D) takes that kernel: plain fp32 tensors on
    the CPU, as many key as query heads, no mask besides the causal one, no dropout, up to
    ``CAUSAL_KERNEL_MAX_TOKENS`` tokens, each token's values contiguous, with a gradient to take, eager, and
    torch's own ops wanted by no dispatch mode (``torch_ops_watched``)."""
    return (CAUSAL_TRAINING_KERNEL and is_causal and mask is None and not dropout and type(q) is torch.Tensor
            and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and q.shape == k.shape == v.shape and q.shape[2] <= CAUSAL_KERNEL_MAX_TOKENS
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and not torch.compiler.is_compiling() and not torch_ops_watched())


def torch_ops_watched() -> bool:
    """Whether a dispatch mode is watching torch's ops (a FLOP counter, the memory probe, fake tensors): the
    training kernels then step aside, since what they compute in C would not be seen."""
    return _get_current_dispatch_mode() is not None


# GELU in fp32 training goes through csrc/gelu.c (nn/gelu.py), which keeps the derivative from its
# forward, rather than torch's, whose backward computes erf and exp (or tanh) again: exact GELU's forward
# + backward 1.8x at a shard's shape capped at AVX2 (2.0x on two threads), 1.1x natively with AVX-512;
# the tanh form's 4.6x capped, 2.8x natively (BENCHMARKS.md "Causal attention and GELU for fp32 training").
GELU_KERNEL = True


def gelu_kernel(x: torch.Tensor) -> bool:
    """Whether GELU of ``x`` (exact or its tanh form) takes that kernel: a plain fp32 tensor on the CPU, with a gradient to take, eager,
    no dispatch mode watching (``torch_ops_watched``)."""
    return (GELU_KERNEL and type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype == torch.float32
            and x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch_ops_watched())


# One new token per row (decoding on a CPU; nn/decode_attention.py) attends through csrc/decode_attention.c
# rather than SDPA, with the step's key mask if it has one: with the cache out of the caches, as in a step,
# 1.17-1.71x faster at 80 to 1024 slots on a 2-core Zen 4 EPYC, natively and capped at AVX2, and 1-7% of a
# GPT-2-small step (BENCHMARKS.md "Decode attention from a cache that is not in the caches"); a padded
# batch and a compiled step too (BENCHMARKS.md "Decode attention with a key mask").
DECODE_ATTENTION_KERNEL = True


def decode_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                            compiled_ok: bool = False) -> bool:
    """Whether one query token per row (``q`` (B, H, 1, D)) over the slots of ``k``/``v`` takes that kernel:
    fp32 queries on the CPU, over a cache of fp32, bf16, fp16 or int8, inference, with no mask or a bool key mask
    (B or 1, 1, 1, S); eager, or compiled where ``compiled_ok`` (its C++ operator is loaded)."""
    return (DECODE_ATTENTION_KERNEL and q.device.type == "cpu" and q.shape[2] == 1 and q.dtype == torch.float32
            and k.dtype == v.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
            and k.stride(-1) == v.stride(-1) == 1
            and (mask is None or is_key_mask(mask, q.shape[0], k.shape[2]))
            and not torch.is_grad_enabled() and (compiled_ok or not torch.compiler.is_compiling()))


def is_key_mask(mask: torch.Tensor, B: int, S: int) -> bool:
    """A bool mask of keys alone, one row per batch row or one for all: (B or 1, 1, 1, S)."""
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1
            and mask.shape[2] == 1 and mask.shape[3] == S)


# --- the output head fused with the loss (nn/loss.py) ------------------------------------

# Rows of logits the fused head and loss make at a time: 128 was faster than 64 and 256 (AVX512-BF16,
# bf16; BENCHMARKS.md "Kernel choices").
HEAD_LOSS_CHUNK_ROWS = 128
# Fewest classes for which the head is fused with the loss: below it torch's one-piece loss is faster,
# with AVX-512 and capped to AVX2 alike (BENCHMARKS.md "Kernel choices").
FUSE_MIN_VOCAB = 1000


def fuse_head_loss(head: nn.Module, h: torch.Tensor) -> bool:
    """Fuse a plain, unsharded ``nn.Linear`` head of ``FUSE_MIN_VOCAB`` classes or more in eager mode (fewer
    are faster in one piece: BENCHMARKS.md; LoRA, tensor parallelism and inductor score logits their way)."""
    return (
        type(head) is nn.Linear
        and head.out_features >= FUSE_MIN_VOCAB
        and not torch.compiler.is_compiling()
        and not isinstance(h, DTensor)
        and not isinstance(head.weight, DTensor)
    )


# --- dropout (nn/dropout.py) -------------------------------------------------------------


def cheap_dropout(x: torch.Tensor) -> bool:
    """The cheap 16-bit mask for a plain CPU tensor in eager mode: torch's per-element ``bernoulli_`` is
    several times dearer on a CPU (BENCHMARKS.md); a DTensor and ``torch.compile`` keep their own masks."""
    return type(x) is torch.Tensor and x.device.type == "cpu" and not torch.compiler.is_compiling()


# --- weights packed for decoding (generate/packed.py) ------------------------------------


def packs_on_this_cpu(dtype: torch.dtype) -> bool:
    """Pack bf16 weights on AVX512-BF16 or AMX, and fp32 on AVX-512 without AMX: about twice as
    fast at a decode step's few rows on an AVX512-BF16 EPYC (BENCHMARKS.md "Kernel choices"). On
    an AMX Xeon packed fp32 decoded GPT-2 small at 0.85x ``F.linear``'s pace (bf16 packed at 1.33x),
    so fp32 stays ``F.linear`` there; AVX2-only CPUs do not pack, and a compiled step reads no packed
    weight (both stream instead: ``streams_decode_matmuls``)."""
    if dtype == torch.bfloat16:
        return cpu_has("_is_avx512_bf16_supported") or cpu_has("_is_amx_tile_supported")
    return dtype == torch.float32 and cpu_has("_is_avx512_supported") and not cpu_has("_is_amx_tile_supported")


# fp32 weights that are not packed take blockformer's few-row kernel (csrc/f32_matmul.c, generate/packed.py
# StreamedLinear) on every CPU without AMX: on an AVX2-only EPYC it streamed a GPT-2-small step's weights at
# 18.7 GB/s where torch.mm at one row drew 9.0; on an AVX512-BF16 EPYC (Zen 4), where eager decoding packs
# them instead, a compiled step cannot read packed weights, and streamed it decoded GPT-2 small at 1.8x
# F.linear's pace (BENCHMARKS.md "Decoding on an AVX512-BF16 EPYC"). On AMX Xeons torch's F.linear
# streamed faster than the kernel (27 against 21-24 GB/s, two hosts), so they keep F.linear.
def streams_decode_matmuls(dtype: torch.dtype) -> bool:
    """Whether a decoding model's unpacked fp32 linears go through blockformer's C kernel at a step's few rows."""
    return dtype == torch.float32 and not cpu_has("_is_amx_tile_supported")


# Where every step has a few rows (``generate``'s one prompt), that kernel decoded GPT-2 small faster than
# oneDNN's packed weights on both AVX512-BF16 EPYCs, which pack fp32 for eager steps: 1.05-1.10x on a Zen 4
# and 1.03-1.14x on a Zen 5, batch 1, a 16-token prompt included; by rows it led up to 5 and trailed from 8.
# Packing keeps more rows (a server's batches, beam search, a check of 4 drafts or more): at 16 rows it ran
# 1.5-1.9x the kernel there (BENCHMARKS.md "Decoding on an AVX512-BF16 EPYC", its Zen 5 part).
STREAM_OVER_PACKED_ROWS = 4


def streams_rather_than_packs(dtype: torch.dtype, rows: int | None) -> bool:
    """Whether weights that would pack stream instead, for decode steps of at most ``rows`` rows (None: not known)."""
    return rows is not None and rows <= STREAM_OVER_PACKED_ROWS and streams_decode_matmuls(dtype)


# --- serving (serve/runner.py) ------------------------------------------------------------

# Decoding rows attend through the C kernel that reads the paged pool in place (serve/paged_attention.py),
# not a gathered copy and SDPA: 3.6-6x faster at 1-64 rows in fp32 (BENCHMARKS.md "Serving", "Paged
# attention"); a bf16 pool is read in place too (1.06x a served bf16 GPT-2 small at 16 in flight, AMX).
PAGED_DECODE_KERNEL = True


def paged_decode_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a server's decoding rows use that kernel: fp32, bf16, fp16 and int8 pools on the CPU (it has no other)."""
    return PAGED_DECODE_KERNEL and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16,
                                                                      torch.int8)


# --- weight-only int8/int4 decoding (generate/quantize.py) ------------------------------

# fp32 activations go through blockformer's C kernels (csrc/int8_matmul.c, csrc/int4_matmul.c) at any
# number of rows: torch's int8 and int4 kernels are slower than the fp32 model with fp32 activations, and
# the dense path dequantizes every weight per call. On an AVX2-only EPYC, GPT-2-small decoding ran at
# 2.6-3.0x (int8) and 2.4-2.9x (int4) Hugging Face's fp32 (BENCHMARKS.md "Decode speed on an AVX2-only
# CPU"). From 5-8 rows the kernels widen a panel of 16 channels' weights to floats once for all the rows
# (csrc/rows.h): with it they ran 1.07-3.5x faster than the dense path on GPT-2 small's weights at 128 to
# 2048 fp32 rows on the AVX512-BF16 EPYC, and 1.06-3.3x capped at AVX2 (BENCHMARKS.md "Many rows through
# the weight-only kernels"). bf16 activations, widened to fp32 for the product, take the int8 kernel too on
# CPUs without AMX: on an AVX512-BF16 EPYC, GPT-2 small decoded with int8 weights at 86-105 tok/s
# compiled against 70-72 for torch's bf16 kernel, alternated in one hour; int4 went the other way (62-94
# against 91-120), so bf16 int4 keeps torch's kernel, as do AMX CPUs, where neither was measured
# (BENCHMARKS.md "Decoding on an AVX512-BF16 EPYC").
# bf16 rows past NATIVE_QUANTIZED_ROWS (int4) or BF16_INT8_NATIVE_ROWS (int8) take the dense path, a bf16
# matmul on the CPUs that pick bf16: on the AVX512-BF16 EPYC it overtook the int8 kernel between 32 and 64
# rows (0.72x at 64, 0.58x at 128) and the int4 one past 128 (1.17x at 128, 0.58x at 512).
NATIVE_QUANTIZED_ROWS = 128
BF16_INT8_NATIVE_ROWS = 32
# torch's packed bf16 int8/int4 CPU kernels beat a dense matmul only for this many rows. Past them, bf16
# rows widen to fp32 for the C kernels rather than take the dense path, which dequantizes the whole
# weight every call: a served GPT-2 small's int4 layers at 16 rows ran 4.6-4.7x faster that way on the
# AVX512-BF16 EPYC (BENCHMARKS.md "int8 weights against int8 activations").
TORCH_PACKED_MAX_ROWS = 4


def bf16_rows_in_c_kernels() -> bool:
    """Whether bf16 activations take the int8 C kernel: on CPUs without AMX."""
    return not cpu_has("_is_amx_tile_supported")


# Probed once, at import: a compiled decode step reads it as a constant (dynamo cannot call the probes).
INT8_BF16_IN_C = bf16_rows_in_c_kernels()


def native_quantized_matmul(dtype: torch.dtype, rows: int, bits: int) -> bool:
    """Whether a ``bits``-bit quantized layer's product of ``rows`` rows takes blockformer's C kernel:
    fp32 rows, any number; bf16 rows up to the limits above, past the few of torch's packed kernels,
    and int8 ones of fewer on CPUs without AMX."""
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16 or rows > (BF16_INT8_NATIVE_ROWS if bits == 8 else NATIVE_QUANTIZED_ROWS):
        return False
    return rows > TORCH_PACKED_MAX_ROWS or (bits == 8 and INT8_BF16_IN_C)


def a8_kernel_rows(dtype: torch.dtype, rows: int) -> bool:
    """Whether an a8 layer's product of ``rows`` rows takes its C kernel (``generate/quantize.py``'s
    ``RoundedActivations``) rather than the rounded rows times the dequantized weight. Any number in
    fp32: with their many-row path (8 channels to a vector) the kernels ran 1.4-10x faster than that
    dense product at 128 to 2048 rows on the AVX512-BF16 EPYC, native and capped at AVX2, and 1.1-6x
    against it in bf16 (``bench_quantized_rows.py``, BENCHMARKS.md "Many rows through the a8 kernels"). So
    bf16 rows, widened, go too where the int8 rule sends them to C (no AMX); on AMX CPUs, where a bf16
    dense product was not measured against them, only up to NATIVE_QUANTIZED_ROWS."""
    return dtype == torch.float32 or INT8_BF16_IN_C or rows <= NATIVE_QUANTIZED_ROWS


# --- precision "auto" (precision.py) -----------------------------------------------------


def native_bf16_cpu() -> bool:
    """``auto`` picks bf16 on a CPU with AMX or AVX512-BF16: elsewhere bf16 matmuls are emulated, many times
    slower than fp32 (BENCHMARKS.md "Kernel choices")."""
    return cpu_has("_is_amx_tile_supported") or cpu_has("_is_avx512_bf16_supported")
