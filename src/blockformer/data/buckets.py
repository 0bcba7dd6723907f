"""A small fixed set of padded batch shapes, so a compiled training step never recompiles.

Length-bucketed batches come in as many shapes as there are (batch size, source length,
target length) triples; ``torch.compile`` with static shapes would trace each anew. Padding
every batch up to one of a few bucket lengths (about 1.5x apart, so at most a third of a
batch is padding) and a fixed number of rows per bucket leaves as many shapes as buckets:
each is compiled once, in the first steps, and replayed after. Padded rows have no real
token: the attention masks hide them and the loss ignores their ``pad`` targets.
"""

from __future__ import annotations

import torch

from ..tokenizers import PAD_ID
from .seq2seq import Seq2SeqBatch

_SMALLEST = 16


def length_buckets(max_len: int) -> list[int]:
    """Bucket lengths up to ``max_len``: 16, 24, 32, 48, 64, 96, ... and ``max_len`` itself."""
    buckets, n = [], _SMALLEST
    while n < max_len:
        buckets.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3  # 16 -> 24 -> 32 -> 48 -> 64 ...
    return [*buckets, max_len]


def bucket_of(length: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``length`` (the largest, if none does)."""
    for b in buckets:
        if length <= b:
            return b
    return buckets[-1]


def pad_to_shape(batch: Seq2SeqBatch, rows: int, length: int) -> Seq2SeqBatch:
    """``batch`` padded to ``rows`` sequences of ``length`` tokens, source and target alike."""
    B, S = batch.src.shape
    T = batch.tgt_in.shape[1]
    if B > rows or max(S, T) > length:
        raise ValueError(f"pad_to_shape: a ({B}, {S}/{T}) batch does not fit ({rows}, {length})")

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        out = torch.full((rows, length), value, dtype=t.dtype, device=t.device)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    return Seq2SeqBatch(
        pad(batch.src, PAD_ID), pad(batch.src_mask, False), pad(batch.tgt_in, PAD_ID),
        pad(batch.tgt_out, PAD_ID), pad(batch.tgt_mask, False),
        num_tokens=batch.num_tokens, num_src_tokens=batch.num_src_tokens,
    )


def pad_to_bucket(batch: Seq2SeqBatch, buckets: list[int], rows: int) -> Seq2SeqBatch:
    """Pad to the bucket of the batch's longer side, and to ``rows`` sequences."""
    length = max(batch.src.shape[1], batch.tgt_in.shape[1])
    return pad_to_shape(batch, rows, bucket_of(length, buckets))
