"""What the runs page reads: the run directories under a folder, their configs, and their
``metrics.jsonl`` read a piece at a time.

A run directory is one the trainer wrote: it holds ``metrics.jsonl`` or ``config.toml``
(``train/run_dir.py``). The metrics are read from a cursor, ``"<file id>:<byte offset>:<lines>"``,
that the page sends back with each poll: only the bytes written since are read, so fifty
runs of ten thousand lines stay cheap to watch. A last line without its newline is a
record still being written and is left for the next poll; a line that is not a JSON object
is skipped and named in ``warnings``; a file replaced under the cursor (a resumed run
rewrites it) starts again from its first byte, with ``reset`` set.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..textformats import loads_json, loads_toml
from ..train.checkpoint import BEST, CONFIG, best_checkpoint, step_checkpoints
from ..train.metrics import METRICS
from ..train.run_dir import CONFIG_TOML, LOCK

MAX_DEPTH = 3  # run directories are looked for this many folders down (a sweep nests its points)
TAIL_BYTES = 16 * 1024  # the summary's last figures come from this much of the file's end
MAX_READ = 32 * 1024 * 1024  # one poll reads at most this much; the next goes on from there


@dataclass(frozen=True)
class Run:
    name: str  # the path below the runs folder, with "/" between parts
    path: Path


def find_runs(root: Path) -> list[Run]:
    """The run directories under ``root`` (``root`` itself when it is one), sorted by name."""
    if not root.is_dir():
        raise UsageError(f"{root}: runs directory not found")
    found: list[Run] = []

    def visit(folder: Path, depth: int) -> None:
        if _is_run(folder):
            found.append(Run(folder.relative_to(root).as_posix() if folder != root else folder.name, folder))
            return
        if depth == MAX_DEPTH:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return  # unreadable: not listed
        for child in children:
            visit(child, depth + 1)

    visit(root, 0)
    return found


def _is_run(folder: Path) -> bool:
    return (folder / METRICS).is_file() or (folder / CONFIG_TOML).is_file()


def checkpoints_of(run: Run) -> list[str]:
    """The checkpoints of a run, as names below its folder: ``best`` first, then the steps."""
    names = [BEST] if best_checkpoint(run.path) is not None else []
    names += [p.name for p in reversed(step_checkpoints(run.path))]
    if not names and (run.path / CONFIG).is_file():  # the folder is a checkpoint itself
        names = ["."]
    return names


def read_config(run: Run) -> tuple[dict[str, Any] | None, str | None]:
    """(the run's ``config.toml`` as a dict, or None; a one-line problem, or None)."""
    path = run.path / CONFIG_TOML
    if not path.is_file():
        return None, f"{path.name}: not written yet"
    try:
        return loads_toml(path.read_text(encoding="utf-8-sig")), None
    except (OSError, ValueError) as e:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"{path.name}: cannot be read ({' '.join(str(e).split())})"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The dotted keys whose values differ between two configs (absent: None)."""
    fa, fb = flatten(a), flatten(b)
    return [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def summary(run: Run) -> dict[str, Any]:
    """What the runs table shows: live or not, the last train and validation records, the
    model's shape, and the checkpoints."""
    config, problem = read_config(run)
    last = _last_records(run.path / METRICS)
    model = (config or {}).get("model", {}) if isinstance((config or {}).get("model"), dict) else {}
    return {
        "name": run.name,
        "live": (run.path / LOCK).exists(),
        "last_train": last.get("train"),
        "last_val": last.get("val"),
        "model": {k: model.get(k) for k in ("arch", "d_model", "n_layers", "n_heads", "position") if k in model},
        "steps": ((config or {}).get("train") or {}).get("steps") if config else None,
        "checkpoints": checkpoints_of(run),
        "problem": problem if config is None and (run.path / CONFIG_TOML).exists() else None,
        "modified": _mtime(run.path / METRICS),
    }


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _last_records(path: Path) -> dict[str, dict[str, Any]]:
    """The last complete record of each split, from the file's last ``TAIL_BYTES``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().split(b"\n")[:-1]  # the part after the last newline is still being written
    except OSError:
        return {}
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first line is cut by the seek
    last: dict[str, dict[str, Any]] = {}
    for line in reversed(lines):  # from the end: the train and val records are usually near it
        record = _record(line)
        if record is not None:
            last.setdefault(str(record.get("split", "train")), record)
            if {"train", "val"} <= last.keys():
                break
    return last


def _record(line: bytes) -> dict[str, Any] | None:
    """A metrics record with JSON-safe values (NaN and infinities as None), or None."""
    try:
        record = loads_json(line.decode("utf-8"))
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


# ---------------------------------------------------------------------- reading from a cursor
def read_new(run: Run, cursor: str = "") -> dict[str, Any]:
    """The records written since ``cursor`` ("" for the whole file), as columns per split:
    ``{"train": {"step": [...], "loss": [...]}, "val": {...}}``, with the next cursor."""
    path = run.path / METRICS
    file_id, offset, lines = _parse_cursor(cursor)
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            here = f"{stat.st_dev}-{stat.st_ino}"
            reset = bool(cursor) and (here != file_id or stat.st_size < offset)
            if reset or not cursor:
                offset, lines = 0, 0
            f.seek(offset)
            data = f.read(MAX_READ)
    except FileNotFoundError:
        return {"columns": {}, "cursor": "", "reset": bool(cursor), "warnings": [f"{METRICS}: not written yet"],
                "partial": False, "more": False}
    except OSError as e:
        raise UsageError(f"{path}: cannot be read ({e.strerror or e})") from None
    end = data.rfind(b"\n") + 1  # only whole lines; the rest is read again next time
    parsed, warnings = _parse_lines(data[:end], lines + 1)
    columns = _columns(parsed)
    lines += data[:end].count(b"\n")
    partial = end < len(data) and len(data) < MAX_READ
    if partial and not (run.path / LOCK).exists():  # no trainer will finish it
        warnings.append(f"{METRICS}: line {lines + 1} is cut short (an interrupted write?); ignored")
    return {"columns": columns, "cursor": f"{here}:{offset + end}:{lines}", "reset": reset, "warnings": warnings,
            "partial": partial, "more": len(data) == MAX_READ}


def _parse_cursor(cursor: str) -> tuple[str, int, int]:
    if not cursor:
        return "", 0, 0
    try:
        file_id, offset, lines = cursor.split(":")
        return file_id, int(offset), int(lines)
    except ValueError:
        raise UsageError(f"cursor {cursor!r}: expected the cursor a previous answer gave") from None


def _parse_lines(data: bytes, first: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of whole lines (numbered from ``first``), and a warning per bad line. The
    lines are parsed as one JSON array when they can be (much faster than one by one)."""
    lines = data.split(b"\n")[:-1]
    try:
        records = loads_json("[" + b",".join(line for line in lines if line.strip()).decode("utf-8") + "]")
        if all(isinstance(r, dict) for r in records):
            return records, []
    except ValueError:
        pass
    records, warnings = [], []
    for n, line in enumerate(lines, first):
        if not line.strip():
            continue
        try:
            record = loads_json(line.decode("utf-8"))
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            warnings.append(f"{METRICS}: line {n} is not a metrics record; skipped")
    return records, warnings


def _columns(records: list[dict[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """Records as columns per split, of equal length (None where a record lacks the key;
    NaN, infinities and values that are not numbers or strings as None too)."""
    splits: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        splits.setdefault(str(r.get("split", "train")), []).append(r)
    columns = {}
    for split, group in splits.items():
        keys = dict.fromkeys(k for r in group for k in r)
        columns[split] = {k: [_scalar(r.get(k)) for r in group] for k in keys}
    return columns


def _scalar(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value if isinstance(value, (int, str)) or value is None else None
