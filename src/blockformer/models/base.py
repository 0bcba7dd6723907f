"""What the three architectures share: the output head, initialisation, the KV cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import TransformerConfig
from ..nn.attention import Attention
from ..nn.feedforward import FeedForward
from ..nn.kv_cache import KVCache
from ..nn.loss import PAD, head_loss
from ..nn.moe import MoEFeedForward, auxiliary_loss
from ..nn.position import RelativeBias
from .checks import check_int, check_targets
from .head_layers import HeadTransform


def with_auxiliary_loss(model: nn.Module, loss: torch.Tensor, n_targets: Any) -> torch.Tensor:
    """A summed training ``loss`` over ``n_targets`` targets (a count, or a function counting
    them when needed), plus what the last forward's MoE routers recorded (their weighted
    balance and z losses) per target; ``loss`` itself in eval and without MoE."""
    aux = auxiliary_loss(model) if getattr(model, "training", False) else None
    if aux is None:
        return loss
    return loss + aux * (n_targets() if callable(n_targets) else n_targets)


class TransformerModel(nn.Module):
    """Base class: subclasses set ``self.cfg`` and build their modules, then call
    ``self._init_weights()``."""

    cfg: TransformerConfig

    def _make_head(self, embedding: nn.Embedding) -> nn.Linear:
        """The output projection; also sets ``head_transform`` (BERT's dense + act + norm)."""
        self.head_transform = HeadTransform(self.cfg) if self.cfg.head_transform else None
        head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=self.cfg.head_bias)
        if self.cfg.tie_embeddings:
            head.weight = embedding.weight  # one matrix reads tokens in and writes them out
        return head

    def _logits(
        self, h: torch.Tensor, targets: torch.Tensor | None = None, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """Final hidden states (B, T, d_model) -> logits (B, T, vocab); with ``targets``
        (B, T), the summed token loss instead, the head fused with it (``nn/loss.py``). In
        training that loss includes what the forward's MoE routers recorded (their weighted
        balance and z losses, per target token), so the trainer needs to know nothing of them."""
        if self.head_transform is not None:
            h = self.head_transform(h)
        if self.cfg.output_scale != 1.0:
            h = h * self.cfg.output_scale  # T5 with tied embeddings: d_model^-0.5
        if targets is not None:
            check_targets(targets, h[..., 0], self.cfg.vocab_size, label_smoothing)
            loss = head_loss(h, self.head, targets, label_smoothing)
            return with_auxiliary_loss(self, loss, lambda: (targets != PAD).sum())  # counted only with MoE
        return self.head(h)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of some final hidden states only (e.g. each row's last): what a server
        needs from a prefill, without the (T, vocab) logits of every prompt position."""
        return self._logits(h)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Normal(0, init_std) for matmuls; the projections that write into the residual
        stream are scaled by 1/sqrt(2 * total depth) so the stream's variance does not
        grow with depth (GPT-2). Embeddings use d_model^-0.5 when they are scaled up by
        sqrt(d_model), so the sum starts at unit scale (Vaswani et al.; fairseq)."""
        cfg = self.cfg
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.total_layers)
        deepnet = cfg.residual == "scaled" and cfg.residual_scale_target == "trunk"
        beta = (8 * cfg.total_layers) ** -0.25  # DeepNet's init gain (Wang et al. 2022)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():  # after the Linears: a tied head must not overwrite them
            if isinstance(module, nn.Embedding):
                emb_std = cfg.d_model**-0.5 if cfg.scale_embeddings else std
                nn.init.normal_(module.weight, 0.0, emb_std)
        for module in self.modules():
            if isinstance(module, Attention):
                nn.init.normal_(module.out.weight, 0.0, out_std)
                if deepnet:
                    module.out.weight.mul_(beta)
                    kv_dim = module.n_kv_heads * module.head_dim
                    fused = module.kv if module.cross else module.qkv  # value rows come last
                    fused.weight[-kv_dim:].mul_(beta)
            elif isinstance(module, FeedForward):
                nn.init.normal_(module.down.weight, 0.0, out_std)
                if deepnet:
                    module.down.weight.mul_(beta)
                    module.up.weight.mul_(beta)
            elif isinstance(module, MoEFeedForward):
                module.reset_parameters(std, out_std, beta if deepnet else 1.0)
            elif isinstance(module, RelativeBias):
                nn.init.normal_(module.table.weight, 0.0, cfg.d_model**-0.5)  # T5's scale

    def hidden_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask of the encoder's output for an input mask: the same, or with a class token
        an input adapter puts in front (models/inputs.py)."""
        adapter = getattr(self, "src_embed", None) or getattr(self, "embed", None)
        return adapter.hidden_mask(attention_mask) if hasattr(adapter, "hidden_mask") else attention_mask

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A preallocated cache for decoding up to ``max_len`` target tokens. With a sliding
        window it holds at most two windows (a ring: any length decodes in bounded memory;
        feed it at most ``window + 1`` tokens a call)."""
        check_int(batch_size, "batch_size", 1)
        check_int(max_len, "max_len", 1)
        param = next(self.parameters())
        # The attention layers' own head count: a tensor-parallel rank holds n_kv_heads / tp.
        n_kv_heads = next(m.n_kv_heads for m in self.modules() if isinstance(m, Attention))
        if self.cfg.attention_window:
            max_len = min(max_len, 2 * self.cfg.attention_window)
        n_layers = self.cfg.n_decoder_layers if self.cfg.arch == "encoder-decoder" else self.cfg.n_layers
        return KVCache(
            n_layers,
            batch_size,
            max_len,
            n_kv_heads,
            self.cfg.head_dim,
            device=device or param.device,
            dtype=dtype or param.dtype,
        )


def default_positions(tokens: torch.Tensor, cache_pos: torch.Tensor | None) -> torch.Tensor:
    """Position ids (B, T): 0..T-1, or the cache slots being written."""
    B, T = tokens.shape
    base = torch.arange(T, device=tokens.device) if cache_pos is None else cache_pos
    return base[None, :].expand(B, T)
