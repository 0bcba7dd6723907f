"""A corpus tokenised once into a flat binary file, then memory-mapped (as nanoGPT's ``train.bin``).

Documents are joined with ``eos``. The file is named by a hash of the text and the
tokenizer's fingerprint, so a second run with the same inputs reuses it without
re-tokenising, and a changed corpus or tokenizer gets a new file. It is written to a
temporary name and renamed, so a crash never leaves a half-written file under the real name.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import UsageError
from ..tokenizers import EOS_ID, Tokenizer
from .sources import PIECE_CHARS, Spec, iter_pieces

MAGIC = b"BFTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ16s")  # magic, version, itemsize, count, vocab_size, fingerprint
HEADER_SIZE = 64  # data starts here
BATCH_CHARS = 4 * PIECE_CHARS  # characters handed to the tokenizer at once


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32: half the disk and page cache for most vocabularies."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def _reader(source: Spec | Iterable[str], max_bytes: int | None) -> Callable[[], Iterator[tuple[str, bool]]]:
    """A function returning a fresh ``(piece, starts_document)`` iterator each call (read twice)."""
    if isinstance(source, (str, os.PathLike, list, tuple)):
        return lambda: iter_pieces(source, max_bytes)
    texts = list(source)  # in-memory documents: a one-shot iterator is kept for the second pass
    return lambda: ((text, True) for text in texts)


def build_token_file(
    source: Spec | Iterable[str],
    tokenizer: Tokenizer,
    cache_dir: str | Path,
    max_bytes: int | None = None,
) -> Path:
    """Tokenise ``source`` into ``cache_dir/tokens-<hash>.bin`` (or reuse it) and return its path.

    ``source`` is a spec (a path, glob or ``"stdlib"``, or a list or tuple of them: see
    ``sources``) or any other iterable of document strings, e.g. a generator.
    ``max_bytes`` caps how much of a spec is read.
    """
    pieces = _reader(source, max_bytes)
    digest = hashlib.sha256(f"blockformer-tokens-v{VERSION}:{tokenizer.fingerprint()}".encode())
    for text, starts in pieces():
        digest.update(b"\xff" if starts else b"")  # 0xff never occurs in UTF-8: a document boundary
        digest.update(text.encode("utf-8"))
    cache_dir = Path(cache_dir)
    path = cache_dir / f"tokens-{digest.hexdigest()[:24]}.bin"
    if path.is_file():
        if check_token_file(path) is None:
            return path
        path.unlink()  # truncated or damaged (e.g. a copy cut short): rebuilt below
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=path.name + ".", suffix=".tmp")
    except OSError as e:
        raise UsageError(f"{cache_dir}: cannot write the token cache there ({e.strerror}); expected a writable "
                         f"directory (set data.cache_dir or $BLOCKFORMER_CACHE)") from None
    try:
        with os.fdopen(fd, "wb") as f:
            count = _write_tokens(f, pieces(), tokenizer)
            f.seek(0)
            f.write(_header(tokenizer, count))
            f.flush()
            os.fsync(f.fileno())
        if count == 0:
            raise UsageError("data: the source gave no tokens; expected some text")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def check_token_file(path: str | Path) -> str | None:
    """None if ``path`` is a whole token file (header, and exactly the bytes its count
    says); else what is wrong with it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        return f"cannot open it ({e.strerror})"
    if len(raw) < HEADER.size or raw[:8] != MAGIC:
        return "not a blockformer token file"
    _, version, itemsize, count, _, _ = HEADER.unpack(raw)
    if version != VERSION:
        return f"token file version {version}, expected {VERSION}"
    expected = HEADER_SIZE + count * itemsize
    if itemsize not in (2, 4) or size != expected:
        return f"{size} bytes where its header promises {expected} (truncated or damaged)"
    return None


def _header(tokenizer: Tokenizer, count: int) -> bytes:
    itemsize = token_dtype(tokenizer.vocab_size).itemsize
    fields = (MAGIC, VERSION, itemsize, count, tokenizer.vocab_size, tokenizer.fingerprint().encode("ascii"))
    return HEADER.pack(*fields).ljust(HEADER_SIZE, b"\0")


def _write_tokens(f, pieces: Iterator[tuple[str, bool]], tokenizer: Tokenizer) -> int:
    """Stream the tokens of ``pieces`` after the header, in batches; return how many."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([EOS_ID], dtype=dtype).tobytes()
    f.write(b"\0" * HEADER_SIZE)
    count, n_docs = 0, 0
    batch: list[tuple[str, bool]] = []
    size = 0

    def flush() -> None:
        nonlocal count, n_docs
        for ids, (_, starts) in zip(tokenizer.encode_batch([text for text, _ in batch]), batch):
            if starts and n_docs > 0:
                f.write(eos)
                count += 1
            n_docs += starts
            f.write(np.asarray(ids, dtype=dtype).tobytes())
            count += len(ids)
        batch.clear()

    for text, starts in pieces:
        batch.append((text, starts))
        size += len(text)
        if size >= BATCH_CHARS:
            flush()
            size = 0
    flush()
    return count


class TokenFile:
    """A token file opened as a read-only ``numpy.memmap`` (``.tokens``); pages load on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                raw = f.read(HEADER.size)
        except OSError as e:
            raise UsageError(f"{self.path}: cannot open token file ({e.strerror})") from None
        if len(raw) < HEADER.size or raw[:8] != MAGIC:
            raise UsageError(f"{self.path}: not a blockformer token file; expected one from build_token_file")
        _, version, itemsize, count, self.vocab_size, fingerprint = HEADER.unpack(raw)
        if version != VERSION:
            raise UsageError(f"{self.path}: token file version {version}; expected {VERSION} (delete it)")
        problem = check_token_file(self.path)
        if problem is not None:
            raise UsageError(f"{self.path}: {problem}; delete it to rebuild it")
        self.fingerprint = fingerprint.decode("ascii")
        dtype = np.dtype(np.uint16 if itemsize == 2 else np.uint32)
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]

    def __array__(self, dtype=None, copy=None):
        return self.tokens if dtype is None else self.tokens.astype(dtype)
