"""The weights file of a checkpoint: all weights, or a LoRA run's adapter.

A LoRA run saves only its adapters and its task head (``adapter.safetensors``, whose
metadata names the base checkpoint and holds a fingerprint of the base weights) instead of
``model.safetensors``; loading one rebuilds the base, checks the fingerprint (a base changed
since the adapter was trained is refused; an adapter written before fingerprints loads as
before) and lays these tensors over it (``load.load_weights``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..nn.lora import LORA_MARK, LoRALinear, adapter_state, lora_layers, low_rank_product
from ..run_config import RunConfig

ADAPTER = "adapter.safetensors"
HEAD = "head."  # a TaskModel's head parameters
_CACHE = "_base_fingerprint"  # on the model: (its base tensors' identity, their fingerprint)


def is_adapted(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def _trained_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Besides the adapters, what a LoRA checkpoint stores: a task head (never the LM head)."""
    return (HEAD,) if isinstance(model, TaskModel) else ()


def save_weights(model: nn.Module, directory: Path, config: RunConfig, weights_name: str) -> None:
    """The weights file of a checkpoint: all weights (``weights_name``), or, for a LoRA run,
    only the adapters and the head in ``adapter.safetensors``, with the base named."""
    if not is_adapted(model):
        # save_model drops the duplicate names of tied tensors, which safetensors refuses.
        safetensors.torch.save_model(model, str(directory / weights_name))
        return
    tensors = {k: v.contiguous() for k, v in adapter_state(model, _trained_prefixes(model)).items()}
    base = os.path.abspath(config.train.init_from)  # abspath keeps a `best` link unresolved
    meta = {"base": base, "format": "blockformer-lora", "base_fingerprint": base_fingerprint(model)}
    safetensors.torch.save_file(tensors, str(directory / ADAPTER), metadata=meta)


def read_adapter_base(directory: Path) -> str:
    return _adapter_metadata(directory).get("base", "")


def _adapter_metadata(directory: Path) -> dict[str, str]:
    with safetensors.safe_open(str(directory / ADAPTER), framework="pt") as f:
        return f.metadata() or {}


def base_fingerprint(model: nn.Module) -> str:
    """sha256 over the base weights of a LoRA model: every tensor but the adapters and a
    task head, in name order, each as its name, dtype, shape and bytes (a tied tensor once).
    About 0.6 s for GPT-2 small's 124M fp32 parameters on one (shared) CPU core; a run's
    later saves reuse it while no base tensor has changed (same storage, same version)."""
    trained = _trained_prefixes(model)
    base = [(n, t) for n, t in sorted(model.state_dict().items()) if LORA_MARK not in n and not n.startswith(trained)]
    identity = tuple((n, t.data_ptr(), t._version) for n, t in base)  # _version: bumped by every in-place write
    cached = getattr(model, _CACHE, None)
    if cached is not None and cached[0] == identity:
        return cached[1]
    fingerprint = fingerprint_of((n, t.dtype, t.shape, tied, lambda t=t: [t])
                                 for n, t, tied in marked_ties(base, _same_storage))
    setattr(model, _CACHE, (identity, fingerprint))
    return fingerprint


def marked_ties(named: Iterable[tuple[str, torch.Tensor]], same: Callable[[torch.Tensor], Hashable]
                ) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, whether an earlier name holds the same tensor) for each of ``named``, in
    order: the fingerprint hashes a tied table once. ``same`` keys a tensor: its storage for
    real tensors, ``id`` for a meta build's (no storage; a tied table is one object)."""
    seen, marked = set(), []
    for name, t in named:
        key = same(t)
        marked.append((name, t, key in seen))
        if t.numel():
            seen.add(key)
    return marked


def _same_storage(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape)  # state_dict() detaches: a tied table is two objects


