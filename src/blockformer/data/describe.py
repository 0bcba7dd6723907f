"""What a run learns, decided once from its ``[data]`` section: the task description.

``describe_task(cfg)`` checks the data against ``[model]`` and ``[head]``, builds the
tokenizer (trained on the run's own data, or the one ``tokenizer_from`` gives: a
checkpoint's), writes the vocabulary size and the label names into the config and names
the objective. ``TaskData.load`` then reads the training and held-out batch sources (token
files are built, pairs and labelled files encoded), which the trainer wraps in the objective
class that ``TaskData.objective`` names. The two steps are apart so that a run that does
not fit in memory is refused before any data is read.

Each data kind (``DataConfig.kind``) is one entry of ``KINDS``:

========  ==========================================  ================================
kind      objective                                   tokenizer trained on
========  ==========================================  ================================
text      ``lm`` (a decoder), ``mlm`` (an encoder)    the text
pairs     ``seq2seq`` (an encoder-decoder)            both sides of the pairs
task      ``seq2seq`` (an encoder-decoder)            the task's alphabet
labelled  ``head`` (any architecture, a task head)    the labelled texts
dataset   ``array-head`` or ``image-to-text``         none (byte, or the digits' chars)
========  ==========================================  ================================

This is the only module of ``data/`` besides ``arrays`` that reads a ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, get_args

import torch

from ..config import TransformerConfig
from ..errors import UsageError
from ..models.embedding import reads_token_types
from ..run_config import DataConfig, RunConfig
from ..tokenizers import TOKENIZERS, Tokenizer, load_tokenizer, train_tokenizer
from .arrays import DATASETS, DigitStrings, array_data, check_dataset, dataset_labels, dataset_tokenizer
from .batcher import TokenBatcher
from .buckets import length_buckets
from .labelled import (Example, LabelledData, class_weights, label_counts, label_names, read_labelled,
                       split_examples, texts_of)
from .lm import LMDataset
from .seq2seq import encode_pairs, read_pairs
from .sources import iter_texts
from .tasks import Task, TaskBatches, make_task
from .token_file import TokenFile, build_token_file

ObjectiveKind = Literal["lm", "mlm", "seq2seq", "head", "array-head", "image-to-text"]
OBJECTIVE_KINDS: tuple[str, ...] = get_args(ObjectiveKind)
ARCH_FOR = {"text": "decoder", "pairs": "encoder-decoder", "task": "encoder-decoder"}
Log = Callable[..., Any]


@dataclass(frozen=True)
class Batches:
    """Where an objective's batches come from: ``train`` (an ``LMDataset``, ``TokenBatcher``,
    ``TaskBatches``, ``LabelledData``, ``ArrayData`` or ``DigitStrings``) and ``val`` (the
    held-out data of the same kind, or fixed held-out ``Seq2SeqBatch``es)."""

    train: Any
    val: Any
    task: Task | None = None  # a synthetic task: exact match on its held-out pairs
    class_weights: torch.Tensor | None = None  # a task head's loss weights (head.class_weights)
    buckets: list[int] | None = None  # a synthetic task's batches are padded to these lengths
    heldout: int = 0  # digit-strings: held-out strings for exact match


@dataclass(frozen=True)
class TaskData:
    """A run's task: its config (``model.vocab_size`` from the tokenizer, ``head.labels``
    filled in), tokenizer, objective kind and label names; ``batches`` once loaded."""

    config: RunConfig
    tokenizer: Tokenizer
    objective: ObjectiveKind
    labels: list[str] = field(default_factory=list)
    batches: Batches | None = None

    @classmethod
    def of(cls, cfg: RunConfig, tokenizer: Tokenizer) -> TaskData:
        """The task of a config already complete (a checkpoint's), with its tokenizer: nothing
        is checked or inferred."""
        return cls(cfg, tokenizer, KINDS[cfg.data.kind].objective(cfg), list(cfg.head.labels))

    def load(self, log: Log = print, *, compiled: bool = False) -> TaskData:
        """This task with its batch sources read; ``compiled``: the loss is compiled, so
        sequence-to-sequence batches come in few shapes (``length_buckets``)."""
        batches = KINDS[self.config.data.kind].batches(self.config, self.tokenizer, log, compiled)
        return dataclasses.replace(self, batches=batches)


def describe_task(cfg: RunConfig, *, tokenizer_from: Callable[[], Tokenizer] | None = None) -> TaskData:
    """The task ``cfg`` trains (see the module docstring). ``tokenizer_from`` gives the
    tokenizer to keep (a checkpoint's when resuming or fine-tuning), called once the config
    is checked; without it the tokenizer ``data.tokenizer`` names is built from the data."""
    check_arch(cfg)
    kind = KINDS[cfg.data.kind]
    tokenizer = tokenizer_from() if tokenizer_from is not None else kind.tokenizer(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    if kind.labels is not None and cfg.head.task != "none" and not cfg.head.labels:  # saved with the run
        cfg = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, labels=kind.labels(cfg)))
    return TaskData.of(cfg, tokenizer)


# ---------------------------------------------------------------------- checks and decisions
def objective_for(cfg: RunConfig) -> str:
    """``train.objective`` resolved: what the data and architecture ask for under ``auto``."""
    kind, arch, objective = cfg.data.kind, cfg.model.arch, cfg.train.objective
    if kind == "dataset":  # images or signals (data/arrays.py)
        return "head" if cfg.head.task != "none" else "seq2seq"
    if kind == "labelled":
        return "head"
    if kind == "text" and objective == "auto":
        return "mlm" if arch == "encoder" else "lm"
    return objective if kind == "text" else "seq2seq"


def check_arch(cfg: RunConfig) -> None:
    """The data against ``model.arch``, ``model.input`` and ``head.task``: one line naming
    what does not fit."""
    kind, arch, objective = cfg.data.kind, cfg.model.arch, cfg.train.objective
    if kind == "dataset":
        return check_dataset(cfg)
    if cfg.model.input != "tokens":
        raise UsageError(f"model.input={cfg.model.input!r}: reads images or signals; expected data.dataset "
                         f"(one of {', '.join(DATASETS)}) or model.input='tokens'")
    if objective == "mlm" and (kind != "text" or arch != "encoder"):
        raise UsageError(f"train.objective='mlm': masked language modelling trains an encoder on text; expected "
                         f"model.arch='encoder' and data.text (got model.arch={arch!r}, {kind} data)")
    if (kind == "labelled") != (cfg.head.task != "none"):
        raise UsageError("head.task: labelled data (data.labels) trains a task head and a task head needs "
                         f"labelled data; got head.task={cfg.head.task!r} with data.labels={cfg.data.labels!r}")
    if cfg.data.text_pair and cfg.head.task == "tokens":
        raise UsageError(f"data.text_pair={cfg.data.text_pair!r}: head.task='tokens' labels the words of one text; "
                         f"expected head.task classify, multilabel or regress for text pairs, or no data.text_pair")
    if kind == "labelled" or (kind == "text" and objective_for(cfg) == "mlm"):
        return  # any architecture carries a head; an encoder learns text by MLM
    if arch != ARCH_FOR[kind]:
        what = {
            "text": "data.text (language modelling)",
            "pairs": "data.src/data.tgt",
            "task": f"data.task={cfg.data.task!r}",
        }
        fix = "a decoder" if kind == "text" else "an encoder-decoder"
        raise UsageError(
            f"model.arch={arch!r}: {what[kind]} trains {fix}; expected model.arch={ARCH_FOR[kind]!r}"
            + (" or set data.src/data.tgt or data.task" if kind == "text" else "")
        )


def _dataset_objective(cfg: RunConfig) -> ObjectiveKind:
    check_dataset(cfg)
    return "image-to-text" if DATASETS[cfg.data.dataset][1] == "seq2seq" else "array-head"


# ---------------------------------------------------------------------- the data section read
def default_cache_dir() -> Path:
    """Where token files are cached: ``$BLOCKFORMER_CACHE`` or ``~/.cache/blockformer``."""
    env = os.environ.get("BLOCKFORMER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "blockformer"


def text_spec(data: DataConfig) -> str | list[str]:
    """``data.text`` as a source spec: comma-separated items become a list."""
    if not data.text.strip():
        raise UsageError("data.text: no text given; expected files, directories, globs or 'stdlib' "
                         "(e.g. --set data.text=input.txt)")
    items = [t.strip() for t in data.text.split(",") if t.strip()]
    return items[0] if len(items) == 1 else items


def make_task_for(data: DataConfig) -> Task:
    """The synthetic task ``data.task`` with the options ``[data]`` gives it."""
    if data.task == "add":
        return make_task("add", digits=data.task_digits, n_heldout=data.heldout)
    return make_task(data.task, min_len=data.task_min_len, max_len=data.task_max_len, n_heldout=data.heldout)


def labelled_splits(data: DataConfig) -> tuple[list, list]:
    """Training and held-out examples: ``data.val_labels`` if given, else a fixed share."""
    examples = read_labelled(data.labels, data.text_pair)
    if data.val_labels:
        return examples, read_labelled(data.val_labels, data.text_pair)
    return split_examples(examples, data.val_fraction or 0.1, "data.labels")


def pair_segments(model: TransformerConfig) -> bool:
    """Whether text pairs give ``model`` their segment ids 0 and 1: an encoder whose segment
    table has a row for each (one row, as RoBERTa's: every token is segment 0, the default)."""
    return reads_token_types(model) and model.n_token_types >= 2


def labelled_data(cfg: RunConfig, examples: list[Example], tokenizer: Tokenizer, where: str) -> LabelledData:
    """``examples`` encoded for ``cfg``'s model: cut to ``data.seq_len``, and text pairs'
    segment ids kept when the model reads them (``pair_segments``)."""
    max_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
    return LabelledData(examples, tokenizer, cfg.head.task, cfg.head.labels, max_len, where,
                        token_types=pair_segments(cfg.model))


def split_pairs(pairs: list[tuple[str, str]], data: DataConfig) -> tuple[list, list]:
    """The held-out pair files if given, else the last ``val_fraction`` of the pairs."""
    if data.val_src or data.val_tgt:
        if not (data.val_src and data.val_tgt):
            raise UsageError("data.val_src/data.val_tgt: expected both files of the held-out pair or neither")
        return pairs, read_pairs(data.val_src, data.val_tgt)
    n_val = max(1, int(len(pairs) * data.val_fraction)) if data.val_fraction > 0 else 0
    if n_val >= len(pairs):
        raise UsageError(f"{data.src}: {len(pairs)} pairs leave none for training after holding out {n_val}")
    return pairs[: len(pairs) - n_val], pairs[len(pairs) - n_val :] or pairs[-1:]


# ---------------------------------------------------------------------- tokenizers
def make_tokenizer(data: DataConfig, texts: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: trained on ``texts`` (a callable giving an
    iterable of strings, called only when needed) or loaded from a file."""
    if data.tokenizer not in TOKENIZERS:
        return load_tokenizer(data.tokenizer)
    if data.tokenizer == "byte":
        return train_tokenizer("byte", [])
    vocab_size = data.vocab_size if data.tokenizer == "bpe" else None
    return train_tokenizer(data.tokenizer, texts(), vocab_size)


def _text_tokenizer(cfg: RunConfig) -> Tokenizer:
    data = cfg.data
    return make_tokenizer(data, lambda: iter_texts(text_spec(data), data.max_bytes))


def _pairs_tokenizer(cfg: RunConfig) -> Tokenizer:
    data = cfg.data
    return make_tokenizer(data, lambda: (t for pair in read_pairs(data.src, data.tgt) for t in pair))


def _task_tokenizer(cfg: RunConfig) -> Tokenizer:
    task = make_task_for(cfg.data)
    if cfg.data.tokenizer == "char":
        return task.char_tokenizer()  # the whole alphabet, even characters the data may miss
    return make_tokenizer(cfg.data, lambda: [task.alphabet])


def _labelled_tokenizer(cfg: RunConfig) -> Tokenizer:
    data = cfg.data
    return make_tokenizer(data, lambda: (t for text, _ in read_labelled(data.labels, data.text_pair)
                                         for t in texts_of(text)))


# ---------------------------------------------------------------------- batch sources
def _text_batches(cfg: RunConfig, tokenizer: Tokenizer, log: Log, compiled: bool) -> Batches:
    data = cfg.data
    if data.seq_len > cfg.model.max_seq_len:
        raise UsageError(
            f"data.seq_len={data.seq_len}: expected <= model.max_seq_len={cfg.model.max_seq_len}"
        )
    cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    tokens = TokenFile(build_token_file(text_spec(data), tokenizer, cache, max_bytes=data.max_bytes))
    log(f"data: {len(tokens):,} tokens ({tokenizer.kind} tokenizer, {tokenizer.vocab_size} ids)")
    train = LMDataset(tokens, data.seq_len, "train", data.val_fraction)
    return Batches(train, LMDataset(tokens, data.seq_len, "val", data.val_fraction))


def _task_batches(cfg: RunConfig, tokenizer: Tokenizer, log: Log, compiled: bool) -> Batches:
    buckets = length_buckets(cfg.model.max_seq_len) if compiled else None  # few shapes to compile
    task = make_task_for(cfg.data)
    task.check_fits(cfg.model.max_seq_len)
    batches = TaskBatches(task, tokenizer, cfg.train.batch_size)
    return Batches(batches, list(batches.heldout_batches()), task=task, buckets=buckets)


def _pair_batches(cfg: RunConfig, tokenizer: Tokenizer, log: Log, compiled: bool) -> Batches:
    data, tc = cfg.data, cfg.train
    buckets = length_buckets(cfg.model.max_seq_len) if compiled else None  # few shapes to compile
    train_pairs, val_pairs = split_pairs(read_pairs(data.src, data.tgt), data)
    max_len = cfg.model.max_seq_len - 1  # room for bos/eos
    batcher = TokenBatcher(encode_pairs(train_pairs, tokenizer), tc.max_tokens, shuffle=True, seed=tc.seed,
                           max_len=max_len, overlong="clip", buckets=buckets)
    val_ids = encode_pairs(val_pairs, tokenizer)
    val_batcher = TokenBatcher(val_ids, tc.max_tokens, shuffle=False, max_len=max_len, overlong="clip")
    val_batches = list(val_batcher.batches(0))
    log(f"data: {len(train_pairs):,} training pairs, {len(val_pairs):,} held out")
    return Batches(batcher, val_batches)


def _labelled_batches(cfg: RunConfig, tokenizer: Tokenizer, log: Log, compiled: bool) -> Batches:
    """Encoded labelled examples (cut to ``data.seq_len``) and the head's loss weights."""
    data, head = cfg.data, cfg.head
    train_ex, val_ex = labelled_splits(data)
    train = labelled_data(cfg, train_ex, tokenizer, data.labels)
    val = labelled_data(cfg, val_ex, tokenizer, data.val_labels or data.labels)
    weights = None
    if head.class_weights and head.task != "regress":
        counts = label_counts(train_ex, head.task, head.labels)
        weights = class_weights(head.class_weights, counts, head.labels)
    log(f"data: {len(train):,} labelled training examples, {len(val):,} held out, "
        f"{len(head.labels) or 'regression'} labels")
    if data.text_pair:
        m = cfg.model
        segments = "segment ids 0 then 1" if pair_segments(m) else (
            f"no segment ids (model.arch={m.arch!r}, model.n_token_types={m.n_token_types}): </s> alone marks "
            f"where the second text starts")
        log(f"data: text pairs (data.text_pair={data.text_pair!r}) as <s> a </s> b </s>, {segments}")
    return Batches(train, val, class_weights=weights)


def _dataset_batches(cfg: RunConfig, tokenizer: Tokenizer, log: Log, compiled: bool) -> Batches:
    """Images or signals for a head, or digit-string images for an encoder-decoder."""
    check_dataset(cfg)
    data, tc = cfg.data, cfg.train
    if DATASETS[data.dataset][1] == "seq2seq":
        train = DigitStrings("train", cfg, tokenizer, tc.batch_size, train=True)
        val = DigitStrings("val", cfg, tokenizer, tc.batch_size, train=False)
        log(f"data: digit strings of 1-{data.max_digits} digits from {len(train.labels):,} training digits; "
            f"{data.heldout} held-out strings from {len(val.labels)} validation digits")
        return Batches(train, val, heldout=data.heldout)
    train, val = array_data(cfg, "train", train=True), array_data(cfg, "val")
    log(f"data: {data.dataset}, {len(train):,} training examples, {len(val):,} held out for validation, "
        f"{len(train.names)} classes" + (f"; shifts up to {data.shift} px, rotations up to {data.rotate} deg, "
                                          f"scale +-{data.zoom}" if train.augment else ""))
    return Batches(train, val)


# ---------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class DataKind:
    """How one kind of data becomes a task: its tokenizer (built from the data), objective,
    label names (kinds that train a head) and batch sources."""

    tokenizer: Callable[[RunConfig], Tokenizer]
    objective: Callable[[RunConfig], ObjectiveKind]
    batches: Callable[[RunConfig, Tokenizer, Log, bool], Batches]
    labels: Callable[[RunConfig], list[str]] | None = None


KINDS: dict[str, DataKind] = {
    "text": DataKind(_text_tokenizer, lambda cfg: "mlm" if objective_for(cfg) == "mlm" else "lm",
                     _text_batches),
    "pairs": DataKind(_pairs_tokenizer, lambda cfg: "seq2seq", _pair_batches),
    "task": DataKind(_task_tokenizer, lambda cfg: "seq2seq", _task_batches),
    "labelled": DataKind(_labelled_tokenizer, lambda cfg: "head", _labelled_batches,
                         labels=lambda cfg: label_names(labelled_splits(cfg.data)[0], cfg.head.task)),
    "dataset": DataKind(dataset_tokenizer, _dataset_objective, _dataset_batches, labels=dataset_labels),
}
