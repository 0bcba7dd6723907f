"""Interop without a Hugging Face model to start from: blockformer models of each mapped shape
export to transformers with equal logits; the weight layouts are checked one by one; bad
input is one line naming the file and key (exit code 2 on the command line)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

from safetensors.torch import load_file, save_file  # noqa: E402

from blockformer import TransformerConfig, build_model  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import from_hf, half_to_interleaved, interleaved_to_half, to_hf  # noqa: E402
from blockformer.nn.position import Rotary, apply_rope  # noqa: E402

V = 40
SMALL = dict(vocab_size=V, d_model=32, n_heads=4, d_ff=48, max_seq_len=64, n_layers=2)
NATIVE = {  # blockformer configs and the transformers class that loads their export
    "gpt2": (dict(arch="decoder", position="learned", norm_position="pre", gelu_approximate="tanh"),
             "AutoModelForCausalLM"),
    "llama-interleaved-rope": (dict(arch="decoder", position="rope", norm="rms", ffn="swiglu", bias=False,
                                    n_kv_heads=2, tie_embeddings=False, rope_interleaved=True), "AutoModelForCausalLM"),
    "bert": (dict(arch="encoder", position="learned", norm_position="post", embedding_norm=True,
                  head_transform=True, head_bias=True, n_token_types=2, norm_eps=1e-12), "AutoModelForMaskedLM"),
    "bert-plain": (dict(arch="encoder", position="learned", norm_position="post", embedding_norm=True),
                   "AutoModel"),
    "t5": (dict(arch="encoder-decoder", position="relative", norm="rms", ffn="geglu", gelu_approximate="tanh",
                bias=False, attention_scale=1.0, relative_buckets=8, relative_max_distance=20,
                n_decoder_layers=3), "AutoModelForSeq2SeqLM"),
    "bart": (dict(arch="encoder-decoder", position="learned", position_offset=2, norm_position="post",
                  embedding_norm=True, head_bias=True), "AutoModelForSeq2SeqLM"),
    "marian": (dict(arch="encoder-decoder", position="sinusoidal", sinusoid_layout="split", norm_position="post",
                    ffn="silu", head_bias=True), "AutoModelForSeq2SeqLM"),
}


def _random_native(kwargs) -> torch.nn.Module:
    model = build_model(TransformerConfig(**SMALL, **kwargs), seed=0).eval()
    with torch.no_grad():  # norms, biases and gates away from 1 and 0: every layout shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", list(NATIVE))
def test_native_blockformer_models_export_with_equal_logits(name, tmp_path):
    kwargs, auto = NATIVE[name]
    model = _random_native(kwargs)
    hf = getattr(transformers, auto).from_pretrained(to_hf(model, tmp_path / name)).eval()
    ids = torch.randint(4, V, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        if model.cfg.arch == "encoder-decoder":
            tgt = ids[:, :6].flip(1)
            want = model(ids, tgt, src_mask=mask)
            got = hf(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=tgt).logits
            assert (want - got).abs().max() <= 1e-4
            return
        if model.cfg.arch == "encoder" and not model.cfg.head_transform:  # BertModel: hidden states
            want = model.hidden_states(ids, attention_mask=mask)
            got = hf(ids, attention_mask=mask.long()).last_hidden_state
        else:
            want = model(ids, attention_mask=mask)
            got = hf(ids, attention_mask=mask.long()).logits
    assert (want - got)[mask].abs().max() <= 1e-4
    assert type(hf).__name__.lower().startswith(name.split("-")[0])


def test_rope_layouts_differ_by_a_permutation_that_the_tolerance_catches(tmp_path):
    """Rotating pairs (2i, 2i+1) of W x equals rotating pairs (i, i+d/2) of P W x. Skipping P
    changes logits only a little (0.01-ish here), so parity is asserted at 1e-5."""
    torch.manual_seed(0)
    n_heads, hd = 4, 8
    w = torch.randn(n_heads * hd, 32)
    x = torch.randn(1, 5, 32)
    cos, sin = Rotary(TransformerConfig(d_model=32, n_heads=n_heads))(torch.arange(5)[None])

    def rotated(weight, interleaved):
        q = (x @ weight.T).view(1, 5, n_heads, hd).transpose(1, 2)
        return apply_rope(q, cos, sin, interleaved)

    half = rotated(interleaved_to_half(w, n_heads), False)
    inter = rotated(w, True)  # the same rotation, its head dims in interleaved order
    assert torch.allclose(half, torch.cat([inter[..., 0::2], inter[..., 1::2]], dim=-1), atol=1e-6)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, n_heads), n_heads), w)
    # The same model exported with and without the permutation: only the right one matches.
    model = _random_native(NATIVE["llama-interleaved-rope"][0])
    ids = torch.randint(4, V, (1, 12), generator=torch.Generator().manual_seed(1))
    good = transformers.AutoModelForCausalLM.from_pretrained(to_hf(model, tmp_path / "good")).eval()
    model.cfg.rope_interleaved = False  # export as if the layouts agreed
    bad = transformers.AutoModelForCausalLM.from_pretrained(to_hf(model, tmp_path / "bad")).eval()
    model.cfg.rope_interleaved = True
    with torch.no_grad():
        want = model(ids)
        assert (good(ids).logits - want).abs().max() <= 1e-5
        wrong = (bad(ids).logits - want).abs().max()
    assert 1e-5 < wrong < 1.0  # small enough to pass a loose tolerance, not this one


def test_gpt2_conv1d_weights_are_transposed_and_qkv_stays_fused(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4,
                                                              n_positions=16)).eval()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path).model
    c_attn = hf.transformer.h[0].attn.c_attn.weight  # (in, 3 * out): Conv1D
    assert c_attn.shape == (32, 96) and model.decoder.blocks[0].attn.qkv.weight.shape == (96, 32)
    assert torch.equal(model.decoder.blocks[0].attn.qkv.weight, c_attn.T)
    assert model.head.weight is model.embed.tokens.weight  # tied stays tied


def test_t5_v11_with_an_untied_head_as_transformers_4_saved_it(tmp_path):
    """T5 v1.1 files from transformers 4 carry ``tie_word_embeddings: false`` and their own
    ``lm_head.weight``: the head is untied and the output unscaled."""
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu")).eval()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(tie_word_embeddings=False)
    cfg.pop("scale_decoder_outputs", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "model.safetensors")
    head = torch.randn(V, 32)
    save_file({**tensors, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    imported = from_hf(tmp_path)
    assert not imported.config.tie_embeddings and imported.config.output_scale == 1.0
    src, tgt = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 5))
    with torch.no_grad():
        hidden = hf(input_ids=src, decoder_input_ids=tgt, output_hidden_states=True).decoder_hidden_states[-1]
        assert (imported.model(src, tgt) - hidden @ head.T).abs().max() <= 1e-4
        back = transformers.AutoModelForSeq2SeqLM.from_pretrained(to_hf(imported.model, tmp_path / "out")).eval()
        assert (back(input_ids=src, decoder_input_ids=tgt).logits - hidden @ head.T).abs().max() <= 1e-4


# ---------------------------------------------------------------------- bad input
@pytest.fixture()
def gpt2_dir(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4,
                                                              n_positions=16))
    hf.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def _edit_tensors(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _cli_error(capsys, *args) -> str:
    assert main(["convert", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_directory_without_config_json_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _cli_error(capsys, "--from-hf", tmp_path / "empty", "--out", tmp_path / "out")
    assert "empty/config.json: not found" in err


def test_an_unknown_model_type_is_named(gpt2_dir, tmp_path, capsys):
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    (gpt2_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    err = _cli_error(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "out")
    assert "config.json: model_type='gpt_neox' is not supported; expected one of bart, bert, gpt2" in err


def test_a_missing_tensor_names_the_file_and_key(gpt2_dir, tmp_path, capsys):
    _edit_tensors(gpt2_dir, lambda t: t.pop("transformer.h.0.mlp.c_fc.weight"))
    err = _cli_error(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "out")
    assert "model.safetensors: missing tensor 'transformer.h.0.mlp.c_fc.weight'" in err


def test_a_tensor_of_the_wrong_shape_names_the_file_key_and_shapes(gpt2_dir, tmp_path, capsys):
    _edit_tensors(gpt2_dir, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)}))
    err = _cli_error(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "out")
    assert "model.safetensors: tensor 'transformer.h.0.attn.c_attn.weight' has shape (96, 32); expected (32, 96)" in err


def test_an_unmapped_tensor_and_an_unsupported_option_are_refused(gpt2_dir, tmp_path):
    _edit_tensors(gpt2_dir, lambda t: t.update({"score.weight": torch.zeros(2, 32)}))
    with pytest.raises(UsageError, match=r"model.safetensors: tensor 'score.weight' has no place"):
        from_hf(gpt2_dir)
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    (gpt2_dir / "config.json").write_text(json.dumps({**cfg, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(UsageError, match="config.json: scale_attn_by_inverse_layer_idx=True is not supported"):
        from_hf(gpt2_dir)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="decoder", position="alibi"), "matches no Hugging Face family"),
        (dict(arch="decoder", position="learned", norm="rms"), "model.norm='rms' has no counterpart in Hugging Face gpt2"),
        (dict(arch="decoder", position="learned", n_kv_heads=2), "model.n_kv_heads=2 has no counterpart"),
        (dict(arch="encoder-decoder", position="sinusoidal", norm_position="post"), "model.sinusoid_layout"),
        (dict(arch="decoder", position="rope", norm="rms", ffn="swiglu", residual="gated"), "model.residual='gated'"),
    ],
)
def test_configs_without_a_counterpart_name_the_field(kwargs, message, tmp_path):
    with pytest.raises(UsageError, match=message):
        to_hf(build_model(TransformerConfig(**SMALL, **kwargs)), tmp_path / "out")


def test_cli_round_trip_gives_a_checkpoint_generate_reads_and_an_export_transformers_loads(gpt2_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(4, V)} | {"<unk>": 0, "</s>": 1, "<s>": 2, "<pad>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(gpt2_dir / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(gpt2_dir), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "w5 w6", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("w") >= 3
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 30 + 4}" for i in range(400)))
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "text.txt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] > 0
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        assert (hf(ids).logits - back(ids).logits).abs().max() <= 1e-5


def test_pytorch_bin_and_sharded_safetensors_read_like_one_file(gpt2_dir, tmp_path):
    want = from_hf(gpt2_dir).model.state_dict()
    tensors = load_file(gpt2_dir / "model.safetensors")
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((gpt2_dir / "config.json").read_text())
    torch.save(tensors, binary / "pytorch_model.bin")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((gpt2_dir / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, sharded / f"model-0000{i + 1}-of-00002.safetensors")
        weight_map.update({n: f"model-0000{i + 1}-of-00002.safetensors" for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for directory in (binary, sharded):
        got = from_hf(directory).model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_directory_without_tokenizer_json_needs_tokenizer_on_the_command_line(tmp_path, capsys):
    hf = transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=3))
    hf.save_pretrained(tmp_path / "marian")
    capsys.readouterr()  # transformers' progress bar
    err = _cli_error(capsys, "--from-hf", tmp_path / "marian", "--out", tmp_path / "out")
    assert "marian: no tokenizer.json" in err and "--tokenizer" in err
    err = _cli_error(capsys, "--from-hf", tmp_path / "marian", "--out", tmp_path / "out", "--tokenizer", tmp_path / "no.json")
    assert "no.json: tokenizer not found" in err
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(4, V)} | {"<unk>": 0, "</s>": 1, "<s>": 2, "<pad>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tok.json"))
    assert main(["convert", "--from-hf", str(tmp_path / "marian"), "--out", str(tmp_path / "out"),
                 "--tokenizer", str(tmp_path / "tok.json")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
