"""From a run config to the things a run needs: tokenizer, model and objective.

The data decides the task: ``data.describe_task`` reads ``[data]`` (checked against
``[model]`` and ``[head]``) into a ``TaskData`` with the tokenizer, the config completed
(``model.vocab_size`` from the tokenizer, the label names), the objective kind and, once
loaded, the batch sources. Here the model is built and the objective kind mapped to its
class (``OBJECTIVES``); nothing else is decided from the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.describe import (  # noqa: F401 - the data's names that cli/, probes/ and benchmarks read here
    TaskData,
    default_cache_dir,
    describe_task,
    make_task_for,
    objective_for,
    text_spec,
)
from ..stats import check_run_fits
from ..run_config import RunConfig
from ..tokenizers import Tokenizer
from .arrays import ArrayHead, ImageToText
from .classify import TaskHead
from .compile import resolve_compile
from .build import build_run_model
from .finetune import build_model_for
from .load import load_tokenizer_for, read_config
from .mlm import MaskedLM
from .objective import LanguageModelling, Objective, Seq2Seq

# the objective kind a task description names -> the objective that trains it
OBJECTIVES: dict[str, type[Objective]] = {
    "lm": LanguageModelling,
    "mlm": MaskedLM,
    "seq2seq": Seq2Seq,
    "head": TaskHead,
    "array-head": ArrayHead,
    "image-to-text": ImageToText,
}


@dataclass
class Run:
    config: RunConfig  # model.vocab_size set from the tokenizer
    tokenizer: Tokenizer
    model: nn.Module
    objective: Objective


def build_run(
    cfg: RunConfig, device: torch.device, *, tokenizer_from: str | Path | None = None, log: Any = print,
    meta: bool = False,
) -> Run:
    """Tokenizer (trained, or the checkpoint's when resuming), model and objective for ``cfg``;
    ``meta``: the model on the meta device (``parallel.meta``), for a sharded run to fill in."""
    source = tokenizer_from or cfg.train.init_from or None  # fine-tuning keeps the base's tokenizer
    keep = None if source is None else lambda: load_tokenizer_for(source, read_config(source).model.vocab_size)
    task = describe_task(cfg, tokenizer_from=keep)
    cfg = task.config
    check_run_fits(cfg, device, make_task_for)  # estimated from arithmetic: refused before anything is built
    if meta:  # a sharded run: built on the meta device, each rank's shards filled in by parallelize
        model = build_run_model(cfg, seed=cfg.train.seed, meta=True)
    else:
        model = build_model_for(cfg, seed=cfg.train.seed, device=device, log=log,
                                load_init=tokenizer_from is None)  # resuming loads all the weights next
    return Run(config=cfg, tokenizer=task.tokenizer, model=model, objective=objective_of(task, device, log))


def objective_of(task: TaskData, device: torch.device, log: Any = print) -> Objective:
    """The objective ``task`` names, on its batches (read here)."""
    cfg = task.config
    task = task.load(log, compiled=resolve_compile(cfg.train.compile, cfg.model))
    return OBJECTIVES[task.objective].from_data(task, device)


def build_objective(
    cfg: RunConfig, tokenizer: Tokenizer, device: torch.device, log: Any = print
) -> Objective:
    """Training and validation data for a complete ``cfg`` (a checkpoint's) with its tokenizer,
    wrapped as the loop's objective."""
    return objective_of(TaskData.of(cfg, tokenizer), device, log)


build_head_objective = build_objective  # benchmarks/bench_finetune.py's name for a labelled run's
