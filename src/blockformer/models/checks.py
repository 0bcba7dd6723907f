"""Argument checks at the models' ``forward``: errors that name the argument.

Without them a bad input fails deep inside (an ``IndexError`` in an embedding, a CUDA
device assert) or, worse, runs: float ids are truncated, a mask passed where positions go
is read as positions. Type, dtype and shape checks read only metadata and cost nothing.
Value checks (ids in range, positions inside a fixed table) read the tensor, so they run
once per call: not under ``torch.compile`` (they would break a full graph) and not inside
``trusted_inputs()``, which generation enters after checking its prompts once, so the
decode loop pays nothing per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..config import ADDITIVE_POSITIONS, TransformerConfig

_TRUSTED = [0]  # depth of trusted_inputs() blocks


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Skip the value checks inside this block (the caller has checked its inputs once)."""
    _TRUSTED[0] += 1
    try:
        yield
    finally:
        _TRUSTED[0] -= 1


def _check_values() -> bool:
    return not torch.compiler.is_compiling() and _TRUSTED[0] == 0


def check_ids(tokens: object, vocab_size: int, name: str = "tokens", *, values: bool = True) -> None:
    """``tokens`` must be an integer tensor (batch, length) of ids in ``[0, vocab_size)``."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name}: a {type(tokens).__name__}; expected a torch.long tensor of token ids, "
                        f"shape (batch, length), e.g. torch.tensor([ids])")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"{name}: dtype {tokens.dtype}; expected integer token ids (torch.long)")
    if tokens.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(tokens.shape)}; expected (batch, length) "
                         f"(a single sequence: {name}[None])")
    if values and tokens.numel() and _check_values():
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: id {bad} is outside [0, {vocab_size}); expected ids below the "
                             f"model's vocab_size={vocab_size}")


def check_mask(mask: object, tokens: torch.Tensor, name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: a {type(mask).__name__}; expected a bool tensor (batch, length)")
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"{name}: shape {tuple(mask.shape)}; expected {tuple(tokens.shape)}, one flag per token "
                         f"(True = real token)")


def check_positions(
    cfg: TransformerConfig, tokens: torch.Tensor, positions: object, name: str = "tokens", *, values: bool = True
) -> None:
    """Explicit ``positions`` must be integer (batch, length) ids; with a fixed position
    table (learned, sinusoidal) every position must lie inside it."""
    table = cfg.max_seq_len if cfg.position in ADDITIVE_POSITIONS else None
    if positions is None:
        if table is not None and tokens.shape[1] > table:
            raise ValueError(
                f"{name}: length {tokens.shape[1]} exceeds max_seq_len={table}, the size of the model's "
                f"{cfg.position} position table; expected at most {table} tokens (generate() slides a window "
                f"over longer texts)"
            )
        return
    if not isinstance(positions, torch.Tensor) or positions.dtype == torch.bool or positions.is_floating_point():
        what = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"positions: {what}; expected an integer tensor of position ids (batch, length) "
                        f"(masks go in attention_mask=)")
    if positions.dim() != 2 or positions.shape[1] != tokens.shape[1] or positions.shape[0] not in (1, tokens.shape[0]):
        raise ValueError(f"positions: shape {tuple(positions.shape)}; expected {tuple(tokens.shape)} like {name}")
    if values and positions.numel() and _check_values():
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or (table is not None and high >= table):
            raise ValueError(f"positions: {low if low < 0 else high} is outside [0, {table or 'inf'}); expected "
                             f"positions inside the {cfg.position} table (max_seq_len={table})")
