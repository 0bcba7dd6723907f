"""Output paths checked before long work starts: one line naming the path and the reason.

Training for an hour and then failing to write the result is the worst way to learn that
a directory is read-only, so commands check their outputs first. Errors the checks cannot
foresee (a disk filling up) still end as one line: the command line turns ``OSError``
into the path and the OS reason.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError

# Names of what a writer leaves beside its target until it renames into place (a crash
# leaves them for the next run to clean: train/checkpoint.recover).
TMP_TAG, TRASH_TAG = ".tmp-", ".trash-"
# A checkpoint's consolidated weights (train/checkpoint.py), also written from a parallel run's dcp/.
WEIGHTS = "model.safetensors"


def check_writable_dir(path: str | Path, what: str) -> None:
    """Raise UsageError (one line: the path and the reason) unless ``path`` is, or can be
    created as, a directory this process can write into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path}: is a file; expected a {what} (a directory, or a new name)")
    probe = path
    while not probe.exists():  # the nearest existing ancestor must be a writable directory
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"{path}: {probe} is a file; expected a {what} under a directory")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: cannot write into {probe} (permission denied); expected a writable {what}")


def check_output_file(path: str | Path, flag: str) -> None:
    """Check before long work that ``path`` can be written as a file (its directory
    exists and is writable, and it is not a directory)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; expected a file name (e.g. {path / 'out.txt'})")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: permission denied; expected a writable file")


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a new file beside it, flushed to disk, then renamed over it. A
    link at ``path`` is replaced, never written through; an OS error (a full disk) names ``path``."""
    path = Path(path)
    tmp = path.parent / f".{path.name}{TMP_TAG}{os.getpid()}"
    try:
        unlink_if_present(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        unlink_if_present(tmp)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def unlink_if_present(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
