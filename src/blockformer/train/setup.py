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
from ..data.lm import LMDataset
from ..data.seq2seq import encode_pairs, read_pairs
from ..data.sources import iter_texts
from ..data.tasks import Task, TaskBatches, make_task
from ..data.token_file import TokenFile, build_token_file
from ..errors import UsageError
from ..models import build_model
from ..run_config import DataConfig, RunConfig
from ..tokenizers import TOKENIZERS, Tokenizer, load_tokenizer, train_tokenizer
from .checkpoint import load_tokenizer_for, read_config
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


def check_arch(cfg: RunConfig) -> None:
    kind, arch = cfg.data.kind, cfg.model.arch
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
    if tokenizer_from is not None:
        return load_tokenizer_for(tokenizer_from, read_config(tokenizer_from).model.vocab_size)
    if data.kind == "task":
        task = make_task_for(data)
        if data.tokenizer == "char":
            return task.char_tokenizer()  # the whole alphabet, even characters the data may miss
        return make_tokenizer(data, lambda: [task.alphabet])
    if data.kind == "pairs":
        return make_tokenizer(data, lambda: (t for pair in read_pairs(data.src, data.tgt) for t in pair))
    return make_tokenizer(data, lambda: iter_texts(text_spec(data), data.max_bytes))


def build_run(
    cfg: RunConfig, device: torch.device, *, tokenizer_from: str | Path | None = None, log: Any = print
) -> Run:
    """Tokenizer (trained, or the checkpoint's when resuming), model and objective for ``cfg``."""
    check_arch(cfg)
    tokenizer = build_tokenizer(cfg, tokenizer_from)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    model = build_model(cfg.model, seed=cfg.train.seed, device=device)
    objective = build_objective(cfg, tokenizer, device, log)
    return Run(config=cfg, tokenizer=tokenizer, model=model, objective=objective)


def build_objective(
    cfg: RunConfig, tokenizer: Tokenizer, device: torch.device, log: Any = print
) -> Objective:
    """Training and validation data for ``cfg``, wrapped as the loop's objective."""
    data, tc = cfg.data, cfg.train
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
        return LanguageModelling(train, val, tc.batch_size, tc.seed, device)
    if data.kind == "task":
        task = make_task_for(data)
        batches = TaskBatches(task, tokenizer, tc.batch_size)
        val_batches = list(batches.heldout_batches())
        return Seq2Seq(batches, val_batches, device, seed=tc.seed, task=task, tokenizer=tokenizer)
    train_pairs, val_pairs = _split_pairs(read_pairs(data.src, data.tgt), data)
    max_len = cfg.model.max_seq_len - 1  # room for bos/eos
    batcher = TokenBatcher(encode_pairs(train_pairs, tokenizer), tc.max_tokens, shuffle=True, seed=tc.seed,
                           max_len=max_len, overlong="clip")
    val_ids = encode_pairs(val_pairs, tokenizer)
    val_batcher = TokenBatcher(val_ids, tc.max_tokens, shuffle=False, max_len=max_len, overlong="clip")
    val_batches = list(val_batcher.batches(0))
    log(f"data: {len(train_pairs):,} training pairs, {len(val_pairs):,} held out")
    return Seq2Seq(batcher, val_batches, device, seed=tc.seed, tokenizer=tokenizer)


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

