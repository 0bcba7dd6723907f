"""Parameter counts and FLOPs estimates, against hand arithmetic."""

import pytest

from blockformer import TransformerConfig, build_model, count_parameters, flops_per_token, memory_estimate


def test_parameter_count_matches_hand_arithmetic():
    d, V, L, ff = 64, 100, 3, 256
    cfg = TransformerConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=4, d_ff=ff, position="rope")
    model = build_model(cfg)
    per_block = (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * (2 * d)  # qkv, out, ffn, 2 LN
    expected = V * d + L * per_block + 2 * d  # tied embedding/head, final norm
    assert count_parameters(model) == expected
    assert count_parameters(model, exclude_embeddings=True) == expected - V * d
    untied = build_model(TransformerConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=4, d_ff=ff,
                                           tie_embeddings=False))
    assert count_parameters(untied) == expected + V * d


def test_flops_per_token_is_six_n_plus_attention():
    cfg = TransformerConfig(vocab_size=1000, d_model=128, n_layers=2, n_heads=4, d_ff=512)
    matmul = 2 * (128 * 384 + 128 * 128 + 2 * 128 * 512) + 128 * 1000
    attention = 4 * 64 * 128 * 2
    assert flops_per_token(cfg, 64) == 3 * (2 * matmul + attention)
    assert flops_per_token(cfg, 64, training=False) == 2 * matmul + attention


def test_memory_estimate_counts_weights_and_optimizer_state():
    cfg = TransformerConfig(vocab_size=1000, d_model=128, n_layers=2, n_heads=4)
    est = memory_estimate(cfg, batch_size=8, seq_len=64)
    assert est["parameters"] == count_parameters(build_model(cfg))
    assert est["weights_bytes"] == 4 * est["parameters"]
    assert est["total_bytes"] == pytest.approx(4 * est["weights_bytes"] + est["activation_bytes"])
