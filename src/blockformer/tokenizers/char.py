"""Character tokenizer: one id per Unicode code point seen in the training texts.

The smallest vocabulary that still spells every training text exactly: the shape of
char-rnn and nanoGPT's Shakespeare runs, and of the synthetic tasks.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Iterable

import numpy as np

from ..errors import UsageError
from .base import check_id_list, check_text, MARKER, NUM_SPECIALS, UNK_ID, Tokenizer


class CharTokenizer(Tokenizer):
    """Ids ``4..`` are the sorted characters; a character outside the vocabulary encodes as ``unk``."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = sorted(set(chars))
        bad = [c for c in chars if len(c) != 1]
        if bad:
            raise UsageError(f"char tokenizer: {bad[0]!r} is not one character; expected single code points")
        self.chars: list[str] = chars
        # Sorted single-character strings sort by code point, so `_codes` is sorted too.
        self._codes = np.array([ord(c) for c in chars], dtype=np.uint32)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> CharTokenizer:
        """Every character of ``texts``, or the ``vocab_size - 4`` most frequent ones."""
        if vocab_size is None:
            seen: set[str] = set()
            for text in texts:
                seen.update(text)
            return cls(seen)
        if vocab_size <= NUM_SPECIALS:
            raise UsageError(
                f"tokenizer.vocab_size: {vocab_size} leaves no room for characters; expected > {NUM_SPECIALS}"
            )
        counts: collections.Counter[str] = collections.Counter()
        for text in texts:
            counts.update(text)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # ties: by character, for determinism
        return cls(c for c, _ in ranked[: vocab_size - NUM_SPECIALS])

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIALS + len(self.chars)

    def encode_array(self, text: str) -> np.ndarray:
        check_text(text)
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        if len(self._codes) == 0:
            return np.full(len(codes), UNK_ID, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._codes, codes), len(self._codes) - 1)
        return np.where(self._codes[pos] == codes, pos + NUM_SPECIALS, UNK_ID).astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        check_id_list(ids)
        chars, n = self.chars, len(self.chars)
        return "".join(chars[i - NUM_SPECIALS] for i in map(int, ids) if 0 <= i - NUM_SPECIALS < n)

    def _vocab_description(self) -> Any:
        return self.chars

    def _to_json(self) -> str:
        data = {MARKER: self.kind, "version": 1, "chars": self.chars}
        return json.dumps(data, ensure_ascii=False, indent=1)

    @classmethod
    def from_dict(cls, data: dict, source: str) -> CharTokenizer:
        chars = data.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) for c in chars):
            raise UsageError(f"{source}: char tokenizer without a 'chars' list of strings")
        return cls(chars)
