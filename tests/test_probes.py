"""The probes: each claim's numbers on small sizes, and the `blockformer probe` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.cli import main
from blockformer.errors import UsageError
from blockformer.probes import PROBES, run_probe
from blockformer.probes import attention, cost, depth, equivariance, gradients, scale, toy
from blockformer.probes.memory import TensorMemory, measure
from blockformer.probes.report import format_table, parse_ints


# ---------------------------------------------------------------------- toy
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_toy_pre_norm_block_reproduces_the_seed_example(dtype):
    data = toy.run(dtype=dtype).data["pre"]
    values = {s["step"]: s["value"] for s in data["steps"]}
    assert values["Norm(x)"] == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert values["A = Attn(Norm(x))"] == pytest.approx([0.4, -0.2], abs=1e-6)
    assert values["r = x + A"] == pytest.approx([1.4, 1.8], abs=1e-6)
    assert values["Norm(r)"] == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert values["F = FFN(Norm(r))"] == pytest.approx([0.3, 0.5], abs=1e-6)
    assert data["output"] == pytest.approx([1.7, 2.3], abs=1e-6)
    assert data["max_error"] < 1e-6


def test_toy_post_norm_block_normalises_each_sum():
    data = toy.run().data["post"]
    values = {s["step"]: s["value"] for s in data["steps"]}
    assert values["x + A"] == pytest.approx([1.4, 1.8], abs=1e-9)
    assert values["r' = Norm(x + A)"] == pytest.approx([-1.0, 1.0], abs=1e-9)
    assert values["r' + F"] == pytest.approx([-0.7, 1.5], abs=1e-9)
    assert data["output"] == pytest.approx([-1.0, 1.0], abs=1e-9)


def test_toy_values_are_read_from_the_real_block_not_recomputed():
    block = toy.toy_block("pre")
    block.ffn = toy.FixedOutput([1.0, 1.0])  # a different FFN changes the traced output
    trace = toy.trace_block(block, torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 1, 2))
    assert trace["output"] == pytest.approx([2.4, 2.8], abs=1e-9)
    assert trace["ffn_residual"] == trace["output"]


# ---------------------------------------------------------------------- equivariance
def test_equivariance_holds_only_for_an_order_blind_encoder():
    result = equivariance.run(seq_len=6, pad=2, batch_size=1)
    grid = result.data["grid"]
    assert len(grid) == 2 * 6 * 2
    for g in grid:
        if g["arch"] == "encoder" and g["position"] == "none":
            assert g["error"] < 1e-5, g
        else:
            assert g["error"] > 1e-2, g
    assert all(g["holds"] for g in grid)


def test_equivariance_order_example_xiaoming_xiaohong():
    sentence = equivariance.run(seq_len=4, pad=1, batch_size=1).data["sentence"]
    errors = {(s["arch"], s["position"]): s["errors"] for s in sentence["settings"]}
    assert sentence["a"] == "小明打小红" and sentence["b"] == "小红打小明"
    assert max(errors["encoder", "none"]) < 1e-5  # each character's output just moves
    assert min(errors["encoder", "sinusoidal"]) > 1e-2  # a position signal changes every output
    assert max(errors["decoder", "none"]) > 1e-2  # the causal mask carries order


def test_equivariance_padding_permutes_only_real_tokens():
    model = equivariance.small_model("encoder", "none", init_std=0.2, seed=0)
    tokens = torch.tensor([[5, 9, 7, 11, 0, 0]])
    err = equivariance.permutation_error(model, tokens, 4, torch.tensor([2, 0, 3, 1]))
    assert err < 1e-10


def test_equivariance_rejects_too_few_real_tokens():
    with pytest.raises(UsageError, match="--pad"):
        equivariance.run(seq_len=3, pad=2)


# ---------------------------------------------------------------------- gradients and scale
def test_gradient_ratios_first_vs_last_block_at_init():
    data = gradients.run(depths="8,32", variants="pre,post,pre-nores,post-nores,nonorm-nores", steps=0).data
    v = data["variants"]
    assert 0.5 < v["pre"]["init_ratio"][32] < 2.0  # Pre-Norm: even through depth
    assert 0.1 < v["post"]["init_ratio"][32] < 10.0  # Post-Norm: within 10x too
    # ... but, as Xiong et al. (2020) found, Post-Norm's gradient grows toward the output.
    assert v["post"]["init_ratio"][32] < 0.8 < v["pre"]["init_ratio"][32]
    for name in ("pre-nores", "post-nores", "nonorm-nores"):
        assert v[name]["init_ratio"][32] < 1e-3, name  # no residual: vanished
    assert v["pre-nores"]["init_ratio"][32] < v["pre-nores"]["init_ratio"][8]  # worse with depth


def test_gradients_after_training_are_reported():
    data = gradients.run(depths="4", variants="pre", steps=5, train_depth=4).data["variants"]["pre"]
    assert len(data["trained"]) == 4 and len(data["losses"]) == 5
    assert all(math.isfinite(x) and x > 0 for x in data["trained"])


def test_scale_is_bounded_with_normalisation_and_collapses_without_residuals():
    v = scale.run(depths="8,32", variants="pre,post,nonorm-nores", steps=0).data["variants"]
    assert all(abs(r - 1.0) < 1e-3 for r in v["post"]["init"][32])  # LayerNorm output: RMS 1
    pre = v["pre"]["init"][32]
    assert max(pre) / min(pre) < 2.0
    assert v["nonorm-nores"]["init_growth"][32] < 1e-3


def test_variant_names_are_validated():
    with pytest.raises(UsageError, match="--variants"):
        gradients.run(variants="pre,sideways", steps=0, depths="2")
    with pytest.raises(UsageError, match="--depths"):
        scale.run(depths="8,x", steps=0)
    assert parse_ints("8, 16", "--depths") == [8, 16]


# ---------------------------------------------------------------------- depth
def test_post_norm_without_warmup_ends_with_higher_loss_than_pre_norm():
    runs = depth.run(depth=8, steps=100, lr=3e-3, warmup=0, seed=0).data["runs"]
    by = {r["norm"]: r for r in runs}
    assert [r["warmup"] for r in runs] == [0, 0]
    assert by["post"]["final_loss"] > by["pre"]["final_loss"] + 0.5
    assert by["post"]["verdict"] == "stalled"
    assert by["pre"]["verdict"] == "learns"


@pytest.mark.slow
def test_depth_probe_defaults_post_norm_needs_warmup():
    # the default run's curves but Pre-Norm with warmup (each run is its own model and data)
    both = depth.run(norms="post").data["runs"] + depth.run(norms="pre", warmup=0).data["runs"]
    runs = {(r["norm"], r["warmup"] > 0): r for r in both}
    assert runs["post", False]["verdict"] == "stalled"
    assert runs["post", True]["verdict"] == "learns"
    assert runs["pre", False]["verdict"] == "learns"
    assert runs["post", True]["final_loss"] < runs["post", False]["final_loss"] - 0.5


def test_depth_verdicts():
    assert depth.verdict([3.0, math.nan], 16, 1) == "diverged"
    assert depth.verdict([2.8, 2.77], 16, 1) == "stalled"
    assert depth.verdict([2.8, 1.0], 16, 1) == "learns"


# ---------------------------------------------------------------------- cost
def test_tensor_memory_counts_live_storage_once():
    def f():
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100) * 2  # a view shares storage; the product is new
        del a
        return b.sum()

    assert measure(f)["peak_bytes"] == 8000  # a and b alive together; the sum comes after a is freed
    with TensorMemory() as mem:
        x = torch.zeros(10, 10, dtype=torch.float64)
    assert mem.largest == 800 and mem.largest_shape == (10, 10) and x.shape == (10, 10)


def test_cost_score_memory_grows_as_the_square_of_the_sequence_length():
    data = cost.run(seq_lens="128,256", rnn_seq_lens="", d_model=32, n_heads=2, time_it=False).data
    a, b = data["attention"]
    assert a["score_bytes"] == 2 * 128 * 128 * 4
    assert b["score_bytes"] / a["score_bytes"] == 4  # exactly: T doubled
    for r in (a, b):  # the math path materialises exactly that tensor; the fused path never does
        assert r["math"]["largest_bytes"] == r["score_bytes"]
        assert r["math"]["largest_shape"][-2:] == [r["seq_len"], r["seq_len"]]
        assert r["fused"]["largest_bytes"] < r["score_bytes"]
        assert r["fused"]["peak_bytes"] < r["math"]["peak_bytes"]
    # deterministic: measuring again gives the same bytes
    again = cost.run(seq_lens="128,256", rnn_seq_lens="", d_model=32, n_heads=2, time_it=False).data
    peaks = [r["math"]["peak_bytes"] for r in again["attention"]]
    assert peaks == [a["math"]["peak_bytes"], b["math"]["peak_bytes"]]


def test_cost_block_vs_lstm_counts_sequential_steps():
    result = cost.run(seq_lens="16", rnn_seq_lens="8,16", d_model=16, n_heads=2, rnn_batch_size=2, repeats=1)
    rnn = result.data["rnn"]
    # counted by hooks on the modules (the LSTM unrolled into its cell, which gives its output)
    assert [(r["block_sequential_steps"], r["lstm_sequential_steps"]) for r in rnn] == [(1, 8), (1, 16)]
    assert all(r["lstm_unrolled_max_error"] < 1e-5 for r in rnn)
    # counted by FlopCounterMode, against hand arithmetic: 4 gates, each a (d x 2d) matmul per token;
    # the block's qkv, output and FFN matmuls plus QK^T and AV over all T^2 pairs
    d, B, d_ff = 16, 2, 64
    for r in rnn:
        T = r["seq_len"]
        assert r["lstm_forward_flops"] == 2 * 4 * d * (2 * d) * B * T
        assert r["block_forward_flops"] == 2 * (4 * d * d + 2 * d * d_ff) * B * T + 4 * B * T * T * d
    assert rnn[1]["lstm_forward_flops"] == 2 * rnn[0]["lstm_forward_flops"]  # linear in T
    assert all(r["block_seconds"] > 0 and r["lstm_seconds"] > 0 for r in rnn)
    assert "LSTM" in result.table()


# ---------------------------------------------------------------------- attention
def _check_rows(layer, causal):
    w = torch.tensor(layer["weights"])  # (H, Tq, Tk)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2], dtype=w.dtype), atol=1e-6, rtol=0)
    if causal:
        assert w.triu(diagonal=1).abs().max().item() == 0.0  # no weight on the future
    assert layer["reproduction_error"] < 1e-5


@pytest.mark.parametrize("position", ["rope", "alibi", "relative", "sinusoidal"])
def test_attention_weights_rows_sum_to_one_and_respect_the_causal_mask(position):
    result = attention.run(text="hello, world", position=position)
    assert len(result.data["layers"]) == 2 and len(result.data["layers"][0]["weights"]) == 4
    for layer in result.data["layers"]:
        _check_rows(layer, causal=True)
    row = result.rows[0]
    assert 0 < row[2] <= row[3] + 1e-9  # entropy never exceeds uniform over visible keys


def test_attention_encoder_decoder_has_self_and_cross_maps():
    result = attention.run(text="abc", target="xy", arch="encoder-decoder", n_layers=1)
    layers = {l["module"]: l for l in result.data["layers"]}
    enc, dec = layers["encoder.blocks.0.attn"], layers["decoder.blocks.0.attn"]
    cross = layers["decoder.blocks.0.cross_attn"]
    assert torch.tensor(enc["weights"]).shape == (4, 3, 3)
    assert torch.tensor(cross["weights"]).shape == (4, 3, 3)  # queries: <bos> x y; keys: a b c
    assert cross["queries"] == ["<bos>", "x", "y"] and cross["keys"] == ["a", "b", "c"]
    _check_rows(enc, causal=False)
    _check_rows(dec, causal=True)
    _check_rows(cross, causal=False)


def test_attention_recompute_matches_gqa_with_padding_mask():
    cfg = TransformerConfig(arch="encoder", vocab_size=32, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                            position="alibi", init_std=0.2)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.tensor([[5, 6, 7, 8, 0, 0]])
    mask = tokens != 0
    records = attention.capture(model, lambda: model(tokens, attention_mask=mask))
    for r in records:
        assert r["error"] < 1e-5
        assert r["weights"][:, :, 4:].abs().max().item() == 0.0  # padded keys get no weight
        torch.testing.assert_close(r["weights"].sum(-1), torch.ones(4, 6), atol=1e-6, rtol=0)


def test_attention_entropy_of_uniform_and_one_hot_rows():
    w = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # one head, causal rows
    ent, uniform = attention.entropy_bits(w)
    assert ent == pytest.approx([0.5]) and uniform == pytest.approx([0.5])
    assert attention.mean_distance(w) == pytest.approx([0.25])


def test_attention_probe_reads_a_checkpoint(tmp_path):
    from blockformer.train import checkpoint as ckpt
    from blockformer.run_config import RunConfig
    from blockformer.tokenizers import train_tokenizer

    tok = train_tokenizer("char", ["hello world"])
    cfg = RunConfig(model=TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2))
    ckpt.save_checkpoint(tmp_path / "ckpt", build_model(cfg.model, seed=0), tok, cfg)
    result = attention.run(text="hello", checkpoint=str(tmp_path / "ckpt"))
    assert result.data["tokens"] == list("hello")
    _check_rows(result.data["layers"][0], causal=True)


# ---------------------------------------------------------------------- results and CLI
def test_format_table_aligns_wide_characters():
    lines = format_table(["a", "b"], [["小明", 1.0], ["xy", 22.5]]).splitlines()
    assert lines[2] == "小明     1"  # 小明 takes 4 terminal columns, like "xy  "
    assert lines[3] == "xy    22.5"


def test_every_probe_is_registered():
    assert list(PROBES) == ["toy", "equivariance", "gradients", "scale", "depth", "cost", "attention", "length"]
    with pytest.raises(UsageError, match="did you mean 'toy'"):
        run_probe("tyo")


def test_cli_probe_toy_json_and_plot(tmp_path, capsys):
    png = tmp_path / "toy.png"
    assert main(["probe", "toy", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["probe"] == "toy"
    assert out["data"]["pre"]["output"] == pytest.approx([1.7, 2.3], abs=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_probe_prints_a_table_and_rejects_bad_options(capsys):
    assert main(["probe", "scale", "--depths", "2", "--steps", "0", "--variants", "post"]) == 0
    assert "Post-Norm" in capsys.readouterr().out
    assert main(["probe", "gradients", "--variants", "sideways"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--variants" in err


@pytest.mark.parametrize("name", ["equivariance", "gradients", "scale", "depth", "cost", "attention"])
def test_every_probe_plots(name, tmp_path):
    small = {
        "equivariance": {"seq_len": 4, "pad": 1},
        "gradients": {"depths": "2,3", "steps": 2, "train_depth": 2},
        "scale": {"depths": "2", "steps": 2, "train_depth": 2},
        "depth": {"depth": 2, "steps": 4, "warmup": 2},
        "cost": {"seq_lens": "8,16", "rnn_seq_lens": "8", "d_model": 16, "n_heads": 2, "repeats": 1},
        "attention": {"text": "ab", "n_layers": 1},
    }[name]
    path = run_probe(name, **small).save_plot(tmp_path / f"{name}.png")
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("options", [{"attention_scale": 1.0}, {"rope_interleaved": True}])
def test_attention_recompute_follows_the_scale_and_rope_layout_the_model_uses(options):
    """T5's unscaled scores and GPT-J's interleaved rope: the probe's weights reproduce the
    module's output, not those of a 1/sqrt(head_dim), half-split rope model."""
    cfg = TransformerConfig(arch="decoder", vocab_size=32, d_model=32, n_heads=4, n_layers=1, position="rope",
                            init_std=0.5, **options)
    model = build_model(cfg, seed=0).eval()
    records = attention.capture(model, lambda: model(torch.tensor([[5, 6, 7, 8, 9]])))
    assert records and all(r["error"] < 1e-5 for r in records)
