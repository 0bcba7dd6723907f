"""The task description ``data.describe_task`` builds from a run config's ``[data]``: for each
data kind, the objective kind, the tokenizer, the vocabulary and label fields written into
the config, and the batch sources ``TaskData.load`` reads; and the trainer's one map from
objective kind to objective class."""

from __future__ import annotations

import pytest
import torch

from blockformer.data.arrays import ArrayData, DigitStrings
from blockformer.data.buckets import length_buckets
from blockformer.data.describe import KINDS, OBJECTIVE_KINDS, Batches, TaskData, describe_task
from blockformer.data.labelled import LabelledData
from blockformer.data.lm import LMDataset
from blockformer.data.batcher import TokenBatcher
from blockformer.data.tasks import TaskBatches
from blockformer.errors import UsageError
from blockformer.run_config import load_run_config
from blockformer.tokenizers import CharTokenizer, train_tokenizer
from blockformer.train.arrays import ArrayHead, ImageToText
from blockformer.train.classify import TaskHead
from blockformer.train.mlm import MaskedLM
from blockformer.train.objective import LanguageModelling, Seq2Seq
from blockformer.train.setup import OBJECTIVES, build_objective, build_run

CPU = torch.device("cpu")
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64"]
WORDS = ["a cat", "the dog", "a red ball", "two birds", "the old man", "a small house"]


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKFORMER_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"To be, or not to be: line {i} of the play.\n" for i in range(200)))
    src = [f"{w} is {v}" for w in WORDS for v in ("here", "there", "big", "small", "green")] * 2
    (tmp_path / "p.src").write_text("\n".join(src) + "\n")
    (tmp_path / "p.tgt").write_text("\n".join(s.upper() for s in src) + "\n")
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(f'{{"text": "{s}", "label": "{s.split()[1]}"}}\n' for s in src))
    return {"corpus": corpus, "src": tmp_path / "p.src", "tgt": tmp_path / "p.tgt", "labels": labels}


def config(preset: str, *sets: str):
    return load_run_config(preset=preset, overrides=[*SMALL, *sets])


def loaded(task: TaskData, **kw) -> TaskData:
    out = task.load(log=lambda *a: None, **kw)
    assert isinstance(out.batches, Batches) and task.batches is None  # load returns a new description
    return out


# ---------------------------------------------------------------------- one test per data kind
def test_text_for_a_decoder_is_language_modelling_with_the_char_tokenizer(files):
    task = describe_task(config("char-lm-tiny", f"data.text={files['corpus']}"))
    assert task.objective == "lm"
    assert task.tokenizer.kind == "char"
    assert task.config.model.vocab_size == task.tokenizer.vocab_size
    assert task.labels == [] and task.config.head.labels == []
    batches = loaded(task).batches
    assert isinstance(batches.train, LMDataset) and isinstance(batches.val, LMDataset)
    assert batches.task is None and batches.class_weights is None


def test_text_for_an_encoder_is_masked_language_modelling(files):
    task = describe_task(config("stdlib-mlm", f"data.text={files['corpus']}"))
    assert task.objective == "mlm"
    assert task.tokenizer.kind == "byte" and task.config.model.vocab_size == 260
    auto = describe_task(config("stdlib-mlm", f"data.text={files['corpus']}", "train.objective=auto"))
    assert auto.objective == "mlm"  # an encoder on text: auto means mlm
    assert isinstance(loaded(task).batches.train, LMDataset)


def test_a_synthetic_task_is_seq2seq_over_its_whole_alphabet():
    task = describe_task(config("copy", "data.heldout=20"))
    assert task.objective == "seq2seq"
    assert isinstance(task.tokenizer, CharTokenizer)
    assert task.config.model.vocab_size == task.tokenizer.vocab_size == 14  # the preset's own count
    batches = loaded(task).batches
    assert isinstance(batches.train, TaskBatches) and batches.task is not None and batches.task.name == "copy"
    assert isinstance(batches.val, list) and batches.val  # fixed held-out batches
    assert batches.buckets is None
    assert loaded(task, compiled=True).batches.buckets == length_buckets(task.config.model.max_seq_len)


def test_aligned_pairs_are_seq2seq_with_a_bpe_tokenizer_trained_on_both_sides(files):
    task = describe_task(config("translate-small", f"data.src={files['src']}", f"data.tgt={files['tgt']}",
                                "data.vocab_size=300", "train.max_tokens=400"))
    assert task.objective == "seq2seq"
    assert task.tokenizer.kind == "bpe" and task.config.model.vocab_size == task.tokenizer.vocab_size
    assert task.tokenizer.encode("THE DOG") and task.tokenizer.decode(task.tokenizer.encode("THE DOG")) == "THE DOG"
    batches = loaded(task).batches
    assert isinstance(batches.train, TokenBatcher) and isinstance(batches.val, list)
    assert batches.task is None and batches.buckets is None  # a TokenBatcher pads to its own buckets


