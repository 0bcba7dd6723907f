"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), inside the usual directory.

A parallel run's checkpoint is the ordinary self-describing directory (``config.json``,
``tokenizer.json``, ``trainer_state.pt``) with its weights and AdamW moments in ``dcp/``:
every rank writes its own shards there at once, each named by parameter and placed in the
tensor's global shape, in the model's own row order. Tensor parallelism stores a fused
weight's rows reordered (``tensor.RowOrder``); a rank's rows are written as the runs that
are contiguous in the model's order (``model_rows.py``), so ``dcp/`` is the same whatever
layout wrote it, and any layout reads it back: each rank reads only the pieces of the
files that hold its own shards (DCP reshards), never the whole model.

``model.safetensors``, which ``generate``/``eval`` and the exporters also read, is an export
of ``dcp/``: written beside it when ``train.consolidate`` is on (the default), or later with
``blockformer convert --consolidate``, one tensor at a time (``write_consolidated``), so the
writing process never holds the whole model. Every reader takes either form.

Checkpoints written before the model-order ``dcp/`` (no ``dcp_rows`` in the trainer state,
with ``tp > 1``) carry ``model.safetensors`` and resume into another layout through it.
Reading ``dcp/`` never runs code from it: every load goes through ``dcp_reader.safe_load``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import struct
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import UsageError
from ..models import build_model
from ..paths import TMP_TAG, WEIGHTS
from ..run_config import RunConfig
from .dcp_reader import read_metadata, safe_load
from .model_rows import ModelRowsSavePlanner, contiguous_runs, flat_row_orders
from .tensor import RowOrder, row_order

DCP_DIR = "dcp"
ROWS_KEY, MODEL_ROWS = "dcp_rows", "model"  # trainer state: dcp/ holds every tensor in the model's row order


def save_sharded(
    par: Any,
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    cfg: RunConfig,
    trainer_state: dict[str, Any],
    write: Callable[..., Path],
) -> Path:
    """Write a checkpoint from every rank of ``par`` (a collective: all ranks call it): the
    shards go to ``dcp/``, and rank 0 commits the directory with ``write`` (the trainer's
    checkpoint writer), streaming ``model.safetensors`` from ``dcp/`` when ``train.consolidate``."""
    directory = Path(directory)
    staging = directory.parent / f".{directory.name}{TMP_TAG}dcp"  # a crashed save leaves it to recover()
    if par.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    par.barrier()
    state = _sharded_state(model, optimizer)
    dcp.save(state, checkpoint_id=str(staging), planner=ModelRowsSavePlanner(flat_row_orders(state, par.rows)))
    if par.is_main:
        try:
            meta = {**trainer_state, "parallel": par.layout(), ROWS_KEY: MODEL_ROWS}

            def add_shards(tmp: Path) -> None:
                os.replace(staging, tmp / DCP_DIR)
                if cfg.train.consolidate:
                    write_consolidated(tmp / DCP_DIR, cfg, tmp / WEIGHTS)

            write(directory, None, tokenizer, cfg, meta, before_commit=add_shards)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    par.barrier()
    return directory


def load_sharded(par: Any, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path,
                 model_rows: bool = True) -> None:
    """Every rank reads its shards of the weights and optimizer state from ``dcp/`` (a
    collective), whatever layout wrote them; ``model_rows=False``: an older checkpoint, whose
    ``dcp/`` holds the reordered rows as they were sharded (read back on the same layout only)."""
    state = _sharded_state(model, optimizer)
    groups = [g["params"] for g in state["optim"]["param_groups"]]  # this rank's names (a pipeline stage's)
    orders = flat_row_orders(state, par.rows) if model_rows else None
    safe_load(state, checkpoint / DCP_DIR, no_dist=False, orders=orders)
    for group, names in zip(state["optim"]["param_groups"], groups):
        group["params"] = names  # the saved groups' hyperparameters, with the parameters held here
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def lays_out_rows_by_model(state: dict[str, Any]) -> bool:
    """Whether the parallel checkpoint of trainer state ``state`` wrote ``dcp/`` in the
    model's row order (every checkpoint since ``dcp_rows``, and any without tensor parallelism)."""
    return state.get(ROWS_KEY) == MODEL_ROWS or state.get("parallel", {}).get("tp", 1) == 1


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


