"""Checkpoints: self-describing directories, written atomically.

A checkpoint is a directory holding ``config.json`` (the run config: model, data, train),
``model.safetensors`` (the unwrapped module's weights: no ``_orig_mod.``/``module.``
prefixes), ``tokenizer.json`` and ``trainer_state.pt`` (optimizer, schedule, step, RNG
states, data position; plain tensors and containers, loaded with ``weights_only=True``).

It is written into a temporary directory beside its final place, flushed to disk, then
renamed: a crash mid-save leaves the previous checkpoint untouched. A run directory holds
``step-NNNNNN`` checkpoints and a ``best`` link to the one with the lowest validation loss;
the last ``keep_last`` and the best are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models import build_model
from ..run_config import RunConfig
from ..tokenizers import load_tokenizer

CONFIG, WEIGHTS, TOKENIZER, STATE = "config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"
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
def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    tokenizer: Any,
    config: RunConfig,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint to ``directory`` atomically (replacing one already there)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        meta = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                "fingerprint": tokenizer.fingerprint()}  # load_checkpoint checks the tokenizer against it
        text = json.dumps({**config.to_dict(), "tokenizer": meta}, indent=2) + "\n"
        (tmp / CONFIG).write_text(text, encoding="utf-8")
        # save_model drops the duplicate names of tied tensors, which safetensors refuses.
        safetensors.torch.save_model(unwrap(model), str(tmp / WEIGHTS))
        tokenizer.save(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / STATE)
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(directory.parent)
    return directory


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first, then removed."""
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


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
    tmp = run_dir / f".{BEST}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(Path(checkpoint).name, tmp)
    os.replace(tmp, run_dir / BEST)


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """The ``step-NNNNNN`` checkpoints in ``run_dir``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all step checkpoints but the last ``keep_last`` and the best; return the deleted."""
    run_dir = Path(run_dir)
    best = run_dir / BEST
    keep = {best.resolve().name} if best.is_symlink() else set()
    ckpts = step_checkpoints(run_dir)
    doomed = [p for p in ckpts[: max(0, len(ckpts) - keep_last)] if p.name not in keep]
    for p in doomed:
        shutil.rmtree(p)
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
    """The run config saved in a checkpoint's ``config.json``."""
    return RunConfig.from_dict(_read_json(path))


def _read_json(path: str | Path) -> dict[str, Any]:
    """``config.json``: the run config's sections, plus ``tokenizer`` (kind, size, fingerprint)."""
    path = resolve_checkpoint(path)
    try:
        data = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path / CONFIG}: expected a JSON object with model, data and train")
    data.pop("tokenizer", None)
    return data


def load_weights(model: nn.Module, path: str | Path, device: torch.device | str = "cpu") -> None:
    """Load ``model.safetensors`` from checkpoint ``path`` into ``model`` (strictly)."""
    file = resolve_checkpoint(path) / WEIGHTS
    if not file.is_file():
        raise UsageError(f"{file}: weights file not found")
    try:
        safetensors.torch.load_model(unwrap(model), str(file), strict=True, device=str(device))
    except (safetensors.SafetensorError, RuntimeError) as e:  # truncated file, or weights of another shape
        reason = str(e).strip().splitlines()[0]
        raise UsageError(f"{file}: cannot load the weights ({reason}); expected the file written with "
                         f"this checkpoint's config.json") from None


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
    recorded = json.loads((path / CONFIG).read_text(encoding="utf-8")).get("tokenizer", {}).get("fingerprint")
    if recorded is not None and recorded != tokenizer.fingerprint():
        raise UsageError(
            f"{file}: not the tokenizer this model was trained with (fingerprint {tokenizer.fingerprint()}, "
            f"expected {recorded})"
        )
    return tokenizer


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> Checkpoint:
    """The model (eval mode, on ``device``), tokenizer and run config of a checkpoint."""
    path = resolve_checkpoint(path)
    config = read_config(path)
    tokenizer = load_tokenizer_for(path, config.model.vocab_size)
    model = build_model(config.model)
    load_weights(model, path)
    return Checkpoint(model=model.to(device).eval(), tokenizer=tokenizer, config=config, path=path)


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE
    if not file.is_file():
        raise UsageError(f"{file}: trainer state not found; expected a checkpoint from `blockformer train`")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for a damaged file: name it, do not trace back
        raise UsageError(f"{file}: cannot read the trainer state ({type(e).__name__}); the file is damaged, "
                         f"resume from an earlier checkpoint") from None
