"""Train a tokenizer by kind, or load one from a ``tokenizer.json`` (ours or Hugging Face's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer

from ..errors import UsageError
from ..textformats import loads_json
from ..schema import kind_of
from .base import FILE_NAME, MARKER, Tokenizer
from .bpe import BPETokenizer
from .byte import ByteTokenizer
from .char import CharTokenizer

TOKENIZERS: dict[str, type] = {"char": CharTokenizer, "byte": ByteTokenizer, "bpe": BPETokenizer}


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int | None = None) -> Tokenizer:
    """A ``char``, ``byte`` or ``bpe`` tokenizer fitted to ``texts``.

    ``vocab_size`` counts the four specials: for ``char`` it caps the vocabulary at the most
    frequent characters, for ``bpe`` it is the target size (default 4096), ``byte`` is 260.
    """
    if kind not in TOKENIZERS:
        raise UsageError(f"tokenizer.kind: unknown kind {kind!r}; expected one of {', '.join(TOKENIZERS)}")
    if isinstance(texts, str):  # one text, not an iterable of one-character texts
        texts = [texts]
    if isinstance(texts, bytes) or not hasattr(texts, "__iter__"):
        raise TypeError(f"texts: {kind_of(texts)}; expected an iterable of str")
    return TOKENIZERS[kind].train(texts, vocab_size)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in ``path``: a ``tokenizer.json`` or a directory (e.g. a checkpoint) holding one."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path: {kind_of(path)}; expected a path to a {FILE_NAME} or a directory holding one")
    path = Path(path)
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"{file}: tokenizer not found; expected a {FILE_NAME} or a directory containing one")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{file}: not UTF-8 text; expected a {FILE_NAME}") from None
    if not text.strip():
        raise UsageError(f"{file}: empty file; expected a {FILE_NAME}")
    try:
        data = loads_json(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{file}: invalid JSON ({e.msg}, line {e.lineno}); expected a {FILE_NAME}") from None
    if isinstance(data, dict) and MARKER in data:
        kind = data[MARKER]
        if kind not in ("char", "byte"):
            raise UsageError(f"{file}: unknown {MARKER} kind {kind!r}; expected char or byte")
        if data.get("version", 1) != 1 or isinstance(data.get("version"), bool):
            raise UsageError(f"{file}: version {data['version']!r} of the {kind} tokenizer format; "
                             f"expected 1 (the only version this blockformer reads)")
        return TOKENIZERS[kind].from_dict(data, str(file))
    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception
        raise UsageError(f"{file}: not a tokenizer the `tokenizers` package can read ({e})") from None
    return BPETokenizer(hf, source=str(file))
