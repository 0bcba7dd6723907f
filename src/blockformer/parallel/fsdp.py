"""Data parallelism: FSDP2 (``fully_shard``) and DDP.

FSDP (ZeRO-3, Rajbhandari et al. 2020; Zhao et al. 2023) keeps ``1/dp_shard`` of every
parameter, gradient and optimizer moment on each rank; it all-gathers a block's weights
just before the block runs and reduce-scatters its gradients just after. Each block is
one unit so only one block's full weights exist at a time, then the embeddings and head,
then the root for what is left. With ``dp_replicate > 1`` too the mesh is 2-D (HSDP):
sharded within a group, replicated across groups. DDP (plain replicas, gradients
all-reduced) is used when nothing is sharded and there is no tensor parallelism.

Under gradient accumulation only the last micro-batch's backward communicates
(``gradient_sync``, with ``parallel.grad_sync = "last"``, the default; ``"every"`` keeps
each micro-batch's reduction and the gradients sharded): the earlier ones accumulate unsharded gradients locally, so a step
makes one reduce-scatter per FSDP unit (one bucketed all-reduce pass under DDP) instead of
one per micro-batch. The price is memory: between the first and the last backward each rank
holds the unsharded gradients of every unit (the whole model's, in fp32), where syncing
every micro-batch (torchtitan's default) holds only its shard. The weights are still
resharded after each backward (``set_reshard_after_backward`` is left on): keeping them
whole too would save the next forward's all-gather at the cost of the model's full weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from ..precision import DTYPES


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The Transformer blocks of every stack of ``model``, in order (encoder first)."""
    out = []
    for name in ("encoder", "decoder"):
        stack = getattr(model, name, None)
        if stack is not None:
            blocks = stack.blocks
            out.extend(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    return out


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16/fp16 weights in the forward and backward, gradients reduced in fp32."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, precision: str, roots: list[nn.Module] | None = None) -> None:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP). ``roots``
    are the modules called from outside (default: ``model``; pipeline stages under PP)."""
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision(precision)}
    for block in blocks_of(model):
        fully_shard(block, **kwargs)
    if not model.cfg.tie_embeddings:  # a tied table is shared by embedding and head: leave it to the root
        for name in ("embed", "src_embed", "tgt_embed", "head"):
            module = getattr(model, name, None)
            if module is not None and any(p.requires_grad for p in module.parameters()):
                fully_shard(module, **kwargs)
    for root in roots or [model]:
        fully_shard(root, **kwargs)
        for method in ("encode", "decode"):  # greedy decoding calls these, not forward
            if hasattr(root, method):
                register_fsdp_forward_method(root, method)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``model`` replicated over the 1-D ``mesh``, its gradients all-reduced (a wrapper)."""
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, device_mesh=mesh)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """The forward and backward inside reduce gradients across the data-parallel ranks only
    when ``enabled`` (the last micro-batch of a step); otherwise they accumulate locally. FSDP2
    reads its flag at backward time, DDP at forward time; a plain module (one process, TP
    alone) has nothing to sync."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)  # recurses into every unit
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield
