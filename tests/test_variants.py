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


# ---------------------------------------------------------------------- the families' options
FAMILY_OPTIONS = [  # each option of the published families, on every architecture where it applies
    {"gelu_approximate": "tanh"},
    {"gelu_approximate": "tanh", "ffn": "geglu"},
    {"attention_scale": 1.0},
    {"position": "rope", "rope_interleaved": True},
    {"position": "sinusoidal", "sinusoid_layout": "split"},
    {"position": "learned", "position_offset": 2},
    {"n_token_types": 2},
    {"embedding_norm": True},
    {"head_transform": True, "head_bias": True},
    {"output_scale": 0.125},
]


@pytest.mark.parametrize("options", FAMILY_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("arch", ARCHS)
def test_family_options_build_train_and_keep_cache_parity(arch, options):
    torch.manual_seed(0)
    cfg = TransformerConfig(arch=arch, vocab_size=11, d_model=16, n_layers=2, n_heads=2, max_seq_len=12,
                            init_std=0.1, **{"position": "learned", **options})
    model = build_model(cfg)
    tokens = torch.randint(0, 11, (2, 7))
    logits = model(tokens, tokens) if arch == "encoder-decoder" else model(tokens)
    logits.logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    if arch == "encoder":
        return
    model.eval()
    with torch.no_grad():
        if arch == "decoder":
            full = model(tokens)
            cache = model.new_cache(2, 8)
            steps = [model(tokens[:, t : t + 1], cache=cache, cache_pos=torch.tensor([t])) for t in range(7)]
        else:
            full = model(tokens, tokens)
            memory = model.encode(tokens)
            cache = model.new_cache(2, 8)
            steps = [model.decode(tokens[:, :1], memory, cache=cache, cache_pos=torch.tensor([0]))]
            steps += [model.decode(tokens[:, t : t + 1], None, cache=cache, cache_pos=torch.tensor([t]))
                      for t in range(1, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_family_options_change_what_they_say():
    torch.manual_seed(0)
    base = dict(arch="decoder", vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_seq_len=12, init_std=0.2)
    tokens = torch.randint(0, 11, (1, 6))

    def logits(**kw):
        return build_model(TransformerConfig(**base, **kw), seed=0).eval()(tokens)

    assert not torch.allclose(logits(), logits(gelu_approximate="tanh"))
    # A scale of 1/sqrt(head_dim) is the default one.
    torch.testing.assert_close(logits(attention_scale=8**-0.5), logits())
    # output_scale multiplies the logits of a plain head.
    torch.testing.assert_close(logits(output_scale=0.5), 0.5 * logits())
    # The offset reads the table from row 2: the same as shifting the rows by 2.
    m = build_model(TransformerConfig(**base, position="learned", position_offset=2), seed=0).eval()
    ref = build_model(TransformerConfig(**base, position="learned"), seed=0).eval()
    ref.load_state_dict({**m.state_dict(), "embed.position.table.weight": m.embed.position.table.weight[2:]})
    torch.testing.assert_close(m(tokens), ref(tokens))
    # Split sinusoids are the interleaved ones with the dims regrouped.
    from blockformer.nn.position import sinusoidal_table

    inter, split = sinusoidal_table(5, 8), sinusoidal_table(5, 8, "split")
    torch.testing.assert_close(split, torch.cat([inter[:, 0::2], inter[:, 1::2]], dim=1))


def test_the_pooler_is_the_tanh_of_a_projection_of_the_first_position():
    model = build_model(TransformerConfig(arch="encoder", vocab_size=11, d_model=16, n_heads=2, pooler=True), seed=0)
    hidden = model.hidden_states(torch.randint(0, 11, (2, 5)))
    torch.testing.assert_close(model.pool(hidden), torch.tanh(model.pooler.dense(hidden[:, 0])))
    with pytest.raises(ValueError, match="no pooler"):
        build_model(TransformerConfig(arch="encoder", d_model=16, n_heads=2)).pool(hidden)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_scale": 0.0}, "attention_scale"),
        ({"output_scale": -1.0}, "output_scale"),
        ({"n_token_types": -1}, "n_token_types"),
        ({"position": "rope", "position_offset": 2}, "position='learned'"),
        ({"arch": "decoder", "pooler": True}, "arch='encoder'"),
        ({"position": "learned", "rope_interleaved": True}, "position='rope'"),
        ({"gelu_approximate": "erf"}, "gelu_approximate"),
        ({"sinusoid_layout": "halves"}, "sinusoid_layout"),
    ],
)
def test_bad_family_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)
