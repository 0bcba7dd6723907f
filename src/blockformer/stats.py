"""Size and cost of a model: parameters, FLOPs per token, memory for a batch.

Also the estimates made before a model is built at its depth (``size_estimate``) and the
refusal of a run that cannot fit this machine's RAM (``check_fits_in_memory``,
``check_run_fits``): arithmetic on the config and a model on the meta device, no training.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from torch import nn

from .config import TransformerConfig
from .errors import UsageError
from .models.checks import check_config, check_int, check_model
from .nn.moe import moe_layers
from .models import build_model


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


# ---------------------------------------------------------------- estimates before building
EXACT_LAYERS = 64  # deeper configs are measured at two small depths and extrapolated


def size_estimate(cfg: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """Parameters (all, without embeddings, active) and ``memory_estimate`` for ``cfg``
    without building it at its depth: every block of a stack holds the same parameters, so
    each figure is linear in the number of layers; a config deeper than ``EXACT_LAYERS`` is
    built (on the meta device) at depths 2 and 3 and extended along that line. A width whose
    tensors overflow torch's size limit raises a one-line ``UsageError``."""
    if cfg.total_layers <= EXACT_LAYERS:
        return _measured(cfg, batch_size, seq_len)
    if cfg.arch == "encoder-decoder":
        depths = {"n_encoder_layers": cfg.n_encoder_layers, "n_decoder_layers": cfg.n_decoder_layers}
    else:
        depths = {"n_layers": cfg.n_layers}
    small = dict.fromkeys(depths, 2)
    base = _measured(dataclasses.replace(cfg, **small), batch_size, seq_len)
    out = dict(base)
    for name, depth in depths.items():
        step = _measured(dataclasses.replace(cfg, **{**small, name: 3}), batch_size, seq_len)
        out = _combine(out, step, base, depth - 2)
    return out


def _combine(acc: Any, step: Any, base: Any, times: int) -> Any:
    """``acc + times * (step - base)``, leaf by leaf through nested dicts of integers."""
    if isinstance(acc, dict):
        return {k: _combine(acc[k], step[k], base[k], times) for k in acc}
    return acc + times * (step - base)


def _measured(cfg: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
    """The figures of ``cfg``, from a model built on the meta device (no memory allocated)."""
    import torch  # noqa: PLC0415

    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except RuntimeError as e:  # "Storage size calculation overflowed with sizes=[...]"
        weights = block_weights(cfg) + cfg.d_model * cfg.vocab_size
        raise UsageError(
            f"model: d_model={cfg.d_model}, d_ff={cfg.d_ff}, vocab_size={cfg.vocab_size} give a tensor "
            f"too large for torch to allocate (about {weights:.3g} weights by arithmetic: {str(e).splitlines()[0]}); "
            "expected a smaller width"
        ) from None
    return {
        "parameters": count_parameters(model),
        "parameters_without_embeddings": count_parameters(model, exclude_embeddings=True),
        "active_parameters": active_parameters(model, cfg),
        "memory_bytes": memory_estimate(cfg, batch_size, seq_len),
    }


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_in_memory(cfg: Any, batch_size: int, seq_len: int, what: str) -> dict[str, Any]:
    """``size_estimate``, or a one-line ``UsageError`` when its training-memory estimate
    exceeds this machine's RAM: refused before anything is built (or hangs in swap)."""
    est = size_estimate(cfg, batch_size, seq_len)
    ram, need = machine_memory_bytes(), est["memory_bytes"]["total_bytes"]
    if ram is not None and need > ram:
        raise UsageError(
            f"{what}: training needs about {need / 2**30:,.1f} GiB ({est['parameters']:,} parameters, a "
            f"micro-batch of {batch_size} x {seq_len} tokens, fp32 estimate) but this machine has "
            f"{ram / 2**30:,.1f} GiB of RAM; expected a smaller model, batch or sequence length"
        )
    return est


def run_batch_shape(cfg: Any, make_task: Callable[[Any], Any]) -> tuple[int, int]:
    """``(batch, seq_len)`` of a run config's training micro-batch: ``train.batch_size``
    sequences of the data's length (``train.max_tokens`` tokens for aligned pairs). For a
    synthetic task the length is its longest example, from ``make_task(cfg.data)`` (the
    caller's task factory: this module knows no data)."""
    m, data, tc = cfg.model, cfg.data, cfg.train
    if data.kind == "text":
        T, B = data.seq_len, tc.batch_size
    elif data.kind == "task":
        T, B = min(make_task(data).longest() + 1, m.max_seq_len), tc.batch_size
    elif data.kind == "pairs":
        T = m.max_seq_len
        B = max(1, tc.max_tokens // T)
    else:
        T, B = m.max_seq_len, tc.batch_size
    return B, T


def check_run_fits(cfg: Any, device: Any, make_task: Callable[[Any], Any]) -> None:
    """``check_fits_in_memory`` for a run config about to train on ``device``, its micro-batch
    as ``run_batch_shape`` finds it (``make_task``: ``data -> Task``, called only for a
    synthetic task). Only on the CPU, where RAM is the bound; a GPU reports its own OOM."""
    if getattr(device, "type", str(device)) != "cpu":
        return
    B, T = run_batch_shape(cfg, make_task)
    check_fits_in_memory(cfg.model, B, T, "model")
