"""``train.compile``: the model's forward pass and its loss as one compiled graph.

``torch.compile`` traces ``objective.loss`` (embeddings, every block, the head and the
cross-entropy) into one graph with static shapes, so inductor fuses the elementwise work
around the matmuls and never builds a dynamic-shape kernel. Shapes are kept few: language
modelling batches are always ``(batch_size, seq_len)``; sequence-to-sequence batches are
padded to a small set of bucket shapes (``data.buckets``), each compiled once in the first
steps. The optimizer step is not traced: fused AdamW (``train.optim``) already runs it as
one kernel over all parameters, which is what compiling it would buy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .objective import Objective

LossFn = Callable[..., torch.Tensor]  # (model, batch, label_smoothing) -> summed loss

BACKEND: Any = "inductor"  # tests swap in a counting backend


def compile_loss(objective: Objective, max_shapes: int = 16) -> LossFn:
    """``objective.loss`` compiled whole (``fullgraph``: a graph break is an error, not a
    silent slowdown), with room for ``max_shapes`` static shapes before torch gives up."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), max_shapes))
    return torch.compile(objective.loss, fullgraph=True, dynamic=False, backend=BACKEND)
