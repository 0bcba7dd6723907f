"""Data for training: text sources, token files, LM windows, seq2seq batches and synthetic tasks.

tokens flow as: ``iter_texts(spec)`` -> ``build_token_file`` (tokenised once, cached) ->
``TokenFile`` (memory-mapped) -> ``LMDataset`` windows; or ``read_pairs`` / a task ->
``encode_pairs`` -> ``TokenBatcher`` / ``TaskBatches`` -> ``Seq2SeqBatch``.

Which of these a run uses is decided once, by ``describe_task(cfg)`` (``describe``): the
run's tokenizer, objective kind, label names and (``TaskData.load``) batch sources.
"""

from .batcher import TokenBatcher
from .describe import Batches, ObjectiveKind, TaskData, describe_task
from .lm import LMDataset
from .seq2seq import Seq2SeqBatch, collate_pairs, encode_pairs, read_pairs
from .sources import STDLIB, iter_texts, stdlib_dir
from .tasks import TASKS, Task, TaskBatches, exact_match, make_task
from .token_file import TokenFile, build_token_file

__all__ = [
    "describe_task",
    "TaskData",
    "Batches",
    "ObjectiveKind",
    "iter_texts",
    "stdlib_dir",
    "STDLIB",
    "build_token_file",
    "TokenFile",
    "LMDataset",
    "read_pairs",
    "encode_pairs",
    "collate_pairs",
    "Seq2SeqBatch",
    "TokenBatcher",
    "TASKS",
    "Task",
    "TaskBatches",
    "make_task",
    "exact_match",
]
