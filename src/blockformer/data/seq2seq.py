"""Sequence-to-sequence data: aligned line pairs, and the padded batch an encoder-decoder trains on.

Conventions (docs/CONTRACTS.md): ``src = ids + [eos]``, ``tgt_in = [bos] + ids`` (the target
shifted right, what the decoder reads), ``tgt_out = ids + [eos]`` (what it predicts),
padding ``pad = 0``; masks are bool with True on real tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import UsageError
from ..tokenizers import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from .sources import open_text

PairIds = tuple[Sequence[int], Sequence[int]]  # (source ids, target ids), no specials


def _read_lines(path: Path, expected: str = "one sentence per line") -> list[str]:
    """The lines of a UTF-8 text file (``.gz`` read directly); a missing, unreadable or
    empty file is a UsageError that says what was ``expected``."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file; expected {expected} (plain or .gz)")
    try:
        with open_text(path) as f:
            lines = [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not valid UTF-8 text; expected UTF-8") from None
    except (OSError, EOFError) as e:
        raise UsageError(f"{path}: cannot be read ({e})") from None
    if not lines:
        raise UsageError(f"{path}: empty file; expected {expected}")
    return lines


def read_pairs(src_path: str | Path, tgt_path: str | Path) -> list[tuple[str, str]]:
    """Line ``i`` of ``src_path`` with line ``i`` of ``tgt_path`` (``.gz`` read directly)."""
    src, tgt = _read_lines(Path(src_path)), _read_lines(Path(tgt_path))
    if len(src) != len(tgt):
        raise UsageError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
            "expected aligned files, one pair per line"
        )
    return list(zip(src, tgt))


def encode_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """Token ids of each (source, target) pair, without specials (batching adds them)."""
    src = tokenizer.encode_batch([s for s, _ in pairs])
    tgt = tokenizer.encode_batch([t for _, t in pairs])
    return list(zip(src, tgt))


@dataclass
class Seq2SeqBatch:
    """A padded batch: ``src, src_mask`` ``(B, S)``; ``tgt_in, tgt_out, tgt_mask`` ``(B, T)``."""

    src: torch.Tensor
    src_mask: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    tgt_mask: torch.Tensor
    num_tokens: int = -1  # real target tokens (the loss's denominator); counted once, on the CPU
    num_src_tokens: int = -1  # real source tokens (for tokens/s); likewise: no device sync per step

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = int(self.tgt_mask.sum())
        if self.num_src_tokens < 0:
            self.num_src_tokens = int(self.src_mask.sum())

    def __len__(self) -> int:
        return self.src.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Seq2SeqBatch:
        """The same batch with every tensor on ``device`` (``non_blocking`` from pinned memory
        when going to CUDA, so the copy overlaps the step still running there)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        moved = {
            f.name: _pinned(getattr(self, f.name), pin).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if f.name not in ("num_tokens", "num_src_tokens")
        }
        return Seq2SeqBatch(**moved, num_tokens=self.num_tokens, num_src_tokens=self.num_src_tokens)


def _pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return t.pin_memory() if pin and t.device.type == "cpu" else t


def collate_pairs(pairs: Sequence[PairIds]) -> Seq2SeqBatch:
    """Add the specials to each pair of ids and pad the batch with ``pad = 0``."""
    if not pairs:
        raise ValueError("collate_pairs: empty batch")
    src_len = np.array([len(s) + 1 for s, _ in pairs])  # + eos
    tgt_len = np.array([len(t) + 1 for _, t in pairs])  # + bos (in) or eos (out)
    src = np.full((len(pairs), src_len.max()), PAD_ID, dtype=np.int64)
    tgt_in = np.full((len(pairs), tgt_len.max()), PAD_ID, dtype=np.int64)
    tgt_out = tgt_in.copy()
    for b, (s, t) in enumerate(pairs):
        src[b, : len(s)], src[b, len(s)] = s, EOS_ID
        tgt_in[b, 0], tgt_in[b, 1 : len(t) + 1] = BOS_ID, t
        tgt_out[b, : len(t)], tgt_out[b, len(t)] = t, EOS_ID
    src_mask = np.arange(src.shape[1]) < src_len[:, None]
    tgt_mask = np.arange(tgt_in.shape[1]) < tgt_len[:, None]
    return Seq2SeqBatch(*map(torch.from_numpy, (src, src_mask, tgt_in, tgt_out, tgt_mask)))
