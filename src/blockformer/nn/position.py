"""Position signals: how order enters an otherwise permutation-equivariant model.

Two families. Added to the token embeddings once, at the bottom of the stack:
``sinusoidal`` (Vaswani et al. 2017) and ``learned`` (GPT). Acting inside attention, at
every layer: ``rope`` rotates queries and keys by their position (Su et al. 2021), so
their dot product depends only on the offset; ``alibi`` (Press et al. 2022) and
``relative`` (T5's bucketed bias, Raffel et al. 2020) add a per-head bias to the scores.

Every signal is a function of explicit position ids ``(B, T)``, so left-padded batches
and cached decoding see each token at its true position.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TransformerConfig


def sinusoidal_table(n_positions: int, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """``PE[p, 2i] = sin(p / 10000^(2i/d))``, ``PE[p, 2i+1] = cos(...)``: (n_positions, dim).

    ``layout="split"`` puts all sines first and all cosines after them (Marian, XLM)."""
    position = torch.arange(n_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_positions, dim)
    if layout == "split":
        half = (dim + 1) // 2
        table[:, :half] = torch.sin(position * inv_freq)
        table[:, half:] = torch.cos(position * inv_freq[: dim // 2])
        return table
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table


class AbsolutePosition(nn.Module):
    """A vector per position, added to the token embedding: fixed sinusoids or learned."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.offset = cfg.position_offset  # BART's table starts at row 2
        if cfg.position == "learned":
            self.table = nn.Embedding(cfg.max_seq_len + self.offset, cfg.d_model)
        else:
            # Not saved in checkpoints: it is a function of the config.
            table = sinusoidal_table(cfg.max_seq_len, cfg.d_model, cfg.sinusoid_layout)
            self.register_buffer("sinusoids", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "table"):
            return self.table(positions + self.offset if self.offset else positions)
        return self.sinusoids[positions]  # (B, T, d_model)


def rope_base_of(cfg: TransformerConfig) -> float:
    """The base rope's frequencies are computed from: ``rope_base``, raised for "ntk"
    scaling to ``rope_base * s^(d/(d-2))`` (a static change of base, nothing else)."""
    if cfg.rope_scaling == "ntk":
        return cfg.rope_base * cfg.rope_scaling_factor ** (cfg.head_dim / max(cfg.head_dim - 2, 1))
    return cfg.rope_base


class Rotary(nn.Module):
    """Rotary embedding tables: ``cos`` and ``sin`` of ``position * theta_i``.

    Uses the half-split layout (the pair of dimension ``i`` is ``i + head_dim/2``), as in
    GPT-NeoX and Hugging Face's Llama, so weights convert without permutation.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.half, self.base = cfg.head_dim // 2, cfg.rope_base
        s = cfg.rope_scaling_factor
        # Extending a trained model's context s-fold. "linear" (position interpolation, Chen et
        # al. 2023): positions / s, so the longest context maps onto the trained angles.
        # "ntk" (NTK-aware, bloc97 2023): base * s^(d/(d-2)), which leaves the fastest
        # frequencies (local order) alone and slows the slowest ones by s.
        self.position_scale = 1.0 / s if cfg.rope_scaling == "linear" else 1.0
        self.base = rope_base_of(cfg)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Frequencies are computed here in fp32, not kept in a buffer: `model.to(bfloat16)`
        # would round a buffer and shift every angle.
        exponent = torch.arange(self.half, device=positions.device, dtype=torch.float32) / self.half
        inv_freq = self.base**-exponent
        angles = (positions[..., None].float() * self.position_scale) * inv_freq  # (B, T, head_dim/2)
        angles = angles[:, None]  # (B, 1, T, head_dim/2): broadcast over heads
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair of ``x`` (B, H, T, head_dim) by its angle; with
    ``interleaved``, each (x_{2i}, x_{2i+1}) pair (GPT-J; Meta's Llama checkpoints)."""
    if interleaved:
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return rotated.type_as(x)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Geometric head slopes ``2^(-8 i / n)``; non-powers of two interleave (Press et al.)."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest)
    if closest < n_heads:
        slopes += powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


class AlibiBias(nn.Module):
    """``-slope_h * |i - j|``: attention decays linearly with distance, per head."""

    def __init__(self, cfg: TransformerConfig, causal: bool) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads)[:, None, None], persistent=False)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs()  # (B, 1, Tq, Tk)
        return -self.slopes * distance  # (B, H, Tq, Tk)


class RelativeBias(nn.Module):
    """T5's relative position bias: one learned scalar per head and distance bucket.

    Offsets up to ``buckets/2`` (``/4`` each way when bidirectional) get their own bucket;
    longer ones share logarithmically wider buckets up to ``relative_max_distance``. One
    table is shared by all blocks of a stack, as in T5.
    """

    def __init__(self, cfg: TransformerConfig, causal: bool) -> None:
        super().__init__()
        self.bidirectional = not causal
        self.n_buckets = cfg.relative_buckets
        self.max_distance = cfg.relative_max_distance
        self.table = nn.Embedding(cfg.relative_buckets, cfg.n_heads)

    def bucket(self, relative: torch.Tensor) -> torch.Tensor:
        """Bucket index of ``relative = key_pos - query_pos``."""
        n_buckets = self.n_buckets
        ret = torch.zeros_like(relative)
        if self.bidirectional:
            n_buckets //= 2
            ret = ret + (relative > 0).long() * n_buckets
            distance = relative.abs()
        else:
            distance = (-relative).clamp(min=0)
        max_exact = n_buckets // 2
        log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(
            self.max_distance / max_exact
        )
        large = (max_exact + (log_ratio * (n_buckets - max_exact)).long()).clamp(max=n_buckets - 1)
        return ret + torch.where(distance < max_exact, distance, large)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # (B, Tq, Tk)
        return self.table(self.bucket(relative)).permute(0, 3, 1, 2)  # (B, H, Tq, Tk)


BIAS_MODULES = {"alibi": AlibiBias, "relative": RelativeBias}
