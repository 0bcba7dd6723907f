"""Continuous signals: JapaneseVowels, sequences of real-valued frames of variable length.

Nine male speakers each uttered the vowels /ae/; every utterance is a sequence of 7 to 29
frames of 12 LPC cepstral coefficients (Kudo, Toyama and Shimbo 1999; UCI, and the UEA
multivariate time-series archive). The task: which of the 9 speakers is talking. The
archive's split is used as shipped by ``sktime`` (no download): 270 training utterances
(30 per speaker) and 370 test ones; 10% of the training ones (stratified,
``random_state=0``) are held out for validation, leaving 243.

Frames are standardised with the training frames' per-coefficient mean and deviation, and
a batch is right-padded with zeros and a mask of the real frames (``pad_frames``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import UsageError

SPLITS = ("train", "val", "test")
N_COEFFICIENTS = 12


@functools.lru_cache(maxsize=1)
def _vowels() -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
    try:
        from sklearn.model_selection import train_test_split  # noqa: PLC0415
        from sktime.datasets import load_japanese_vowels  # noqa: PLC0415
    except ImportError:
        raise UsageError("data.dataset='japanese-vowels' needs sktime, which ships the data: "
                         "pip install 'blockformer[data]'") from None

    def load(split: str) -> tuple[list[np.ndarray], np.ndarray]:
        X, y = load_japanese_vowels(split=split)  # nested frame: one column per coefficient
        series = [np.stack([np.asarray(X.iloc[i, j], dtype=np.float32) for j in range(X.shape[1])], axis=1)
                  for i in range(len(X))]  # (T_i, 12) each
        return series, np.asarray(y).astype(np.int64) - 1  # speakers 1..9 -> 0..8

    train_all, y_all = load("train")
    test, y_test = load("test")
    rows_train, rows_val = train_test_split(np.arange(len(y_all)), test_size=0.1, stratify=y_all, random_state=0)
    rows_train, rows_val = np.sort(rows_train), np.sort(rows_val)
    frames = np.concatenate([train_all[i] for i in rows_train])
    mean, std = frames.mean(0), frames.std(0) + 1e-6

    def norm(series: list[np.ndarray], rows) -> list[np.ndarray]:
        return [(series[i] - mean) / std for i in rows]

    return {
        "train": (norm(train_all, rows_train), y_all[rows_train]),
        "val": (norm(train_all, rows_val), y_all[rows_val]),
        "test": (norm(test, range(len(test))), y_test),
    }


def load_vowels_split(split: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(standardised series, each (T_i, 12), speaker ids 0..8) of ``split``: train, val or test."""
    if split not in SPLITS:
        raise UsageError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    series, labels = _vowels()[split]
    return [torch.from_numpy(s) for s in series], torch.from_numpy(labels)


def pad_frames(series: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Series (T_i, F) -> (B, T_max, F) right-padded with zeros, and the mask (B, T_max) of real frames."""
    T = max(s.shape[0] for s in series)
    batch = torch.zeros(len(series), T, series[0].shape[1])
    mask = torch.zeros(len(series), T, dtype=torch.bool)
    for b, s in enumerate(series):
        batch[b, : s.shape[0]], mask[b, : s.shape[0]] = s, True
    return batch, mask
