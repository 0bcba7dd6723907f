"""LoRA adapters both ways with PEFT, on tiny random transformers models built offline: a PEFT
adapter imported onto ``from_hf``'s model gives PEFT's logits (<= 1e-5), a blockformer adapter
exported loads in ``peft`` with equal logits, separate q/k/v As fuse at a grown rank exactly,
and a LoRA checkpoint refuses a base changed since it was trained."""

from __future__ import annotations

import json

import pytest
import safetensors
import safetensors.torch
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs both
peft = pytest.importorskip("peft")

from test_interop_hf import V, ours, save_hf, theirs_logits  # noqa: E402

from blockformer import TransformerConfig, build_model  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import from_hf, from_peft, to_hf, to_peft  # noqa: E402
from blockformer.nn.lora import LoRALinear, apply_lora, unload_lora  # noqa: E402
from blockformer.run_config import DataConfig, LoraConfig, RunConfig, TrainConfig  # noqa: E402
from blockformer.train.adapter import ADAPTER, base_fingerprint  # noqa: E402
from blockformer.train.checkpoint import save_checkpoint
from blockformer.train.load import load_checkpoint  # noqa: E402

ATOL = 1e-5
HF = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64)),
}
PEFT_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"],
                "bert": ["query", "key", "value", "output.dense", "intermediate.dense"]}
OUR_TARGETS = {"llama": ["qkv", "out", "gate", "up", "down"], "gpt2": ["qkv", "out", "up", "down"],
               "bert": ["qkv", "out", "up", "down"]}
IDS = torch.randint(12, V, (2, 9), generator=torch.Generator().manual_seed(0))


