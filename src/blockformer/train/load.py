"""Reading a checkpoint back: its run config, weights, tokenizer and trainer state.

``load_checkpoint`` is the whole of it: a model ready for inference. Its parts serve the
trainer (a resume reads ``load_weights`` and ``load_trainer_state``) and the commands that
need only the config (``read_config``). Weights come from ``model.safetensors``, from a
parallel run's ``dcp/`` alone, or, for a LoRA run, from the base checkpoint its adapter names
(matched by name and shape, ``load_matching``, and checked against the fingerprint recorded)
with the adapter laid over it. ``init_from`` uses the same matching to start a run from
another's weights. Loading never runs code from the checkpoint: weights are safetensors, the
trainer state is read with ``weights_only=True``, and a config that describes a model far
larger than its weights is refused before anything is built.
"""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..nn.lora import LORA_MARK, unload_lora
from ..parallel.checkpoint import DCP_DIR, dcp_parameter_count, load_into
from ..paths import WEIGHTS
from ..run_config import RunConfig
from ..stats import size_estimate
from ..textformats import loads_json
from ..tokenizers import load_tokenizer
from .adapter import ADAPTER, HEAD, adapter_base, check_base_fingerprint, load_adapter_tensors
from .build import build_run_model
from .checkpoint import CONFIG, STATE, TOKENIZER, resolve_checkpoint, unwrap


@dataclass
class Checkpoint:
    model: nn.Module  # in eval mode
    tokenizer: Any
    config: RunConfig
    path: Path


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
