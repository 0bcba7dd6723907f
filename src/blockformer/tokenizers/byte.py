"""Byte tokenizer: the UTF-8 bytes of the text, shifted past the four specials.

No training and no unknown tokens: every string of any language encodes, at the price of
longer sequences (a Chinese character is three bytes).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import numpy as np

from ..errors import UsageError
from .base import check_id_list, check_text, MARKER, NUM_SPECIALS, Tokenizer


class ByteTokenizer(Tokenizer):
    """Id ``4 + b`` for byte ``b``: 260 ids in all."""

    kind = "byte"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> ByteTokenizer:
        """Nothing to learn; ``vocab_size`` may only restate 260."""
        if vocab_size not in (None, NUM_SPECIALS + 256):
            raise UsageError(f"tokenizer.vocab_size: {vocab_size} for a byte tokenizer; expected 260/unset")
        return cls()

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIALS + 256

    def encode_array(self, text: str) -> np.ndarray:
        check_text(text)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + NUM_SPECIALS

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        # A sampled sequence may cut a character's bytes: show U+FFFD rather than fail.
        check_id_list(ids)
        data = bytes(i - NUM_SPECIALS for i in map(int, ids) if NUM_SPECIALS <= i < NUM_SPECIALS + 256)
        return data.decode("utf-8", errors="replace")

    def _vocab_description(self) -> Any:
        return 256

    def _to_json(self) -> str:
        return json.dumps({MARKER: self.kind, "version": 1}, indent=1)

    @classmethod
    def from_dict(cls, data: dict, source: str) -> ByteTokenizer:
        return cls()
