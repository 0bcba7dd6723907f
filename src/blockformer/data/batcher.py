"""Sequence-to-sequence batches by token count, with length bucketing (Vaswani et al. 2017, 5.1:
"sentence pairs were batched together by approximate sequence length").

Each epoch the pairs are shuffled, cut into large chunks, sorted by length within each chunk
and packed greedily so a batch's padded size ``B * max_len`` stays within ``max_tokens``;
then the batches are shuffled. Everything follows from ``(seed, epoch)``, and the position
``(epoch, index)`` is all a trainer must save to resume with the identical next batch.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import UsageError
from .buckets import bucket_of, pad_to_shape
from .seq2seq import PairIds, Seq2SeqBatch, collate_pairs


class TokenBatcher:
    """Batches of ``pairs_ids`` (source ids, target ids; no specials), at most ``max_tokens`` padded.

    ``max_len`` limits source and target lengths: longer pairs are dropped, or clipped with
    ``overlong="clip"``. ``max_sentences`` caps pairs per batch. ``chunk_batches`` sets the
    bucketing chunk, in batches' worth of pairs: larger sorts more globally (less padding),
    smaller mixes lengths more. ``buckets`` (lengths, see ``data.buckets``) packs and pads
    every batch to one of a few fixed shapes, ``(max_tokens // bucket, bucket)``, for a
    compiled training step.
    """

    def __init__(
        self,
        pairs_ids: Sequence[PairIds],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        max_len: int | None = None,
        overlong: str = "drop",
        max_sentences: int | None = None,
        chunk_batches: int = 100,
        buckets: list[int] | None = None,
    ):
        if overlong not in ("drop", "clip"):
            raise UsageError(f"data.overlong: {overlong!r}; expected 'drop' or 'clip'")
        pairs = list(pairs_ids)
        if max_len is not None and overlong == "clip":
            pairs = [(s[:max_len], t[:max_len]) for s, t in pairs]
        elif max_len is not None:
            pairs = [(s, t) for s, t in pairs if len(s) <= max_len and len(t) <= max_len]
        self.num_dropped = len(pairs_ids) - len(pairs)
        if not pairs:
            raise UsageError(
                f"data: no sentence pairs left to batch (max_len={max_len} dropped {self.num_dropped}); "
                "expected some pairs"
            )
        self.pairs = pairs
        # Padded length of a pair in either tensor: its longer side plus eos (or bos).
        self.lengths = np.array([max(len(s), len(t)) + 1 for s, t in pairs])
        self.buckets = buckets
        # What packing counts per pair: its length, or its bucket's when shapes are fixed.
        self.pack_lengths = self.lengths
        if buckets:
            self.pack_lengths = np.array([bucket_of(n, buckets) for n in self.lengths])
        longest = int(self.pack_lengths.max())
        if max_tokens < longest:
            raise UsageError(
                f"batch.max_tokens: {max_tokens} is below the longest pair ({longest} tokens); "
                f"expected >= {longest}, or set max_len"
            )
        self.max_tokens, self.shuffle, self.seed = max_tokens, shuffle, seed
        self.max_sentences = max_sentences
        self.chunk = max(1, chunk_batches * max_tokens // int(self.lengths.mean()))
        self.epoch, self.index = 0, 0  # the next batch is batch `index` of epoch `epoch`
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def batch_indices(self, epoch: int) -> list[np.ndarray]:
        """The pairs (indices into ``self.pairs``) of each batch of ``epoch``, in order."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.pairs)) if self.shuffle else np.arange(len(self.pairs))
        batches: list[np.ndarray] = []
        for c in range(0, len(order), self.chunk):
            chunk = order[c : c + self.chunk]
            batches.extend(self._pack(chunk[np.argsort(self.lengths[chunk], kind="stable")]))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cached = (epoch, batches)
        return batches

    def _pack(self, ordered: np.ndarray) -> list[np.ndarray]:
        """Greedy packing of pairs sorted by length: the newest pair is always the longest."""
        batches, start = [], 0
        cap = self.max_sentences or len(ordered)
        for j, length in enumerate(self.pack_lengths[ordered].tolist()):
            if (j - start + 1) * length > self.max_tokens or j - start >= cap:
                batches.append(ordered[start:j])
                start = j
        batches.append(ordered[start:])
        return batches

    def _collate(self, indices: np.ndarray) -> Seq2SeqBatch:
        batch = collate_pairs([self.pairs[i] for i in indices])
        if not self.buckets:
            return batch
        length = int(self.pack_lengths[indices].max())
        rows = self.max_tokens // length
        return pad_to_shape(batch, min(rows, self.max_sentences or rows), length)

    def num_batches(self, epoch: int) -> int:
        return len(self.batch_indices(epoch))

    def batches(self, epoch: int | None = None) -> Iterator[Seq2SeqBatch]:
        """The batches of ``epoch`` (default: the current one), from the saved position if resuming it."""
        epoch = self.epoch if epoch is None else epoch
        start = self.index if epoch == self.epoch else 0
        order = self.batch_indices(epoch)
        self.epoch, self.index = epoch, start
        for k in range(start, len(order)):
            self.index = k + 1  # counted before the yield: a checkpoint taken now resumes after it
            yield self._collate(order[k])
        self.epoch, self.index = epoch + 1, 0

    def stream(self) -> Iterator[Seq2SeqBatch]:
        """Batches forever, epoch after epoch, from the current position."""
        while True:
            yield from self.batches()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_pairs": len(self.pairs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_pairs") != len(self.pairs) or state.get("seed") != self.seed:
            raise UsageError(
                f"resume: the batcher state is for {state.get('num_pairs')} pairs with seed "
                f"{state.get('seed')}; "
                f"this data has {len(self.pairs)} pairs with seed {self.seed}"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
