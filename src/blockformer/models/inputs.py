"""Input adapters: other things than token ids, turned into the ``d_model`` vectors a block reads.

The block reads any sequence of vectors; what makes a modality is four choices, and here
three of them are separate, swappable parts of the model (the fourth, the head, is
``models/heads.py``):

===========  =========================================  ==========================================
choice       ``patches`` (images)                       ``frames`` (continuous signals)
===========  =========================================  ==========================================
split        P x P pixel patches, row by row            one vector per time step (given)
project      ``Linear(C * P * P, d_model)``             ``Linear(frame_dim, d_model)``
position     2-D: ``patch_position`` learned/sinusoidal  any 1-D ``position`` scheme (additive here,
             (``nn/position2d.py``), or none            rope/alibi/relative inside attention)
read out     class token (``cls``) or ``mean`` pooling  ``cls``, ``mean`` or ``last`` pooling
===========  =========================================  ==========================================

Each adapter maps ``(inputs, mask)`` to ``(x (B, T, d_model), positions (B, T), mask)``:
``mask`` (B, N) is True for real patches or frames (padding of variable-length inputs is
hidden from attention); a class token, if ``cls_token``, is prepended as position 0 and is
always real. ``hidden_mask`` gives the mask of the encoder's output, which a task head's
pooling and a decoder's cross-attention read.

A stack that reads patches gets no 1-D position signal (``stack_config``): the patches'
place is the 2-D signal, and raster order is not an order a rope or bias should impose.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..config import ADDITIVE_POSITIONS, TransformerConfig
from ..errors import UsageError
from ..nn.dropout import Dropout
from ..nn.position import AbsolutePosition
from ..nn.position2d import Position2d

Adapted = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # x, positions, mask


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C * P * P): non-overlapping patches, row by row (raster order)."""
    B, C, H, W = images.shape
    P = patch_size
    x = images.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5)  # (B, rows, cols, C, P, P)
    return x.reshape(B, (H // P) * (W // P), C * P * P)


class InputAdapter(nn.Module):
    """What both adapters share: the optional class token and the masks it implies."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.d_model = cfg.d_model
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.d_model) * cfg.init_std) if cfg.cls_token else None
        self.dropout = Dropout(cfg.dropout)
        self.position_1d: nn.Module | None = None  # frames: an additive 1-D table

    def n_items(self, inputs: torch.Tensor) -> int:
        """Patches or frames in ``inputs`` (before a class token)."""
        raise NotImplementedError

    def default_mask(self, inputs: torch.Tensor) -> torch.Tensor:
        """All real: (B, N) True."""
        return torch.ones(inputs.shape[0], self.n_items(inputs), dtype=torch.bool, device=inputs.device)

    def hidden_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask of the adapter's output: ``mask`` with the class token's True in front."""
        if mask is None or self.cls is None:
            return mask
        return torch.cat([torch.ones_like(mask[:, :1], dtype=torch.bool), mask.bool()], dim=1)

    def _finish(self, x: torch.Tensor, mask: torch.Tensor | None) -> Adapted:
        """Prepend the class token, number the positions 0..T-1, apply dropout."""
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)[None, :].expand(B, T)
        if self.position_1d is not None:
            x = x + self.position_1d(positions).to(x.dtype)
        return self.dropout(x), positions, self.hidden_mask(mask)

    def _check_mask(self, mask: torch.Tensor | None, B: int, N: int, what: str) -> None:
        if mask is not None and tuple(mask.shape) != (B, N):
            raise UsageError(f"attention_mask: shape {tuple(mask.shape)}; expected ({B}, {N}), one per {what}")


class PatchInput(InputAdapter):
    """Images (B, C, H, W) -> patches -> linear projection (+ 2-D position) (+ class token)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg)
        self.patch_size, self.channels = cfg.patch_size, cfg.image_channels
        self.max_hw = (cfg.image_height, cfg.image_width)
        self.proj = nn.Linear(cfg.image_channels * cfg.patch_size**2, cfg.d_model)
        rows, cols = cfg.image_height // cfg.patch_size, cfg.image_width // cfg.patch_size
        self.position = None if cfg.patch_position == "none" else Position2d(cfg.patch_position, cfg.d_model, rows, cols)

    def _check(self, images: torch.Tensor) -> None:
        if images.dim() != 4 or images.shape[1] != self.channels:
            raise UsageError(f"images: shape {tuple(images.shape)}; expected (batch, {self.channels}, height, width)")
        H, W = images.shape[-2:]
        P, (max_h, max_w) = self.patch_size, self.max_hw
        if H % P or W % P or H > max_h or W > max_w:
            raise UsageError(f"images: {H}x{W} pixels; expected multiples of patch_size={P}, "
                             f"at most image_height={max_h} x image_width={max_w}")

    def n_items(self, images: torch.Tensor) -> int:
        return (images.shape[-2] // self.patch_size) * (images.shape[-1] // self.patch_size)

    def forward(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> Adapted:
        """``mask`` (B, N): True for real patches (padding of narrower images is False)."""
        self._check(images)
        patches = patchify(images.to(self.proj.weight.dtype), self.patch_size)  # (B, N, C*P*P)
        self._check_mask(mask, patches.shape[0], patches.shape[1], "patch")
        x = self.proj(patches)  # (B, N, d_model)
        if self.position is not None:
            cols = images.shape[-1] // self.patch_size
            index = torch.arange(patches.shape[1], device=x.device)
            x = x + self.position(index // cols, index % cols)[None].to(x.dtype)
        return self._finish(x, mask)


class FrameInput(InputAdapter):
    """Real vectors (B, T, frame_dim) -> linear projection (+ 1-D absolute position) (+ class token).

    Rope, alibi and relative positions act inside attention on the positions returned here,
    so any 1-D scheme of ``position`` applies; sinusoidal and learned tables are added here.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg)
        self.frame_dim = cfg.frame_dim
        self.proj = nn.Linear(cfg.frame_dim, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.position_1d = AbsolutePosition(cfg) if cfg.position in ADDITIVE_POSITIONS else None
        self.max_len = cfg.max_seq_len - cfg.cls_token

    def n_items(self, frames: torch.Tensor) -> int:
        return frames.shape[1]

    def forward(self, frames: torch.Tensor, mask: torch.Tensor | None = None) -> Adapted:
        """``mask`` (B, T): True for real frames (right padding is False)."""
        if frames.dim() != 3 or frames.shape[-1] != self.frame_dim:
            raise UsageError(f"frames: shape {tuple(frames.shape)}; expected (batch, time, frame_dim={self.frame_dim})")
        if frames.shape[1] > self.max_len:
            raise UsageError(f"frames: {frames.shape[1]} time steps; expected at most {self.max_len} (max_seq_len)")
        self._check_mask(mask, frames.shape[0], frames.shape[1], "frame")
        x = self.proj(frames.to(self.proj.weight.dtype)) * self.scale  # (B, T, d_model)
        return self._finish(x, mask)


ADAPTERS: dict[str, type[InputAdapter]] = {"patches": PatchInput, "frames": FrameInput}


def build_input(cfg: TransformerConfig) -> InputAdapter:
    """The adapter ``cfg.input`` names (``tokens`` is the ``Embedding`` of ``embedding.py``)."""
    if cfg.input not in ADAPTERS:
        raise ValueError(f"input={cfg.input!r}: expected one of {', '.join(ADAPTERS)} for an adapter")
    return ADAPTERS[cfg.input](cfg)


def stack_config(cfg: TransformerConfig) -> TransformerConfig:
    """The config of the stack that reads the adapter's output: without 1-D positions for patches."""
    return dataclasses.replace(cfg, position="none") if cfg.input == "patches" else cfg


def describe_parts(cfg: TransformerConfig, head: str = "", pooling: str = "") -> dict[str, str]:
    """The three swappable parts in words (``blockformer info`` prints them): the input
    adapter, the position scheme and the output head (``head``: a ``[head] task`` or empty)."""
    if cfg.input == "patches":
        rows, cols = cfg.image_height // cfg.patch_size, cfg.image_width // cfg.patch_size
        dim = cfg.image_channels * cfg.patch_size**2
        adapter = (f"patches: {cfg.patch_size}x{cfg.patch_size} pixels of {cfg.image_height}x{cfg.image_width}"
                   f"x{cfg.image_channels} images -> {rows * cols} patches, Linear({dim}, {cfg.d_model})")
        position = {"learned": "2-D learned (a row table + a column table)", "none": "none (the patches are a set)",
                    "sinusoidal": "2-D sinusoidal (row sinusoids + column sinusoids)"}[cfg.patch_position]
    elif cfg.input == "frames":
        adapter = f"frames: {cfg.frame_dim} values per time step, Linear({cfg.frame_dim}, {cfg.d_model})"
        position = f"1-D {cfg.position}"
    else:
        adapter = f"tokens: Embedding({cfg.vocab_size}, {cfg.d_model})"
        position = f"1-D {cfg.position}"
    if cfg.cls_token:
        adapter += " + a class token"
    if head and head != "none":
        out = f"{head} head ({pooling} pooling)" if head != "tokens" else "tokens head (every position)"
    elif cfg.arch == "encoder-decoder":
        out = f"the decoder's token logits ({cfg.vocab_size} ids)"
    elif cfg.input != "tokens":
        out = "none: the hidden states (add a [head])"
    else:
        out = f"token logits ({cfg.vocab_size} ids)"
    if cfg.arch == "encoder-decoder" and cfg.input != "tokens":
        position += f"; the decoder: 1-D {cfg.position}"
    return {"input": adapter, "position": position, "head": out}
