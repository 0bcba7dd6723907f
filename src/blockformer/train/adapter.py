"""The weights file of a checkpoint: all weights, or a LoRA run's adapter.

A LoRA run saves only its adapters and its task head (``adapter.safetensors``, whose
metadata names the base checkpoint) instead of ``model.safetensors``; loading one rebuilds
the base and lays these tensors over it (``checkpoint.load_weights``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
from torch import nn

from ..errors import UsageError
from ..models.heads import TaskModel
from ..nn.lora import adapter_state, lora_layers
from ..run_config import RunConfig

ADAPTER = "adapter.safetensors"
HEAD = "head."  # a TaskModel's head parameters


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
    safetensors.torch.save_file(tensors, str(directory / ADAPTER), metadata={"base": base, "format": "blockformer-lora"})


def read_adapter_base(directory: Path) -> str:
    with safetensors.safe_open(str(directory / ADAPTER), framework="pt") as f:
        return (f.metadata() or {}).get("base", "")


def load_adapter_tensors(model: nn.Module, directory: Path, device: Any = "cpu") -> None:
    """The adapter and head tensors of ``directory`` into ``model`` (its base already loaded),
    refused unless they are exactly the ones this model's config gives it."""
    file = directory / ADAPTER
    tensors = safetensors.torch.load_file(str(file), device=str(device))
    expected = set(adapter_state(model, _trained_prefixes(model)))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise UsageError(f"{file}: adapter tensors do not match the config (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); expected the file written with this checkpoint's config.json")
    model.load_state_dict(tensors, strict=False)
