"""The block variants the depth probes compare, and what they measure in each block.

Pre-Norm and Post-Norm, each with and without the residual path, and without
normalisation at all (where Pre- and Post-Norm coincide). ``gradients`` and ``scale``
read the same per-block figures from one forward and backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TransformerConfig
from ..models import build_model
from .report import parse_ints, pick
from .training import reverse_batch, task_loss, task_vocab, train_reverse

# name -> (label, config fields)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "pre": ("Pre-Norm", {"norm_position": "pre"}),
    "post": ("Post-Norm", {"norm_position": "post"}),
    "pre-nores": ("Pre-Norm, no residual", {"norm_position": "pre", "residual": "none"}),
    "post-nores": ("Post-Norm, no residual", {"norm_position": "post", "residual": "none"}),
    "nonorm": ("no norm", {"norm": "none"}),
    "nonorm-nores": ("no norm, no residual", {"norm": "none", "residual": "none"}),
}


def variant_config(
    variant: str,
    depth: int,
    *,
    d_model: int = 32,
    n_heads: int = 2,
    n_symbols: int = 16,
    length: int = 8,
    scale_embeddings: bool = False,
) -> TransformerConfig:
    """A small causal decoder for the reversal task, ``depth`` blocks deep. With
    ``scale_embeddings`` the first block reads unit-scale input, as in the paper."""
    return TransformerConfig(
        arch="decoder",
        vocab_size=task_vocab(n_symbols),
        d_model=d_model,
        n_layers=depth,
        n_heads=n_heads,
        max_seq_len=2 * length,
        position="learned",
        ffn="gelu",
        scale_embeddings=scale_embeddings,
        **VARIANTS[variant][1],
    )


def build_variant(variant: str, depth: int, *, seed: int = 0, **sizes: Any) -> nn.Module:
    return build_model(variant_config(variant, depth, **sizes), seed=seed)


def probe_batch(batch_size: int, length: int, n_symbols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch every measurement uses (the task's own distribution)."""
    return reverse_batch(torch.Generator().manual_seed(seed + 1_000_003), batch_size, length, n_symbols)


def block_stats(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, list[float]]:
    """Per block: the gradient norm of its parameters for the task loss, and the RMS of its
    output (the residual stream it hands on). Index 0 is the block nearest the input."""
    blocks = list(model.decoder.blocks)
    rms: list[float] = [0.0] * len(blocks)

    def record(i: int):
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            rms[i] = output.detach().float().pow(2).mean().sqrt().item()

        return hook

    handles = [b.register_forward_hook(record(i)) for i, b in enumerate(blocks)]
    try:
        model.zero_grad(set_to_none=True)
        task_loss(model, inputs, targets).backward()
    finally:
        for h in handles:
            h.remove()
    grads = []
    for b in blocks:
        squares = [p.grad.float().pow(2).sum() for p in b.parameters() if p.grad is not None]
        grads.append(torch.stack(squares).sum().sqrt().item() if squares else 0.0)
    model.zero_grad(set_to_none=True)
    return {"grad_norm": grads, "rms": rms}


def measure_profiles(
    depths: str | list[int],
    variants: str | list[str],
    *,
    steps: int,
    train_depth: int,
    lr: float,
    warmup: int,
    d_model: int,
    seed: int,
    batch_size: int = 16,
    length: int = 8,
    n_symbols: int = 16,
) -> dict[str, Any]:
    """``block_stats`` for each variant at each depth at initialisation and, when
    ``steps > 0``, for each variant at ``train_depth`` after ``steps`` training steps on the
    reversal task (with the loss curve). All measured on one fixed batch. ``depths`` and
    ``variants`` may be comma-separated strings (command-line values)."""
    depths = parse_ints(depths, "--depths")
    variants = pick(variants, list(VARIANTS), "--variants")
    # Unit-scale embeddings (the paper's sqrt(d_model) scaling): with GPT-2's tiny 0.02 ones,
    # Post-Norm's first LayerNorm would divide by 0.02 and inflate block 1's gradient ~15x, an
    # effect of the embedding scale rather than of depth.
    sizes = {"d_model": d_model, "length": length, "n_symbols": n_symbols, "scale_embeddings": True}
    inputs, targets = probe_batch(batch_size, length, n_symbols, seed)
    init = {v: {d: block_stats(build_variant(v, d, seed=seed, **sizes), inputs, targets) for d in depths}
            for v in variants}
    trained = {}
    if steps > 0:
        for v in variants:
            model = build_variant(v, train_depth, seed=seed, **sizes)
            losses = train_reverse(model, steps=steps, lr=lr, warmup=warmup, batch_size=batch_size,
                                   length=length, n_symbols=n_symbols, seed=seed)
            trained[v] = {**block_stats(model, inputs, targets), "final_loss": losses[-1], "losses": losses}
    return {"depths": depths, "variants": variants, "init": init, "trained": trained}


def ratio(a: float, b: float) -> float:
    """``a / b``, with 0 / 0 read as 0 (both vanished) and x / 0 as inf."""
    if b == 0:
        return 0.0 if a == 0 else float("inf")
    return a / b


__all__ = ["VARIANTS", "variant_config", "build_variant", "probe_batch", "block_stats", "measure_profiles",
           "ratio"]
