"""Hugging Face interop: tiny random models of each family, built offline, converted both
ways, give the same logits (fp32, <= 1e-4), the same greedy continuations through the KV
cache, and survive blockformer -> Hugging Face -> equal logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from blockformer import TransformerConfig, build_model  # noqa: E402
from blockformer.generate import generate  # noqa: E402
from blockformer.generate.seq2seq import greedy_decode  # noqa: E402
from blockformer.interop import from_hf, to_hf  # noqa: E402

V = 48
ATOL = 1e-4
# Specials away from blockformer's ids 0-3, so the row permutation is exercised.
SPECIALS = {"<s>": 5, "</s>": 7, "<pad>": 9, "<unk>": 11}


def write_tokenizer(directory: Path, vocab_size: int = V, specials: dict[str, int] = SPECIALS) -> None:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    for name, i in specials.items():
        del vocab[f"w{i}"]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def save_hf(model, directory: Path, **tokenizer_kw) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory, **tokenizer_kw)
    return directory


def round_trip(hf, tmp_path: Path, auto):
    """``hf`` saved, imported, exported again to ``tmp_path / "out"`` and loaded with ``auto``."""
    imported = from_hf(save_hf(hf, tmp_path / "in"))
    to_hf(imported.model, tmp_path / "out", tokenizer=imported.tokenizer)
    return imported, auto.from_pretrained(tmp_path / "out").eval()


def ours(imported, hf_ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face ids -> blockformer ids (the tokenizer's specials moved to 0-3)."""
    return torch.as_tensor(np.argsort(imported.vocab.order))[hf_ids]


def theirs_logits(imported, logits: torch.Tensor) -> torch.Tensor:
    """blockformer logits -> columns in Hugging Face id order."""
    return logits[..., torch.as_tensor(np.argsort(imported.vocab.order))]


def hf_greedy(hf, ids, mask=None, **kw):
    config = transformers.GenerationConfig(max_new_tokens=20, do_sample=False, num_beams=1, **kw)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, generation_config=config)


def random_batch(seed: int = 0, B: int = 3, T: int = 9, low: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False  # right padding
    mask[2, 4:] = False
    return ids, mask


# ---------------------------------------------------------------------- decoders
DECODERS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt2-untied-relu": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="relu",
        tie_word_embeddings=False)),
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0)),
    "llama-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, sliding_window=None)),
    "mistral-sliding-window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)),
    "llama-linear-rope-scaling": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


