"""Task heads to and from Hugging Face: a blockformer classifier fine-tuned from an imported
BERT, exported, gives Hugging Face's pipelines blockformer's own labels and probabilities
(1e-5); token classification, regression and decoders' sequence classification give the
same outputs; a head the family computes differently is refused in one line naming the
field; and a Hugging Face classifier imports as a checkpoint ``predict`` reads."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402

from blockformer import TransformerConfig  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.cli.predict import predict  # noqa: E402
from blockformer.data.labelled import encode_text  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import from_hf, to_hf  # noqa: E402
from blockformer.models import build_model  # noqa: E402
from blockformer.models.heads import SequenceHead, TaskModel, TokenHead  # noqa: E402
from blockformer.run_config import RunConfig, load_run_config  # noqa: E402
from blockformer.train import train  # noqa: E402
from blockformer.tokenizers import train_tokenizer  # noqa: E402
from blockformer.train.load import load_checkpoint, read_config  # noqa: E402

ATOL = 1e-5
WORDS = [f"w{i}" for i in range(40)]
SPECIALS = {"[PAD]": 0, "[UNK]": 10, "[CLS]": 41, "[SEP]": 42, "[MASK]": 43}
QUIET = dict(log=lambda *a: None)
LABELS = ["neg", "pos", "mid"]


def write_bert_tokenizer(directory: Path) -> None:
    """A WordLevel tokenizer that adds [CLS] ... [SEP] as BERT's does (ids away from 0-3)."""
    vocab = {w: i for i, w in enumerate(WORDS + ["x0", "x1", "x2", "x3", "x4"])}
    for name, i in SPECIALS.items():
        vocab = {(name if j == i else w): j for w, j in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", SPECIALS["[CLS]"]), ("[SEP]", SPECIALS["[SEP]"])])
    tok.save(str(directory / "tokenizer.json"))


def _randomize(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def right_padded(pad_id: int, vocab_size: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 6:] = mask[2, 3:] = False
    ids[~mask] = pad_id  # right padding, as blockformer batches
    return ids, mask


def load_exported(auto, out: Path):
    hf, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # every tensor where the class wants it
    return hf.eval()


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=45, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64, **kw)


def _labelled(path: Path, task: str, n: int = 48, seed: int = 0) -> Path:
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = r.choices(WORDS[4:], k=r.randint(2, 7))
            if task == "tokens":
                f.write(json.dumps({"text": " ".join(words), "label": [LABELS[int(w[1:]) % 3] for w in words]}) + "\n")
            elif task == "regress":
                f.write(f"{' '.join(words)}\t{sum(int(w[1:]) for w in words) / 100}\n")
            else:
                f.write(f"{' '.join(words)}\t{LABELS[int(words[0][1:]) % 3]}\n")
    return path


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    """A tiny random BertModel (with its pooler), imported with `convert --from-hf`."""
    tmp = tmp_path_factory.mktemp("bert")
    _randomize(transformers.BertModel(bert_config())).save_pretrained(tmp / "hf")
    write_bert_tokenizer(tmp / "hf")
    assert main(["convert", "--from-hf", str(tmp / "hf"), "--out", str(tmp / "ckpt")]) == 0
    return tmp / "ckpt"


def fine_tune(base: Path, tmp: Path, task: str, *overrides: str) -> Path:
    data = _labelled(tmp / f"{task}.{'jsonl' if task == 'tokens' else 'tsv'}", task)
    cfg = load_run_config(overrides=[
        f"train.init_from={base}", f"data.labels={data}", "data.seq_len=16", f"head.task={task}", "train.steps=4",
        "train.eval_every=0", "train.batch_size=8", "train.progress=false", "train.lr=1e-2", "train.warmup=0",
        *overrides]).to_dict()
    cfg["model"] = read_config(base).model.to_dict()  # as `train --init-from` does
    return train(RunConfig.from_dict(cfg), tmp / f"run-{task}", **QUIET).checkpoint


TEXTS = ["w5 w6 w7", "w10 w11", "w20 w33 w4 w9 w12", "w38"]


def test_a_bert_classifier_on_the_pooler_gives_pipelines_its_labels_and_probabilities(bert_ckpt, tmp_path):
    ckpt = fine_tune(bert_ckpt, tmp_path, "classify", "head.pooling=pooler")
    out = to_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    loaded = load_checkpoint(ckpt)
    assert config["id2label"] == {str(i): n for i, n in enumerate(loaded.config.head.labels)}
    assert sorted(loaded.config.head.labels) == sorted(LABELS)
    assert config["problem_type"] == "single_label_classification" and config["num_labels"] == 3
    ours = predict(loaded, TEXTS)
    pipe = transformers.pipeline("text-classification", model=str(out), tokenizer=str(out), top_k=None)
    for record, theirs in zip(ours, pipe(TEXTS)):
        assert max(theirs, key=lambda d: d["score"])["label"] == record["label"]
        for d in theirs:
            assert abs(d["score"] - record["probs"][d["label"]]) <= ATOL


def test_a_lora_classifier_exports_with_its_adapters_merged(bert_ckpt, tmp_path):
    ckpt = fine_tune(bert_ckpt, tmp_path, "classify", "head.pooling=pooler", "lora.rank=2", "train.lr=5e-2")
    assert (ckpt / "adapter.safetensors").is_file() and not (ckpt / "model.safetensors").is_file()
    loaded = load_checkpoint(ckpt)
    hf = load_exported(transformers.AutoModelForSequenceClassification, to_hf(ckpt, tmp_path / "hf"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        theirs = hf(**tok(TEXTS, return_tensors="pt", padding=True)).logits.softmax(-1)
    ours = torch.tensor([[r["probs"][n] for n in loaded.config.head.labels] for r in predict(loaded, TEXTS)])
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


def test_a_bert_token_classifier_gives_the_same_probabilities_per_token(bert_ckpt, tmp_path):
    ckpt = fine_tune(bert_ckpt, tmp_path, "tokens")
    out = to_hf(ckpt, tmp_path / "hf")
    hf = load_exported(transformers.AutoModelForTokenClassification, out)
    assert type(hf).__name__ == "BertForTokenClassification"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    loaded = load_checkpoint(ckpt)
    for text, record in zip(TEXTS, predict(loaded, TEXTS)):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            probs = hf(ids).logits.softmax(-1)[0, 1:-1]  # the words, without [CLS] and [SEP]
        for word, p in zip(record["words"], probs):
            assert hf.config.id2label[int(p.argmax())] == word["label"] and abs(float(p.max()) - word["prob"]) <= ATOL


def test_a_bert_regression_head_exports_with_problem_type_regression_and_equal_values(bert_ckpt, tmp_path):
    ckpt = fine_tune(bert_ckpt, tmp_path, "regress", "head.pooling=pooler")
    out = to_hf(ckpt, tmp_path / "hf")
    hf = load_exported(transformers.AutoModelForSequenceClassification, out)
    assert hf.config.problem_type == "regression" and hf.config.num_labels == 1
    tok = transformers.AutoTokenizer.from_pretrained(out)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = hf(**batch).logits[:, 0]
    ours = torch.tensor([r["value"] for r in predict(load_checkpoint(ckpt), TEXTS)])
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- decoders
DECODERS = {
    "gpt2": dict(arch="decoder", position="learned", norm="layer", ffn="gelu", gelu_approximate="tanh"),
    "llama": dict(arch="decoder", position="rope", norm="rms", ffn="swiglu", bias=False, tie_embeddings=False),
}


def decoder_task_model(name: str, task: str = "classify", pooling: str = "last", bias: bool = False,
                       vocab_size: int = 60) -> TaskModel:
    fields = {**DECODERS[name], "vocab_size": vocab_size, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}
    body = build_model(TransformerConfig(**fields), seed=1)
    head = TokenHead(32, 3) if task == "tokens" else SequenceHead(32, 3, pooling, bias=bias, task=task)
    torch.nn.init.normal_(head.proj.weight, 0, 0.5)
    if head.proj.bias is not None and task == "tokens":
        torch.nn.init.normal_(head.proj.bias, 0, 0.5)
    return TaskModel(body, head).eval()


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("task", ["classify", "multilabel", "tokens"])
def test_a_decoder_head_exports_with_equal_logits_at_the_last_real_token(name, task, tmp_path):
    model = decoder_task_model(name, task)
    out = to_hf(model, tmp_path / "hf", labels=LABELS)
    auto = (transformers.AutoModelForTokenClassification if task == "tokens"
            else transformers.AutoModelForSequenceClassification)
    hf = load_exported(auto, out)
    assert hf.config.id2label == dict(enumerate(LABELS))
    if task != "tokens":
        assert hf.config.problem_type == {"classify": "single_label_classification",
                                          "multilabel": "multi_label_classification"}[task]
    ids, mask = right_padded(hf.config.pad_token_id)
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask), hf(ids, attention_mask=mask.long()).logits
    if task == "tokens":
        ours, theirs = ours[mask], theirs[mask]
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_decoder_sequence_classifier_imports_with_equal_logits(name):
    config = {"gpt2": lambda: transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=32),
              "llama": lambda: transformers.LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        max_position_embeddings=32)}[name]()
    config.pad_token_id, config.id2label = 0, dict(enumerate(LABELS))
    config.label2id = {n: i for i, n in enumerate(LABELS)}
    hf = _randomize(transformers.AutoModelForSequenceClassification.from_config(config))
    imported = from_hf(hf)  # a model object: no tokenizer, Hugging Face's own ids
    assert isinstance(imported.model, TaskModel) and imported.head.labels == LABELS and not imported.head.bias
    ids, mask = right_padded(0)
    with torch.no_grad():
        ours, theirs = imported.model(ids, attention_mask=mask), hf(ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


def test_a_gpt2_classifier_with_a_blockformer_bpe_gives_pipelines_its_labels_and_probabilities(tmp_path):
    """blockformer reads a labelled text as <s> text </s>; the exported tokenizer adds them too."""
    texts = ["the cat sat on the mat", "a dog ran", "the bird sang a song today", "cats and dogs"]
    tok = train_tokenizer("bpe", texts * 4, vocab_size=280)
    model = decoder_task_model("gpt2", vocab_size=tok.vocab_size)
    out = to_hf(model, tmp_path / "hf", tokenizer=tok, labels=LABELS)
    pipe = transformers.pipeline("text-classification", model=str(out), tokenizer=str(out), top_k=None)
    for text, theirs in zip(texts, pipe(texts)):
        with torch.no_grad():
            ours = model(torch.tensor([encode_text(text, tok, 32)])).softmax(-1)[0]
        assert all(abs(d["score"] - float(ours[LABELS.index(d["label"])])) <= ATOL for d in theirs)


# ---------------------------------------------------------------------- refusals
def _refusal(model, tmp_path, **kw) -> str:
    with pytest.raises(UsageError) as e:
        to_hf(model, tmp_path / "hf", **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    return str(e.value)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_bert_sequence_heads_off_the_pooler_are_refused_naming_head_pooling(bert_ckpt, pooling, tmp_path):
    body = load_checkpoint(bert_ckpt).model
    message = _refusal(TaskModel(body, SequenceHead(32, 2, pooling)), tmp_path)
    assert message.startswith(f"head.pooling={pooling!r}") and "BertForSequenceClassification" in message
    assert "head.pooling='pooler'" in message and "model.pooler=true" not in message  # this body has one
    without = build_model(dataclasses.replace(body.cfg, pooler=False))
    assert "with model.pooler=true" in _refusal(TaskModel(without, SequenceHead(32, 2, pooling)), tmp_path)


def test_decoder_heads_with_a_bias_or_another_pooling_are_refused_naming_the_field(tmp_path):
    biased = decoder_task_model("gpt2", bias=True)
    torch.nn.init.constant_(biased.head.proj.bias, 0.1)
    message = _refusal(biased, tmp_path)
    assert message.startswith("head.bias=True") and "GPT2ForSequenceClassification" in message
    assert "head.bias=false" in message
    assert _refusal(decoder_task_model("llama", pooling="mean"), tmp_path).startswith("head.pooling='mean'")
    zero_bias = decoder_task_model("gpt2", bias=True)  # a bias that is exactly zero is no bias: exported
    assert "score.bias" not in load_file(str(to_hf(zero_bias, tmp_path / "zero") / "model.safetensors"))


def test_labels_that_do_not_name_every_output_once_are_refused_naming_labels(tmp_path):
    model = decoder_task_model("gpt2")
    assert _refusal(model, tmp_path, labels=["a", "b"]).startswith("labels: 2 names (2 distinct) for a head of 3")
    assert _refusal(model, tmp_path, labels=["a", "a", "b"]).startswith("labels: 3 names (2 distinct)")
    assert json.loads((to_hf(model, tmp_path / "plain") / "config.json").read_text())["id2label"] == {
        "0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}  # none given: Hugging Face's own names


def test_a_head_on_a_family_without_one_is_refused_naming_head_task(tmp_path):
    t5 = TransformerConfig(arch="encoder-decoder", position="relative", norm="rms", bias=False, vocab_size=60,
                           d_model=32, n_layers=2, n_heads=4, attention_scale=1.0, ffn="relu")
    message = _refusal(TaskModel(build_model(t5), SequenceHead(32, 2, "mean")), tmp_path)
    assert message.startswith("head.task='classify'") and "t5" in message


def test_head_pooling_pooler_without_a_pooler_is_refused_naming_the_field(tmp_path):
    data = _labelled(tmp_path / "d.tsv", "classify")
    cfg = load_run_config(overrides=["model.arch=encoder", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                                     "model.vocab_size=260", f"data.labels={data}", "head.task=classify",
                                     "head.pooling=pooler", "train.steps=1"])
    with pytest.raises(UsageError, match=r"^head.pooling='pooler': the body has no pooler"):
        train(cfg, tmp_path / "run", **QUIET)


# ---------------------------------------------------------------------- import
@pytest.mark.parametrize("kind", ["sequence", "tokens"])
def test_a_hugging_face_bert_classifier_imports_as_a_checkpoint_predict_reads(kind, tmp_path):
    cls = transformers.BertForTokenClassification if kind == "tokens" else transformers.BertForSequenceClassification
    hf = _randomize(cls(bert_config(id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})))
    hf.save_pretrained(tmp_path / "hf")
    write_bert_tokenizer(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config.head.labels == LABELS
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text, record in zip(TEXTS, predict(loaded, TEXTS)):
        with torch.no_grad():
            probs = hf(**tok(text, return_tensors="pt")).logits.softmax(-1)[0]
        if kind == "tokens":
            for word, p in zip(record["words"], probs[1:-1]):
                assert LABELS[int(p.argmax())] == word["label"] and abs(float(p.max()) - word["prob"]) <= ATOL
        else:
            assert all(abs(float(p) - record["probs"][n]) <= ATOL for n, p in zip(LABELS, probs))