# ---------------------------------------------------------------------- a base read in parts
def read_parts(checkpoint: Path, wanted: dict[str, tuple[torch.Tensor, list[str]]], rows: RowOrder,
               weights: str = WEIGHTS) -> None:
    """Fill in each of ``wanted`` (name -> this rank's target, a DTensor or a tensor it holds
    whole, and the names the checkpoint may hold it under: a tied table's) from ``checkpoint``,
    reading only the block the rank holds: a slice of its safetensors file ``weights`` at the
    shard's offsets (safetensors copies just those rows and columns), else the rank's own
    chunks of ``dcp/`` (a collective). A reordered fused weight (``rows``) is a few runs of rows
    that lie contiguous in the file's order: one slice each."""
    with torch.no_grad():
        if (checkpoint / weights).is_file():
            _from_safetensors(checkpoint / weights, wanted, rows)
        else:
            _from_dcp(checkpoint / DCP_DIR, wanted, rows)


def _block(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's tensor of ``target``, its shape and its offsets in the (sharded-order) whole."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return target.to_local(), tuple(shape), tuple(offset)
    return target, tuple(target.shape), (0,) * target.dim()


def _copy_block(target: torch.Tensor, whole: Any, order: torch.Tensor | None,
                scalar: Callable[[], torch.Tensor] | None = None, add: bool = False) -> None:
    """This rank's block of ``target`` copied from ``whole``, the full tensor in the model's row
    order (a safetensors slice, a tensor mapped from a file, or anything indexed by a row slice
    and column slices), or added to it (``add``): only that block is read. A reordered fused
    weight (``order``: the model's row of each sharded row) is a few runs of rows that lie
    contiguous in the model's order, one slice each."""
    local, shape, offset = _block(target)
    put = torch.Tensor.add_ if add else torch.Tensor.copy_
    if local.numel() == 0:
        return
    if local.dim() == 0:
        put(local, scalar() if scalar is not None else whole)
        return
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))
    if order is None:
        put(local, whole[(slice(offset[0], offset[0] + shape[0]), *rest)])
        return
    mine = order[offset[0]: offset[0] + shape[0]]  # the model's rows, in the shard's order
    for a, b in contiguous_runs(mine):
        start = int(mine[a])
        put(local[a:b], whole[(slice(start, start + b - a), *rest)])


def add_parts(wanted: dict[str, tuple[torch.Tensor, Any]], rows: RowOrder) -> None:
    """Add to each of ``wanted`` (name -> this rank's target, and the full tensor to add,
    indexed by a row slice and column slices: an adapter's low-rank update) this rank's block."""
    with torch.no_grad():
        for name, (target, whole) in wanted.items():
            _copy_block(target, whole, rows.orders.get(name), add=True)


def _from_safetensors(file: Path, wanted: dict[str, tuple[torch.Tensor, list[str]]], rows: RowOrder) -> None:
    try:
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            for name, (target, names) in wanted.items():
                key = next((n for n in names if n in present), None)
                if key is None:
                    raise UsageError(f"{file}: holds no {name}; expected the file written with its config.json")
                _copy_block(target, f.get_slice(key), rows.orders.get(name),
                            lambda: f.get_tensor(key))  # a 0-dim tensor cannot be sliced
    except SafetensorError as e:
        raise UsageError(f"{file}: cannot read the weights ({str(e).strip().splitlines()[0]}); expected the "
                         f"file written with its config.json") from None


def _from_dcp(dcp_dir: Path, wanted: dict[str, tuple[torch.Tensor, list[str]]], rows: RowOrder) -> None:
    present = {k[len("model."):] for k in read_metadata(dcp_dir).state_dict_metadata if k.startswith("model.")}
    state, orders = {}, {}
    for name, (target, names) in wanted.items():
        key = next((n for n in names if n in present), None)
        if key is None:
            raise UsageError(f"{dcp_dir}: holds no {name}; expected the dcp/ written with its config.json")
        state[key] = target
        if name in rows.orders:
            orders[f"model.{key}"] = rows.orders[name]
    safe_load({"model": state}, dcp_dir, no_dist=False, orders=orders)