def _randomize(model):
    """Random values for every parameter (norms and biases too), so no layout hides behind
    an initialisation of ones and zeros."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_import_matches_logits_and_greedy_continuations(name, tmp_path):
    torch.manual_seed(0)
    hf = _randomize(DECODERS[name]())
    imported = from_hf(save_hf(hf, tmp_path / name))
    ids, mask = random_batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long()).logits
        got = theirs_logits(imported, imported.model(ours(imported, ids), attention_mask=mask))
    assert (want - got)[mask].abs().max() <= ATOL

    prompts = ids[:, :5]
    hf_out = hf_greedy(hf, prompts, eos_token_id=None, pad_token_id=SPECIALS["<pad>"])[:, 5:]
    got = generate(imported.model, ours(imported, prompts).tolist(), 20, do_sample=False)
    assert torch.equal(theirs_ids(imported, torch.tensor(got)), hf_out)


def theirs_ids(imported, ids: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(imported.vocab.order)[ids]


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_export_loads_in_transformers_with_equal_logits(name, tmp_path):
    hf = _randomize(DECODERS[name]())
    imported, back = round_trip(hf, tmp_path, transformers.AutoModelForCausalLM)
    out = tmp_path / "out"
    ids, mask = random_batch(1)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long()).logits
        got = back(ids, attention_mask=mask.long()).logits
    assert (want - got)[mask].abs().max() <= ATOL
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id == SPECIALS["<pad>"] and tok.convert_ids_to_tokens(7) == "</s>"


# ---------------------------------------------------------------------- BERT
def bert_config(**kw):
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64, **kw)


@pytest.mark.parametrize("kind", ["mlm", "base-with-pooler"])
def test_bert_import_matches_mlm_logits_hidden_states_and_pooler(kind, tmp_path):
    cls = transformers.BertForMaskedLM if kind == "mlm" else transformers.BertModel
    hf = _randomize(cls(bert_config()))
    imported = from_hf(save_hf(hf, tmp_path / kind))
    assert imported.config.head_transform == (kind == "mlm") and imported.config.pooler == (kind != "mlm")
    ids, mask = random_batch(2)
    with torch.no_grad():
        out = hf(ids, attention_mask=mask.long(), output_hidden_states=True)
        hidden = imported.model.hidden_states(ours(imported, ids), attention_mask=mask)
        assert (out.hidden_states[-1] - hidden)[mask].abs().max() <= ATOL
        if kind == "mlm":
            got = theirs_logits(imported, imported.model(ours(imported, ids), attention_mask=mask))
            assert (out.logits - got)[mask].abs().max() <= ATOL
        else:
            assert (out.pooler_output - imported.model.pool(hidden)).abs().max() <= ATOL


def test_bert_export_loads_as_masked_lm_with_equal_logits(tmp_path):
    hf = _randomize(transformers.BertForMaskedLM(bert_config(hidden_act="gelu_new")))
    imported, back = round_trip(hf, tmp_path, transformers.AutoModelForMaskedLM)
    ids, mask = random_batch(3)
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask.long()).logits, back(ids, attention_mask=mask.long()).logits
    assert (want - got)[mask].abs().max() <= ATOL


# ---------------------------------------------------------------------- encoder-decoders
SEQ2SEQ = {
    "t5-v1.0-relu": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, feed_forward_proj="relu",
        pad_token_id=9, eos_token_id=7, decoder_start_token_id=9)),
    "t5-v1.1-gated-gelu": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        pad_token_id=9, eos_token_id=7, decoder_start_token_id=9)),
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
        pad_token_id=9, bos_token_id=5, eos_token_id=7, decoder_start_token_id=7, forced_eos_token_id=None)),
    "marian": lambda: transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=64, pad_token_id=9, eos_token_id=7, decoder_start_token_id=9,
        forced_eos_token_id=None)),
}


def _randomize_seq2seq(hf):
    _randomize(hf)
    if hasattr(hf, "final_logits_bias"):
        hf.final_logits_bias.normal_(0, 0.2)
    if isinstance(hf, transformers.MarianMTModel):  # its sinusoids are fixed, not random
        for side in (hf.model.encoder, hf.model.decoder):
            side.embed_positions.weight.data = side.embed_positions.create_weight()
    return hf


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_encoder_decoder_import_matches_logits_and_cached_greedy_decoding(name, tmp_path):
    hf = _randomize_seq2seq(SEQ2SEQ[name]())
    imported = from_hf(save_hf(hf, tmp_path / name))
    src, src_mask = random_batch(4)
    tgt = torch.randint(12, V, (3, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt).logits
        got = theirs_logits(imported, imported.model(ours(imported, src), ours(imported, tgt), src_mask=src_mask))
    assert (want - got).abs().max() <= ATOL

    start, eos = hf.config.decoder_start_token_id, hf.config.eos_token_id
    hf_out = hf_greedy(hf, src, src_mask.long(), decoder_start_token_id=start, eos_token_id=eos, pad_token_id=9)
    got = greedy_decode(imported.model, ours(imported, src), src_mask, max_len=20,
                        bos_id=int(ours(imported, torch.tensor(start))), eos_id=int(ours(imported, torch.tensor(eos))))
    for row, ids in zip(hf_out.tolist(), got):
        row = row[1:]  # drop the start token
        row = row[: row.index(eos)] if eos in row else row
        assert theirs_ids(imported, torch.tensor(ids, dtype=torch.long)).tolist() == row


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_encoder_decoder_export_loads_in_transformers_with_equal_logits(name, tmp_path):
    hf = _randomize_seq2seq(SEQ2SEQ[name]())
    imported, back = round_trip(hf, tmp_path, transformers.AutoModelForSeq2SeqLM)
    src, src_mask = random_batch(6)
    tgt = torch.randint(12, V, (3, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt).logits
        got = back(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt).logits
    assert (want - got).abs().max() <= ATOL


def test_missing_special_roles_are_added_and_a_short_tokenizer_is_padded(tmp_path):
    """GPT-2's tokenizer has only <|endoftext|>: pad, bos and unk become new tokens with new
    rows. A tokenizer shorter than the embedding (T5's) is padded to it first."""
    hf = _randomize(DECODERS["gpt2"]())
    directory = save_hf(hf, tmp_path / "in")
    vocab = {f"w{i}": i for i in range(V - 6)} | {"<|endoftext|>": V - 6}  # 5 rows without a token
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    imported = from_hf(directory)
    t = imported.tokenizer
    assert imported.config.vocab_size == V + 3 and t.vocab_size == V + 3
    assert [t.hf.id_to_token(int(imported.vocab.order[i])) for i in (t.pad_id, t.bos_id, t.eos_id, t.unk_id)] == \
        ["<pad>", "<s>", "<|endoftext|>", "<unk>"]
    ids, mask = random_batch(8, low=0)
    ids = ids.clamp(max=V - 6)
    with torch.no_grad():
        want = hf(ids).logits
        got = theirs_logits(imported, imported.model(ours(imported, ids)))
    assert (want - got[..., :V]).abs().max() <= ATOL
    back = transformers.AutoModelForCausalLM.from_pretrained(
        to_hf(imported.model, tmp_path / "out", tokenizer=imported.tokenizer)).eval()
    with torch.no_grad():
        assert (back(ids).logits - got).abs().max() <= ATOL
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").pad_token == "<pad>"


def test_from_hf_takes_a_model_object_and_keeps_its_ids():
    hf = _randomize(DECODERS["llama-gqa"]())
    imported = from_hf(hf)
    assert imported.tokenizer is None and imported.family == "llama"
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        assert (hf(ids).logits - imported.model(ids)).abs().max() <= ATOL


def test_an_imported_chat_template_reaches_the_server(tmp_path):
    """``convert --from-hf`` keeps the source's chat template next to the checkpoint, and
    the serving engine picks it up (it answers /v1/chat/completions with it)."""
    import json

    from blockformer.cli import main
    from blockformer.serve import Engine

    src = save_hf(_randomize(DECODERS["gpt2"]()), tmp_path / "in")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "chat_template.jinja").read_text() == template
    assert Engine.from_checkpoint(tmp_path / "ckpt").chat_template == template


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_an_exported_encoder_decoder_generates_as_blockformer_under_transformers_defaults(name, tmp_path):
    """``generate()`` with nothing but the exported files (config.json, generation_config.json)
    starts from the token blockformer trains targets from and gives blockformer's greedy output."""
    hf = _randomize_seq2seq(SEQ2SEQ[name]())
    imported, back = round_trip(hf, tmp_path, transformers.AutoModelForSeq2SeqLM)
    src, src_mask = random_batch(9)
    with torch.no_grad():
        theirs = back.generate(src, attention_mask=src_mask.long())  # the exported defaults, nothing else
    limit = imported.config.max_seq_len - 1  # generation_config's max_length counts the start token
    got = greedy_decode(imported.model, ours(imported, src), src_mask, max_len=limit)
    eos = back.generation_config.eos_token_id
    assert theirs[:, 0].tolist() == [imported.vocab.their_id(imported.tokenizer.bos_id)] * len(got)
    for row, ids in zip(theirs.tolist(), got):
        row = row[1:]
        row = row[: row.index(eos)] if eos in row else row
        assert theirs_ids(imported, torch.tensor(ids, dtype=torch.long)).tolist() == row
    assert max(len(ids) for ids in got) > 5  # long enough to mean something


