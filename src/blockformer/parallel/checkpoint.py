"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), inside the usual directory.

A parallel run's checkpoint is the ordinary self-describing directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``trainer_state.pt``) plus ``dcp/``: every
rank writes its own shards of the weights and AdamW moments there at once, named by
parameter and with their global shapes, so the files do not depend on the layout that
wrote them. Rank 0 then reads the weights back into one CPU model (in the model's own
row order, see ``tensor.RowOrder``) and writes ``model.safetensors``, which
``generate``/``eval`` read on one process; the directory is committed with the same
temporary-directory-and-rename as any checkpoint.

Resuming at any layout (4 ranks -> 2 or 1, or 1 -> 2): the weights come from
``model.safetensors`` before the model is wrapped; the optimizer state is read as a full,
name-keyed state dict (from ``dcp/``, or from a 1-process ``trainer_state.pt``) and handed
to ``set_optimizer_state_dict``, which keeps each rank's shard of it.

Reading ``dcp/`` never runs code from it (see "Reading dcp/ safely" below): DCP's own
reader unpickles ``.metadata`` with plain ``pickle`` and its planner reads bytes items with
``torch.load(weights_only=False)``, so every load here goes through ``_SafeReader`` and
``_SafePlanner`` instead.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import UsageError
from ..models import build_model
from ..run_config import RunConfig
from ..train.checkpoint import TMP_TAG, save_checkpoint
from ..train.finetune import lr_scale
from ..train.optim import build_optimizer
from .tensor import RowOrder, row_order

DCP_DIR = "dcp"


def save_sharded(
    par: Any,
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    cfg: RunConfig,
    trainer_state: dict[str, Any],
) -> Path:
    """Write a checkpoint from every rank of ``par`` (a collective: all ranks call it)."""
    directory = Path(directory)
    staging = directory.parent / f".{directory.name}{TMP_TAG}dcp"  # a crashed save leaves it to recover()
    if par.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    par.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(staging))
    if par.is_main:
        try:
            full = consolidate(staging, cfg, par.degrees.tp)
            meta = {**trainer_state, "parallel": par.layout()}
            save_checkpoint(directory, full, tokenizer, cfg, meta,
                            before_commit=lambda tmp: os.replace(staging, tmp / DCP_DIR))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    par.barrier()
    return directory


def consolidate(dcp_dir: str | Path, cfg: RunConfig, tp: int) -> nn.Module:
    """One CPU model with the weights of the DCP checkpoint ``dcp_dir`` (written with tensor
    parallel degree ``tp``), in the model's row order."""
    model = build_model(cfg.model)
    rows = row_order(model, tp)  # every stage's reorderings, not only this rank's
    weights = model.state_dict()
    _load_here({"model": weights}, dcp_dir)
    with torch.no_grad():
        for name, value in weights.items():
            value.copy_(rows.to_model(name, value.clone()))
    return model


def same_layout(par: Any, state: dict[str, Any] | None) -> bool:
    """Whether the checkpoint was written by ranks laid out as ``par``'s: then each rank reads
    only its own shards (``load_sharded``)."""
    return par is not None and state is not None and state.get("parallel") == par.layout()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Every rank reads its shards of the weights and optimizer state from ``dcp/`` (a collective)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    _safe_load(state, checkpoint / DCP_DIR, no_dist=False)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def full_optimizer_state(model: nn.Module, cfg: RunConfig, checkpoint: Path, state: dict[str, Any]) -> dict:
    """The optimizer state of ``checkpoint`` as a full state dict keyed by parameter name, in the
    model's row order; ``model`` is the unwrapped model on this process (not yet sharded)."""
    scratch = build_optimizer(model, cfg.train, lr_scale(model, cfg))  # the saved state's groups
    if "optimizer" in state:  # written by one process
        scratch.load_state_dict(state["optimizer"])
        return get_optimizer_state_dict(model, scratch)
    if not (checkpoint / DCP_DIR).is_dir():
        raise UsageError(f"{checkpoint}: neither an optimizer state in {checkpoint / 'trainer_state.pt'} "
                         f"nor a sharded one in {checkpoint / DCP_DIR}; expected a checkpoint from `blockformer train`")
    loaded = {"optim": get_optimizer_state_dict(model, scratch)}  # zero moments: the shapes to read into
    _load_here(loaded, checkpoint / DCP_DIR)
    saved_rows = row_order(model, state.get("parallel", {}).get("tp", 1))
    return _map_states(loaded["optim"], saved_rows.to_model)


def load_optimizer_state(par: Any, model: nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Give ``optimizer`` (over ``model``, possibly sharded) the full state dict ``full``."""
    rows = par.rows if par is not None else RowOrder()
    full = _map_states(full, rows.to_sharded)
    mine = {name for name, _ in model.named_parameters()}  # a pipeline rank holds some stages only
    full = {"state": {k: v for k, v in full["state"].items() if k in mine},
            "param_groups": [{**g, "params": [p for p in g["params"] if p in mine]} for g in full["param_groups"]]}
    options = StateDictOptions(full_state_dict=par is not None)
    set_optimizer_state_dict(model, optimizer, full, options=options)


def _load_here(state: dict, dcp_dir: Path) -> None:
    """Read ``state`` whole from ``dcp_dir`` in this process alone (no collective)."""
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        _safe_load(state, Path(dcp_dir), no_dist=True)


def _map_states(osd: dict, f) -> dict:
    """``osd`` with each per-parameter tensor ``v`` of parameter ``name`` replaced by ``f(name, v)``."""
    states = {name: {k: f(name, v) if torch.is_tensor(v) else v for k, v in s.items()}
              for name, s in osd["state"].items()}
    return {**osd, "state": states}


# ---------------------------------------------------------------------- reading dcp/ safely
# A checkpoint may come from anyone: its files are data. ``.metadata`` is read by an
# unpickler that builds only DCP's own metadata classes (and the torch values inside them),
# every item it names must lie in a file directly inside dcp/, and bytes items (the
# optimizer's lr, betas, ...) are read with ``weights_only=True``, as DCP already reads tensors.
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


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose bytes items are read with ``weights_only=True``: numbers,
    strings, tensors and containers only."""

    def __init__(self, dcp_dir: Path) -> None:
        super().__init__()
        self.dcp_dir = dcp_dir

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


def _safe_load(state: dict, dcp_dir: Path, *, no_dist: bool) -> None:
    """``dcp.load(state)`` from ``dcp_dir`` through the safe reader and planner; any failure
    is one UsageError naming the directory."""
    reader = _SafeReader(dcp_dir)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(dcp_dir), no_dist=no_dist)
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
