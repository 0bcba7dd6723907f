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


@pytest.mark.parametrize("d, layers, heads, seq_len, vocab, attention_dropout", [
    (128, 2, 4, 128, 1000, 0.0),
    (64, 3, 4, 128, 500, 0.1),  # attention dropout: the scores are stored too
    (256, 2, 8, 64, 2000, 0.0),
])
def test_the_activation_estimate_is_within_30_percent_of_measured_memory(d, layers, heads, seq_len, vocab,
                                                                         attention_dropout):
    """The bytes a training forward keeps alive for backward (every live tensor counted by
    TensorMemory, the parameters excluded) against memory_estimate's activation figure:
    ratios 1.00-1.13 here."""
    import torch

    from blockformer.probes.memory import measure
    from blockformer.nn.loss import token_loss

    cfg = TransformerConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                            attention_dropout=attention_dropout)
    model = build_model(cfg, seed=0).train()
    B = 8
    x, y = torch.randint(0, vocab, (B, seq_len)), torch.randint(0, vocab, (B, seq_len))
    kept = []
    peak = measure(lambda: kept.append(token_loss(model(x), y, 0.0)))["peak_bytes"]
    # The weights are seen too (as the transposed views a linear layer takes): not activations.
    measured = peak - sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = memory_estimate(cfg, B, seq_len)["activation_bytes"]
    assert 0.8 < measured / estimate < 1.3, (measured, estimate)
