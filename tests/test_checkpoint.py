"""Checkpoints: exact round trip, unwrapped keys, atomic writes, keep-last-k and best."""

import json
import os

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.run_config import RunConfig
from blockformer.tokenizers import CharTokenizer
from blockformer.train import checkpoint as ckpt_mod
from blockformer.train.checkpoint import (
    mark_best,
    prune,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from blockformer.train.load import load_checkpoint, load_trainer_state


def _setup(arch="decoder", tie=True):
    tok = CharTokenizer("abcdefgh")
    model_cfg = TransformerConfig(arch=arch, vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=1,
                                  max_seq_len=16, tie_embeddings=tie)
    cfg = RunConfig(model=model_cfg)
    return cfg, build_model(model_cfg, seed=0), tok


@pytest.mark.parametrize("arch, tie", [("decoder", True), ("decoder", False), ("encoder-decoder", True)])
def test_round_trip_gives_identical_logits_and_keeps_ties(tmp_path, arch, tie):
    cfg, model, tok = _setup(arch, tie)
    state = {"step": 3, "optimizer": {"lr": torch.tensor(0.5)}, "rng": torch.get_rng_state()}
    path = save_checkpoint(tmp_path / "ck", model, tok, cfg, state)
    files = ["config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"]
    assert sorted(os.listdir(path)) == files
    loaded = load_checkpoint(path)
    assert loaded.config == cfg and loaded.tokenizer.vocab_size == tok.vocab_size
    assert not loaded.model.training
    x = torch.tensor([[4, 5, 6, 7]])
    model.eval()
    if arch == "decoder":
        torch.testing.assert_close(loaded.model(x), model(x), atol=0, rtol=0)
        assert (loaded.model.head.weight is loaded.model.embed.tokens.weight) == tie
    else:
        torch.testing.assert_close(loaded.model(x, x), model(x, x), atol=0, rtol=0)
    st = load_trainer_state(path)  # weights_only=True
    assert st["step"] == 3 and torch.equal(st["rng"], state["rng"])
    meta = json.loads((path / "config.json").read_text())
    assert set(meta) == {"model", "data", "train", "head", "lora", "parallel", "tokenizer"}
    assert meta["tokenizer"]["vocab_size"] == 12


def test_a_compiled_module_is_saved_without_the_wrapper_prefix(tmp_path):
    from safetensors import safe_open

    cfg, model, tok = _setup()
    compiled = torch.compile(model)  # lazy: nothing is compiled until called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    path = save_checkpoint(tmp_path / "ck", compiled, tok, cfg)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and not any(k.startswith(("_orig_mod.", "module.")) for k in keys)
    assert keys <= set(model.state_dict())


@pytest.mark.parametrize("fail_in", ["weights", "state"])
@pytest.mark.parametrize("same_name", [True, False])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, fail_in, same_name):
    cfg, model, tok = _setup()
    good = save_checkpoint(tmp_path / "step-000001", model, tok, cfg, {"step": 1})
    x = torch.tensor([[4, 5, 6]])
    before = load_checkpoint(good).model(x)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    target = "save_model" if fail_in == "weights" else "save"
    monkeypatch.setattr(ckpt_mod.safetensors.torch if fail_in == "weights" else ckpt_mod.torch, target, boom)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the new save would hold different weights
    with pytest.raises(OSError, match="disk full"):
        name = "step-000001" if same_name else "step-000002"
        save_checkpoint(tmp_path / name, model, tok, cfg, {"step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]  # no temporary directory left behind
    torch.testing.assert_close(load_checkpoint(good).model(x), before, atol=0, rtol=0)
    assert load_trainer_state(good)["step"] == 1
    assert resolve_checkpoint(tmp_path, prefer="latest") == good


def test_keep_last_k_and_the_best(tmp_path):
    cfg, model, tok = _setup()
    for step in range(1, 6):
        path = save_checkpoint(tmp_path / f"step-{step:06d}", model, tok, cfg)
        if step == 2:
            mark_best(tmp_path, path)
        prune(tmp_path, keep_last=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-000002", "step-000004", "step-000005"]
    assert os.readlink(tmp_path / "best") == "step-000002"
    assert resolve_checkpoint(tmp_path) == tmp_path / "best"
    assert resolve_checkpoint(tmp_path, prefer="latest").name == "step-000005"
    mark_best(tmp_path, tmp_path / "step-000005")
    prune(tmp_path, keep_last=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-000004", "step-000005"]


def test_a_different_tokenizer_is_refused(tmp_path):
    cfg, model, tok = _setup()
    path = save_checkpoint(tmp_path / "ck", model, tok, cfg)
    CharTokenizer("abcdefgz").save(path)  # same size, different characters
    with pytest.raises(UsageError, match="tokenizer.json: not the tokenizer this model was trained with"):
        load_checkpoint(path)
    CharTokenizer("abc").save(path)
    with pytest.raises(UsageError, match=r"tokenizer has 7 tokens but the model expects vocab_size=12"):
        load_checkpoint(path)


def test_missing_checkpoints_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="config.json missing"):
        load_checkpoint(tmp_path / "empty")


def test_damaged_files_are_usage_errors_naming_the_file(tmp_path):
    cfg, model, tok = _setup()
    path = save_checkpoint(tmp_path / "ck", model, tok, cfg, {"step": 1})
    weights, state = path / "model.safetensors", path / "trainer_state.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(UsageError, match=r"model.safetensors: cannot load the weights \(.*header"):
        load_checkpoint(path)
    state.write_bytes(state.read_bytes()[:50])
    with pytest.raises(UsageError, match=r"trainer_state.pt: cannot read the trainer state"):
        load_trainer_state(path)


def test_weights_of_another_shape_are_refused(tmp_path):
    cfg, model, tok = _setup()
    path = save_checkpoint(tmp_path / "ck", model, tok, cfg)
    meta = json.loads((path / "config.json").read_text())
    meta["model"]["d_model"] = 64  # config edited after training
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match=r"model.safetensors: cannot load the weights"):
        load_checkpoint(path)
