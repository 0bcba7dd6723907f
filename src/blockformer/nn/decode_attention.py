"""One new token per row attending to every slot of its cache, through a small C kernel.

At an eager decode step on a CPU the keys and values come from memory: the weights that the
step streamed since the layer last ran have pushed them out of the caches. torch's SDPA read
them there at 10-19 GB/s on a 2-core Zen 4 EPYC; ``csrc/decode_attention.c`` reads each row of
keys and of values once, in order, prefetched ahead, at 20-24: 1.2-1.7x SDPA's speed at 80 to
1024 slots, and 1-7% of a GPT-2-small decode step (BENCHMARKS.md "Decode attention from a cache
that is not in the caches"). A cache kept in bf16 or fp16 under an fp32 model (``KVCache``'s
``dtype``, ``generate --kv-cache-dtype``) is read as it is, each value widened as it is loaded:
half the bytes, and no fp32 copy of the slots per layer. It takes SDPA's key mask where the step
has one, a row of slots per batch row: a left-padded batch, a source's padding in cross-attention,
the slots a compiled step has not written yet (it attends over the whole cache); a masked slot is
skipped unread. ``nn/attention.py`` takes it where ``kernels.decode_attention_kernel`` says so (fp32
queries, inference, eager, or compiled where the C++ operator is loaded). Where the kernel cannot
be built, SDPA runs as before.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import kernels, native


# What the kernel reads a cache of: its code for each dtype (csrc/decode_attention.c's `kv`)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


@functools.cache
def kernel():
    """The compiled ``decode_attention_f32``, or None where it cannot be built. Loading it also
    loads the C++ operators (``native.load_cpp_ops``), so that a step calls it without ctypes."""
    fn = native.function("decode_attention", "decode_attention_f32", 8, 18, ctypes.c_float)
    if fn is not None:
        native.load_cpp_ops()
    return fn


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale q k^T) v for ``q`` (B, H, 1, D) over the slots of ``k``, ``v`` (B, H_kv, S, D) that
    ``mask`` keeps (None: all of them; else bool (B or 1, 1, 1, S), SDPA's key mask), on the CPU, each
    slot's D values contiguous; (B, H, 1, D). ``q`` is fp32, ``k`` and ``v`` fp32, bf16, fp16 or int8
    (``KV_TYPES``); int8 codes are read as ``k * k_scale[..., None]`` with ``k_scale`` (B, H_kv, S) fp32,
    and ``v`` alike. A masked slot is not read; a row with none kept gives zeros. (B, H) pairs are split
    over torch's threads."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    threads = native.pieces(B * H)
    scores = torch.empty(threads * S)
    if mask is not None:
        mask = key_mask(mask, B, S)
    if (k.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale, v_scale: expected both with an int8 cache and neither otherwise")
    if k_scale is not None and (k_scale.shape != k.shape[:3] or k_scale.stride(-1) != 1 or v_scale.shape != v.shape[:3]
                                or v_scale.stride(-1) != 1 or {k_scale.dtype, v_scale.dtype} != {torch.float32}):
        raise ValueError(f"k_scale, v_scale: expected fp32 {tuple(k.shape[:3])}, each head's slots contiguous")
    kernel()(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(),
             None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
             out.data_ptr(), scores.data_ptr(), B, H, Hkv, S, D, *k.stride()[:3], *v.stride()[:3],
             0 if mask is None else mask.stride(0), *(k_scale.stride()[:2] if k_scale is not None else (0, 0)),
             *(v_scale.stride()[:2] if v_scale is not None else (0, 0)), threads, KV_TYPES[k.dtype], scale)
    return out


def key_mask(mask: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``mask`` (B or 1, 1, 1, S) bool as the kernel reads it: a row of S bytes per batch row, each
    row's slots contiguous (a broadcast row's batch stride is 0)."""
    if not kernels.is_key_mask(mask, B, S):
        raise ValueError(f"mask: {tuple(mask.shape)} {mask.dtype}; expected bool (B or 1, 1, 1, {S})")
    mask = mask[:, 0, 0]
    return (mask if mask.stride(-1) == 1 else mask.contiguous()).expand(B, S)
