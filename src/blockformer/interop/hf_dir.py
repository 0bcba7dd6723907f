"""A Hugging Face model directory: ``config.json`` and the weights, read lazily.

Weights come from ``model.safetensors`` (or its sharded index) or, failing that, from
``pytorch_model.bin`` (or its index), loaded with ``weights_only=True``: a pickle is never
executed. Every error names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import UsageError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory; expected a Hugging Face model directory")
    file = directory / CONFIG
    if not file.is_file():
        raise UsageError(f"{file}: not found; expected a Hugging Face model directory with {CONFIG}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file}: expected a JSON object")
    return data


class HFWeights:
    """Tensor name -> file, opened lazily. ``prefix`` is added to names that lack it and do
    not start with one of ``outside`` (so ``GPT2Model`` and ``GPT2LMHeadModel`` files read
    alike: ``h.0...`` and ``transformer.h.0...``)."""

    def __init__(self, directory: Path, prefix: str = "", outside: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self._where: dict[str, tuple[Path, str]] = {}  # our name -> (file, name in file)
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        for file, names in self._listing():
            for name in names:
                full = name
                if prefix and not name.startswith(prefix) and not name.startswith(outside):
                    full = prefix + name
                self._where[full] = (file, name)

    def _listing(self) -> list[tuple[Path, list[str]]]:
        d = self.directory
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if (d / index).is_file():
                try:
                    weight_map = json.loads((d / index).read_text(encoding="utf-8"))["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise UsageError(f"{d / index}: expected a JSON object with a weight_map ({e})") from None
                by_file: dict[str, list[str]] = {}
                for name, fname in weight_map.items():
                    by_file.setdefault(fname, []).append(name)
                return [(d / f, names) for f, names in by_file.items()]
            if (d / single).is_file():
                return [(d / single, self._names(d / single))]
        raise UsageError(f"{d}: no weights; expected {SAFETENSORS} or {BIN} (or a sharded index)")

    def _names(self, file: Path) -> list[str]:
        if not file.is_file():
            raise UsageError(f"{file}: weights shard not found")
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), "pt") as f:
                    return list(f.keys())
            except Exception as e:  # safetensors raises its own error types for a damaged file
                raise UsageError(f"{file}: not a readable safetensors file ({e})") from None
        return list(self._bin(file))

    def _bin(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._bins:
            try:
                self._bins[file] = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:  # many error types for a damaged or unsafe pickle
                raise UsageError(f"{file}: cannot read the weights ({type(e).__name__}: {e})") from None
        return self._bins[file]

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self._where[name][0] if name in self._where else self._default_file()

    def name_in_file(self, name: str) -> str:
        """The tensor's own name in its file (without the prefix added for the key map)."""
        return self._where[name][1] if name in self._where else name

    def _default_file(self) -> Path:
        return next(iter(self._where.values()))[0] if self._where else self.directory

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UsageError(f"{self._default_file()}: missing tensor {name!r}")
        file, inner = self._where[name]
        if file.suffix == ".safetensors":
            with safe_open(str(file), "pt") as f:
                return f.get_tensor(inner)
        return self._bin(file)[inner]


def write_hf_dir(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` (the tensors as they are, contiguous)."""
    import safetensors.torch

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    owned = {k: v.detach().contiguous().clone() for k, v in tensors.items()}  # no shared storage
    safetensors.torch.save_file(owned, str(directory / SAFETENSORS), metadata={"format": "pt"})