def test_labelled_examples_train_a_head_and_their_label_names_go_into_the_config(files):
    task = describe_task(config("stdlib-packages", f"data.labels={files['labels']}",
                                f"data.val_labels={files['labels']}", "head.class_weights=balanced"))
    names = sorted({w.split()[1] for w in WORDS})
    assert task.objective == "head"
    assert task.tokenizer.kind == "byte" and task.config.model.vocab_size == 260
    assert task.labels == names and task.config.head.labels == names
    batches = loaded(task).batches
    assert isinstance(batches.train, LabelledData) and batches.train.names == names
    assert batches.class_weights is not None and batches.class_weights.shape == (len(names),)


def test_digit_images_train_an_array_head_with_ten_classes():
    task = describe_task(config("digits-vit", "train.batch_size=8"))
    assert task.objective == "array-head"
    assert task.tokenizer.kind == "byte"  # unused, but every checkpoint carries one
    assert task.labels == [str(d) for d in range(10)] == task.config.head.labels
    batches = loaded(task).batches
    assert isinstance(batches.train, ArrayData) and batches.train.augment is not None
    assert batches.val.augment is None


def test_digit_strings_are_image_to_text_over_the_digit_characters():
    task = describe_task(config("digits-to-text", "data.heldout=10"))
    assert task.objective == "image-to-text"
    assert isinstance(task.tokenizer, CharTokenizer) and task.tokenizer.decode(task.tokenizer.encode("0179")) == "0179"
    assert task.config.model.vocab_size == task.tokenizer.vocab_size
    assert task.labels == [] and task.config.head.task == "none"
    batches = loaded(task).batches
    assert isinstance(batches.train, DigitStrings) and batches.heldout == 10


def test_vowel_frames_train_an_array_head_of_nine_speakers():
    task = describe_task(config("vowels-frames"))
    assert task.objective == "array-head"
    assert task.tokenizer.kind == "byte"
    assert task.labels == [str(s) for s in range(1, 10)] == task.config.head.labels
    pytest.importorskip("sktime")
    assert isinstance(loaded(task).batches.train, ArrayData)


# ---------------------------------------------------------------------- the map and its edges
def test_every_objective_kind_maps_to_one_objective_class():
    assert set(OBJECTIVES) == set(OBJECTIVE_KINDS)
    assert OBJECTIVES == {"lm": LanguageModelling, "mlm": MaskedLM, "seq2seq": Seq2Seq, "head": TaskHead,
                          "array-head": ArrayHead, "image-to-text": ImageToText}
    assert set(KINDS) == {"text", "pairs", "task", "labelled", "dataset"}


@pytest.mark.parametrize(
    ("preset", "sets", "cls"),
    [
        ("char-lm-tiny", ["data.text={corpus}"], LanguageModelling),
        ("stdlib-mlm", ["data.text={corpus}"], MaskedLM),
        ("copy", ["data.heldout=20"], Seq2Seq),
        ("stdlib-packages", ["data.labels={labels}", "data.val_labels={labels}"], TaskHead),
        ("digits-vit", [], ArrayHead),
        ("digits-to-text", ["data.heldout=10"], ImageToText),
    ],
)
def test_build_run_trains_the_objective_the_description_names(preset, sets, cls, files):
    run = build_run(config(preset, *[s.format(**files) for s in sets]), CPU, log=lambda *a: None)
    assert type(run.objective) is cls
    assert run.config.model.vocab_size == run.tokenizer.vocab_size
    again = build_objective(run.config, run.tokenizer, CPU, log=lambda *a: None)  # a checkpoint's config
    assert type(again) is cls


def test_a_kept_tokenizer_is_asked_for_only_after_the_config_is_checked(files):
    calls = []

    def keep():
        calls.append(1)
        return train_tokenizer("byte", [])

    with pytest.raises(UsageError, match="head.task: labelled data"):
        describe_task(config("char-lm-tiny", f"data.text={files['corpus']}", "head.task=classify"), tokenizer_from=keep)
    assert calls == []
    task = describe_task(config("char-lm-tiny", f"data.text={files['corpus']}"), tokenizer_from=keep)
    assert calls == [1] and task.tokenizer.kind == "byte" and task.config.model.vocab_size == 260


def test_a_complete_config_keeps_its_labels_and_is_not_checked_again(files):
    task = describe_task(config("stdlib-packages", f"data.labels={files['labels']}",
                                f"data.val_labels={files['labels']}", "head.labels=cat,dog,x"))
    assert task.labels == ["cat", "dog", "x"]  # given labels are never re-read from the data
    same = TaskData.of(task.config, task.tokenizer)
    assert (same.objective, same.labels, same.batches) == ("head", ["cat", "dog", "x"], None)
