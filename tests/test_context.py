"""Context length: RoPE scaling and sliding-window attention with a bounded (ring) KV cache."""

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.generate import generate
from blockformer.nn.position import Rotary
from cached import cached_logits

V = 37


def make(**kw):
    base = dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, position="rope",
                init_std=0.1)
    base.update(kw)
    return build_model(TransformerConfig(**base), seed=0).eval()


def test_linear_rope_scaling_maps_position_s_times_p_onto_p():
    plain = Rotary(TransformerConfig(d_model=32, n_heads=4))
    linear = Rotary(TransformerConfig(d_model=32, n_heads=4, rope_scaling="linear", rope_scaling_factor=4.0))
    p = torch.arange(10)[None]
    for a, b in zip(linear(4 * p), plain(p)):
        torch.testing.assert_close(a, b)


def test_ntk_rope_scaling_keeps_the_fastest_frequency_and_slows_the_slowest_by_s():
    d, s = 8, 4.0  # head_dim 8: frequencies base^(-i/4), i = 0..3
    plain = Rotary(TransformerConfig(d_model=16, n_heads=2))
    ntk = Rotary(TransformerConfig(d_model=16, n_heads=2, rope_scaling="ntk", rope_scaling_factor=s))
    assert ntk.base == pytest.approx(10000.0 * s ** (d / (d - 2)))
    one = torch.ones(1, 1)
    theta_plain = torch.atan2(plain(one)[1], plain(one)[0]).flatten()
    theta_ntk = torch.atan2(ntk(one)[1], ntk(one)[0]).flatten()
    assert theta_ntk[0] == pytest.approx(theta_plain[0].item())  # i = 0: frequency 1, untouched
    # The slowest of the d/2 frequencies is slowed by s^((d/2-1)/(d/2) * d/(d-2)) = s exactly.
    assert (theta_plain[-1] / theta_ntk[-1]).item() == pytest.approx(s, rel=1e-4)


@pytest.mark.parametrize("scaling", ["linear", "ntk"])
def test_rope_scaled_cache_equals_the_full_forward(scaling):
    model = make(rope_scaling=scaling, rope_scaling_factor=2.0, max_seq_len=32)
    tokens = torch.randint(0, V, (2, 12))
    torch.testing.assert_close(cached_logits(model, tokens, 5, 16), model(tokens), atol=1e-5, rtol=1e-5)


def test_rope_scaling_needs_rope():
    with pytest.raises(ValueError, match="rope_scaling"):
        TransformerConfig(position="alibi", rope_scaling="linear", rope_scaling_factor=2.0)


def test_window_hides_keys_further_than_the_window():
    model = make(attention_window=4)
    tokens = torch.randint(0, V, (1, 12))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % V
    a, b = model(tokens), model(changed)
    # With 2 layers, position 0 reaches at most 2 * (4 - 1) = 6 positions ahead.
    assert (a[0, 1:7] - b[0, 1:7]).abs().max() > 1e-4
    torch.testing.assert_close(a[0, 7:], b[0, 7:], atol=0, rtol=0)


def test_a_window_wider_than_the_sequence_changes_nothing():
    tokens = torch.randint(0, V, (2, 10))
    torch.testing.assert_close(make(attention_window=16)(tokens), make()(tokens))


@pytest.mark.parametrize("position", ["rope", "alibi", "relative", "none"])
def test_ring_cache_decodes_past_max_seq_len_equal_to_the_full_forward(position):
    """max_seq_len 16, window 4: the cache holds 8 slots, the sequence is 40 tokens long."""
    model = make(position=position, attention_window=4)
    tokens = torch.randint(0, V, (2, 40))
    assert model.new_cache(2, 40).max_len == 8
    # A prefill of window + 1 tokens at most, then the ring wraps around four times.
    torch.testing.assert_close(cached_logits(model, tokens, 5, 40), model(tokens), atol=1e-5, rtol=1e-5)


def test_generate_with_a_window_beyond_max_seq_len_matches_decoding_without_cache():
    model = make(attention_window=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6]]  # a prompt longer than the window: chunked prefill
    cached = generate(model, prompts, 30, do_sample=False)
    uncached = generate(model, prompts, 30, do_sample=False, use_cache=False)
    assert cached == uncached and len(cached[0]) == 30  # 41 tokens, max_seq_len 16


def test_window_must_not_be_negative():
    with pytest.raises(ValueError, match="attention_window"):
        TransformerConfig(attention_window=-1)


def test_a_prefill_that_would_overwrite_its_own_window_is_refused():
    model = make(attention_window=4)
    cache = model.new_cache(1, 40)  # 8 slots
    with pytest.raises(ValueError, match="at most 5 per call"):
        model(torch.randint(0, V, (1, 12)), cache=cache, cache_pos=torch.arange(12))
    model(torch.randint(0, V, (1, 8)), cache=model.new_cache(1, 40), cache_pos=torch.arange(8))  # no wrap: fine


def test_an_encoder_window_is_two_sided():
    model = make(arch="encoder", attention_window=3, n_layers=1)
    tokens = torch.randint(0, V, (1, 10))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % V
    diff = (model(tokens) - model(changed)).abs().amax(-1)[0]  # one layer: reach |i - 5| < 3
    assert (diff[3:8] > 1e-5).all() and diff[:3].max() == 0 and diff[8:].max() == 0
