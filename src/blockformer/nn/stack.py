"""N blocks in sequence, with what they share: masks and attention-level position signals.

An encoder and a decoder are the same stack with different visibility: ``causal`` hides
each position's future, ``cross`` adds attention to an encoder's output. The stack builds
the attention inputs once per forward pass and hands them to every block.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import BIAS_POSITIONS, TransformerConfig
from .attention import AttnInputs
from .block import Block
from .kv_cache import KVCache
from .norm import build_norm
from .position import BIAS_MODULES, Rotary


class Stack(nn.Module):
    def __init__(self, cfg: TransformerConfig, n_layers: int, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.causal, self.cross = causal, cross
        self.window = cfg.attention_window  # 0: every visible position
        self.blocks = nn.ModuleList(
            Block(cfg, causal=causal, cross=cross, layer_idx=i, n_layers=n_layers) for i in range(n_layers)
        )
        self.rotary = Rotary(cfg) if cfg.position == "rope" else None
        self.bias = BIAS_MODULES[cfg.position](cfg, causal) if cfg.position in BIAS_POSITIONS else None
        # Pre-Norm leaves the last block's sum unnormalised: one norm closes the stack.
        self.final_norm = build_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, d_model); positions: (B, T) position ids; attention_mask: (B, T), True
        for real tokens; memory/memory_mask: the encoder output and its mask (cross-
        attention); cache/cache_pos: incremental decoding, writing slots ``cache_pos``."""
        ctx = self._self_inputs(positions, attention_mask, cache, cache_pos)
        cross_ctx = self._cross_inputs(memory, memory_mask, cache) if self.cross else None
        for block in self.blocks:
            x = block(x, ctx, cross_ctx)
        return self.final_norm(x)

    def _self_inputs(self, positions, attention_mask, cache, cache_pos) -> AttnInputs:
        rope = self.rotary(positions) if self.rotary is not None else None
        if cache is not None and not self.causal:
            raise ValueError("a KV cache needs a causal stack")
        if cache is not None and cache.segments is not None:  # sequences packed in one row: a mask each
            masks = [self._mask(positions[0, s.start : s.start + s.rows * s.tokens].view(s.rows, s.tokens),
                                s.k_pos, s.k_valid, _written(s.cache_pos, s.k_pos.shape[1]))
                     for s in cache.segments]
            return AttnInputs(rope=rope, cache=cache, segment_masks=masks, valid=attention_mask)
        if cache is None:
            k_pos, k_valid, causal = positions, attention_mask, None
        else:
            if self.window:
                _check_ring(cache, cache_pos, self.window)
            cache.record(cache_pos, positions, attention_mask)
            if self.bias is None and not self.window and cache.sees_every_slot(cache_pos):
                return AttnInputs(rope=rope, cache=cache, cache_pos=cache_pos, valid=attention_mask)  # no mask
            span = cache.span  # the slots attention reads
            k_pos, k_valid = cache.pos[:, :span], cache.valid[:, :span]
            causal = _written(cache_pos, span)
        if cache is None and attention_mask is None and self.bias is None and not self.window:
            return AttnInputs(is_causal=self.causal, rope=rope)  # the fused kernel's own mask: no (T, T)
        if cache is None and not self.window:  # padding or a bias: the mask is materialised, (T, T)
            T, device = positions.shape[1], positions.device
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril() if self.causal else None
        return AttnInputs(mask=self._mask(positions, k_pos, k_valid, causal), rope=rope, cache=cache,
                          cache_pos=cache_pos, valid=attention_mask)

    def _mask(self, positions, k_pos, k_valid, causal) -> torch.Tensor | None:
        """The SDPA mask of queries at ``positions`` (B, Tq) over keys at ``k_pos`` (B, Tk):
        ``causal`` (Tq, Tk) or the window, the keys' validity, and the position bias."""
        if self.window:
            causal = _window(positions, k_pos, self.window, self.causal)  # (B, Tq, Tk)
        bias = self.bias(positions, k_pos) if self.bias is not None else None  # (B, H, Tq, Tk)
        return _combine(causal, k_valid, bias)

    def _cross_inputs(self, memory, memory_mask, cache) -> AttnInputs:
        if cache is not None:
            if memory is not None:
                cache.memory_mask = memory_mask
            memory_mask = cache.memory_mask
        mask = None if memory_mask is None else _combine(None, memory_mask, None)
        return AttnInputs(mask=mask, memory=memory, cache=cache)


def _written(cache_pos: torch.Tensor, span: int) -> torch.Tensor:
    """(T, S): the cache slots each new token may see, those written up to its own."""
    return cache_pos[:, None] >= torch.arange(span, device=cache_pos.device)[None, :]


def _check_ring(cache: KVCache, cache_pos: torch.Tensor, window: int) -> None:
    """A call that wraps a windowed model's ring cache must not overwrite keys its own
    queries still see: at most ``slots - window + 1`` tokens. One token always fits."""
    T, room = cache_pos.shape[0], cache.max_len - window + 1
    if T > 1 and T > room and not torch.compiler.is_compiling() and int(cache_pos[-1]) >= cache.max_len:
        raise ValueError(
            f"cache_pos: {T} tokens in one call wrap the {cache.max_len}-slot ring cache of a model with "
            f"attention_window={window}; expected at most {room} per call (feed the prompt in chunks)"
        )


def _window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Sliding-window attention (Longformer, Beltagy et al. 2020; Mistral): a query sees the
    keys less than ``window`` positions away (and, causal, not after it). Decided by position
    ids, not cache slots, so it holds in a ring-buffer cache that has wrapped around."""
    offset = q_pos[:, :, None] - k_pos[:, None, :]  # (B, Tq, Tk)
    near = offset.abs() < window
    return near & (offset >= 0) if causal else near


def _combine(
    causal: torch.Tensor | None, key_valid: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """One SDPA mask from a (Tq, Tk) causal pattern, (B, Tk) key validity and a float bias.

    A query row that may see no key at all (a fully padded sequence) is opened to every key:
    its output is then finite (and meaningless, but it is padding too) instead of NaN.
    """
    keep = None
    if causal is not None:
        keep = causal[None, None] if causal.dim() == 2 else causal[:, None]  # (1 or B, 1, Tq, Tk)
    if key_valid is not None:
        valid = key_valid.bool()[:, None, None, :]  # (B, 1, 1, Tk)
        keep = valid if keep is None else keep & valid
    if keep is None:
        return bias
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    if bias is None:
        return keep
    return bias.masked_fill(~keep, float("-inf"))
