"""Activation checkpointing: the same gradients, fewer activations kept for the backward pass."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockformer.config import TransformerConfig
from blockformer.models import build_model
from blockformer.parallel.activation import apply_activation_checkpointing
from blockformer.nn.loss import token_loss


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _run(arch: str, mode: str) -> tuple[dict[str, torch.Tensor], int, Counter]:
    cfg = TransformerConfig(arch=arch, vocab_size=50, d_model=32, n_layers=3, n_heads=4, ffn="swiglu",
                            max_seq_len=32, dropout=0.1)
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, mode)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(1, 50, (4, 24), generator=g), torch.randint(1, 50, (4, 24), generator=g)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    torch.manual_seed(0)  # dropout: a recomputed block must draw the same masks
    with _CountOps() as ops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x) if arch == "decoder" else model(x, y)
        token_loss(logits, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}, saved, ops.counts


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_checkpointing_keeps_gradients_and_saves_memory(arch):
    runs = {mode: _run(arch, mode) for mode in ("none", "full", "selective")}
    for mode in ("full", "selective"):
        for name, grad in runs["none"][0].items():
            torch.testing.assert_close(runs[mode][0][name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    assert runs["full"][1] < runs["none"][1] / 2  # full keeps only each block's input
    ops = {mode: run[2] for mode, run in runs.items()}
    # full recomputes each block: its matmuls and activations run twice;
    # selective keeps the matmul outputs and recomputes only the cheap ops between them
    for op in ("addmm", "_scaled_dot_product_flash_attention_for_cpu"):  # the forward's matmuls, attention
        assert ops["full"][op] == 2 * ops["none"][op] and ops["selective"][op] == ops["none"][op], op
    assert ops["full"]["silu"] == ops["selective"]["silu"] == 2 * ops["none"]["silu"]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="expected 'none', 'full' or 'selective'"):
        apply_activation_checkpointing(build_model(TransformerConfig(d_model=16, n_heads=2, n_layers=1)), "some")
