"""Objectives for inputs that are arrays, not token ids: images and continuous signals.

The data sets (``data.dataset``: ``digits``, ``digit-strings``, ``japanese-vowels``) and
their batches live in ``data/arrays.py``; here are the objectives that train on them:

- ``ArrayHead``: a class per image or utterance, through a task head, trained on batches
  augmented with the objective's own generator;
- ``ImageToText``: an encoder-decoder reads the patches of a digit string and writes it;
  exact match is measured by greedy decoding through the generation code and its KV cache.

Both follow ``TaskHead``'s and ``Seq2Seq``'s interface, so the loop, checkpoints, metrics
and ``eval`` work as for text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data.arrays import DigitStrings
from ..data.images import pad_images
from ..data.labelled import LabelledBatch
from ..generate import beam_search, greedy_decode
from .classify import TaskHead
from .objective import Seq2Seq

if TYPE_CHECKING:
    from ..data.describe import TaskData


# ---------------------------------------------------------------------- classification
class ArrayHead(TaskHead):
    """``TaskHead`` whose training batches are augmented with the objective's own generator
    (saved with the checkpoint, so a resumed run draws the same shifts); ``from_data`` is
    ``TaskHead``'s."""

    def next_batch(self) -> LabelledBatch:
        rows = torch.randint(len(self.train), (self.batch_size,), generator=self.generator).tolist()
        return self.train.batch(rows, self.generator).to(self.device, non_blocking=True)


# ---------------------------------------------------------------------- image -> text
class ImageToText(Seq2Seq):
    """``Seq2Seq`` on digit-string images: loss on fixed held-out batches, and exact match
    of the greedy decoding of the held-out images."""

    def __init__(self, train: DigitStrings, val: DigitStrings, n_heldout: int, device: torch.device,
                 seed: int = 0) -> None:
        images, texts = val.heldout(n_heldout)
        B = train.batch_size
        val_batches = [val.collate(images[i : i + B], texts[i : i + B]) for i in range(0, len(texts), B)]
        self.train, self.val_batches, self.device = train, val_batches, device
        self.heldout_images, self.heldout_texts = images, texts
        self.task, self.tokenizer = "digit-strings", train.tokenizer
        self.generator = torch.Generator().manual_seed(seed)
        self._stream = None  # batches are drawn with the generator (Seq2Seq's state handling)
        self.buckets = None  # images come in one shape; only text targets would need buckets

    @classmethod
    def from_data(cls, data: TaskData, device: torch.device) -> ImageToText:
        b = data.batches
        return cls(b.train, b.val, b.heldout, device, seed=data.config.train.seed)

    @torch.no_grad()
    def exact_match(self, model: nn.Module, n: int, batch_size: int = 64) -> float:
        predictions = decode_images(model, self.tokenizer, self.heldout_images[:n], self.train.patch_size, batch_size)
        truth = self.heldout_texts[:n]
        return sum(p == t for p, t in zip(predictions, truth)) / max(len(truth), 1)


def decode_images(model: nn.Module, tokenizer: Any, images: list[torch.Tensor], patch_size: int,
                  batch_size: int = 64, beam: int = 1) -> list[str]:
    """The text an image-to-text encoder-decoder writes for each image (greedy, or beam
    search with ``beam`` > 1), through the KV cache; at most 2 tokens per patch column."""

    out = []
    for i in range(0, len(images), batch_size):
        src, mask = pad_images(images[i : i + batch_size], patch_size)
        limit = src.shape[-1] // patch_size * 2 + 1
        if beam > 1:
            ids = [h[0].tokens for h in beam_search(model, src, mask, beam_size=beam, max_len=limit)]
        else:
            ids = greedy_decode(model, src, mask, max_len=limit)
        out.extend(tokenizer.decode(row) for row in ids)
    return out