def hf_model(name: str):
    torch.manual_seed(1)  # the same random weights each call: the base of every adapter here
    model = HF[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def peft_adapter(name: str, directory, *, targets=None, **kw):
    """A PEFT adapter with random A and B (init_lora_weights=False), saved; and its model."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets or PEFT_TARGETS[name],
                             init_lora_weights=False, fan_in_fan_out=name == "gpt2", **kw)
    model = peft.get_peft_model(hf_model(name), config).eval()
    model.save_pretrained(directory)
    return model


def randomise_b(model, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def logits(model, imported) -> torch.Tensor:
    """blockformer's logits for IDS (Hugging Face ids), in Hugging Face's column order."""
    with torch.no_grad():
        return theirs_logits(imported, model(ours(imported, IDS)))


def peft_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each family's tiny model saved with a tokenizer whose specials move (ids permuted)."""
    root = tmp_path_factory.mktemp("bases")
    return {name: save_hf(hf_model(name), root / name) for name in HF}


# ---------------------------------------------------------------------- PEFT -> blockformer
@pytest.mark.parametrize("name,rslora", [("llama", False), ("llama", True), ("gpt2", False), ("bert", False)])
def test_a_peft_adapter_imports_with_pefts_logits(name, rslora, bases, tmp_path):
    theirs = peft_adapter(name, tmp_path / "adapter", use_rslora=rslora)
    adapted = from_peft(tmp_path / "adapter", bases[name])
    got = logits(adapted.model, adapted)
    torch.testing.assert_close(got, peft_logits(theirs), atol=ATOL, rtol=0)
    assert (got - peft_logits(hf_model(name))).abs().max() > 1e-2  # the adapter acts
    torch.testing.assert_close(logits(unload_lora(adapted.model), adapted), got, atol=ATOL, rtol=0)


def test_q_k_v_adapters_with_their_own_a_fuse_at_rank_3r_and_export_back_exactly(bases, tmp_path):
    theirs = peft_adapter("llama", tmp_path / "adapter")
    adapted = from_peft(tmp_path / "adapter", bases["llama"])
    qkv = adapted.model.decoder.blocks[0].attn.qkv
    assert qkv.lora_A["qkv"].shape[0] == 12 and adapted.model.decoder.blocks[0].attn.out.lora_A["out"].shape[0] == 4
    assert len(adapted.notes) == 1 and "rank 4 -> 12" in adapted.notes[0] and "2 layer(s)" in adapted.notes[0]
    # back to PEFT: q/k/v at rank 12 (A repeated, B rows split), the rest at 4, through rank_pattern
    to_peft(adapted.model, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["rank_pattern"].values()) == {12}
    back = peft.PeftModel.from_pretrained(hf_model("llama"), tmp_path / "back").eval()
    torch.testing.assert_close(peft_logits(back), peft_logits(theirs), atol=ATOL, rtol=0)


def test_q_and_v_only_fuse_at_rank_2r_with_k_untouched(bases, tmp_path):
    theirs = peft_adapter("llama", tmp_path / "adapter", targets=["q_proj", "v_proj"])
    adapted = from_peft(tmp_path / "adapter", bases["llama"])
    layer = adapted.model.decoder.blocks[1].attn.qkv
    assert layer.lora_A["qkv"].shape[0] == 8 and list(layer.parts) == ["qkv"]
    q = adapted.config.n_heads * adapted.config.head_dim
    kv = adapted.config.n_kv_heads * adapted.config.head_dim
    assert torch.count_nonzero(layer.lora_B["qkv"][q:q + kv]) == 0  # k's rows
    assert not isinstance(adapted.model.decoder.blocks[0].ffn.up, LoRALinear)
    torch.testing.assert_close(logits(adapted.model, adapted), peft_logits(theirs), atol=ATOL, rtol=0)
    with pytest.raises(UsageError, match="already carries LoRA adapters"):
        from_peft(tmp_path / "adapter", adapted)  # a second adapter would silently replace the first


# ---------------------------------------------------------------------- blockformer -> PEFT
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_a_blockformer_adapter_exports_and_loads_in_peft_with_equal_logits(name, bases, tmp_path):
    imported = from_hf(bases[name])
    apply_lora(imported.model, LoraConfig(rank=3, alpha=5.0, dropout=0.1, targets=OUR_TARGETS[name]))
    randomise_b(imported.model)
    want = logits(imported.model.eval(), imported)
    to_peft(imported.model, tmp_path / "peft", base_model_name_or_path=str(bases[name]))
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (3, 5.0, 0.1)
    assert config["base_model_name_or_path"] == str(bases[name])
    theirs = peft.PeftModel.from_pretrained(hf_model(name), tmp_path / "peft").eval()
    torch.testing.assert_close(peft_logits(theirs), want, atol=ATOL, rtol=0)
    assert (want - peft_logits(hf_model(name))).abs().max() > 1e-2  # the adapter acts
    # and back: PEFT's q/k/v now share one A, so the fused rank stays 3
    again = from_peft(tmp_path / "peft", bases[name])
    assert again.notes == [] and {m.lora_A[p].shape[0] for m in again.model.modules()
                                  if isinstance(m, LoRALinear) for p in m.parts} == {3}
    torch.testing.assert_close(logits(again.model, again), want, atol=ATOL, rtol=0)


def test_rope_interleaved_q_k_rows_of_the_adapter_are_permuted_like_the_base(tmp_path):
    cfg = TransformerConfig(arch="decoder", position="rope", norm="rms", ffn="swiglu", bias=False, n_kv_heads=2,
                            tie_embeddings=False, rope_interleaved=True, vocab_size=V, d_model=32, n_heads=4,
                            d_ff=48, max_seq_len=64, n_layers=2)
    model = build_model(cfg, seed=0).eval()
    apply_lora(model, LoraConfig(rank=2, targets=["qkv"], rslora=True))
    randomise_b(model)
    with torch.no_grad():
        want = model(IDS)
    base = transformers.AutoModelForCausalLM.from_pretrained(to_hf(model, tmp_path / "base")).eval()  # unmerged
    theirs = peft.PeftModel.from_pretrained(base, to_peft(model, tmp_path / "peft")).eval()
    torch.testing.assert_close(peft_logits(theirs), want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- fingerprint
def _lora_checkpoint(base_dir, out, seed: int = 2):
    """A LoRA checkpoint on ``base_dir`` (no training needed: random non-zero B)."""
    base = load_checkpoint(base_dir)
    cfg = RunConfig(model=base.config.model, data=DataConfig(tokenizer=str(base_dir)),
                    train=TrainConfig(init_from=str(base_dir)), lora=LoraConfig(rank=2, targets=["qkv", "out", "up"]))
    apply_lora(base.model, cfg.lora)
    randomise_b(base.model, seed)
    return save_checkpoint(out, base.model, base.tokenizer, cfg)


def test_a_lora_checkpoint_refuses_a_changed_base_and_an_old_adapter_still_loads(bases, tmp_path, capsys):
    assert main(["convert", "--from-hf", str(bases["llama"]), "--out", str(tmp_path / "base")]) == 0
    lora = _lora_checkpoint(tmp_path / "base", tmp_path / "lora")
    with safetensors.safe_open(str(lora / ADAPTER), framework="pt") as f:
        meta = f.metadata()
    assert meta["base_fingerprint"].startswith("sha256:")
    want = load_checkpoint(lora).model(IDS)
    changed = load_checkpoint(tmp_path / "base")
    with torch.no_grad():
        changed.model.decoder.blocks[1].ffn.down.weight[0, 0] += 1e-3
    save_checkpoint(tmp_path / "base", changed.model, changed.tokenizer, changed.config)
    with pytest.raises(UsageError, match="has changed since the adapter was trained") as e:
        load_checkpoint(lora)
    assert str(lora / ADAPTER) in str(e.value) and str(tmp_path / "base") in str(e.value)
    assert "\n" not in str(e.value)
    # an adapter written before fingerprints: loaded unchecked (onto the changed base)
    tensors = safetensors.torch.load_file(str(lora / ADAPTER))
    del meta["base_fingerprint"]
    safetensors.torch.save_file(tensors, str(lora / ADAPTER), metadata=meta)
    got = load_checkpoint(lora).model(IDS)
    assert 0 < (got - want).abs().max() < 1e-2


def test_the_fingerprint_covers_the_base_not_the_adapter_and_sees_an_in_place_change():
    model = build_model(TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4), seed=0)
    apply_lora(model, LoraConfig(rank=2))
    first = base_fingerprint(model)
    randomise_b(model)  # the adapter trains: the base's fingerprint stays
    assert base_fingerprint(model) == first
    with torch.no_grad():
        model.decoder.blocks[0].attn.qkv.weight[3, 1] += 1e-6  # the base changes in place: seen (not cached)
    assert base_fingerprint(model) != first


# ---------------------------------------------------------------------- the command line
def test_convert_to_peft_and_back_from_peft_keep_the_logits(bases, tmp_path, capsys):
    hf_dir = str(bases["llama"])
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "base")]) == 0
    lora = _lora_checkpoint(tmp_path / "base", tmp_path / "run" / "step-000010")
    imported = from_hf(hf_dir)  # for the id permutation
    want = logits(load_checkpoint(tmp_path / "run").model, imported)
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--base", hf_dir, "--out", str(tmp_path / "peft")]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == hf_dir
    theirs = peft.PeftModel.from_pretrained(hf_model("llama"), tmp_path / "peft").eval()
    torch.testing.assert_close(peft_logits(theirs), want, atol=ATOL, rtol=0)
    capsys.readouterr()
    assert main(["convert", "--from-peft", str(tmp_path / "peft"), "--base", hf_dir, "--out", str(tmp_path / "merged")]) == 0
    assert "merged the PEFT adapter" in capsys.readouterr().out
    merged = load_checkpoint(tmp_path / "merged")
    assert not any(isinstance(m, LoRALinear) for m in merged.model.modules())
    torch.testing.assert_close(logits(merged.model, imported), want, atol=ATOL, rtol=0)
    assert lora.is_dir()


