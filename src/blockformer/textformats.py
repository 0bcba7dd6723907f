"""JSON and TOML parsing that fails only in the parsers' own error types.

``json.loads`` and ``tomllib.loads`` raise more than their decode errors on hostile text:
``RecursionError`` for arrays nested some thousand levels deep (a ``RuntimeError``, which
the command line treats as a bug, with a traceback), and JSON a bare ``ValueError`` for an
integer literal of more digits than Python converts (4300), whose message names no file.
These wrappers turn both into ``json.JSONDecodeError`` / ``tomllib.TOMLDecodeError``, so
every reader's ``except`` for a malformed file (which names the file) catches them too."""

from __future__ import annotations

import json
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TOO_DEEP = "nested too deeply"


def loads_json(text: str) -> Any:
    """``json.loads(text)``; any failure to parse is a ``json.JSONDecodeError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, text, 0) from None
    except ValueError as e:  # an integer beyond sys.get_int_max_str_digits()
        raise json.JSONDecodeError(str(e).split(";")[0], text, 0) from None


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads(text)``; any failure to parse is a ``tomllib.TOMLDecodeError``."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError(TOO_DEEP) from None
