"""Checkpoints: self-describing directories, written atomically.

A checkpoint is a directory holding ``config.json`` (the run config: model, data, train),
``model.safetensors`` (the unwrapped module's weights: no ``_orig_mod.``/``module.``
prefixes), ``tokenizer.json`` and ``trainer_state.pt`` (optimizer, schedule, step, RNG
states, data position; plain tensors and containers, loaded with ``weights_only=True``).

It is written into a temporary directory beside its final place, flushed to disk, then
renamed: the rename is the only mark of a complete checkpoint, and a crash at any moment
leaves the previous checkpoints loadable (see "The save protocol" below). A run directory
holds ``step-NNNNNN`` checkpoints and a ``best`` link to the one with the lowest
validation loss; the last ``keep_last`` and the best are kept. Loading never runs code
from the checkpoint: weights are safetensors, the trainer state is read with
``weights_only=True``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import pickle
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..nn.lora import LORA_MARK, unload_lora
from ..parallel.checkpoint import DCP_DIR, dcp_parameter_count, load_into
from ..paths import TMP_TAG, TRASH_TAG, WEIGHTS
from ..run_config import RunConfig
from ..stats import size_estimate
from ..textformats import loads_json
from ..tokenizers import load_tokenizer
from .adapter import ADAPTER, HEAD, adapter_base, check_base_fingerprint, load_adapter_tensors, save_weights
from .build import build_run_model

CONFIG, TOKENIZER, STATE = "config.json", "tokenizer.json", "trainer_state.pt"
BEST = "best"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    model: nn.Module  # in eval mode
    tokenizer: Any
    config: RunConfig
    path: Path


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


def read_config(path: str | Path) -> RunConfig:
    """The run config saved in a checkpoint's ``config.json``, checked against the size of
    the weights beside it."""
    path = resolve_checkpoint(path)
    config = RunConfig.from_dict(_read_json(path))
    _check_size_against_weights(config, path)
    return config


def _check_size_against_weights(config: RunConfig, path: Path) -> None:
    """A ``config.json`` describing a model far larger than its ``model.safetensors`` holds
    (``n_layers`` edited to 10**12) is refused before anything is built: building it would
    run for hours or exhaust the memory. Only the file's header is read; a damaged file is
    left to ``load_weights``, which names the damage; a LoRA run (no weights file) is skipped."""
    file = path / WEIGHTS
    if not file.is_file() and (path / DCP_DIR).is_dir():  # a parallel run's shards alone: their metadata
        file, held = path / DCP_DIR, dcp_parameter_count(path)
        if held is None:
            return
    elif not file.is_file():
        return
    else:
        try:
            with safetensors.safe_open(str(file), framework="pt") as f:
                held = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        except Exception:  # noqa: BLE001 - the Rust side raises several types for a damaged header
            return
    expected = size_estimate(config.model, 1, 1)["parameters"]
    if expected > 2 * held + 2**20:  # a loose bound: heads, tied and LoRA weights shift the counts a little
        raise UsageError(f"{path / CONFIG}: describes a model of {expected:,} parameters but {file} holds "
                         f"{held:,}; expected the config.json written with these weights")


def _read_json(path: str | Path) -> dict[str, Any]:
    """``config.json``: the run config's sections, plus ``tokenizer`` (kind, size, fingerprint)."""
    path = resolve_checkpoint(path)
    try:
        data = loads_json((path / CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path / CONFIG}: expected a JSON object with model, data and train")
    data.pop("tokenizer", None)
    return data


def load_weights(model: nn.Module, path: str | Path, device: torch.device | str = "cpu") -> None:
    """Load ``model.safetensors`` from checkpoint ``path`` into ``model`` (strictly), or, where
    a parallel run left its weights in ``dcp/`` alone, those."""
    file = resolve_checkpoint(path) / WEIGHTS
    if not file.is_file() and (file.parent / ADAPTER).is_file():  # a LoRA run: base + adapter
        _load_adapter(unwrap(model), file.parent, read_config(file.parent), device)
        return
    if not file.is_file() and (file.parent / DCP_DIR).is_dir():
        load_into(unwrap(model), file.parent)
        return
    if not file.is_file():
        raise UsageError(f"{file}: weights file not found")
    try:
        safetensors.torch.load_model(unwrap(model), str(file), strict=True, device=str(device))
    except (safetensors.SafetensorError, RuntimeError) as e:  # truncated file, or weights of another shape
        reason = str(e).strip().splitlines()[0]
        raise UsageError(f"{file}: cannot load the weights ({reason}); expected the file written with "
                         f"this checkpoint's config.json") from None


# ---------------------------------------------------------------------- weights by name
@dataclass
class InitReport:
    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)  # in this model, not in the base
    skipped: list[str] = field(default_factory=list)  # in both, shapes differ (or the head's task differs)
    unused: list[str] = field(default_factory=list)  # in the base, not used here

    def describe(self, source: str) -> str:
        parts = [f"init-from {source}: {len(self.loaded)} tensors loaded"]
        for what, names in (("new (not in the base)", self.new), ("skipped (shape or task differs)", self.skipped),
                            ("unused from the base", self.unused)):
            if names:
                parts.append(f"{what}: {', '.join(names)}")
        return "; ".join(parts)


