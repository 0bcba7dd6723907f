"""A small, self-contained training loop on a synthetic task, for the probes that need a
model that has learned something (``gradients`` after training, ``depth``).

The task is sequence reversal, read by a causal decoder: ``a1 .. an SEP an .. a1``; the
loss counts only the reversed half, which needs attention to reach across positions.
Kept apart from ``blockformer.train`` on purpose: a probe must show the raw effect of an
architectural choice, without the trainer's clipping and schedules hiding it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SEP = 1  # the bos id separates the input from its reversal
FIRST_SYMBOL = 4  # ids 0..3 are the special tokens (pad, bos, eos, unk)
IGNORE = -100


def task_vocab(n_symbols: int) -> int:
    """Vocabulary size of the reversal task with ``n_symbols`` distinct symbols."""
    return FIRST_SYMBOL + n_symbols


def reverse_batch(
    generator: torch.Generator,
    batch_size: int,
    length: int,
    n_symbols: int,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both (B, 2 * length): next-token targets, ``IGNORE`` on the first half."""
    symbols = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + n_symbols, (batch_size, length), generator=generator)
    sep = torch.full((batch_size, 1), SEP)
    seq = torch.cat([symbols, sep, symbols.flip(1)], dim=1)  # (B, 2 * length + 1)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, : length - 1] = IGNORE  # the first half is random: nothing to learn there
    targets[:, length - 1] = IGNORE  # neither is the separator
    return inputs.to(device), targets.to(device)


def task_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


def warmup_lr(step: int, lr: float, warmup: int) -> float:
    """Linear warmup from ``lr / warmup`` to ``lr`` over ``warmup`` steps, then constant."""
    return lr * min(1.0, (step + 1) / warmup) if warmup > 0 else lr


def train_reverse(
    model: nn.Module,
    *,
    steps: int,
    lr: float,
    warmup: int = 0,
    batch_size: int = 16,
    length: int = 8,
    n_symbols: int = 16,
    seed: int = 0,
    betas: tuple[float, float] = (0.9, 0.98),
) -> list[float]:
    """Train ``model`` in place with Adam (no weight decay, no clipping; the fused kernel: a
    24-block probe model has ~300 tensors, which the per-tensor loop took 9 ms a step to
    update) for ``steps`` steps;
    returns the loss at every step. A non-finite loss ends the run early (diverged): the
    rest of the curve is NaN."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=1e-9, weight_decay=0.0, fused=True)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, lr, warmup)
        inputs, targets = reverse_batch(generator, batch_size, length, n_symbols, device)
        loss = task_loss(model, inputs, targets)
        value = loss.item()
        if not math.isfinite(value):
            losses += [math.nan] * (steps - step)
            break
        losses.append(value)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return losses


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (NaN propagates: a diverged run stays NaN)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out
