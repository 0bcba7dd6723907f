"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

A checkpoint may come from anyone: its files are data. DCP's own ``FileSystemReader``
unpickles ``.metadata`` with plain ``pickle``, and its ``DefaultLoadPlanner`` reads bytes
items (the optimizer's lr, betas, ...) with ``torch.load(weights_only=False)``: either runs
whatever a planted pickle asks. Here ``.metadata`` is read by an unpickler that builds only
DCP's own metadata classes (and the torch values inside them), every item it names must lie
in a file directly inside ``dcp/``, and bytes items are read with ``weights_only=True``, as
DCP already reads tensors.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..errors import UsageError
from .model_rows import ModelRowsPlanning

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # how a torch.layout pickles
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of ``_METADATA_GLOBALS`` and torch dtypes; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and not name.startswith("_") and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")


def read_metadata(dcp_dir: Path) -> Metadata:
    """The checkpoint's ``dcp/.metadata``, unpickled without running anything and checked."""
    file = dcp_dir / ".metadata"
    if not file.is_file():
        raise UsageError(f"{file}: not found; expected the metadata of a sharded checkpoint")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UsageError(f"{file}: refused ({e}): it could run code when loaded; not loaded (expected the "
                         f"metadata `torch.distributed.checkpoint` writes)") from None
    except Exception as e:  # a damaged pickle raises many types
        raise UsageError(f"{file}: cannot read the sharded checkpoint's metadata ({_reason(e)}); "
                         f"the file is damaged") from None
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata: Any, file: Path) -> None:
    """The metadata's types, and every shard file a plain name inside its directory."""
    expected = "expected the metadata `torch.distributed.checkpoint` writes"
    if not isinstance(metadata, Metadata):
        raise UsageError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata; {expected}")
    if not isinstance(metadata.state_dict_metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
        for k, v in metadata.state_dict_metadata.items()
    ):
        raise UsageError(f"{file}: state_dict_metadata is not a map of names to tensor or bytes entries; {expected}")
    if not isinstance(metadata.storage_data, dict) or not isinstance(metadata.storage_meta, (StorageMeta, type(None))):
        raise UsageError(f"{file}: storage_data is not a map of items to files; {expected}")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UsageError(f"{file}: storage_data holds a {type(info).__name__}; {expected}")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UsageError(f"{file}: item {index.fqn!r} is stored in {name!r}, outside {file.parent}; "
                             f"expected the name of a file in that directory")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length)):
            raise UsageError(f"{file}: item {index.fqn!r} has offset {info.offset!r}, length {info.length!r}; "
                             f"expected integers >= 0")


class _SafeReader(FileSystemReader):
    """FileSystemReader with its metadata read (and checked) by ``read_metadata`` up front,
    so that a refused file is one error here, not DCP's fallback to per-rank files."""

    def __init__(self, dcp_dir: Path) -> None:
        super().__init__(dcp_dir)
        self._metadata = read_metadata(dcp_dir)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _SafePlanner(ModelRowsPlanning, DefaultLoadPlanner):
    """DefaultLoadPlanner whose bytes items are read with ``weights_only=True``: numbers,
    strings, tensors and containers only; reordered weights are read in the model's row
    order (``model_rows.py``)."""

    def __init__(self, dcp_dir: Path, orders: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(orders)
        self.dcp_dir = dcp_dir

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self._chunk(index)
        return super().lookup_tensor(index) if chunk is None else chunk

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UsageError(f"{self.dcp_dir}: item {fqn!r}: {_refusal(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def safe_load(state: dict, dcp_dir: Path, *, no_dist: bool, orders: dict[str, torch.Tensor] | None = None) -> None:
    """``dcp.load(state)`` from ``dcp_dir`` through the safe reader and planner (``orders``:
    the row orders of reordered tensors, ``model_rows.flat_row_orders``); any failure is
    one UsageError naming the directory."""
    reader = _SafeReader(dcp_dir)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(dcp_dir, orders), no_dist=no_dist)
    except CheckpointException as e:  # DCP gathers each rank's error, with its traceback
        first = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(first, UsageError):
            raise first from None
        raise UsageError(f"{dcp_dir}: {_refusal(first)}") from None
    except Exception as e:  # raised outside DCP's gathering
        raise UsageError(f"{dcp_dir}: {_refusal(e)}") from None


def _refusal(e: BaseException) -> str:
    if isinstance(e, pickle.UnpicklingError) and "global" in str(e).lower():  # torch's weights_only refusal
        return ("refused: it holds objects other than tensors and plain values, which could run code when "
                "loaded; not loaded (use a checkpoint written by `blockformer train`)")
    return f"cannot read the sharded checkpoint ({_reason(e)}); expected the dcp/ a `blockformer train` run wrote"


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
