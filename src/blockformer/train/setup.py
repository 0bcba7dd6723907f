"""From a run config to the things a run needs: tokenizer, model and objective.

The data decides the objective (text -> language modelling with a decoder; aligned pairs
or a synthetic task -> sequence-to-sequence with an encoder-decoder); the tokenizer decides
the model's vocabulary size, which is written back into the config that is saved.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.batcher import TokenBatcher
from ..data.buckets import length_buckets
from ..data.lm import LMDataset
from ..data.seq2seq import encode_pairs, read_pairs
from ..data.sources import iter_texts
from ..data.tasks import Task, TaskBatches, make_task
from ..stats import check_run_fits
from ..data.token_file import TokenFile, build_token_file
from ..errors import UsageError
from ..data.labelled import LabelledData, class_weights, label_counts, label_names, read_labelled, split_examples
from ..data.masking import MaskingRates
from ..run_config import DataConfig, RunConfig
from ..tokenizers import TOKENIZERS, Tokenizer, load_tokenizer, train_tokenizer
from .arrays import DATASETS, build_array_objective, check_dataset, dataset_labels, dataset_tokenizer
from .checkpoint import load_tokenizer_for, read_config
from .classify import TaskHead
from .compile import resolve_compile
from .finetune import build_model_for
from .mlm import MaskedLM
from .objective import LanguageModelling, Objective, Seq2Seq

ARCH_FOR = {"text": "decoder", "pairs": "encoder-decoder", "task": "encoder-decoder"}


@dataclass
class Run:
    config: RunConfig  # model.vocab_size set from the tokenizer
    tokenizer: Tokenizer
    model: nn.Module
    objective: Objective


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
    if data.task == "add":
        return make_task("add", digits=data.task_digits, n_heldout=data.heldout)
    return make_task(data.task, min_len=data.task_min_len, max_len=data.task_max_len, n_heldout=data.heldout)


def objective_for(cfg: RunConfig) -> str:
    """``train.objective`` resolved: what the data and architecture ask for under ``auto``."""
    kind, arch, objective = cfg.data.kind, cfg.model.arch, cfg.train.objective
    if kind == "dataset":  # images or signals (train/arrays.py)
        return "head" if cfg.head.task != "none" else "seq2seq"
    if kind == "labelled":
        return "head"
    if kind == "text" and objective == "auto":
        return "mlm" if arch == "encoder" else "lm"
    return objective if kind == "text" else "seq2seq"


def check_arch(cfg: RunConfig) -> None:
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


def make_tokenizer(data: DataConfig, texts: Any) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: trained on ``texts`` (a callable giving an
    iterable of strings, called only when needed) or loaded from a file."""
    if data.tokenizer not in TOKENIZERS:
        return load_tokenizer(data.tokenizer)
    if data.tokenizer == "byte":
        return train_tokenizer("byte", [])
    vocab_size = data.vocab_size if data.tokenizer == "bpe" else None
    return train_tokenizer(data.tokenizer, texts(), vocab_size)


def build_tokenizer(cfg: RunConfig, tokenizer_from: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer when resuming, else the one ``data.tokenizer`` names,
    trained on the run's own text."""
    data = cfg.data
    tokenizer_from = tokenizer_from or cfg.train.init_from or None  # fine-tuning keeps the base's tokenizer
    if tokenizer_from is not None:
        return load_tokenizer_for(tokenizer_from, read_config(tokenizer_from).model.vocab_size)
    if data.kind == "dataset":
        return dataset_tokenizer(cfg)
    if data.kind == "task":
        task = make_task_for(data)
        if data.tokenizer == "char":
            return task.char_tokenizer()  # the whole alphabet, even characters the data may miss
        return make_tokenizer(data, lambda: [task.alphabet])
    if data.kind == "pairs":
        return make_tokenizer(data, lambda: (t for pair in read_pairs(data.src, data.tgt) for t in pair))
    if data.kind == "labelled":
        return make_tokenizer(data, lambda: (text for text, _ in read_labelled(data.labels)))
    return make_tokenizer(data, lambda: iter_texts(text_spec(data), data.max_bytes))


def build_run(
    cfg: RunConfig, device: torch.device, *, tokenizer_from: str | Path | None = None, log: Any = print
) -> Run:
    """Tokenizer (trained, or the checkpoint's when resuming), model and objective for ``cfg``."""
    check_arch(cfg)
    tokenizer = build_tokenizer(cfg, tokenizer_from)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    if cfg.data.kind == "labelled" and not cfg.head.labels:  # the label names, saved with the run
        cfg = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, labels=labelled_names(cfg)))
    if cfg.data.kind == "dataset" and cfg.head.task != "none" and not cfg.head.labels:
        cfg = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, labels=dataset_labels(cfg)))
    check_run_fits(cfg, device, make_task_for)  # estimated from arithmetic: refused before anything is built
    model = build_model_for(cfg, seed=cfg.train.seed, device=device, log=log, load_init=tokenizer_from is None)
    objective = build_objective(cfg, tokenizer, device, log)
    return Run(config=cfg, tokenizer=tokenizer, model=model, objective=objective)


