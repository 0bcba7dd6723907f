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

Reading ``dcp/`` never runs code from it: every load goes through ``dcp_reader.safe_load``.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import UsageError
from ..models import build_model
from ..paths import TMP_TAG
from ..run_config import RunConfig
from .dcp_reader import safe_load
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
    write: Callable[..., Path],
) -> Path:
    """Write a checkpoint from every rank of ``par`` (a collective: all ranks call it): rank 0
    consolidates the weights and ``write`` (the trainer's checkpoint writer) commits them,
    with the sharded state moved into the checkpoint's ``dcp/``."""
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
            write(directory, full, tokenizer, cfg, meta, before_commit=lambda tmp: os.replace(staging, tmp / DCP_DIR))
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


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Every rank reads its shards of the weights and optimizer state from ``dcp/`` (a collective)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    safe_load(state, checkpoint / DCP_DIR, no_dist=False)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


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
        safe_load(state, Path(dcp_dir), no_dist=True)


def _map_states(osd: dict, f) -> dict:
    """``osd`` with each per-parameter tensor ``v`` of parameter ``name`` replaced by ``f(name, v)``."""
    states = {name: {k: f(name, v) if torch.is_tensor(v) else v for k, v in s.items()}
              for name, s in osd["state"].items()}
    return {**osd, "state": states}

