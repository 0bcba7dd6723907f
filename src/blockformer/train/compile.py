"""``train.compile``: the model's forward pass and its loss as one compiled graph.

``torch.compile`` traces ``objective.loss`` (embeddings, every block, the head and the
cross-entropy) into one graph with static shapes, so inductor fuses the elementwise work
around the matmuls and never builds a dynamic-shape kernel. Shapes are kept few: language
modelling batches are always ``(batch_size, seq_len)``; sequence-to-sequence batches are
padded to a small set of bucket shapes (``data.buckets``), each compiled once in the first
steps. The optimizer step is not traced: fused AdamW (``train.optim``) already runs it as
one kernel over all parameters, which is what compiling it would buy.

``train.compile = "auto"`` (the default) compiles where it was measured to pay for itself
(BENCHMARKS.md, 2-core CPU, bf16): at GPT-2 small's shape (85M weights in the blocks) the
compiled step ran 1.46x the eager one. At nanoGPT's CPU shape (0.8M) it ran 1.26x, but a
2000-step run took 44.6 s compiled against 41.5 s eager (compilation and evaluations
included), and the
7M-weight translator was slower over its first 80 steps while its bucket shapes compiled.
Small models make short runs, where the start-up (and, on a CPU, the C++ toolchain
inductor needs) is not worth it; so auto compiles when the blocks hold at least
``AUTO_MIN_BLOCK_WEIGHTS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import TransformerConfig
from ..stats import block_weights
from .objective import Objective

LossFn = Callable[..., torch.Tensor]  # (model, batch, label_smoothing) -> summed loss

BACKEND: Any = "inductor"  # tests swap in a counting backend
AUTO_MIN_BLOCK_WEIGHTS = 20_000_000


def resolve_compile(setting: bool | str, cfg: TransformerConfig) -> bool:
    """``train.compile`` as a decision: ``"auto"`` is on for models whose blocks hold at
    least ``AUTO_MIN_BLOCK_WEIGHTS`` matmul weights (embeddings and head not counted)."""
    if setting == "auto":
        return block_weights(cfg) >= AUTO_MIN_BLOCK_WEIGHTS
    return bool(setting)


def compile_loss(objective: Objective, max_shapes: int = 16) -> LossFn:
    """``objective.loss`` compiled whole (``fullgraph``: a graph break is an error, not a
    silent slowdown), with room for ``max_shapes`` static shapes before torch gives up."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), max_shapes))
    return torch.compile(objective.loss, fullgraph=True, dynamic=False, backend=BACKEND)
