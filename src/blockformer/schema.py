"""Dataclass <-> dict/TOML plumbing shared by config (the model) and run_config (a whole training run).

Typed-field checks, "did you mean" for unknown names, and a minimal TOML writer; no
config of its own.

``TransformerConfig`` (the model) and the run config (data, training, parallel) are plain
dataclasses; these helpers make a bad value fail with the field's name and what it expects.
"""

from __future__ import annotations

import difflib
import json
import math
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints


def read_if_path(text_or_path: str | Path) -> str:
    if isinstance(text_or_path, Path) or (
        isinstance(text_or_path, str) and "\n" not in text_or_path and Path(text_or_path).is_file()
    ):
        return Path(text_or_path).read_text(encoding="utf-8-sig")  # a byte-order mark is skipped
    return str(text_or_path)


# Names other libraries use for our fields: a typo of one of them still finds ours.
ALIASES = {"learning_rate": "lr", "hidden_size": "d_model", "dim": "d_model", "num_layers": "n_layers",
           "n_layer": "n_layers", "num_heads": "n_heads", "n_head": "n_heads", "max_steps": "steps",
           "warmup_steps": "warmup", "intermediate_size": "d_ff", "ffn_dim": "d_ff", "block_size": "max_seq_len",
           "max_position_embeddings": "max_seq_len", "context_length": "seq_len", "clip": "grad_clip",
           "max_grad_norm": "grad_clip", "dtype": "precision", "epochs": "steps"}


def suggest(name: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or an empty string.

    Spelling alone misses abbreviations (``lerning_rate`` is far from ``lr``), so a name is
    also matched through the common names of ``ALIASES``, by its initials and by shared words.
    """
    best = _closest(name, choices)
    return f" (did you mean {best!r}?)" if best else ""


def _closest(name: str, choices: list[str]) -> str | None:
    lowered = name.lower()
    close = difflib.get_close_matches(lowered, choices, n=1, cutoff=0.6)
    if close:
        return close[0]
    aliases = {a: t for a, t in ALIASES.items() if t in choices}
    close = difflib.get_close_matches(lowered, list(aliases), n=1, cutoff=0.75)
    if close:
        return aliases[close[0]]
    words = [w for w in lowered.replace("-", "_").split("_") if w]
    if len(words) > 1 and "".join(w[0] for w in words) in choices:  # lerning_rate -> lr
        return "".join(w[0] for w in words)
    shared = [(len(set(words) & set(c.split("_"))), c) for c in choices]
    shared = [(n, c) for n, c in shared if n and any(len(w) > 2 for w in set(words) & set(c.split("_")))]
    if shared:
        return max(shared, key=lambda nc: (nc[0], difflib.SequenceMatcher(None, lowered, nc[1]).ratio()))[1]
    close = difflib.get_close_matches(lowered, choices, n=1, cutoff=0.5)
    return close[0] if close else None


def checked_kwargs(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as constructor arguments of dataclass ``cls``; unknown keys raise ValueError."""
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise ValueError(f"{cls.__name__}: unknown field {key!r}{suggest(key, names)}")
    return dict(data)


MAX_INT = 2**53  # larger integers are typos (and overflow torch's int64 or float arithmetic)


def check_types(obj: Any, where: str | None = None) -> None:
    """Check each field's value against its annotation (ints, floats, bools, Literals); a
    message names the field as ``where.field`` (a run config's section), else by its class."""
    where = where or type(obj).__name__
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        options = get_args(hint) if is_union(hint) else (hint,)
        if not any(_matches(value, option) for option in options):
            raise ValueError(
                f"{where}.{f.name}={value!r}: expected {describe(hint)}"
            )
        # NaN and infinity pass every comparison check silently (nan > 0 is False, so
        # "<= 0" does not catch it) and surface much later as NaN losses: refuse them here.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}.{f.name}={value!r}: expected a finite number")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"{where}.{f.name}={value}: expected an integer below 2**53")


def kind_of(value: object) -> str:
    """``None`` or ``a list``/``an int``: how a message names a value of the wrong type."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def is_union(hint: Any) -> bool:
    return get_origin(hint) in (typing.Union, types.UnionType)


def _matches(value: Any, hint: Any) -> bool:
    if hint is type(None):
        return value is None
    if get_origin(hint) is Literal:
        return value in get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # container annotations are checked by their owners


def describe(hint: Any) -> str:
    if is_union(hint):
        return " or ".join(describe(h) for h in get_args(hint))
    if hint is type(None):
        return "None"
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(hint))
    return getattr(hint, "__name__", str(hint))


def dumps_toml(data: dict[str, Any]) -> str:
    """A minimal TOML writer: scalars, lists of scalars and one level of tables.

    ``None`` has no TOML spelling, so ``None`` values are left out (every ``None`` field has
    ``None`` as its default, so reading the file back gives the same config).
    """
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    for key, value in data.items():
        if value is not None and not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
