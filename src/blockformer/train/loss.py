"""Token-level cross-entropy, summed, so micro-batches of different sizes weigh by tokens.

Label smoothing (Szegedy et al. 2016; used by Vaswani et al. 2017 with epsilon = 0.1)
trains against ``(1 - eps) * one_hot + eps / V``: the loss becomes
``(1 - eps) * NLL(target) + eps * mean_k(-log p_k)``. Padding (id 0) is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

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


def count_targets(targets: torch.Tensor) -> int:
    """The number of tokens ``token_loss`` averages over (non-padding targets)."""
    return int((targets != PAD).sum())
