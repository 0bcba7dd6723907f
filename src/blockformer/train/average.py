"""Checkpoint averaging: the mean of the weights of the last few checkpoints of a run.

Vaswani et al. (2017, section 6.1) average the last 5 checkpoints (written every 10
minutes) for the base model: late in training the weights wander around a minimum, and
their mean sits closer to it than any one of them (Polyak averaging, applied after the
fact). The checkpoints must share one model config and tokenizer; the float tensors are
averaged (accumulated in float64), any other tensor must be identical in all of them.
The result is an ordinary checkpoint directory, written atomically, without trainer
state: it is for translating and evaluating, not for resuming.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import safetensors.torch
import torch

from ..errors import UsageError
from ..models import build_model
from ..parallel.checkpoint import DCP_DIR, dcp_weights
from ..paths import WEIGHTS, check_writable_dir
from .checkpoint import resolve_checkpoint, save_checkpoint, step_checkpoints
from .load import load_tokenizer_for, read_config, tokenizer_meta

SOURCES = "averaged_from.json"  # written next to the weights: which checkpoints were averaged


def last_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The ``n`` most recent ``step-NNNNNN`` checkpoints of a run directory, oldest first."""
    if n < 1:
        raise UsageError(f"--last {n}: expected an integer >= 1")
    found = step_checkpoints(run_dir)
    if not Path(run_dir).is_dir():
        raise UsageError(f"{run_dir}: run directory not found")
    if len(found) < n:
        raise UsageError(
            f"{run_dir}: {len(found)} step checkpoints, fewer than --last {n}; expected a run trained with "
            f"train.keep_last >= {n} (and train.eval_every, which sets how often checkpoints are written)"
        )
    return found[-n:]


def average_state(files: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    """The mean of the float tensors of several ``model.safetensors`` files (same names,
    shapes and dtypes in each); other tensors are taken from the first, and must match.
    A file that cannot be read, a non-finite weight or a mismatch is a UsageError naming
    the file and the tensor."""
    total: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    for k, file in enumerate(files):
        state = read_weights(file)
        if k == 0:
            first = state
            total = {n: t.double() for n, t in state.items() if t.is_floating_point()}
            continue
        if state.keys() != first.keys():
            diff = sorted(state.keys() ^ first.keys())
            raise UsageError(f"{file}: tensors {diff[:3]} differ from {files[0]}; expected the same model")
        for name, t in state.items():
            if t.shape != first[name].shape or t.dtype != first[name].dtype:
                raise UsageError(
                    f"{file}: tensor {name} is {t.dtype} {tuple(t.shape)} but {first[name].dtype} "
                    f"{tuple(first[name].shape)} in {files[0]}; expected the same model"
                )
            if name in total:
                total[name] += t.double()
            elif not torch.equal(t, first[name]):
                raise UsageError(f"{file}: non-float tensor {name} differs from {files[0]}; cannot average it")
    n = len(files)
    return {name: (total[name] / n).to(t.dtype) if name in total else t for name, t in first.items()}


def read_weights(file: str | Path) -> dict[str, torch.Tensor]:
    """A ``model.safetensors`` file's tensors (or, where a parallel run left only ``dcp/``
    beside it, that one's); a missing, truncated or garbled file, or a NaN or infinite
    weight, is a UsageError naming it (and the tensor)."""
    file = Path(file)
    if not file.is_file() and (file.parent / DCP_DIR).is_dir():
        return _finite(dcp_weights(file.parent, read_config(file.parent)), file.parent / DCP_DIR)
    if not file.is_file():
        raise UsageError(f"{file}: weights file not found; expected a checkpoint's {WEIGHTS}")
    try:
        state = safetensors.torch.load_file(str(file))
    except (safetensors.SafetensorError, ValueError, RuntimeError) as e:  # a cut or garbled file
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"{file}: cannot read the weights ({reason}); expected a complete safetensors "
                         f"file as written by save_checkpoint") from None
    return _finite(state, file)


def _finite(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UsageError(f"{file}: tensor {name} holds NaN or infinite values; expected finite weights "
                             f"(leave this checkpoint out of the average)")
    return state


def average_checkpoints(checkpoints: Sequence[str | Path], output: str | Path) -> Path:
    """Average ``checkpoints`` (checkpoint or run directories) into a new checkpoint at
    ``output``; returns its path."""
    if len(checkpoints) < 1:
        raise UsageError("--checkpoints: none given; expected one or more checkpoint directories")
    paths = [resolve_checkpoint(c, prefer="latest") for c in checkpoints]
    seen: dict[Path, Path] = {}
    for p in paths:
        if p.resolve() in seen:
            raise UsageError(f"--checkpoints: {seen[p.resolve()]} and {p} are one checkpoint, which would "
                             f"count double; expected distinct checkpoints")
        seen[p.resolve()] = p
    output = Path(output)
    if output.resolve() in {p.resolve() for p in paths}:
        raise UsageError(f"--output {output}: is one of the checkpoints being averaged; expected a new directory")
    check_writable_dir(output, "checkpoint directory")
    if output.is_dir() and any(output.iterdir()) and not (output / SOURCES).is_file():
        raise UsageError(f"--output {output}: already holds files that are not an averaged checkpoint; "
                         f"expected a new directory (or an earlier average, which is replaced)")
    configs = [read_config(p) for p in paths]
    fingerprints = [_tokenizer_fingerprint(p) for p in paths]
    for p, cfg, fp in zip(paths[1:], configs[1:], fingerprints[1:]):
        if cfg.model != configs[0].model:
            diff = [k for k, v in cfg.model.to_dict().items() if configs[0].model.to_dict()[k] != v]
            raise UsageError(f"{p}: model config differs from {paths[0]} in {diff}; expected checkpoints of one model")
        if fp != fingerprints[0]:
            raise UsageError(f"{p}: tokenizer differs from {paths[0]}; expected checkpoints of one run")
    state = average_state([p / WEIGHTS for p in paths])
    model = build_model(configs[0].model)
    params = model.state_dict()  # tied weights appear under both names, sharing storage
    missing = [n for n in params if n not in state and not _tied_elsewhere(model, n, state)]
    if missing:
        raise UsageError(f"{paths[0] / WEIGHTS}: no tensor for {missing[:3]}; expected a complete checkpoint")
    _check_against(params, state, paths[0] / WEIGHTS)
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    tokenizer = load_tokenizer_for(paths[0], configs[0].model.vocab_size)
    sources = json.dumps([str(p) for p in paths], indent=2) + "\n"
    save_checkpoint(output, model, tokenizer, configs[-1], extra_files={SOURCES: sources})
    return output


def _check_against(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor], file: Path) -> None:
    """Every averaged tensor must be one the model (built from config.json) has, in its shape."""
    for name, t in state.items():
        if name not in params:
            raise UsageError(f"{file}: tensor {name} is not in the model its config.json describes; "
                             f"expected the weights written with that config")
        if t.shape != params[name].shape:
            raise UsageError(f"{file}: tensor {name} is {tuple(t.shape)} but the model its config.json "
                             f"describes has {tuple(params[name].shape)}; expected the weights written "
                             f"with that config")


def _tokenizer_fingerprint(path: Path) -> str | None:
    return tokenizer_meta(path).get("fingerprint")


def _tied_elsewhere(model: torch.nn.Module, name: str, state: dict[str, torch.Tensor]) -> bool:
    """Whether parameter ``name`` shares its storage with one that ``state`` holds
    (safetensors keeps one name per tied tensor)."""
    params = model.state_dict()
    ptr = params[name].data_ptr()
    return any(params[other].data_ptr() == ptr for other in state if other in params)
