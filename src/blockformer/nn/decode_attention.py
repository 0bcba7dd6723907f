"""One new token per row attending to every slot of its cache, through a small C kernel.

At an eager decode step on a CPU the keys and values come from memory: the weights that the
step streamed since the layer last ran have pushed them out of the caches. torch's SDPA read
them there at 10-19 GB/s on a 2-core Zen 4 EPYC; ``csrc/decode_attention.c`` reads each row of
keys and of values once, in order, prefetched ahead, at 20-24: 1.2-1.7x SDPA's speed at 80 to
1024 slots, and 1-7% of a GPT-2-small decode step (BENCHMARKS.md "Decode attention from a cache
that is not in the caches"). A cache kept in bf16 or fp16 under an fp32 model (``KVCache``'s
``dtype``, ``generate --kv-cache-dtype``) is read as it is, each value widened as it is loaded:
half the bytes, and no fp32 copy of the slots per layer. It has no mask: ``nn/attention.py`` takes it only
where the step's mask would be all True (``KVCache.sees_every_slot``), and only where
``kernels.decode_attention_kernel`` says so (fp32, inference, eager). Where the kernel cannot
be built, SDPA runs as before.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native


# What the kernel reads a cache of: its code for each dtype (csrc/decode_attention.c's `kv`)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def kernel():
    """The compiled ``decode_attention_f32``, or None where it cannot be built. Loading it also
    loads the C++ operators (``native.load_cpp_ops``), so that a step calls it without ctypes."""
    fn = native.function("decode_attention", "decode_attention_f32", 5, 13, ctypes.c_float)
    if fn is not None:
        native.load_cpp_ops()
    return fn


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v for ``q`` (B, H, 1, D) over every slot of ``k``, ``v`` (B, H_kv, S, D),
    on the CPU, each slot's D values contiguous; (B, H, 1, D). ``q`` is fp32, ``k`` and ``v`` fp32, bf16
    or fp16 (``KV_TYPES``). (B, H) pairs are split over torch's threads."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    threads = native.pieces(B * H)
    scores = torch.empty(threads * S)
    kernel()(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), scores.data_ptr(), B, H, Hkv, S, D,
             *k.stride()[:3], *v.stride()[:3], threads, KV_TYPES[k.dtype], scale)
    return out
