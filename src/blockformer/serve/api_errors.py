"""Every refusal of the HTTP server as OpenAI sends it: a status and one line naming the field.

``{"error": {"message", "type", "param", "code"}}``: 400 for bad JSON, a bad field (pydantic's
422 becomes 400, as OpenAI and vLLM answer) or a request the engine refuses (its
``UsageError``), 404 for an unknown model or route, 429 with ``Retry-After`` when the
engine's queue is full, 503 when the engine has stopped, 500 only for a bug (its traceback
goes to the server's log, never to the client).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import UsageError
from .async_engine import QueueFull

# A field whose value may take several shapes: what a union's validation error should say.
EXPECTED = {
    "prompt": "a string or a list of token ids",
    "stop": "a string or a list of strings",
    "input": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's names of a union's members


class ApiError(Exception):
    """An error with its HTTP status, sent in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def add_error_handlers(app: FastAPI, count, bodies: dict[str, type], routes: list[str]) -> None:
    """Handlers that turn every exception into an ``ApiError`` reply; ``count(status)`` is
    called for each (the metrics), ``bodies`` are the request models by path (to list an
    unknown field's neighbours), ``routes`` what a 404 offers instead."""

    def reply(e: ApiError) -> JSONResponse:
        count(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def as_api_error(request: Request, e: Exception) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, UsageError):
            return ApiError(400, str(e), param=param_of(str(e)))
        if isinstance(e, QueueFull):
            seconds = max(1, math.ceil(e.retry_after or 1))
            return ApiError(429, f"the server is busy, its queue is full: {e}", type="rate_limit_error",
                            code="queue_full", headers={"Retry-After": str(seconds)})
        if isinstance(e, RequestValidationError):
            message, param = validation_message(e.errors(), bodies.get(request.url.path))
            return ApiError(400, message, param=param)
        if isinstance(e, StarletteHTTPException):
            message = f"{request.method} {request.url.path}: {e.detail}"
            if e.status_code == 404:
                message += "; expected one of " + ", ".join(routes)
            return ApiError(e.status_code, message, type="not_found_error" if e.status_code == 404 else None,
                            headers=dict(e.headers) if e.headers else None)
        # a bug: Starlette re-raises it after this reply, and uvicorn logs its traceback
        return ApiError(500, f"internal error ({type(e).__name__}); the server's log has the details")

    async def handle(request: Request, e: Exception) -> JSONResponse:
        return reply(as_api_error(request, e))

    for kind in (ApiError, UsageError, QueueFull, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, handle)


def param_of(message: str) -> str | None:
    """The field a ``UsageError`` names: its messages start with ``name: ...``."""
    match = re.match(r"([A-Za-z_][\w.]*)(\[\d+\])?:", message)
    return match.group(1) if match else None


def validation_message(errors: list[dict], body_model: type | None = None) -> tuple[str, str | None]:
    """One line for pydantic's errors, naming the first bad field; and that field."""
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return f"request body: not valid JSON ({reason}); expected a JSON object", None
    path = field_path(first["loc"])
    if not path:
        return f"request body: {_show(first.get('input'))}; expected a JSON object", None
    if first["type"] == "missing":
        return f"{path}: missing; expected this field", path
    if first["type"] == "extra_forbidden":
        return _unknown_field(path, list(body_model.model_fields) if body_model is not None else []), path
    union = sum(_top(field_path(e["loc"])) == _top(path) for e in errors) > 1
    leaf = re.findall(r"[A-Za-z_]\w*", path)[-1]
    if union and leaf in EXPECTED:
        expected = f"expected {EXPECTED[leaf]}"
    else:
        expected = first["msg"].replace("Input should be ", "expected ")
    return f"{path}: {_show(first.get('input'))}; {expected}", path


def _unknown_field(path: str, known: list[str]) -> str:
    close = difflib.get_close_matches(path.rpartition(".")[2], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{path}: an unknown field{hint}" + (f"; expected one of {', '.join(known)}" if known else "")


def field_path(loc: tuple) -> str:
    """``("body", "messages", 0, "content", "str")`` -> ``messages[0].content``: the body
    marker and pydantic's union-member tags (``str``, ``list[int]``) dropped."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in TYPE_TAGS:
            path += f".{part}" if path else part
    return path


def _top(path: str) -> str:
    return re.split(r"[.\[]", path)[0]


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
