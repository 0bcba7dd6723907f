"""Each data-parallel rank's slice of the global batch.

Every rank draws the same global batch (the same generator, seeded alike), then keeps the
rows ``[r * B / n, (r + 1) * B / n)``. The slices are disjoint and together the global
batch, so the batch, and the loss curve, do not depend on the number of ranks; a
resumed run needs only the generator's state, which is the same on every rank. Drawing
the indices of a whole batch costs nothing beside the forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..data.seq2seq import Seq2SeqBatch
from ..errors import UsageError


def rows_of(batch_size: int, rank: int, n: int) -> slice:
    """Rank ``rank``'s rows of a batch of ``batch_size`` split ``n`` ways (sizes differ by at most one)."""
    start, stop = rank * batch_size // n, (rank + 1) * batch_size // n
    return slice(start, stop)


def batch_rows(batch: Any) -> int:
    return len(batch) if isinstance(batch, Seq2SeqBatch) else batch[0].shape[0]


def shard_batch(batch: Any, rank: int, n: int) -> Any:
    """Rank ``rank``'s rows of ``batch`` (an ``(x, y)`` pair or a ``Seq2SeqBatch``), split ``n`` ways.

    A padded seq2seq batch keeps its width: padding changes no real token's loss, and
    equal shapes on every rank keep the computation identical to the unsplit batch.
    """
    if n == 1:
        return batch
    size = batch_rows(batch)
    if size < n:
        raise UsageError(f"train.batch_size: a batch of {size} rows cannot be split over {n} data-parallel "
                         f"ranks; expected at least {n} rows per batch (raise batch_size or max_tokens)")
    rows = rows_of(size, rank, n)
    if isinstance(batch, Seq2SeqBatch):
        # The tensors' rows; the token counts (ints) are counted again for the shard.
        parts = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        return Seq2SeqBatch(**{k: v[rows] for k, v in parts.items() if isinstance(v, torch.Tensor)})
    parts = [t[rows] if isinstance(t, torch.Tensor) else None for t in batch]  # host counts: counted again
    return type(batch)(*parts) if hasattr(batch, "_fields") else tuple(parts)
