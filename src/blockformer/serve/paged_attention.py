"""Decode attention read straight from the paged pool, through a small C kernel.

A decoding row has one query and all its past as keys. Gathering those keys and values
through the block table into a copy and then running SDPA over the copy moves each byte
three times; at 64 rows of GPT-2-small that was a third of a step (BENCHMARKS.md "Paged
attention"). ``csrc/paged_attention.c`` reads each key and value once, where the block
table points, with the softmax in between, so its cost follows the cache's bytes. No
library ships such a kernel for the CPU and this torch (vLLM's CPU backend and IPEX carry
their own); ``native`` builds it at first use. A bf16 pool is read as it is, each value
widened to fp32 in the kernel; an int8 pool's codes too, each slot's scale applied once per
score and folded into each value's softmax weight. Where it cannot be built, decode attention
gathers and calls SDPA as the prefill chunks do.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native


# Each part of a row split between threads covers at least this many slots: over fewer, the merge
# and the threads' start would cost more than they save.
PART_SLOTS = 64


@functools.cache
def kernel(dtype: torch.dtype = torch.float32):
    """The compiled ``paged_decode_attention_f32`` (or ``_bf16``, ``_f16``, ``_i8`` for a bf16, fp16 or
    int8 pool), or None where it cannot be built."""
    name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int8: "i8"}[dtype]
    return native.function("paged_attention", f"paged_decode_attention_{name}", 10, 6, ctypes.c_float, ctypes.c_int64)


def decode_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, read: torch.Tensor,
                     mask: torch.Tensor, scale: float, out: torch.Tensor,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``out`` (rows, H, D) = attention of one query per row ``q`` (rows, H, D) over pool
    slots ``read`` (rows, S) where ``mask`` (rows, S) is True; pools (slots, H_kv, D), fp32, bf16,
    fp16 or int8 (its codes, with ``scales``: the keys' and the values' (slots, H_kv) fp32 scales),
    on the CPU. The kernel reads the pools as they are and works in fp32: ``q`` and ``out`` are
    converted where they are bf16. Rows are split over torch's threads; with fewer rows than threads,
    each row's slots are too (``PART_SLOTS`` at least a part), and the parts merged."""
    rows, H, D = q.shape
    S, Hkv = read.shape[1], pool_k.shape[1]
    parts = max(1, min(torch.get_num_threads() // rows, S // PART_SLOTS))
    threads = native.pieces(rows * parts)
    scratch = torch.empty(threads, H * S, dtype=torch.float32)  # each thread's scores
    partials = torch.empty(rows * parts, H * D + 2 * H, dtype=torch.float32) if parts > 1 else scratch
    q32 = q.to(torch.float32).contiguous()
    y = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(rows, H, D, dtype=torch.float32)
    ks, vs = (0, 0) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
    kernel(pool_k.dtype)(q32.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), ks, vs, read.data_ptr(),
                         mask.data_ptr(), y.data_ptr(), scratch.data_ptr(), partials.data_ptr(), rows, S, H, Hkv, D,
                         parts, scale, threads)
    if y is not out:
        out.copy_(y)
    return out
