"""What every tokenizer shares: the four special ids, batch encoding and the fingerprint.

Special ids are the same for every kind (``pad=0, bos=1, eos=2, unk=3``), so the trainer,
the generator and the loss can use them without asking which tokenizer made the ids.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..schema import kind_of

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # names of ids 0..3, in that order
NUM_SPECIALS = len(SPECIAL_TOKENS)
FILE_NAME = "tokenizer.json"
MARKER = "blockformer_tokenizer"  # key that marks a char/byte tokenizer.json as ours


def check_text(text: object, name: str = "text") -> None:
    """``encode`` takes a ``str``: bytes are decoded first, and a list goes to ``encode_batch``."""
    if not isinstance(text, str):
        hint = " (bytes: .decode('utf-8') first)" if isinstance(text, bytes) else \
            " (many texts: encode_batch)" if isinstance(text, (list, tuple)) else ""
        raise TypeError(f"{name}: {kind_of(text)}; expected a str{hint}")


def check_texts(texts: object) -> None:
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: {kind_of(texts)}; expected a list of str (one text: encode)")
    for i, t in enumerate(texts):
        check_text(t, f"texts[{i}]")


def check_id_list(ids: object) -> None:
    """``decode`` takes an iterable of ids; a string is text already. Only the container is
    checked: ``decode`` runs once per generated token (TextStream)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids: {kind_of(ids)}; expected a list of token ids")


class Tokenizer(ABC):
    """Text <-> token ids. ``encode`` adds no specials; ``decode`` skips them."""

    kind: str
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included: every id is in ``range(vocab_size)``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without specials."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; specials and ids outside the vocabulary are skipped."""

    @abstractmethod
    def _vocab_description(self) -> Any:
        """A JSON-serialisable value that determines the encoding: hashed by ``fingerprint``."""

    @abstractmethod
    def _to_json(self) -> str:
        """The contents of ``tokenizer.json``."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` for many texts (BPE encodes them in parallel)."""
        check_texts(texts)
        return [self.encode(t) for t in texts]

    def fingerprint(self) -> str:
        """A stable hash of the vocabulary: a checkpoint stores it to detect a different tokenizer."""
        blob = json.dumps([self.kind, self._vocab_description()], ensure_ascii=False, sort_keys=True)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.json`` (creating the directory) and return its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / FILE_NAME
        path.write_text(self._to_json(), encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, fingerprint={self.fingerprint()!r})"
