"""DCP chunks in the model's own row order for the fused weights tensor parallelism reorders.

Under ``tp > 1`` a fused weight ``[q; k; v]`` is held with its rows reordered rank-major
(``tensor.RowOrder``), so its DTensor's global tensor is not the model's. Saved as is,
``dcp/`` would depend on the tensor-parallel degree that wrote it. Instead each rank's
local rows are described to DCP as the runs that are contiguous in the model's order:
rank ``r`` of ``tp`` holds ``[q_r; k_r; v_r]``, three chunks of the model-order tensor (more
when FSDP cuts a run). Any layout then reads exactly its own rows back (DCP matches chunks
by their offsets), and one process reads the tensor whole, in the model's order.

``_ModelRows`` answers DCP's chunk hooks (``__create_write_items__``, ``__create_chunk_list__``,
the ones DTensor implements); the planners put one in place of each reordered DTensor
after flattening the state dict, and look up a chunk's local rows by its offsets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .tensor import RowOrder


class _ModelRows:
    """A rank's shard of a reordered weight (or of its AdamW moment) as chunks of the
    model-order tensor: one per run of its rows that is contiguous in the model's order."""

    def __init__(self, value: DTensor, order: torch.Tensor) -> None:
        local = value.to_local()
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        rows = order[offsets[0]: offsets[0] + local.shape[0]]  # the shard's rows are contiguous in the sharded order
        self.global_shape, self.dtype = value.shape, local.dtype
        self.views: dict[torch.Size, torch.Tensor] = {}
        self.chunks: list[ChunkStorageMetadata] = []
        for a, b in contiguous_runs(rows):
            chunk = ChunkStorageMetadata(offsets=torch.Size([int(rows[a]), *offsets[1:]]), sizes=local[a:b].shape)
            self.chunks.append(chunk)
            self.views[chunk.offsets] = local[a:b]

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=properties, size=self.global_shape))
                for c in self.chunks]

    def chunk_view(self, offsets: torch.Size) -> torch.Tensor:
        """The local rows of the chunk at ``offsets`` (written from, or read into, in place)."""
        return self.views[torch.Size(offsets)]


def contiguous_runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """The spans ``[a, b)`` of ``rows`` (row indices of the model's order) that run on by one:
    each is one contiguous read or write of the model-order tensor."""
    cuts = [0, *((rows[1:] - rows[:-1] != 1).nonzero().flatten() + 1).tolist(), len(rows)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def flat_row_orders(state: dict[str, Any], rows: RowOrder) -> dict[str, torch.Tensor]:
    """The row order of each reordered tensor of ``state`` (``{"model": ..., "optim": ...}``),
    keyed by the flattened name DCP gives it (``optim.state.<param>.exp_avg``)."""
    orders = {f"model.{name}": rows.orders[name] for name in state["model"] if name in rows.orders}
    for name, moments in state["optim"]["state"].items():
        if name in rows.orders:
            orders.update({f"optim.state.{name}.{k}": rows.orders[name] for k, v in moments.items()
                           if torch.is_tensor(v) and v.dim() > 0})
    return orders


class ModelRowsPlanning:
    """Planner mixin: after flattening, each reordered DTensor becomes a ``_ModelRows`` (not
    before: torch's meta-tensor pass in ``set_up_planner`` keeps only the types it knows)."""

    def __init__(self, orders: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.orders = orders or {}

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_planner(state_dict, *args, **kwargs)
        for fqn, order in self.orders.items():
            if isinstance(self.state_dict.get(fqn), DTensor):
                self.state_dict[fqn] = _ModelRows(self.state_dict[fqn], order)

    def _chunk(self, index: MetadataIndex) -> torch.Tensor | None:
        obj = self.state_dict.get(index.fqn)
        return obj.chunk_view(index.offset) if isinstance(obj, _ModelRows) else None


class ModelRowsSavePlanner(ModelRowsPlanning, DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        chunk = self._chunk(index)
        return super().lookup_object(index) if chunk is None else chunk
