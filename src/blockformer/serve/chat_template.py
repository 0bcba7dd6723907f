"""Chat messages to one prompt string, with the Jinja template a checkpoint carries.

Rendered the way Hugging Face ``apply_chat_template`` does, so a template written for it
works here unchanged: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception`` and ``strftime_now`` globals, a
``tojson`` filter, and the variables ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import UsageError
from ..tokenizers import BOS_ID, EOS_ID, SPECIAL_TOKENS


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str, name: str = "chat template") -> jinja2.Template:
    """The template, compiled once; a syntax error is a ``UsageError`` naming its line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{name}: line {e.lineno}: {e.message}; expected a Jinja chat template") from None


def render_chat(template: jinja2.Template, messages: list[dict[str, Any]]) -> str:
    """The prompt for ``messages``, ending where the assistant's reply starts. A template
    that refuses the messages (``raise_exception``) is a ``UsageError`` naming them."""
    try:
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=SPECIAL_TOKENS[BOS_ID], eos_token=SPECIAL_TOKENS[EOS_ID])
    except jinja2.TemplateError as e:
        raise UsageError(f"messages: the chat template refused them: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise UsageError(f"messages: the chat template failed on them ({type(e).__name__}: {e})") from None
