"""Language-modelling windows from one long token array: random for training, fixed for evaluation.

The array is split contiguously (the first ``1 - val_fraction`` for training, the rest for
validation), as nanoGPT splits tinyshakespeare. Training windows depend only on the
``torch.Generator`` passed in, so a trainer that saves the generator's state resumes exactly.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..errors import UsageError
from .token_file import TokenFile


class LMDataset:
    """Windows ``x = tokens[i : i+T]`` and targets ``y = tokens[i+1 : i+T+1]`` of one split."""

    def __init__(self, tokens: np.ndarray | TokenFile, seq_len: int, split: str, val_fraction: float = 0.1):
        if split not in ("train", "val"):
            raise UsageError(f"split: {split!r}; expected 'train' or 'val'")
        if not 0.0 <= val_fraction < 1.0:
            raise UsageError(f"data.val_fraction: {val_fraction}; expected a number in [0, 1)")
        if seq_len < 1:
            raise UsageError(f"seq_len: {seq_len}; expected a positive integer")
        tokens = tokens.tokens if isinstance(tokens, TokenFile) else tokens
        n_train = int(len(tokens) * (1 - val_fraction))
        # A slice is a view: no copy of a memmap.
        self.tokens = tokens[:n_train] if split == "train" else tokens[n_train:]
        self.seq_len, self.split = seq_len, split
        if len(self.tokens) < seq_len + 1:
            raise UsageError(
                f"data: the {split} split has {len(self.tokens)} tokens, "
                f"fewer than seq_len + 1 = {seq_len + 1}; "
                "expected more text, a shorter seq_len or a different val_fraction"
            )

    def __len__(self) -> int:
        """Tokens in this split."""
        return len(self.tokens)

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = starts[:, None] + np.arange(self.seq_len + 1)  # (B, T+1)
        window = torch.from_numpy(self.tokens[index].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: long tensors ``x, y`` of shape ``(B, T)``, ``y`` shifted by one."""
        starts = torch.randint(len(self.tokens) - self.seq_len, (batch_size,), generator=generator)
        return self._windows(starts.numpy())

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows spread evenly over the split, the same every call.

        All of them when ``max_batches`` is None, else at most ``max_batches * batch_size``.
        """
        n_windows = (len(self.tokens) - 1) // self.seq_len
        k = n_windows if max_batches is None else min(n_windows, max_batches * batch_size)
        starts = (np.arange(k) * n_windows // k) * self.seq_len
        for i in range(0, k, batch_size):
            yield self._windows(starts[i : i + batch_size])
