"""Task heads: what a finished body's last hidden states are turned into besides tokens.

A head reads hidden states ``(B, T, d_model)`` and a mask of the real positions, never
token ids, so any body that yields hidden states can carry one (a text encoder, a decoder,
an encoder-decoder's encoder, a vision encoder's patches).

- ``SequenceHead``: one vector per sequence (pooled: the first position ``cls``, the
  ``mean`` of the real positions, the ``last`` real position, which is the only one a
  causal decoder lets see the whole text, or the body's own ``pooler``: BERT's dense + tanh
  on the first position), then a linear layer (with or without a bias): class logits, or
  one number for regression.
- ``TokenHead``: a linear layer at every position (token classification).

``TaskModel`` joins a body and a head; its state dict keys are ``body.*`` and ``head.*``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..nn.dropout import Dropout
from .checks import check_token_types

POOLINGS = ("cls", "mean", "last", "pooler")  # pooler: the body's, passed to SequenceHead


def pool(hidden: torch.Tensor, mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """(B, T, d) hidden states -> (B, d): the first, the mean of the real, or the last real
    position (``mask`` (B, T): True for real positions; right padding)."""
    if how == "cls":
        return hidden[:, 0]
    if mask is None:
        return hidden.mean(dim=1) if how == "mean" else hidden[:, -1]
    mask = mask.to(hidden.dtype)
    if how == "mean":
        return (hidden * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if how == "last":
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"pooling={how!r}: expected one of {POOLINGS}")


class SequenceHead(nn.Module):
    """Pooled hidden state -> dropout -> ``n_outputs`` logits (or values).

    ``pooling="pooler"`` reads ``pooler`` (the body's ``pool``, BERT's pooler): its weights
    stay the body's, so they load, train and export as the body's. ``task`` (``classify``,
    ``multilabel``, ``regress``) says what the outputs mean, for an export."""

    def __init__(self, d_model: int, n_outputs: int, pooling: str = "cls", dropout: float = 0.0, *,
                 bias: bool = True, pooler: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 task: str = "classify") -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: expected one of {POOLINGS}")
        if (pooling == "pooler") != (pooler is not None):
            raise ValueError(f"pooling={pooling!r}: a pooler is passed exactly with pooling='pooler'")
        self.pooling, self.pooler, self.task = pooling, pooler, task  # a bound method: not a submodule
        self.dropout = Dropout(dropout)
        self.proj = nn.Linear(d_model, n_outputs, bias=bias)
        nn.init.normal_(self.proj.weight, 0.0, 0.02)
        if bias:
            nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d_model) -> (B, n_outputs)."""
        pooled = self.pooler(hidden) if self.pooler is not None else pool(hidden, mask, self.pooling)
        return self.proj(self.dropout(pooled))


class TokenHead(nn.Module):
    """Dropout -> ``n_outputs`` logits at every position."""

    def __init__(self, d_model: int, n_outputs: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = Dropout(dropout)
        self.proj = nn.Linear(d_model, n_outputs)
        nn.init.normal_(self.proj.weight, 0.0, 0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, n_outputs)."""
        return self.proj(self.dropout(hidden))


class TaskModel(nn.Module):
    """A body (any model with ``hidden_states(tokens, *, attention_mask)``) and a task head."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, head
        self.cfg = body.cfg

    def forward(self, tokens: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> the head's output: (B, n) per sequence, or (B, T, n) per token.
        ``token_types`` (B, T): segment ids of a text pair, for an encoder body with a segment
        table (``EncoderModel.hidden_states``); None: all 0."""
        segments = {} if token_types is None else {"token_types": token_types}
        if segments and self.cfg.arch != "encoder":  # only an encoder's hidden_states takes them
            check_token_types(self.cfg, tokens, token_types)  # raises, naming token_types
        hidden = self.body.hidden_states(tokens, attention_mask=attention_mask, **segments)
        hidden_mask = getattr(self.body, "hidden_mask", None)  # an input adapter's class token shifts the mask
        return self.head(hidden, attention_mask if hidden_mask is None else hidden_mask(attention_mask))


def build_head(task: str, d_model: int, n_outputs: int, pooling: str, dropout: float, *, bias: bool = True,
               pooler: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """The head for a ``[head] task``: ``tokens`` gets a ``TokenHead``, the rest a ``SequenceHead``
    (``pooler``: the body's ``pool``, for ``pooling="pooler"``)."""
    if task == "tokens":
        return TokenHead(d_model, n_outputs, dropout)
    return SequenceHead(d_model, n_outputs, pooling, dropout, bias=bias, pooler=pooler, task=task)