# ---------------------------------------------------------------------- one process
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def weight_names(cfg: RunConfig) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The tensors a checkpoint's weights hold, each tied table under one name, the one
    ``safetensors.torch.save_model`` keeps (the first in sorted order): name -> (shape, dtype),
    from a model built on the meta device (no storage)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    tied: dict[int, list[str]] = {}
    tensors = model.state_dict(keep_vars=True)
    for name, t in tensors.items():
        tied.setdefault(id(t), []).append(name)
    kept = sorted(min(names) for names in tied.values())
    return {name: (tensors[name].shape, tensors[name].dtype) for name in kept}


def write_consolidated(dcp_dir: Path, cfg: RunConfig, file: Path) -> None:
    """``model.safetensors`` from ``dcp_dir``, read and written one tensor at a time: the most
    held at once is the largest tensor (the embedding table), not the model. safetensors'
    own writers take the whole dict in memory; the format is a length-prefixed JSON header
    (name -> dtype, shape, byte range) followed by the raw bytes, written here in that order."""
    names = weight_names(cfg)
    saved = read_metadata(dcp_dir).state_dict_metadata
    missing = [n for n in names if f"model.{n}" not in saved]
    if missing:
        raise UsageError(f"{dcp_dir}: no tensor for {missing[:3]}; expected the dcp/ of a checkpoint of this config")
    tensors = {n: (saved[f"model.{n}"].size, saved[f"model.{n}"].properties.dtype) for n in names}  # as saved
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for name, (shape, dtype) in sorted(tensors.items(), key=lambda kv: (-kv[1][1].itemsize, kv[0])):  # aligned
        end = start + dtype.itemsize * shape.numel()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in (k for k in header if k != "__metadata__"):
            tensor = torch.empty(tensors[name][0], dtype=tensors[name][1])
            _load_here({"model": {name: tensor}}, dcp_dir)
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")


