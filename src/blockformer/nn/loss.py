"""Token-level cross-entropy, summed, so micro-batches of different sizes weigh by tokens.

Label smoothing (Szegedy et al. 2016; used by Vaswani et al. 2017 with epsilon = 0.1)
trains against ``(1 - eps) * one_hot + eps / V``: the loss becomes
``(1 - eps) * NLL(target) + eps * mean_k(-log p_k)``. Padding (id 0) is ignored.

Two ways to the same number:

- ``token_loss(logits, targets)``: from logits, what any model's output can be scored by.
- ``head_loss(h, head, targets)``: the output projection and the loss fused. The logits
  ``(N, V)`` are the largest activation of a language model (GPT-2 small at batch 4 x 512:
  103M numbers, 412 MB in float32, kept twice for the log-softmax's backward), and reading
  and writing them is memory-bound work. Here they are made ``kernels.HEAD_LOSS_CHUNK_ROWS``
  rows at a time, small enough to stay in cache; each chunk's loss and its gradient with respect to the
  logits (``softmax - smoothed one_hot``) are computed at once, since the loss is the end
  of the graph, and the gradients of ``h`` and the weight are two matmuls over the whole
  batch. Nothing of size ``N x V`` is kept but that gradient, in the matmul dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from .. import kernels

PAD = 0


def token_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy of logits (..., V) against targets (...), padding excluded.

    Computed in float32 whatever the autocast dtype: a bf16 log-softmax over a large
    vocabulary loses the small differences training depends on.
    """
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=PAD,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    # Vocabulary-parallel logits (parallel/loss.py) give every rank the whole sum, as a DTensor.
    return loss.to_local() if isinstance(loss, DTensor) else loss


def head_loss(h: torch.Tensor, head: nn.Module, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """``token_loss(head(h), targets, label_smoothing)`` without the whole logits.

    Fused for a plain ``nn.Linear`` head over at least ``kernels.FUSE_MIN_VOCAB`` classes in
    eager mode (``kernels.fuse_head_loss``). Otherwise the logits are made and scored as
    usual: a small vocabulary, a subclass (LoRA adds its adapters to the product), a sharded
    head (``DTensor``: tensor parallelism has its own vocabulary-parallel loss), and a traced
    graph (inductor fuses the log-softmax itself).
    """
    if not kernels.fuse_head_loss(head, h):
        return token_loss(head(h), targets, label_smoothing)
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else head.weight.dtype
    return _LinearCrossEntropy.apply(
        h.reshape(-1, h.shape[-1]), head.weight, head.bias, targets.reshape(-1), label_smoothing, dtype
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of ``h @ weight.T + bias``; see the module doc."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, label_smoothing, dtype):  # noqa: ANN001, ANN205
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(h.device.type, enabled=False):  # the dtype is chosen above, once
            x, w = h.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            n, vocab = x.shape[0], w.shape[0]
            grad_logits = x.new_empty(n, vocab) if (need_h or need_w or need_b) else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            eps = label_smoothing
            chunk = kernels.HEAD_LOSS_CHUNK_ROWS
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                z = F.linear(x[rows], w, b).float()
                y = targets[rows]
                real = y != PAD
                # torch's (log-)softmax kernels, not exp/logsumexp: a trained model's log-probs
                # reach -100 and below, where a CPU's exp takes a slow path (10-15x per element)
                logp = torch.log_softmax(z, -1)
                loss = -logp.gather(1, y[:, None]).squeeze(1)
                if eps:
                    loss = (1 - eps) * loss - eps * logp.mean(-1)
                total += loss.masked_fill(~real, 0.0).sum()
                del logp  # at most two chunks of logits alive at once
                if grad_logits is not None:  # d loss / d z = softmax(z) - ((1 - eps) one_hot + eps / V)
                    p = torch.softmax(z, -1)
                    if eps:
                        p.sub_(eps / vocab)
                    p.scatter_add_(1, y[:, None], p.new_full((p.shape[0], 1), eps - 1.0))
                    grad_logits[rows] = p.mul_(real[:, None])
            grad_h = (grad_logits @ w).to(h.dtype) if need_h else None
            grad_w = (grad_logits.t() @ x).to(weight.dtype) if need_w else None
            grad_b = grad_logits.sum(0, dtype=torch.float32).to(bias.dtype) if need_b else None
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scaled = [None if g is None else g * grad_out.to(g.dtype) for g in (grad_h, grad_w, grad_b)]
        return *scaled, None, None, None
