"""The run config: layering (preset < file < --set), typed overrides, typos named with a suggestion."""

import pytest

from blockformer import build_model, count_parameters
from blockformer.errors import UsageError
from blockformer.run_config import RunConfig, load_run_config, parse_override, preset_names, read_preset


def test_layers_apply_in_order(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layers = 3\n[train]\nlr = 0.01\nsteps = 7\n')
    cfg = load_run_config(path, "copy", ["train.lr=2e-3", "model.d_model=64"])
    assert cfg.model.arch == "encoder-decoder"  # from the preset
    assert cfg.model.n_layers == 3  # the file beats the preset (2)
    assert cfg.train.steps == 7
    assert cfg.train.lr == 2e-3  # --set beats the file
    assert cfg.model.d_model == 64 and cfg.model.d_ff == 512  # the preset's d_ff stays


@pytest.mark.parametrize(
    "item, expected",
    [
        ("train.lr=1e-3", ("train", "lr", 1e-3)),
        ("train.lr=2", ("train", "lr", 2.0)),
        ("model.n_layers=6", ("model", "n_layers", 6)),
        ("model.tie_embeddings=false", ("model", "tie_embeddings", False)),
        ("model.n_kv_heads=none", ("model", "n_kv_heads", None)),
        ("model.n_kv_heads=2", ("model", "n_kv_heads", 2)),
        ("data.text=a.txt,b.txt", ("data", "text", "a.txt,b.txt")),
        ("train.sample_prompts=def ,class", ("train", "sample_prompts", ["def ", "class"])),
        ("model.norm=rms", ("model", "norm", "rms")),
    ],
)
def test_overrides_are_typed_by_the_field(item, expected):
    assert parse_override(item) == expected


@pytest.mark.parametrize(
    "item, words",
    [
        ("train.lrr=1", ["train.lrr", "did you mean 'lr'"]),
        ("model.n_layer=2", ["model.n_layer", "did you mean 'n_layers'"]),
        ("trian.lr=1", ["trian", "did you mean 'train'"]),
        ("train.lr=fast", ["train.lr", "expected float"]),
        ("train.steps=1.5", ["train.steps", "expected int"]),
        ("model.norm=batch", ["model.norm", "'layer', 'rms', 'none'"]),
        ("train.precision=fp8", ["train.precision", "'bf16'"]),
        ("lr=1", ["section.key=value"]),
    ],
)
def test_bad_overrides_name_the_key(item, words):
    with pytest.raises(UsageError) as e:
        load_run_config(overrides=[item])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_file_typos_and_bad_values_are_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nwarmpu = 10\n")
    with pytest.raises(UsageError, match=r"train.warmpu: unknown key \(did you mean 'warmup'\?\)"):
        load_run_config(path)
    path.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(ValueError, match="train.steps='many': expected int"):
        load_run_config(path)
    path.write_text("[train]\nsteps = 0\n")
    with pytest.raises(UsageError, match=r"train.steps=0: expected an integer >= 1"):
        load_run_config(path)
    path.write_text("")
    with pytest.raises(UsageError, match="empty"):
        load_run_config(path)
    with pytest.raises(UsageError, match="not found"):
        load_run_config(tmp_path / "missing.toml")
    path.write_text("[train\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_run_config(path)


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(UsageError, match=r"unknown preset \(did you mean 'stdlib-lm'\?\)"):
        read_preset("stdlib-l")


def test_toml_round_trip(tmp_path):
    cfg = load_run_config(preset="stdlib-lm", overrides=["train.lr=5e-4"])
    path = tmp_path / "out.toml"
    cfg.to_toml(path)
    assert load_run_config(path) == cfg
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


PRESETS = ["stdlib-lm", "char-lm-tiny", "copy", "reverse", "sort", "add", "original-base"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_builds(name):
    assert name in preset_names()
    cfg = load_run_config(preset=name)
    if name == "original-base":
        m = cfg.model
        assert (m.n_encoder_layers, m.n_decoder_layers, m.d_model, m.n_heads, m.d_ff) == (6, 6, 512, 8, 2048)
        assert (m.norm_position, m.ffn, m.position) == ("post", "relu", "sinusoidal")
        assert (m.scale_embeddings, m.tie_embeddings, m.dropout) == (True, True, 0.1)
        t = cfg.train
        assert (t.schedule, t.warmup, t.lr, t.label_smoothing) == ("noam", 4000, 1.0, 0.1)
        assert (t.beta1, t.beta2, t.eps) == (0.9, 0.98, 1e-9)
    if name == "char-lm-tiny":
        m, t = cfg.model, cfg.train
        assert (m.n_layers, m.n_heads, m.d_model, m.max_seq_len, m.dropout) == (4, 4, 128, 64, 0.0)
        assert (t.batch_size, t.steps, t.lr, t.min_lr, t.warmup) == (12, 2000, 2e-3, 1e-4, 100)
        assert (cfg.data.seq_len, cfg.data.tokenizer, cfg.data.val_fraction) == (64, "char", 0.1)
    import torch

    with torch.device("meta"):
        assert count_parameters(build_model(cfg.model)) > 0
