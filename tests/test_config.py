"""TransformerConfig: validation names the field, derived sizes, JSON/TOML round trips."""

import pytest

from blockformer import TransformerConfig


def test_derived_sizes_are_filled_in():
    cfg = TransformerConfig(d_model=96, n_heads=6)
    assert (cfg.n_kv_heads, cfg.d_ff, cfg.head_dim) == (6, 384, 16)
    gated = TransformerConfig(d_model=96, n_heads=6, ffn="swiglu")
    assert gated.d_ff == 256  # 8/3 * 96 = 256, a multiple of 8
    ed = TransformerConfig(arch="encoder-decoder", n_layers=3, n_decoder_layers=2)
    assert (ed.n_encoder_layers, ed.n_decoder_layers, ed.total_layers) == (3, 2, 5)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"d_model": 100, "n_heads": 8}, ["d_model", "multiple of n_heads=8"]),
        ({"n_heads": 8, "n_kv_heads": 3}, ["n_kv_heads", "divisor of n_heads=8"]),
        ({"norm": "batch"}, ["norm", "'layer', 'rms', 'none'"]),
        ({"position": "rotary"}, ["position", "'rope'"]),
        ({"ffn": "swish"}, ["ffn", "'swiglu'"]),
        ({"arch": "gpt"}, ["arch", "'encoder-decoder'"]),
        ({"dropout": 1.0}, ["dropout", "[0, 1)"]),
        ({"n_layers": 0}, ["n_layers", ">= 1"]),
        ({"d_model": "256"}, ["d_model", "int"]),
        ({"tie_embeddings": 1}, ["tie_embeddings", "bool"]),
        ({"d_model": 24, "n_heads": 8, "position": "rope"}, ["d_model", "even"]),
        ({"n_decoder_layers": 2}, ["n_decoder_layers", "encoder-decoder"]),
        (
            {"residual": "scaled", "residual_scale_target": "trunk", "norm_position": "pre"},
            ["residual_scale_target='trunk'", "norm_position='post'"],
        ),
    ],
)
def test_bad_values_raise_naming_the_field(kwargs, names):
    with pytest.raises(ValueError) as err:
        TransformerConfig(**kwargs)
    for name in names:
        assert name in str(err.value)


def test_unknown_key_suggests_the_closest_field():
    with pytest.raises(ValueError, match=r"unknown field 'n_layer' \(did you mean 'n_layers'\?\)"):
        TransformerConfig.from_dict({"n_layer": 3})


def test_round_trips_through_json_and_toml(tmp_path):
    cfg = TransformerConfig(
        arch="encoder-decoder", n_layers=3, n_decoder_layers=2, ffn="geglu", position="relative",
        residual="scaled", residual_scale=0.5, norm="rms", dropout=0.1, n_kv_heads=2,
    )
    assert TransformerConfig.from_json(cfg.to_json()) == cfg
    assert TransformerConfig.from_toml(cfg.to_toml()) == cfg
    cfg.to_toml(tmp_path / "m.toml")
    cfg.to_json(tmp_path / "m.json")
    assert TransformerConfig.from_toml(tmp_path / "m.toml") == cfg
    assert TransformerConfig.from_json(tmp_path / "m.json") == cfg


def test_depth_derived_residual_scales():
    trunk = TransformerConfig(residual="scaled", residual_scale_target="trunk", norm_position="post")
    assert trunk.resolved_residual_scale(8) == pytest.approx(16**0.25)  # DeepNet alpha = (2N)^(1/4)
    branch = TransformerConfig(residual="scaled")
    assert branch.resolved_residual_scale(8) == pytest.approx(0.25)  # 1/sqrt(2N)


def test_sinusoidal_positions_scale_embeddings_by_default():
    assert TransformerConfig(position="sinusoidal").scale_embeddings is True
    assert TransformerConfig(position="rope").scale_embeddings is False
    assert TransformerConfig(position="sinusoidal", scale_embeddings=False).scale_embeddings is False