def test_an_exported_bert_keeps_its_token_roles_and_runs_fill_mask(tmp_path):
    """mask/cls/sep survive the export (tokenizer_config.json and special_tokens_map.json), so
    ``pipeline("fill-mask")`` runs on it and ranks tokens as blockformer does."""
    import json

    hf = _randomize(transformers.BertForMaskedLM(bert_config()))
    specials = {"[CLS]": 5, "[SEP]": 7, "[PAD]": 9, "[UNK]": 11, "[MASK]": 13}
    imported = from_hf(save_hf(hf, tmp_path / "in", specials=specials))
    out = to_hf(imported.model, tmp_path / "out", tokenizer=imported.tokenizer)
    roles = json.loads((out / "special_tokens_map.json").read_text())
    assert roles == {"pad_token": "[PAD]", "bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]",
                     "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.mask_token_id, tok.cls_token_id, tok.sep_token_id) == (13, 5, 7)
    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out), top_k=5)
    text = "w20 w21 [MASK] w23"
    preds = fill(text)
    hf_ids = torch.tensor([tok(text)["input_ids"]])
    where = hf_ids[0].tolist().index(13)
    with torch.no_grad():
        probs = imported.model(ours(imported, hf_ids))[0, where].softmax(-1)
    top = probs.topk(5)
    assert [p["token"] for p in preds] == [imported.vocab.their_id(i) for i in top.indices.tolist()]
    assert np.allclose([p["score"] for p in preds], top.values.numpy(), atol=1e-5)