def _base_key(name: str, target_is_task: bool, base_is_task: bool) -> str:
    if target_is_task and not base_is_task:
        return name[len("body."):] if name.startswith("body.") else name
    if base_is_task and not target_is_task:
        return "body." + name
    return name


def load_matching(model: nn.Module, source: str | Path, cfg: RunConfig) -> InitReport:
    """Copy the weights of checkpoint ``source`` into ``model`` (of run config ``cfg``) by name
    and shape. The base's own head (LM head, or a task head for other labels) is not carried
    over to a head of a different task; the report names everything not carried over."""
    base_cfg = check_base_arch(source, cfg)
    base_state = load_checkpoint(source).model.state_dict()
    targets = {name: t.shape for name, t in model.state_dict().items()}
    report, keys = match_weights(targets, {k: t.shape for k, t in base_state.items()}, base_cfg, cfg,
                                 isinstance(model, TaskModel))
    model.load_state_dict({name: base_state[key] for name, key in keys.items()}, strict=False)
    return report


def check_base_arch(source: str | Path, cfg: RunConfig) -> RunConfig:
    """The run config of ``train.init_from`` checkpoint ``source``, refused unless its
    architecture is ``cfg``'s."""
    base_cfg = read_config(source)
    if base_cfg.model.arch != cfg.model.arch:
        raise UsageError(f"train.init_from={source}: a {base_cfg.model.arch} checkpoint; expected "
                         f"model.arch={cfg.model.arch!r} to match it")
    return base_cfg


def match_weights(targets: dict[str, torch.Size], base: dict[str, torch.Size], base_cfg: RunConfig, cfg: RunConfig,
                  target_is_task: bool) -> tuple[InitReport, dict[str, str]]:
    """Which of a model's tensors (``targets``: name -> shape) take which of the base's (``base``:
    key -> shape, every name of a tied table), on shapes alone: the report and name -> key."""
    base_is_task = any(k.startswith("body.") for k in base)
    same_task = base_cfg.head.task == cfg.head.task and base_cfg.head.labels == cfg.head.labels
    report, used, keys = InitReport(), set(), {}
    for name, shape in targets.items():
        if LORA_MARK in name:
            continue
        key = _base_key(name, target_is_task, base_is_task)
        if key not in base:
            report.new.append(name)
        elif base[key] != shape:
            report.skipped.append(f"{name} {tuple(base[key])}->{tuple(shape)}")
            used.add(key)
        elif name.startswith(HEAD) and target_is_task and not same_task:
            report.skipped.append(f"{name} (other labels)")
            used.add(key)
        else:
            keys[name] = key
            report.loaded.append(name)
            used.add(key)
    report.unused = sorted(k for k in base if k not in used)
    return report, keys


