"""The variant matrix: every arch x norm x placement x FFN x residual x position combination
builds, runs forward and backward with finite values; the impossible ones are rejected."""

import itertools

import pytest
import torch

from blockformer import TransformerConfig, build_model

ARCHS = ["encoder", "decoder", "encoder-decoder"]
NORMS = ["layer", "rms", "none"]
PLACEMENTS = ["pre", "post"]
FFNS = ["relu", "gelu", "silu", "swiglu", "geglu"]
RESIDUALS = ["plain", "scaled", "gated", "none"]
POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_combination_builds_and_trains_one_step(arch, position):
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (2, 5))
    built = 0
    for norm, placement, ffn, residual in itertools.product(NORMS, PLACEMENTS, FFNS, RESIDUALS):
        cfg = TransformerConfig(
            arch=arch, vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, position=position,
            norm=norm, norm_position=placement, ffn=ffn, residual=residual, n_kv_heads=1, d_ff=8,
            residual_scale_target="trunk" if placement == "post" else "branch",
        )
        model = build_model(cfg)
        logits = model(tokens, tokens) if arch == "encoder-decoder" else model(tokens)
        assert logits.shape == (2, 5, 11)
        logits.logsumexp(-1).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), (norm, placement, ffn, residual)
        assert torch.isfinite(logits).all()
        built += 1
    assert built == len(NORMS) * len(PLACEMENTS) * len(FFNS) * len(RESIDUALS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 30, "n_heads": 4}, "multiple of n_heads"),
        ({"d_model": 32, "n_heads": 8, "n_kv_heads": 3}, "divisor of n_heads"),
        ({"d_model": 12, "n_heads": 4, "position": "rope"}, "even"),  # head size 3
        ({"residual": "scaled", "residual_scale_target": "trunk", "norm_position": "pre"}, "norm_position='post'"),
        ({"arch": "decoder", "n_encoder_layers": 2}, "encoder-decoder"),
        ({"arch": "encoder", "src_vocab_size": 10}, "encoder-decoder"),
        ({"relative_buckets": 32, "relative_max_distance": 16}, "relative_buckets // 2"),
    ],
)
def test_incompatible_combinations_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)


def test_a_cache_on_an_encoder_is_rejected():
    model = build_model(TransformerConfig(arch="encoder", d_model=8, n_heads=2))
    with pytest.raises(ValueError, match="causal"):
        model.encoder(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long), cache=model.new_cache(1, 4),
                      cache_pos=torch.arange(2))
