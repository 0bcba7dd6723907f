"""Where the trainer's records go: ``metrics.jsonl`` always, TensorBoard when asked.

``train.report_to`` names the reporters (``run_config.REPORT_TO``). ``jsonl`` is always on,
so every run directory describes its run whatever else is asked. The loop talks to one
``Tracker``, which hands each record to every reporter: the loop holds no branch per backend.

TensorBoard goes through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard``
extra) into ``<run_dir>/tensorboard/``, so ``tensorboard --logdir runs`` finds every run,
a sweep's points included. Its scalars are the numbers of the jsonl records at the same
steps, tagged ``<split>/<name>`` (``train/loss``, ``train/lr``, ``val/loss``,
``train/expert_load/3``); the run config goes in as hparams with the run's first event
file. A resumed run opens a new event file with ``purge_step`` one past its checkpoint, so
TensorBoard drops what the interrupted run logged after it, as ``MetricsLog`` drops its lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from ..errors import UsageError
from .metrics import MetricsLog

TENSORBOARD = "tensorboard"  # the reporter's name in train.report_to, and its directory in a run
INSTALL = "pip install 'blockformer[tensorboard]'"
HPARAM_METRICS = ("train/loss", "val/loss")  # the columns of TensorBoard's HParams table


class Reporter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def text(self, tag: str, text: str, step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Tracker:
    """The trainer's one place to log: each call goes to every reporter. A context manager,
    so event files are flushed and closed however the run ends (return, error, Ctrl-C)."""

    def __init__(self, reporters: Sequence[Reporter] = ()) -> None:
        self.reporters = list(reporters)

    def write(self, record: dict[str, Any]) -> None:
        """One metrics record: ``split`` and ``step``, then its values."""
        for reporter in self.reporters:
            reporter.write(record)

    def text(self, tag: str, text: str, step: int) -> None:
        for reporter in self.reporters:
            reporter.text(tag, text, step)

    def flush(self) -> None:
        for reporter in self.reporters:
            reporter.flush()

    def close(self) -> None:
        reporters, self.reporters = self.reporters, []  # a second close is a no-op
        for reporter in reporters:
            reporter.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JsonlReporter(MetricsLog):
    """``metrics.jsonl``: one line per record, written at once (nothing to flush); no text."""

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardReporter:
    """Scalars, text and hparams as event files in ``run_dir/tensorboard``. ``resume_step``:
    the checkpoint a resumed run starts from; later steps of an earlier writer are purged."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        summary_writer = _summary_writer()
        purge = None if resume_step is None else resume_step + 1
        self.writer = summary_writer(log_dir=str(Path(run_dir) / TENSORBOARD), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, record["step"])

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, "```\n" + text + "\n```", step)  # fenced: TensorBoard renders Markdown

    def hparams(self, config: dict[str, Any]) -> None:
        """The run config, flattened to ``section.key``, as the HParams dashboard's row of this run."""
        from torch.utils.tensorboard.summary import hparams  # noqa: PLC0415 - the optional extra

        experiment, start, _ = hparams(flat_hparams(config), dict.fromkeys(HPARAM_METRICS, 0.0))
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(start)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` for each number of a metrics record: ``val_loss`` of the ``val`` split is
    ``val/loss``, a list (each expert's load) one tag per entry; strings are not scalars."""
    split = record.get("split", "train")
    for key, value in record.items():
        if key in ("split", "step"):
            continue
        name = f"{split}/{key.removeprefix(split + '_')}"
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield (f"{name}/{i}" if isinstance(value, list) else name), float(v)


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``: numbers, strings and bools as
    they are, lists as JSON text, None left out (the types the HParams plugin takes)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        elif value is not None:
            flat[name] = value
    return flat


def check_reporters(report_to: Sequence[str]) -> None:
    """Fail before training, not after it, when a reporter's package is missing."""
    if TENSORBOARD in report_to:
        _summary_writer()


def _summary_writer() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - the optional extra
    except ImportError:
        raise UsageError(f"train.report_to=['{TENSORBOARD}']: needs the tensorboard package; "
                         f"install it with {INSTALL}, or leave it out of train.report_to") from None
    return SummaryWriter


def open_tracker(run_dir: str | Path, config: Any, resume_step: int | None = None) -> Tracker:
    """``metrics.jsonl`` and the reporters of ``config.train.report_to`` for one call of ``train``;
    ``resume_step`` continues a run (its records after that step are dropped)."""
    reporters: list[Reporter] = [JsonlReporter(run_dir, resume_step=resume_step)]
    if TENSORBOARD in config.train.report_to:
        first = resume_step is None or not (Path(run_dir) / TENSORBOARD).is_dir()  # or turned on at a resume
        board = TensorBoardReporter(run_dir, resume_step)
        if first:
            board.hparams(config.to_dict())
        reporters.append(board)
    return Tracker(reporters)


def append_tracker(run_dir: str | Path, report_to: Sequence[str]) -> Tracker:
    """The reporters besides ``metrics.jsonl``, appending to a finished run what is made after
    ``train`` returns (its text samples, a sweep point's summary); ``metrics.jsonl`` holds
    the trainer's records only."""
    return Tracker([TensorBoardReporter(run_dir)] if TENSORBOARD in report_to else [])