def _load_adapter(model: nn.Module, directory: Path, config: RunConfig, device: Any) -> None:
    """A LoRA checkpoint: the base weights from the checkpoint its adapter names (checked
    against the fingerprint the adapter recorded), then the adapter and head tensors."""
    base = adapter_base(directory)
    load_matching(model, base, config)
    check_base_fingerprint(model, directory, base)
    load_adapter_tensors(model, directory, device)


def load_tokenizer_for(path: str | Path, vocab_size: int) -> Any:
    """The checkpoint's tokenizer, checked against the model's vocabulary and the
    fingerprint recorded when the checkpoint was written."""
    path = resolve_checkpoint(path)
    file = path / TOKENIZER
    if not file.is_file():
        raise UsageError(f"{file}: tokenizer file not found")
    tokenizer = load_tokenizer(file)
    if tokenizer.vocab_size != vocab_size:
        raise UsageError(
            f"{file}: tokenizer has {tokenizer.vocab_size} tokens but the model expects "
            f"vocab_size={vocab_size}; expected the tokenizer saved with this checkpoint"
        )
    meta = tokenizer_meta(path)
    for key, actual in (("kind", tokenizer.kind), ("vocab_size", tokenizer.vocab_size)):
        if meta.get(key) is not None and meta[key] != actual:
            raise UsageError(f"{path / CONFIG}: tokenizer.{key}={meta[key]!r} but {file} holds a "
                             f"{tokenizer.kind} tokenizer of {tokenizer.vocab_size} tokens; expected the "
                             f"tokenizer saved with this checkpoint")
    recorded = meta.get("fingerprint")
    if recorded is not None and recorded != tokenizer.fingerprint():
        raise UsageError(
            f"{file}: not the tokenizer this model was trained with (fingerprint {tokenizer.fingerprint()}, "
            f"expected {recorded})"
        )
    return tokenizer


def tokenizer_meta(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer`` entry of a checkpoint's ``config.json`` (kind, vocab_size, fingerprint)."""
    file = Path(path) / CONFIG
    try:
        data = loads_json(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{file}: not valid JSON ({e})") from None
    meta = data.get("tokenizer", {}) if isinstance(data, dict) else None
    if (not isinstance(meta, dict) or not isinstance(meta.get("fingerprint", ""), (str, type(None)))
            or not isinstance(meta.get("kind", ""), (str, type(None)))
            or type(meta.get("vocab_size", 0)) not in (int, type(None))):
        raise UsageError(f"{file}: 'tokenizer' is {meta!r}; expected an object with kind, vocab_size "
                         f"and fingerprint (as written by save_checkpoint)")
    return meta


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> Checkpoint:
    """The model (eval mode, on ``device``), tokenizer and run config of a checkpoint. A
    LoRA checkpoint comes back with its adapters merged into the base weights."""
    path = resolve_checkpoint(path)
    config = read_config(path)
    tokenizer = load_tokenizer_for(path, config.model.vocab_size)
    model = build_run_model(config)  # with its task head and adapters, if any
    load_weights(model, path)
    unload_lora(model)  # adapters merged into their base weights: an ordinary model for inference
    return Checkpoint(model=model.to(device).eval(), tokenizer=tokenizer, config=config, path=path)


def load_trainer_state(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """``trainer_state.pt``, read with ``weights_only=True``; ``mmap``: its tensors mapped from the
    file, so a rank that reads part of a one-process optimizer state touches that part only."""
    file = Path(path) / STATE
    if not file.is_file():
        raise UsageError(f"{file}: trainer state not found; expected a checkpoint from `blockformer train`")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # a class or function the safe unpickler will not import
            raise UsageError(f"{file}: refused: it holds objects other than tensors and plain containers, "
                             f"which could run code when loaded; not loaded (use a checkpoint written by "
                             f"`blockformer train`)") from None
        raise UsageError(f"{file}: cannot read the trainer state (UnpicklingError); the file is damaged, "
                         f"resume from an earlier checkpoint") from None
    except Exception as e:  # torch.load raises many types for a damaged file: name it, do not trace back
        raise UsageError(f"{file}: cannot read the trainer state ({type(e).__name__}); the file is damaged, "
                         f"resume from an earlier checkpoint") from None