def fingerprint_of(entries: Iterable[tuple[str, torch.dtype, torch.Size, bool, Callable[[], Iterable[torch.Tensor]]]]
                   ) -> str:
    """The digest of ``base_fingerprint`` over ``entries``: (name, dtype, shape, whether an
    earlier name holds the same tensor, its values as consecutive row blocks). The blocks
    may come from a file a few rows at a time: the bytes hashed are the same."""
    digest = hashlib.sha256()
    for name, dtype, shape, tied, blocks in entries:
        digest.update(f"{name}:{dtype}:{tuple(shape)}:{'tied' if tied else ''};".encode())
        if not tied:
            for block in blocks():
                data = block.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8)
                digest.update(memoryview(data.numpy()))
    return "sha256:" + digest.hexdigest()


def recorded_fingerprint(directory: Path) -> str | None:
    """The base fingerprint the adapter of ``directory`` recorded (None: written before them)."""
    return _adapter_metadata(directory).get("base_fingerprint")


def check_base_fingerprint(model: nn.Module, directory: Path, base: str) -> None:
    """Refuse an adapter whose base weights (now loaded into ``model``) are not the ones it
    was trained on; an adapter without a recorded fingerprint (older) is not checked."""
    recorded = recorded_fingerprint(directory)
    if recorded is not None:
        refuse_changed_base(directory, base, base_fingerprint(model), recorded)


def refuse_changed_base(directory: Path, base: str | Path, now: str, recorded: str) -> None:
    if now != recorded:
        raise UsageError(f"{directory / ADAPTER}: its base {base} has changed since the adapter was trained "
                         f"(base weights {now[:19]}, recorded {recorded[:19]}); expected the checkpoint this "
                         f"adapter was trained on")


def adapter_base(directory: Path) -> Path:
    """The base checkpoint the adapter of ``directory`` names, refused where it is missing."""
    base = read_adapter_base(directory)
    if not base or not Path(base).exists():
        raise UsageError(f"{directory / ADAPTER}: its base checkpoint {base or '(none recorded)'} is missing; "
                         f"expected the checkpoint this adapter was trained on")
    return Path(base)


def check_adapter_names(file: Path, held: Iterable[str], model: nn.Module) -> None:
    """Refuse an adapter file whose tensors (``held``) are not exactly the ones ``model``'s
    config gives it (its adapters and task head)."""
    expected, held = set(adapter_state(model, _trained_prefixes(model))), set(held)
    if held != expected:
        missing, extra = sorted(expected - held), sorted(held - expected)
        raise UsageError(f"{file}: adapter tensors do not match the config (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); expected the file written with this checkpoint's config.json")


def load_adapter_tensors(model: nn.Module, directory: Path, device: Any = "cpu") -> None:
    """The adapter and head tensors of ``directory`` into ``model`` (its base already loaded),
    refused unless they are exactly the ones this model's config gives it."""
    file = directory / ADAPTER
    tensors = safetensors.torch.load_file(str(file), device=str(device))
    check_adapter_names(file, tensors, model)
    model.load_state_dict(tensors, strict=False)


def base_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s base tensors, in the fingerprint's order: not adapters, not a task head."""
    trained = _trained_prefixes(model)
    return sorted(n for n in model.state_dict() if LORA_MARK not in n and not n.startswith(trained))


class LowRankRows:
    """The update ``scale * B_p A_p`` of one adapted weight, all its parts laid in their rows
    (zero elsewhere), as a full (out, in) tensor indexed by a row slice and a column slice:
    only the block asked for is computed, from the rank-r factors."""

    def __init__(self, layer: LoRALinear, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.shape, self.scale, self.parts, self.factors = (layer.out_features, layer.in_features), layer.scale, \
            layer.parts, factors  # part -> (A (r, in), B (rows, r))

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        rows, cols = index
        first, end = rows.start, rows.stop
        a_any = next(iter(self.factors.values()))[0]
        block = torch.zeros(end - first, len(range(*cols.indices(self.shape[1]))), dtype=a_any.dtype)
        for name, (start, stop) in self.parts.items():
            lo, hi = max(first, start), min(end, stop)
            if lo < hi:
                a, b = self.factors[name]
                update = low_rank_product(b[lo - start: hi - start], a[:, cols])
                block[lo - first: hi - first] = self.scale * update
        return block