def build_objective(
    cfg: RunConfig, tokenizer: Tokenizer, device: torch.device, log: Any = print
) -> Objective:
    """Training and validation data for ``cfg``, wrapped as the loop's objective."""
    data, tc = cfg.data, cfg.train
    if data.kind == "dataset":
        return build_array_objective(cfg, tokenizer, device, log)
    if data.kind == "labelled":
        return build_head_objective(cfg, tokenizer, device, log)
    if data.kind == "text":
        if data.seq_len > cfg.model.max_seq_len:
            raise UsageError(
                f"data.seq_len={data.seq_len}: expected <= model.max_seq_len={cfg.model.max_seq_len}"
            )
        cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
        tokens = TokenFile(build_token_file(text_spec(data), tokenizer, cache, max_bytes=data.max_bytes))
        log(f"data: {len(tokens):,} tokens ({tokenizer.kind} tokenizer, {tokenizer.vocab_size} ids)")
        train = LMDataset(tokens, data.seq_len, "train", data.val_fraction)
        val = LMDataset(tokens, data.seq_len, "val", data.val_fraction)
        if objective_for(cfg) == "mlm":
            rates = MaskingRates(tc.mask_rate, tc.mask_token_rate, tc.random_token_rate)
            return MaskedLM(train, val, tc.batch_size, tc.seed, device, tokenizer.vocab_size, rates)
        return LanguageModelling(train, val, tc.batch_size, tc.seed, device)
    compiled = resolve_compile(tc.compile, cfg.model)
    buckets = length_buckets(cfg.model.max_seq_len) if compiled else None  # few shapes to compile
    if data.kind == "task":
        task = make_task_for(data)
        task.check_fits(cfg.model.max_seq_len)
        batches = TaskBatches(task, tokenizer, tc.batch_size)
        val_batches = list(batches.heldout_batches())
        return Seq2Seq(batches, val_batches, device, seed=tc.seed, task=task, tokenizer=tokenizer,
                       buckets=buckets)
    train_pairs, val_pairs = _split_pairs(read_pairs(data.src, data.tgt), data)
    max_len = cfg.model.max_seq_len - 1  # room for bos/eos
    batcher = TokenBatcher(encode_pairs(train_pairs, tokenizer), tc.max_tokens, shuffle=True, seed=tc.seed,
                           max_len=max_len, overlong="clip", buckets=buckets)
    val_ids = encode_pairs(val_pairs, tokenizer)
    val_batcher = TokenBatcher(val_ids, tc.max_tokens, shuffle=False, max_len=max_len, overlong="clip")
    val_batches = list(val_batcher.batches(0))
    log(f"data: {len(train_pairs):,} training pairs, {len(val_pairs):,} held out")
    return Seq2Seq(batcher, val_batches, device, seed=tc.seed, tokenizer=tokenizer)


def labelled_splits(cfg: RunConfig) -> tuple[list, list]:
    """Training and held-out examples: ``data.val_labels`` if given, else a fixed share."""
    data = cfg.data
    examples = read_labelled(data.labels)
    if data.val_labels:
        return examples, read_labelled(data.val_labels)
    return split_examples(examples, data.val_fraction or 0.1, "data.labels")


def labelled_names(cfg: RunConfig) -> list[str]:
    return label_names(labelled_splits(cfg)[0], cfg.head.task)


def build_head_objective(cfg: RunConfig, tokenizer: Tokenizer, device: torch.device, log: Any = print) -> TaskHead:
    """Encoded labelled examples (cut to ``data.seq_len``) and the head's loss weights."""
    data, head = cfg.data, cfg.head
    train_ex, val_ex = labelled_splits(cfg)
    max_len = min(data.seq_len, cfg.model.max_seq_len)
    train = LabelledData(train_ex, tokenizer, head.task, head.labels, max_len, data.labels)
    val = LabelledData(val_ex, tokenizer, head.task, head.labels, max_len, data.val_labels or data.labels)
    weights = None
    if head.class_weights and head.task != "regress":
        weights = class_weights(head.class_weights, label_counts(train_ex, head.task, head.labels), head.labels)
    log(f"data: {len(train):,} labelled training examples, {len(val):,} held out, "
        f"{len(head.labels) or 'regression'} labels")
    return TaskHead(train, val, cfg.train.batch_size, cfg.train.seed, device, weights)


def _split_pairs(pairs: list[tuple[str, str]], data: DataConfig) -> tuple[list, list]:
    """The held-out pair files if given, else the last ``val_fraction`` of the pairs."""
    if data.val_src or data.val_tgt:
        if not (data.val_src and data.val_tgt):
            raise UsageError("data.val_src/data.val_tgt: expected both files of the held-out pair or neither")
        return pairs, read_pairs(data.val_src, data.val_tgt)
    n_val = max(1, int(len(pairs) * data.val_fraction)) if data.val_fraction > 0 else 0
    if n_val >= len(pairs):
        raise UsageError(f"{data.src}: {len(pairs)} pairs leave none for training after holding out {n_val}")
    return pairs[: len(pairs) - n_val], pairs[len(pairs) - n_val :] or pairs[-1:]

