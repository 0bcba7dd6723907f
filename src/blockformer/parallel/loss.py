"""Loss parallel: the training loss computed on logits split by vocabulary, never gathered.

Under tensor parallelism the head is split by vocabulary columns, so each rank computes
logits for ``V / tp`` classes. Gathering them would put the whole ``(B, T, V)`` tensor, the
largest activation of a small model, on every rank. Inside ``loss_context`` the head hands
out its shard instead, a ``DTensor`` placed ``Shard(-1)``, and cross-entropy runs under
``torch.distributed.tensor.parallel.loss_parallel``: the log-softmax all-reduces the max
and the sum of exponentials over the vocabulary shards (two ``(B, T)`` all-reduces), the
target's log-probability is read on the rank that holds its class, and the backward is
local. Outside the context (evaluation, decoding, a checkpoint's logits) the head gathers
its logits as plain TP does.

``loss_parallel`` supports padding (``ignore_index``) and the summed reduction
``token_loss`` uses, but not label smoothing: with ``train.label_smoothing > 0`` the logits
are gathered and the loss is the plain one. The backward pass must run inside the context
too (its nll/log-softmax backward is fused there), so the training step wraps forward and
backward in it.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

_SHARDED = ContextVar("blockformer_sharded_logits", default=False)


def shard_head(head: nn.Linear, mesh: DeviceMesh) -> None:
    """Split ``head`` by vocabulary columns over the 1-D ``mesh``; its logits are ``Shard(-1)``
    inside ``loss_context``, gathered outside it."""
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    head.register_forward_hook(_gather_outside_loss)


def _gather_outside_loss(module: nn.Module, args: tuple[Any, ...], output: DTensor) -> torch.Tensor | DTensor:
    return output if _SHARDED.get() else output.full_tensor()


def applies(par: Any, label_smoothing: float) -> bool:
    """Whether the loss is vocabulary-parallel: tensor parallelism without label smoothing."""
    return par is not None and par.degrees.tp > 1 and label_smoothing == 0.0


@contextmanager
def loss_context(par: Any, label_smoothing: float = 0.0) -> Iterator[None]:
    """Forward and backward of a training loss with vocabulary-parallel logits where it applies
    (a no-op otherwise: one process, ``tp = 1``, label smoothing)."""
    if not applies(par, label_smoothing):
        yield
        return
    token = _SHARDED.set(True)
    try:
        with loss_parallel():
            yield
    finally:
        _SHARDED.reset(token)
