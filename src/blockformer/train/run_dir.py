"""The run directory: one writer at a time, and a new run never destroys an old one.

``RunLock`` is a lock file, ``run_dir/.lock``, holding the owner's pid and host. It is
created atomically (a hard link of a finished file, so it never exists half-written) and
removed when training ends, by any path: return, exception, SIGINT/SIGTERM. A lock left by
a process that died without cleaning up (kill -9, power loss) is stale: on the same host,
a pid that no longer runs is detected and the lock taken over; on another host the user
is told whom to ask. A lock of an earlier attempt of the same torchrun job (its
``TORCHELASTIC_RUN_ID``) is stale wherever it was taken: torchrun stops every worker of an
attempt before it starts the next, whose rank 0 may run on another node. ``check_fresh`` refuses a fresh run into a directory that already
holds something, naming the ways forward.

``train.resume = "auto"`` (``--resume-if-exists``) is what an elastic restart needs: the
relaunched command finds its own run directory and continues from the latest complete
checkpoint there (``latest_of_run``: the same config, checked field by field, the launch's
``[parallel]`` section aside), or starts fresh where there is none, replacing the records
of an attempt that died before its first checkpoint.

Nothing is written through a link: ``check_links`` refuses a run directory where one of
the trainer's names (``config.toml``, ``metrics.jsonl``, ``loss.png``, ``tensorboard``,
``step-*``) is a symbolic link, or ``best`` links anywhere but to a checkpoint beside it;
``replace_file`` writes a whole file by renaming a new one over the name, which replaces a
link itself.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..textformats import loads_json
from ..paths import TMP_TAG, TRASH_TAG, check_writable_dir, replace_file, unlink_if_present as _unlink
from ..run_config import RunConfig
from .checkpoint import BEST, discard, recover, step_checkpoints
from .load import read_config
from .metrics import METRICS, PLOT
from .tracking import TENSORBOARD

LOCK = ".lock"
CONFIG_TOML = "config.toml"  # the run config, as the run was last started
# What a run writes before its first checkpoint: all an attempt that died early leaves.
BEFORE_FIRST_CHECKPOINT = (CONFIG_TOML, METRICS, PLOT, TENSORBOARD, BEST)
# Not compared by train.resume="auto": how this start asks to resume, and what the run fills in
# (the tokenizer's size; the labels of the data, when not given).
_FILLED_IN = ("train.resume", "model.vocab_size")


class RunLock:
    """Exclusive ownership of a run directory (a context manager)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.held = False

    def acquire(self) -> "RunLock":
        check_writable_dir(self.run_dir, "run directory")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), **_job()}
        for _ in range(3):
            if self._try_create(me):
                self.held = True
                return self
            owner = _read_owner(self.path)
            if owner == me:  # this process already holds it (a second train() in one process)
                break
            if owner is not None and not _is_stale(owner):
                raise UsageError(
                    f"{self.run_dir}: another training is writing there (pid {owner['pid']} on "
                    f"{owner['host']}); wait for it to finish, or train into another --out DIR "
                    f"(if that process is gone, delete {self.path})"
                )
            _unlink(self.path)  # stale: its owner died without releasing it
        raise UsageError(f"{self.path}: cannot take the run directory's lock; expected no other writer there")

    def _try_create(self, me: dict[str, Any]) -> bool:
        tmp = self.run_dir / f"{LOCK}{TMP_TAG}{os.getpid()}"
        text = json.dumps(me) + "\n"
        try:
            _unlink(tmp)
            _create(tmp, text)
            os.link(tmp, self.path)  # atomic, and fails if a lock exists: never a half-written lock
            return True
        except FileExistsError:
            return False
        except OSError as e:  # filesystems without hard links: exclusive create
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            try:
                _create(self.path, text)
            except FileExistsError:
                return False
            return True
        finally:
            _unlink(tmp)

    def release(self) -> None:
        if self.held:
            owner = _read_owner(self.path)
            if owner is None or owner.get("pid") == os.getpid():
                _unlink(self.path)
            self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _create(path: Path, text: str) -> None:
    """A new file holding ``text``; FileExistsError if the name is taken (by a link too)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _read_owner(path: Path) -> dict[str, Any] | None:
    try:
        owner = loads_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"pid": -1, "host": "?"}  # unreadable: treated as stale below
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return {"pid": -1, "host": "?"}
    return owner


def _job() -> dict[str, str]:
    """The torchrun job this process belongs to, if any (the same across its restarts)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return {"job": run_id} if run_id else {}


def _is_stale(owner: dict[str, Any]) -> bool:
    """Whether the lock's owner is certainly gone: same host and no such process, or an
    earlier attempt of this torchrun job (this attempt's rank 0 is the only one that locks)."""
    pid = owner["pid"]
    if pid <= 0 or (owner.get("job") is not None and owner.get("job") == _job().get("job")):
        return True
    if owner.get("host") != socket.gethostname():
        return False  # cannot see processes elsewhere: the user decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it runs, as another user
    return False


