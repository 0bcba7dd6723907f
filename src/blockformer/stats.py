"""Size and cost of a model: parameters, FLOPs per token, memory for a batch."""

from __future__ import annotations

from torch import nn

from .config import TransformerConfig
from .models.checks import check_config, check_int, check_model


def count_parameters(model: nn.Module, *, trainable_only: bool = False, exclude_embeddings: bool = False) -> int:
    """Unique parameters (a tied matrix counts once); optionally without embedding tables."""
    check_model(model)
    seen: set[int] = set()
    skip: set[int] = set()
    if exclude_embeddings:
        skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = 0
    for p in model.parameters():
        if id(p) in seen or id(p) in skip or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def _layer_matmul_params(cfg: TransformerConfig, cross: bool) -> int:
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    attn = d * (d + 2 * kv) + d * d
    if cross:
        attn += d * d + d * 2 * kv + d * d
    per_width = d * (3 if cfg.ffn in ("swiglu", "geglu") else 2)  # matmul weights per unit of d_ff
    if cfg.ffn_experts:  # what one token uses: the router, its k experts, the shared ones
        ffn = d * cfg.ffn_experts + per_width * cfg.expert_d_ff * (cfg.experts_top_k + cfg.shared_experts)
    else:
        ffn = per_width * cfg.d_ff
    return attn + ffn


def block_weights(cfg: TransformerConfig) -> int:
    """Matmul weights in the blocks a token passes (attention, cross-attention, FFN; for MoE
    the ones it is routed to), without embeddings and head: what sets a step's matmul size."""
    if cfg.arch == "encoder-decoder":
        return (cfg.n_encoder_layers * _layer_matmul_params(cfg, False)
                + cfg.n_decoder_layers * _layer_matmul_params(cfg, True))
    return cfg.n_layers * _layer_matmul_params(cfg, False)


def active_parameters(model: nn.Module, cfg: TransformerConfig) -> int:
    """Parameters one token uses: all of them, less the experts it is not routed to
    (E - k of each MoE layer's E experts). Equal to ``count_parameters`` for a dense model."""
    from .nn.moe import moe_layers  # noqa: PLC0415

    idle = 0
    for m in moe_layers(model):
        experts = sum(p.numel() for p in (m.w_up, m.w_down, m.b_up, m.b_down) if p is not None)
        idle += experts * (m.n_experts - m.top_k) // m.n_experts
    return count_parameters(model) - idle


def flops_per_token(cfg: TransformerConfig, seq_len: int | None = None, *, training: bool = True) -> float:
    """Matmul FLOPs to process one (target) token: ``2 * N`` forward (N = matmul weights a
    token uses, the output head included; for MoE the router and k experts, not E) plus the attention scores ``2 * 2 * L * T * d``; training
    triples it for the backward pass (Kaplan et al. 2020; PaLM appendix B). For an
    encoder-decoder, a source token of the same length is counted with each target token.
    """
    check_config(cfg)
    T = cfg.max_seq_len if seq_len is None else check_int(seq_len, "seq_len", low=1)
    d = cfg.d_model
    n = block_weights(cfg)
    if cfg.arch == "encoder-decoder":
        attn = 4 * T * d * (cfg.n_encoder_layers + 2 * cfg.n_decoder_layers)
    else:
        attn = 4 * T * d * cfg.n_layers
    forward = 2 * (n + d * cfg.vocab_size) + attn
    return 3 * forward if training else forward


def memory_estimate(cfg: TransformerConfig, batch_size: int, seq_len: int, *, bytes_per_value: int = 4) -> dict[str, int]:
    """Rough training memory in bytes: weights, grads and two AdamW moments (4 copies of
    the parameters), plus stored activations. Korthikanti et al. (2022) count 34 bytes per
    token per layer per width unit and 5 per head per attention score, in 16-bit values:
    17 values per width unit here. Scores are stored only when attention dropout is on (the
    fused kernel keeps none); then this implementation keeps 3 values per score (softmax
    output, dropout mask and output), as measured in tests/test_stats.py."""
    from .models import build_model  # noqa: PLC0415 - avoids an import cycle
    import torch

    check_config(cfg)
    check_int(batch_size, "batch_size", low=1)
    check_int(seq_len, "seq_len", low=1)
    check_int(bytes_per_value, "bytes_per_value", low=1)
    with torch.device("meta"):
        params = count_parameters(build_model(cfg))
    layers = cfg.total_layers
    scores = 3 * cfg.n_heads * seq_len if cfg.attention_dropout > 0 else 0
    act = int(layers * batch_size * seq_len * (17 * cfg.d_model + scores))
    act += batch_size * seq_len * cfg.vocab_size * 2  # logits and their log-softmax
    weights = params * bytes_per_value
    return {
        "parameters": params,
        "weights_bytes": weights,
        "optimizer_bytes": 3 * weights,
        "activation_bytes": act * bytes_per_value,
        "total_bytes": 4 * weights + act * bytes_per_value,
    }