def consolidate_checkpoint(checkpoint: Path, cfg: RunConfig) -> Path:
    """Write ``checkpoint``'s ``model.safetensors`` from its ``dcp/`` (``write_consolidated``),
    under a temporary name renamed into place: a crash never leaves a partial weights file."""
    file = checkpoint / WEIGHTS
    if not (checkpoint / DCP_DIR).is_dir():
        raise UsageError(f"{checkpoint}: has no {DCP_DIR}/; expected a checkpoint written by a parallel run")
    if file.exists():
        raise UsageError(f"{file}: already there; expected a checkpoint whose weights are only in {DCP_DIR}/")
    tmp = checkpoint / f".{WEIGHTS}{TMP_TAG}{os.getpid()}"
    try:
        write_consolidated(checkpoint / DCP_DIR, cfg, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return file


def dcp_parameter_count(checkpoint: Path) -> int | None:
    """How many weights ``checkpoint``'s ``dcp/`` holds, from its metadata alone (None when
    it cannot be read: the load that follows names the damage)."""
    try:
        saved = read_metadata(checkpoint / DCP_DIR).state_dict_metadata
    except UsageError:
        return None
    return sum(md.size.numel() for k, md in saved.items() if k.startswith("model.") and hasattr(md, "size"))


def load_into(model: nn.Module, checkpoint: Path) -> None:
    """The weights of ``checkpoint``'s ``dcp/`` into the (one-process) ``model``, strictly,
    read in place into its own tensors."""
    _load_here({"model": model.state_dict()}, checkpoint / DCP_DIR)


def dcp_weights(checkpoint: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The weights of ``checkpoint``'s ``dcp/`` as one process's state dict (tied tables once)."""
    state = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in weight_names(cfg).items()}
    _load_here({"model": state}, checkpoint / DCP_DIR)
    return state


def dcp_reader(checkpoint: Path) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """The weight names ``checkpoint``'s ``dcp/`` holds, and a reader of one of them whole, in
    the model's row order, by this process alone (no collective): one tensor in memory at a time."""
    sizes = {k[len("model."):]: m for k, m in read_metadata(checkpoint / DCP_DIR).state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}

    def read(key: str) -> torch.Tensor:
        t = torch.empty(sizes[key].size, dtype=sizes[key].properties.dtype)
        _load_here({"model": {key: t}}, checkpoint / DCP_DIR)
        return t

    return set(sizes), read


def full_optimizer_state(model: nn.Module, scratch: torch.optim.Optimizer, checkpoint: Path,
                         state: dict[str, Any]) -> dict:
    """The optimizer state of ``checkpoint`` as a full state dict keyed by parameter name, in the
    model's row order; ``model`` is the unwrapped model on this process (not yet sharded) and
    ``scratch`` a fresh optimizer over it with the run's parameter groups."""
    if "optimizer" in state:  # written by one process
        scratch.load_state_dict(state["optimizer"])
        return get_optimizer_state_dict(model, scratch)
    if not (checkpoint / DCP_DIR).is_dir():
        raise UsageError(f"{checkpoint}: neither an optimizer state in {checkpoint / 'trainer_state.pt'} "
                         f"nor a sharded one in {checkpoint / DCP_DIR}; expected a checkpoint from `blockformer train`")
    loaded = {"optim": get_optimizer_state_dict(model, scratch)}  # zero moments: the shapes to read into
    _load_here(loaded, checkpoint / DCP_DIR)
    if lays_out_rows_by_model(state):
        return loaded["optim"]
    saved_rows = row_order(model, state["parallel"]["tp"])  # an older checkpoint: dcp/ in the sharded order
    return _map_states(loaded["optim"], saved_rows.to_model)


def load_optimizer_state(par: Any, model: nn.Module, optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Give ``optimizer`` (over ``model``, possibly sharded) the full state dict ``full`` (keyed
    by parameter name, in the model's row order), written into its own state in place: each
    rank copies the block of every moment that its parameters hold and nothing more, so a
    state mapped from its file (``torch.load(mmap=True)``) is read in parts."""
    rows = par.rows if par is not None else RowOrder()
    names = {p: name for name, p in model.named_parameters()}  # a pipeline rank holds some stages only
    saved_groups = {name: g for g in full["param_groups"] for name in g["params"]}
    for group in optimizer.param_groups:
        saved = next((saved_groups[names[p]] for p in group["params"] if names[p] in saved_groups), None)
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        for p, name in names.items():
            if name in full["state"]:
                optimizer.state[p] = {k: _moment_block(p, v, rows.orders.get(name)) if torch.is_tensor(v) else v
                                      for k, v in full["state"][name].items()}


def _moment_block(param: torch.Tensor, value: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """This rank's part of ``value``, a full tensor of ``param``'s state: a moment of its shape
    becomes ``param``'s block of it (a DTensor laid out as ``param``, in its dtype), anything
    else (the step) a copy."""
    if value.shape != param.shape or value.dim() == 0:
        return value.detach().clone()
    if isinstance(param, DTensor):
        target = DTensor.from_local(torch.empty_like(param.to_local()), param.device_mesh, param.placements,
                                    run_check=False, shape=param.shape, stride=param.stride())
    else:
        target = torch.empty_like(param, memory_format=torch.contiguous_format)
    _copy_block(target, value, order)
    _page_out(value)
    return target


def _page_out(value: torch.Tensor) -> None:
    """Let the kernel drop ``value``'s pages from this process (``MADV_PAGEOUT``, Linux 5.4+):
    a tensor mapped from its file, once this rank has copied its block, leaves its resident
    memory, so reading a state in parts stays at the parts; the data is kept (a file page is
    read again, and an anonymous one without swap stays), so it is safe on any tensor."""
    if _madvise is None or value.device.type != "cpu" or value.numel() == 0:
        return
    start = value.data_ptr() & ~(_PAGE - 1)
    _madvise(start, value.data_ptr() + value.numel() * value.element_size() - start, _MADV_PAGEOUT)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":  # MADV_PAGEOUT is Linux's: elsewhere the pages stay until the state is freed
        return None
    try:
        f = ctypes.CDLL(None).madvise
    except (AttributeError, OSError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


_madvise, _MADV_PAGEOUT, _PAGE = _libc_madvise(), 21, mmap.PAGESIZE


def _load_here(state: dict, dcp_dir: Path) -> None:
    """Read ``state`` from ``dcp_dir`` in this process alone (no collective)."""
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        safe_load(state, Path(dcp_dir), no_dist=True)


def _map_states(osd: dict, f) -> dict:
    """``osd`` with each per-parameter tensor ``v`` of parameter ``name`` replaced by ``f(name, v)``."""
    states = {name: {k: f(name, v) if torch.is_tensor(v) else v for k, v in s.items()}
              for name, s in osd["state"].items()}
    return {**osd, "state": states}