def main_process() -> bool:
    """Rank 0 of a distributed run (or a single process): the one that owns the directory."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def leftovers(run_dir: Path) -> list[Path]:
    """What a run directory holds besides its lock and temporaries of crashed writers."""
    if not run_dir.is_dir():
        return []
    return [p for p in run_dir.iterdir()
            if p.name != LOCK and not (p.name.startswith(".") and (TMP_TAG in p.name or TRASH_TAG in p.name))]


def check_fresh(run_dir: Path, overwrite: bool) -> None:
    """A fresh run may use an empty or new directory; a used one only with ``overwrite``."""
    used = leftovers(run_dir)
    if used and not overwrite:
        n = len(step_checkpoints(run_dir))
        what = (f"{n} checkpoint{'s' * (n != 1)} of an earlier run" if n
                else f"{len(used)} entr{'ies' if len(used) != 1 else 'y'} ({used[0].name}, ...)")
        raise UsageError(
            f"{run_dir}: already holds {what}; continue it with --resume {run_dir}, train into "
            f"another --out DIR, or pass --overwrite to replace it"
        )


def clear_previous_run(run_dir: Path, log: Any = print) -> None:
    """``--overwrite``: remove an earlier run's checkpoints, ``best`` and metrics (only those;
    its TensorBoard events too, which would otherwise be shown as the new run's)."""

    old = step_checkpoints(run_dir)
    if old:
        log(f"{run_dir}: --overwrite: removing the previous run there ({len(old)} checkpoints)")
    best = run_dir / BEST
    if best.is_symlink() or best.is_file():
        best.unlink()
    for p in old:
        discard(p)
    for name in (METRICS, PLOT):
        _unlink(run_dir / name)
    if (run_dir / TENSORBOARD).is_dir():  # never a link here: check_links refused one
        discard(run_dir / TENSORBOARD)


def check_links(run_dir: Path) -> None:
    """Refuse a run directory in which the trainer would write through a symbolic link:
    its own files and ``step-*`` checkpoints must not be links, and ``best`` may only
    link to a ``step-*`` name in the same directory (as ``mark_best`` writes it)."""

    if not run_dir.is_dir():
        return
    for p in sorted(run_dir.iterdir()):
        if not p.is_symlink():
            continue
        if p.name == BEST and re.fullmatch(r"step-\d+", os.readlink(p)):
            continue
        if p.name in (CONFIG_TOML, METRICS, PLOT, BEST, TENSORBOARD) or re.fullmatch(r"step-\d+", p.name):
            raise UsageError(
                f"{p}: is a symbolic link (to {os.readlink(p)}); the trainer writes this name and never "
                f"through a link: expected a plain file or directory there (remove the link)"
            )


def prepare(run_dir: Path, *, fresh: bool, overwrite: bool,
            auto: RunConfig | None = None) -> tuple[list[Path], Path | None]:
    """Under the lock: clean what crashed writers left; refuse links among the trainer's
    names, and a fresh run into a used directory unless ``overwrite``. With ``auto`` (the
    run's config, under ``train.resume="auto"``) the directory's latest complete checkpoint
    is the one to resume from; with none, an early attempt's records are cleared for a fresh
    start. Returns the cleaned paths and that checkpoint (or None)."""
    cleaned = recover(run_dir)
    check_links(run_dir)
    latest = latest_of_run(run_dir, auto) if auto is not None and fresh else None
    if fresh and latest is None:
        early = auto is not None and all(p.name in BEFORE_FIRST_CHECKPOINT for p in leftovers(run_dir))
        if early:
            clear_previous_run(run_dir)
        check_fresh(run_dir, overwrite or early)
    return cleaned, latest


def latest_of_run(run_dir: Path, cfg: RunConfig) -> Path | None:
    """The latest complete checkpoint in ``run_dir`` if there is one, written by ``cfg`` (the
    first field that differs is a UsageError naming it); None where there is none."""
    ckpts = step_checkpoints(run_dir)
    if not ckpts:
        return None
    latest = ckpts[-1]
    diff = first_difference(read_config(latest), cfg)
    if diff is not None:
        name, saved, given = diff
        raise UsageError(
            f"{latest}: train.resume='auto' continues this run, but it was written with {name}={saved!r} and "
            f"this config has {given!r}; expected the same config (continue with another on purpose: --resume "
            f"{run_dir} --set {name}=..., or train into another --out DIR)"
        )
    return latest


def first_difference(saved: RunConfig, cfg: RunConfig) -> tuple[str, object, object] | None:
    """``(section.key, saved value, cfg's value)`` of the first field in which ``cfg`` differs
    from the config a checkpoint was saved with, or None. The ``[parallel]`` section is how the
    job was launched, not the run (a restart may bring other ranks); the fields the run fills
    in are compared only where ``cfg`` sets them."""
    old = saved.to_dict()
    for section, values in cfg.to_dict().items():
        if section == "parallel":
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name in _FILLED_IN or (name == "head.labels" and not value):
                continue
            if old[section].get(key) != value:
                return name, old[section].get(key), value
    return None
