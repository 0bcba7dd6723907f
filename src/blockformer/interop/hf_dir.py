"""A Hugging Face model directory: ``config.json`` and the weights, read lazily.

Weights come from ``model.safetensors`` (or its sharded index) or, failing that, from
``pytorch_model.bin`` (or its index), loaded with ``weights_only=True``: a pickle is never
executed. Every error names the file and, where there is one, the tensor.

``write_hf_dir`` writes one ``model.safetensors``, or, past ``max_shard_size``, shards named
as transformers names them (``model-00001-of-00003.safetensors``) with their index.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..errors import UsageError
from ..paths import TMP_TAG
from ..textformats import loads_json
from ..train.checkpoint import discard

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    return read_json_object(directory, CONFIG, "a Hugging Face model directory")


def read_json_object(directory: Path, name: str, what: str) -> dict[str, Any]:
    """``directory / name`` parsed as a JSON object; each failure one line naming the path and
    ``what`` the directory should be (``a Hugging Face model directory``)."""
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory; expected {what}")
    file = directory / name
    if not file.is_file():
        raise UsageError(f"{file}: not found; expected {what} with {name}")
    try:
        data = loads_json(file.read_text(encoding="utf-8"))
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
                by_file: dict[str, list[str]] = {}
                for name, fname in _weight_map(d / index).items():
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
                raise UsageError(f"{file}: not a readable safetensors file ({_first_line(e)})") from None
        return list(self._bin(file))

    def _bin(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._bins:
            self._bins[file] = _load_bin(file)
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
        if file.suffix != ".safetensors":
            state = self._bin(file)
            if inner not in state or not torch.is_tensor(state[inner]):
                raise UsageError(f"{file}: no tensor {inner!r}; expected the one its index names")
            return state[inner]
        try:
            with safe_open(str(file), "pt") as f:
                return f.get_tensor(inner)
        except Exception as e:  # a damaged shard, or one without the tensor its index names
            raise UsageError(f"{file}: cannot read tensor {inner!r} ({_first_line(e)}); expected a safetensors "
                             f"file holding it") from None


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded index's ``weight_map`` (tensor name -> shard file), checked: every shard a
    file inside the index's own directory that exists."""
    try:
        data = loads_json(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{index}: not valid JSON ({_first_line(e)}); expected a shard index") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise UsageError(f"{index}: expected a JSON object whose weight_map maps tensor names to shard file names")
    for name, shard in weight_map.items():
        parts = PurePosixPath(shard.replace("\\", "/")).parts
        if not parts or shard.startswith(("/", "\\")) or PureWindowsPath(shard).anchor or ".." in parts:
            raise UsageError(f"{index}: weight_map entry {name!r}: {shard!r} leaves the model directory; "
                             f"expected a shard file name inside {index.parent}")
        if not (index.parent / shard).is_file():
            raise UsageError(f"{index}: weight_map entry {name!r}: shard {shard!r} not found in {index.parent}")
    return weight_map


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``: read with ``weights_only=True``, so a pickle that names any
    class or function is refused, never run."""
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it then reads fine
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # a class or function the safe unpickler will not import
            raise UsageError(f"{file}: refused: it holds objects other than tensors and plain containers, which "
                             f"could run code when loaded; not loaded (expected a state dict of tensors)") from None
        raise UsageError(f"{file}: cannot read the weights (UnpicklingError: {_first_line(e)})") from None
    except Exception as e:  # many error types for a damaged file
        raise UsageError(f"{file}: cannot read the weights ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(state, dict):
        raise UsageError(f"{file}: holds a {type(state).__name__}; expected a state dict (tensor name -> tensor)")
    return state


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


# huggingface_hub's default shard size, and transformers 4's (transformers 5 writes up to 50GB).
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str, flag: str = "max_shard_size") -> int:
    """Bytes from ``"500MB"``, ``"2GB"``, ``"1GiB"`` (decimal and binary units, as transformers
    reads them) or an int of bytes; anything else is an error naming ``flag``."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b)?\s*", value, re.IGNORECASE)
        if m is not None and (m[2] or "." not in m[1]):
            number = int(float(m[1]) * _UNITS[(m[2] or "").lower()])
    if number is None or number <= 0:
        raise UsageError(f"{flag} {value!r}: expected a positive size such as 500MB, 2GB, 1GiB or a number of bytes")
    return number


def shard_names(tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, str]:
    """Tensor name -> file: ``model.safetensors`` when everything fits in ``max_bytes``, else
    shards filled in order, each up to ``max_bytes`` (a tensor bigger than that gets a shard of
    its own), named ``model-0000i-of-0000n.safetensors``."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SAFETENSORS)
    n = len(groups)
    return {name: f"model-{i:05d}-of-{n:05d}.safetensors" for i, group in enumerate(groups, 1) for name in group}


def write_hf_dir(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 files: dict[str, str] | None = None, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write ``config.json``, the tensors as they are (contiguous) in ``model.safetensors`` or,
    when they pass ``max_shard_size``, in shards with ``model.safetensors.index.json``, and
    ``files`` (name -> text) as ``directory``, replacing whatever was there (``staged``)."""
    import safetensors.torch

    max_bytes = parse_size(max_shard_size)
    with staged(directory) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        owned = {k: v.detach().contiguous().clone() for k, v in tensors.items()}  # no shared storage
        weight_map = shard_names(owned, max_bytes)
        for file in dict.fromkeys(weight_map.values()):
            shard = {k: v for k, v in owned.items() if weight_map[k] == file}
            safetensors.torch.save_file(shard, str(tmp / file), metadata={"format": "pt"})
        if len(set(weight_map.values())) > 1:  # the index transformers and HFWeights read
            total = sum(t.numel() * t.element_size() for t in owned.values())
            index = {"metadata": {"total_parameters": sum(t.numel() for t in owned.values()), "total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")


@contextlib.contextmanager
def staged(directory: Path) -> Iterator[Path]:
    """A temporary directory beside ``directory`` to write into; on success it replaces
    ``directory`` whole (one rename), on any failure it is removed and ``directory`` stays as
    it was."""
    tmp = directory.parent / f".{directory.name}{TMP_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        yield tmp
        if directory.is_symlink() or directory.exists():
            discard(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
