"""Multi-head attention: each position gathers from the others by relevance.

Queries, keys and values come from one fused projection (self-attention) or from the
decoder and the encoder output (cross-attention). The scores are computed by
``torch.nn.functional.scaled_dot_product_attention``, which takes the fused (flash) kernel
when there is no attention dropout; an additive position bias (ALiBi, T5) must be
materialised as a float mask, the documented exception. ``n_kv_heads < n_heads`` shares
each key/value head among a group of query heads (GQA, Ainslie et al. 2023; MQA at 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels, native
from ..config import TransformerConfig
from ..precision import cast
from .causal_attention import causal_attention, kernels as causal_attention_built
from .decode_attention import decode_attention, kernel as decode_attention_built
from .dropout import dropout as apply_dropout
from .kv_cache import KVCache, dequantize_rows
from .position import apply_rope

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttnInputs:
    """Everything an attention layer needs besides its input, built once per stack."""

    mask: torch.Tensor | None = None  # bool (True = may attend) or float (added to scores)
    is_causal: bool = False  # the flash path's causal mask, when ``mask`` is None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: (B, 1, T, head_dim/2)
    cache: KVCache | None = None
    cache_pos: torch.Tensor | None = None  # (T,) cache slots this call writes
    memory: torch.Tensor | None = None  # cross-attention: encoder output (B, S, d_model)
    valid: torch.Tensor | None = None  # (B, T) True for this call's real tokens (MoE routing)
    segment_masks: list[torch.Tensor | None] | None = None  # one per ``cache.segments``: sequences packed in a row


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int = 0, cross: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layer_idx, self.cross = layer_idx, cross
        self.dropout = cfg.attention_dropout
        self.scale, self.rope_interleaved = cfg.attention_scale, cfg.rope_interleaved  # None: 1/sqrt(head_dim)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cross:
            self.q = nn.Linear(cfg.d_model, q_dim, bias=cfg.bias)
            self.kv = nn.Linear(cfg.d_model, 2 * kv_dim, bias=cfg.bias)
        else:
            self.qkv = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=cfg.bias)  # rows: q, k, v
        self.out = nn.Linear(q_dim, cfg.d_model, bias=cfg.bias)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)

    def forward(self, x: torch.Tensor, ctx: AttnInputs) -> torch.Tensor:
        B, T, _ = x.shape
        kv_dim, kv_scales = self.n_kv_heads * self.head_dim, None
        if self.cross:
            q = self._heads(self.q(x), self.n_heads)
            k, v = self._cross_kv(ctx)
        else:
            q, k, v = self.qkv(x).split([self.n_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
            q, k, v = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
            if ctx.rope is not None:
                q, k = apply_rope(q, *ctx.rope, self.rope_interleaved), apply_rope(k, *ctx.rope, self.rope_interleaved)
            if ctx.segment_masks is not None:  # sequences side by side in one row: the cache attends for each
                return self.out(ctx.cache.attend(self.layer_idx, q, k, v, ctx.segment_masks, self.scale))
            if ctx.cache is not None:
                k, v = ctx.cache.update(self.layer_idx, ctx.cache_pos, k, v)  # (B, H_kv, S, hd)
                kv_scales = ctx.cache.scales(self.layer_idx)  # an int8 cache's, else None
        y = sdpa(q, k, v, ctx.mask, ctx.is_causal, self.dropout if self.training else 0.0, self.scale, kv_scales)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _cross_kv(self, ctx: AttnInputs) -> tuple[torch.Tensor, torch.Tensor]:
        cache = ctx.cache
        if ctx.memory is None:  # decoding: keys and values were computed once, at prefill
            return cache.cross_k[self.layer_idx], cache.cross_v[self.layer_idx]
        k, v = self.kv(ctx.memory).chunk(2, dim=-1)
        k, v = self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)
        if cache is not None:  # kept in a narrow cache's dtype too (an int8 cache: in the model's)
            if cache.dtype.is_floating_point:
                k, v = cast(k, cache.dtype), cast(v, cache.dtype)
            cache.cross_k[self.layer_idx], cache.cross_v[self.layer_idx] = k, v
        return k, v


def sdpa(q, k, v, mask, is_causal: bool, dropout: float, scale: float | None = None,
         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of ``q`` over ``k``, ``v``; ``kv_scales``: those of an int8 cache's codes (``KVCache.scales``)."""
    if (not is_causal and not dropout and kernels.decode_attention_kernel(q, k, v, mask, native.CPP_OPS)
            and (torch.compiler.is_compiling() or decode_attention_built())):  # one new token per row, on a CPU
        return native.call(decode_attention, q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale,
                           *(kv_scales or (None, None)))
    if kv_scales is not None:  # an int8 cache: its codes times their scales
        k, v = dequantize_rows(k, kv_scales[0], q.dtype), dequantize_rows(v, kv_scales[1], q.dtype)
    k, v = cast(k, q.dtype), cast(v, q.dtype)  # a cache kept narrower than the model computes (KVCache.dtype)
    groups = q.shape[1] // k.shape[1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if groups > 1 and not _SDPA_HAS_GQA:  # pragma: no cover - torch < 2.5
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    # On a CPU, attention dropout always leaves the fused kernel for torch's unfused one,
    # which draws its mask with ``bernoulli_``; the same computation is written out below
    # with the cheaper mask of ``nn.dropout``. bf16 training over short keys is written out
    # too where the fused backward is slower (``kernels.unfused_attention``).
    if kernels.unfused_attention(q.device, q.dtype, k.shape[-2], dropout, torch.is_grad_enabled()):
        return _unfused(q, k, v, mask, is_causal, dropout, scale, groups)
    if kernels.causal_training_kernel(q, k, v, mask, is_causal, dropout) and causal_attention_built():
        return causal_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)  # fp32 training, short
    kwargs = {"enable_gqa": True} if groups > 1 else {}
    if scale is not None:
        kwargs["scale"] = scale
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, **kwargs
    )


def _unfused(q, k, v, mask, is_causal: bool, dropout: float, scale: float | None, groups: int) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with the T x S scores materialised, as torch's math
    kernel computes it (a fully masked row gives zeros, not NaN)."""
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, S)
    if is_causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = apply_dropout(torch.ops.aten._safe_softmax(scores, -1), dropout)
    return weights @ v
