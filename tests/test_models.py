"""The three architectures: order, causality, padding and the KV cache, for every position scheme."""

import copy

import pytest
import torch

from blockformer import TransformerConfig, build_model

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
V = 37


def make(arch, position="rope", **kw):
    base = dict(arch=arch, vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, position=position)
    base.update(kw)
    return build_model(TransformerConfig(**base), seed=0).eval()


def run(model, tokens, **kw):
    if model.cfg.arch == "encoder-decoder":
        return model(tokens, tokens, **kw)
    return model(tokens, **kw)


# ------------------------------------------------------------------ order
def test_encoder_without_position_is_permutation_equivariant():
    # A large init makes attention far from uniform, so equality is not an accident of scale.
    model = make("encoder", "none", init_std=0.3)
    tokens = torch.randint(0, V, (2, 12))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    torch.testing.assert_close(model(tokens[:, perm]), out[:, perm], atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", POSITIONS[1:])
def test_encoder_with_a_position_signal_is_not_equivariant(position):
    model = make("encoder", position, init_std=0.3)
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    error = (model(tokens[:, perm]) - model(tokens)[:, perm]).abs().max()
    assert error > 1e-2


def test_causal_decoder_without_position_is_not_equivariant():
    model = make("decoder", "none", init_std=0.3)
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    assert (model(tokens[:, perm]) - model(tokens)[:, perm]).abs().max() > 1e-2


# ------------------------------------------------------------------ causality and padding
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_future_tokens_never_change_the_past(arch, position):
    model = make(arch, position, init_std=0.3)
    tokens = torch.randint(0, V, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 5) % V
    if arch == "encoder-decoder":  # the source stays; the target's future changes
        a, b = model(tokens, tokens), model(tokens, changed)
    else:
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3  # and the future does change


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_padded_tokens_never_change_real_outputs(arch, position):
    model = make(arch, position, init_std=0.3)
    tokens = torch.randint(4, V, (3, 9))
    real = torch.ones(3, 9, dtype=torch.bool)
    real[1, 6:] = False
    real[2, 2:] = False
    other = torch.where(real, tokens, torch.randint(4, V, (3, 9)))
    if arch == "encoder-decoder":  # padding in the source; the target is the same
        tgt = torch.randint(4, V, (3, 5))
        a, b = model(tokens, tgt, src_mask=real), model(other, tgt, src_mask=real)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        return
    a, b = model(tokens, attention_mask=real), model(other, attention_mask=real)
    torch.testing.assert_close(a[real], b[real], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_a_row_of_only_padding_gives_finite_numbers(arch):
    model = make(arch, "alibi")
    tokens = torch.randint(0, V, (2, 6))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1] = False
    if arch == "encoder-decoder":
        out = model(tokens, tokens, src_mask=real, tgt_mask=real)
    else:
        out = model(tokens, attention_mask=real)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("position", POSITIONS)
def test_decoder_cache_gives_the_full_forward_logits(position, n_kv_heads):
    model = make("decoder", position, n_kv_heads=n_kv_heads, init_std=0.1)
    tokens = torch.randint(0, V, (2, 11))
    full = model(tokens)
    cache = model.new_cache(2, 16)
    steps = [model(tokens[:, :4], cache=cache, cache_pos=torch.arange(4))]  # prefill 4, then one at a time
    for t in range(4, 11):
        steps.append(model(tokens[:, t : t + 1], cache=cache, cache_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["rope", "alibi", "relative"])
def test_eager_cpu_decoding_reads_only_the_written_slots(monkeypatch, position):
    """A 64-slot cache holding 11 tokens: attention reads slots [0, t] at step t, and the
    logits equal those of attending over all 64 slots with the unwritten ones masked."""
    from blockformer.nn.kv_cache import KVCache  # noqa: PLC0415

    model = make("decoder", position, init_std=0.1)
    tokens = torch.randint(0, V, (2, 11))

    def decode(cache):
        out, spans = [model(tokens[:, :4], cache=cache, cache_pos=torch.arange(4))], [cache.span]
        for t in range(4, 11):
            out.append(model(tokens[:, t : t + 1], cache=cache, cache_pos=torch.tensor([t])))
            spans.append(cache.span)
        return torch.cat(out, dim=1), spans

    short, spans = decode(model.new_cache(2, 64))
    assert spans == [4, 5, 6, 7, 8, 9, 10, 11]
    monkeypatch.setattr(KVCache, "span", property(lambda self: self.max_len))
    full, spans = decode(model.new_cache(2, 64))
    assert spans == [64] * 8
    torch.testing.assert_close(short, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("position", POSITIONS)
def test_encoder_decoder_cache_gives_the_full_forward_logits(position, n_kv_heads):
    model = make("encoder-decoder", position, n_kv_heads=n_kv_heads, init_std=0.1)
    src, tgt = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 7))
    src_mask = torch.ones(2, 8, dtype=torch.bool)
    src_mask[1, 5:] = False
    full = model(src, tgt, src_mask=src_mask)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(2, 10)
    steps = [model.decode(tgt[:, :1], memory, src_mask, cache=cache, cache_pos=torch.tensor([0]))]
    for t in range(1, 7):  # later steps read cross-attention keys/values from the cache
        steps.append(model.decode(tgt[:, t : t + 1], None, cache=cache, cache_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_left_padded_cached_row_matches_the_row_alone(position):
    model = make("decoder", position, init_std=0.1)
    prompt = torch.randint(4, V, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    real = torch.tensor([[False] * 3 + [True] * 5])
    positions = (real.cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(1, 12)
    got = model(padded, positions=positions, attention_mask=real, cache=cache, cache_pos=torch.arange(8))
    nxt = torch.randint(4, V, (1, 1))
    got_next = model(nxt, positions=torch.tensor([[5]]), cache=cache, cache_pos=torch.tensor([8]))
    alone = model(torch.cat([prompt, nxt], dim=1))
    torch.testing.assert_close(got[:, 3:], alone[:, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_next, alone[:, 5:], atol=1e-5, rtol=1e-5)


def test_cache_reorder_selects_batch_rows():
    model = make("decoder", "rope")
    tokens = torch.randint(0, V, (3, 4))
    cache = model.new_cache(3, 6)
    model(tokens, cache=cache, cache_pos=torch.arange(4))
    cache.reorder(torch.tensor([2, 2, 0]))
    nxt = torch.randint(0, V, (3, 1))
    out = model(nxt, cache=cache, cache_pos=torch.tensor([4]))
    expected = model(torch.cat([tokens[[2, 2, 0]], nxt], dim=1))[:, -1:]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_cache_reorder_of_the_written_slots_alone_leaves_the_rest_and_the_cross_keys(dtype):
    """``reorder(index, slots=n)`` moves the first n slots as a full reorder would (an int8 cache's
    scales with them) and leaves the others; ``cross=False`` leaves the cross-attention keys (beam
    search: rows of one source)."""
    cache = make("decoder", "rope").new_cache(3, 6, dtype=dtype)
    for t in [*cache.k, *cache.v, *(cache.k_scale or []), *(cache.v_scale or [])]:
        t.copy_(torch.randn(t.shape) * 50)
    cache.pos.copy_(torch.arange(18).view(3, 6))
    cache.cross_k[0] = cache.cross_v[0] = torch.arange(3.0)
    full, part = copy.deepcopy(cache), copy.deepcopy(cache)
    index = torch.tensor([2, 2, 0])
    full.reorder(index)
    part.reorder(index, slots=4, cross=False)
    every = (lambda c: [*c.k, *c.v, *(c.k_scale or []), *(c.v_scale or [])])
    assert len(every(cache)) == (4 if dtype == torch.float32 else 8) * len(cache.k) // 2
    for f, p, before in zip(every(full), every(part), every(cache)):
        assert torch.equal(p[:, :, :4], f[:, :, :4]) and torch.equal(p[:, :, 4:], before[:, :, 4:])
        assert not torch.equal(f[:, :, :4], before[:, :, :4])  # rows 0 and 1 took others' slots
    assert part.pos.tolist() == [[12, 13, 14, 15, 4, 5], [12, 13, 14, 15, 10, 11], [0, 1, 2, 3, 16, 17]]
    assert full.cross_k[0].tolist() == [2.0, 2.0, 0.0] and part.cross_k[0].tolist() == [0.0, 1.0, 2.0]


def test_cache_requires_cache_pos():
    model = make("decoder")
    with pytest.raises(ValueError, match="cache_pos"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=model.new_cache(1, 4))


# ------------------------------------------------------------------ seeds and parameters
def test_seeded_build_is_reproducible_and_tied():
    a, b = make("decoder"), make("decoder")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.head.weight is a.embed.tokens.weight
    ed = make("encoder-decoder")
    assert ed.src_embed.tokens.weight is ed.tgt_embed.tokens.weight is ed.head.weight
    separate = make("encoder-decoder", src_vocab_size=50)
    assert separate.src_embed.tokens.weight.shape == (50, 32)


def test_residual_output_projections_get_the_scaled_init():
    model = build_model(TransformerConfig(d_model=256, n_layers=8, n_heads=4), seed=0)
    block = model.decoder.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert block.attn.out.weight.std().item() == pytest.approx(0.02 / 4, rel=0.03)  # 1/sqrt(2*8)
    assert block.ffn.down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.03)


def test_rope_angles_stay_fp32_when_the_model_is_cast_to_bf16():
    model = make("decoder", "rope")
    positions = torch.arange(2000)[None]
    cos32, _ = model.decoder.rotary(positions)
    cos16, _ = model.to(torch.bfloat16).decoder.rotary(positions)
    assert cos16.dtype == torch.float32
    torch.testing.assert_close(cos16, cos32, atol=0, rtol=0)


def test_scaled_embeddings_start_at_unit_scale_even_when_tied():
    model = build_model(TransformerConfig(vocab_size=1000, d_model=256, n_heads=4, scale_embeddings=True), seed=0)
    assert model.head.weight is model.embed.tokens.weight
    assert model.embed.tokens.weight.std().item() == pytest.approx(256**-0.5, rel=0.02)
    x = model.embed(torch.arange(1000)[None], torch.zeros(1, 1000, dtype=torch.long))
    assert x.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.02)