def _error(capsys, argv) -> str:
    capsys.readouterr()  # what building the inputs printed (transformers' warnings)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_adapters_and_flags_are_one_line_errors(bases, tmp_path, capsys):
    hf = str(bases["llama"])
    (tmp_path / "empty").mkdir()
    out = ["--out", str(tmp_path / "out")]
    assert "adapter_config.json: not found" in _error(capsys, ["convert", "--from-peft", str(tmp_path / "empty"),
                                                               "--base", hf, *out])
    assert "needs --base" in _error(capsys, ["convert", "--from-peft", str(tmp_path / "empty"), *out])
    assert "--base: only with" in _error(capsys, ["convert", "--from-hf", hf, "--base", hf, *out])
    peft_adapter("gpt2", tmp_path / "gpt2")  # target modules of another family
    err = _error(capsys, ["convert", "--from-peft", str(tmp_path / "gpt2"), "--base", hf, *out])
    assert "'transformer.h.0.attn.c_attn'" in err and "target_modules" in err and "self_attn.q_proj" in err
    peft_adapter("llama", tmp_path / "saved", modules_to_save=["lm_head"])
    assert "modules_to_save=['lm_head'] is not supported" in _error(
        capsys, ["convert", "--from-peft", str(tmp_path / "saved"), "--base", hf, *out])
    peft_adapter("llama", tmp_path / "dora", use_dora=True)
    assert "use_dora=True" in _error(capsys, ["convert", "--from-peft", str(tmp_path / "dora"), "--base", hf, *out])
    assert main(["convert", "--from-hf", hf, "--out", str(tmp_path / "plain")]) == 0
    assert "no adapter.safetensors" in _error(capsys, ["convert", "--to-peft", str(tmp_path / "plain"), *out])


def test_an_unsupported_family_is_refused_naming_it():
    cfg = TransformerConfig(arch="encoder-decoder", position="relative", norm="rms", ffn="geglu", bias=False,
                            attention_scale=1.0, vocab_size=V, d_model=32, n_heads=4, d_ff=48, n_layers=1)
    model = build_model(cfg, seed=0)
    apply_lora(model, LoraConfig(rank=2))
    with pytest.raises(UsageError, match="a Hugging Face t5 model; PEFT adapters map for gpt2, llama, bert only"):
        to_peft(model, "unused")
