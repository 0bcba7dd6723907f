"""Checkpoints: self-describing directories, written atomically.

A checkpoint is a directory holding ``config.json`` (the run config: model, data, train),
``model.safetensors`` (the unwrapped module's weights: no ``_orig_mod.``/``module.``
prefixes), ``tokenizer.json`` and ``trainer_state.pt`` (optimizer, schedule, step, RNG
states, data position; plain tensors and containers, loaded with ``weights_only=True``).

It is written into a temporary directory beside its final place, flushed to disk, then
renamed: the rename is the only mark of a complete checkpoint, and a crash at any moment
leaves the previous checkpoints loadable (see "The save protocol" below). A run directory
holds ``step-NNNNNN`` checkpoints and a ``best`` link to the one with the lowest
validation loss; the last ``keep_last`` and the best are kept. Reading one back is
``train/load.py``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..parallel.checkpoint import DCP_DIR
from ..paths import TMP_TAG, TRASH_TAG, WEIGHTS
from ..run_config import RunConfig
from .adapter import ADAPTER, save_weights

CONFIG, TOKENIZER, STATE = "config.json", "tokenizer.json", "trainer_state.pt"
BEST = "best"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def unwrap(model: nn.Module) -> nn.Module:
    """The real module under ``torch.compile`` (``_orig_mod``) and DDP/FSDP (``module``)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------- writing
# The save protocol. A checkpoint directory is complete exactly when it carries its final
# name: it is written under a temporary name, its files and the directory fsynced, then
# renamed into place. Replacing an existing step swaps the two directories atomically
# (renameat2 RENAME_EXCHANGE) where the filesystem allows, so the step and ``best`` never
# dangle; deleting first renames to a trash name, so a half-deleted checkpoint is never
# listed. Temporary and trash names start with a dot and are cleaned at the run's next start.


def save_checkpoint(
    directory: str | Path,
    model: nn.Module | None,
    tokenizer: Any,
    config: RunConfig,
    trainer_state: dict[str, Any] | None = None,
    extra_files: dict[str, str] | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint to ``directory`` atomically (replacing one already there);
    ``extra_files`` (name -> text) are written inside it, and ``before_commit(tmp)`` may add
    more to the temporary directory before it is renamed (a parallel run's ``dcp/``, which
    holds its weights: its ``model`` is None)."""
    directory = Path(directory)
    if directory.is_file():
        raise UsageError(f"{directory}: is a file; expected a checkpoint directory (or a new name)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}{TMP_TAG}{os.getpid()}"
    _remove_tree(tmp)
    try:
        tmp.mkdir()
        meta = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                "fingerprint": tokenizer.fingerprint()}  # load_checkpoint checks the tokenizer against it
        text = json.dumps({**config.to_dict(), "tokenizer": meta}, indent=2) + "\n"
        (tmp / CONFIG).write_text(text, encoding="utf-8")
        try:  # save_model drops the duplicate names of tied tensors, which safetensors refuses
            if model is not None:
                save_weights(unwrap(model), tmp, config, WEIGHTS)
        except safetensors.SafetensorError as e:  # a full disk surfaces here as a Rust I/O error
            raise OSError(errno.EIO, f"cannot write the weights ({str(e).splitlines()[0]})", str(tmp / WEIGHTS)) from None
        tokenizer.save(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / STATE)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        if before_commit is not None:
            before_commit(tmp)
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        _replace_dir(tmp, directory)
    except BaseException:
        _remove_tree(tmp)
        raise
    _fsync(directory.parent)
    return directory


def _replace_dir(src: Path, dst: Path) -> None:
    """Put directory ``src`` at ``dst``. An existing ``dst`` is exchanged with ``src`` in one
    atomic step, then deleted; where the filesystem cannot exchange, it is renamed to a
    trash name just before ``src`` takes its place (``recover`` restores it after a crash
    in between)."""
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    if not dst.exists():
        os.replace(src, dst)
        return
    if _exchange(src, dst):  # src now holds the old checkpoint
        discard(src)
        return
    aside = dst.parent / f".{dst.name}{TRASH_TAG}{os.getpid()}"
    _remove_tree(aside)
    os.replace(dst, aside)
    os.replace(src, dst)
    discard(aside)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed to a trash name first (no longer listed), then removed."""
    path = Path(path)
    if path.name.startswith(".") and (TRASH_TAG in path.name or TMP_TAG in path.name):
        _remove_tree(path)
        return
    trash = path.parent / f".{path.name}{TRASH_TAG}{os.getpid()}"
    _remove_tree(trash)
    os.replace(path, trash)
    _remove_tree(trash)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def recover(run_dir: str | Path) -> list[Path]:
    """Clean up after a crashed writer of ``run_dir`` (call holding the run's lock): a
    checkpoint moved aside whose replacement never arrived is put back; other temporary
    and trash entries are removed. Returns the removed paths."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    removed = []
    for p in sorted(run_dir.iterdir()):
        if not p.name.startswith(".") or not (TMP_TAG in p.name or TRASH_TAG in p.name):
            continue
        name = p.name[1:].split(TRASH_TAG)[0].split(TMP_TAG)[0]
        final = run_dir / name
        if TRASH_TAG in p.name and _STEP_DIR.match(name) and not final.exists() and _complete(p):
            os.replace(p, final)  # the crash came between moving it aside and the new one's rename
            continue
        _remove_tree(p)
        removed.append(p)
    return removed


def _complete(path: Path) -> bool:
    weights = (path / WEIGHTS, path / ADAPTER, path / DCP_DIR / ".metadata")
    return (path / CONFIG).is_file() and any(f.is_file() for f in weights)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - directories cannot be opened on some systems
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def mark_best(run_dir: str | Path, checkpoint: str | Path) -> None:
    """Point ``run_dir/best`` at ``checkpoint`` (a relative symlink, swapped atomically)."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{BEST}{TMP_TAG}{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(Path(checkpoint).name, tmp)
    os.replace(tmp, run_dir / BEST)
    _fsync(run_dir)


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete ``step-NNNNNN`` checkpoints in ``run_dir``, oldest first (temporary,
    trash and incomplete directories are never listed)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and _complete(p)]
    return [p for _, p in sorted(found)]


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``run_dir/best`` points at, or None (absent, or dangling)."""
    best = Path(run_dir) / BEST
    return best if best.is_dir() and _complete(best) else None


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all step checkpoints but the last ``keep_last`` and the best; return the deleted."""
    run_dir = Path(run_dir)
    best = run_dir / BEST
    keep = {best.resolve().name} if best.is_symlink() else set()
    ckpts = step_checkpoints(run_dir)
    doomed = [p for p in ckpts[: max(0, len(ckpts) - keep_last)] if p.name not in keep]
    for p in doomed:
        discard(p)
    return doomed


# ---------------------------------------------------------------------- reading
def resolve_checkpoint(path: str | Path, *, prefer: str = "best") -> Path:
    """A checkpoint directory, given it or a run directory (its ``best``, else its latest)."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    if not path.exists():
        raise UsageError(f"{path}: checkpoint directory not found")
    ckpts = step_checkpoints(path)
    best = path / BEST
    if prefer == "best" and (best / CONFIG).is_file():
        return best
    if ckpts:
        return ckpts[-1]
    raise UsageError(f"{path}: not a checkpoint ({CONFIG} missing) nor a run directory with checkpoints")


