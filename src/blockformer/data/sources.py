"""Where language-modelling text comes from: files, directories, globs, and the built-in ``stdlib``.

A spec is a path to a file (``.gz`` is read directly), a directory (every text file below
it, recursively), a glob pattern, the name ``stdlib``, or a list of these. Each file is one
document. Files are read in pieces of about a megabyte, cut at line ends, so a corpus larger
than memory can be tokenised; ``iter_texts`` joins the pieces back into whole documents.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import sysconfig
from pathlib import Path
from typing import IO, Iterator, Sequence, Union

from ..errors import UsageError

Spec = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

STDLIB = "stdlib"
PIECE_CHARS = 1 << 20  # characters read at a time
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_GLOB_CHARS = set("*?[")


def stdlib_dir() -> Path:
    """The running Python's standard-library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def open_text(path: Path) -> IO[str]:
    """``path`` as UTF-8 text (a leading BOM dropped), decompressing ``.gz``."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KB, git's test for binary content."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except (OSError, EOFError):
        return True


def _walk(directory: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files below ``directory`` in a fixed (sorted) order, skipping hidden and test/package dirs."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.startswith(".") and (suffix is None or name.endswith(suffix)):
                yield Path(root) / name


def resolve(spec: Spec) -> list[tuple[Path, str]]:
    """The files of ``spec`` in reading order, each with how it was found: "file", "walk" or "stdlib".

    An explicitly named file must be non-empty text; files found by a directory walk or a
    glob are skipped when empty or binary, but each walk must find some text. Any file that
    is not UTF-8 is an error, except in ``stdlib``, where it is skipped.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise UsageError("data: empty list of sources; expected files, directories, globs or 'stdlib'")
    files: list[tuple[Path, str]] = []
    for item in items:
        text, origin = os.fspath(item), "walk"
        if text == STDLIB:
            found, origin = list(_walk(stdlib_dir(), ".py")), STDLIB
            where = f"{STDLIB} ({stdlib_dir()})"
        elif Path(text).is_file():
            files.append((Path(text), "file"))
            continue
        elif Path(text).is_dir():
            found = [p for p in _walk(Path(text)) if not _looks_binary(p)]
            where = f"directory {text}"
        elif _GLOB_CHARS & set(text):
            found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
            where = f"glob {text}"
        else:
            raise UsageError(f"{text}: no such file or directory; expected a file, directory, glob, 'stdlib'")
        found = [p for p in found if p.stat().st_size > 0]
        if not found:
            raise UsageError(f"{where}: matched no non-empty text files")
        files.extend((p, origin) for p in found)
    return files


def _file_pieces(path: Path, strict: bool) -> Iterator[str]:
    """``path`` in pieces of about PIECE_CHARS characters, each ending at a line end."""
    try:
        with open_text(path) as f:
            while piece := f.read(PIECE_CHARS):
                yield piece + f.readline(PIECE_CHARS)  # to the line end (within reason)
    except UnicodeDecodeError:
        if strict:
            raise UsageError(f"{path}: not valid UTF-8 text; expected UTF-8") from None
    except (OSError, EOFError) as e:  # unreadable, or a corrupt .gz
        raise UsageError(f"{path}: cannot be read ({e})") from None


def iter_pieces(spec: Spec, max_bytes: int | None = None) -> Iterator[tuple[str, bool]]:
    """``(text, starts_document)`` pieces of every document of ``spec``, in order.

    ``max_bytes`` caps the UTF-8 size read in all; the piece that crosses it is cut at its
    last line end before the cap. The corpus is read twice by the token-file cache (once to
    hash, once to tokenise), so this must be deterministic.
    """
    total = 0
    for path, origin in resolve(spec):
        first, empty = True, True
        for piece in _file_pieces(path, strict=origin != STDLIB):
            size = len(piece.encode("utf-8"))
            if max_bytes is not None and total + size > max_bytes:
                cut = piece.encode("utf-8")[: max_bytes - total].decode("utf-8", "ignore")
                cut = cut[: cut.rfind("\n") + 1]
                if cut:
                    yield cut, first
                return
            total += size
            empty = False
            yield piece, first
            first = False
        if empty and origin == "file":
            raise UsageError(f"{path}: empty file; expected text")


def iter_texts(spec: Spec, max_bytes: int | None = None) -> Iterator[str]:
    """The documents (whole files) of ``spec`` as strings; see the module docstring for specs."""
    parts: list[str] = []
    for piece, starts in iter_pieces(spec, max_bytes):
        if starts and parts:
            yield "".join(parts)
            parts = []
        parts.append(piece)
    if parts:
        yield "".join(parts)
