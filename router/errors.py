"""OpenAI-format error responses and the FastAPI handlers that produce them.

Every error the HTTP layer returns has the body OpenAI's clients parse:
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
`install_error_handlers` maps:
- request validation (malformed JSON, wrong types, missing fields) -> 400 naming
  the field and the problem;
- engine.InvalidRequestError / SamplingParamsError -> 400 (with the error's param);
- unknown route -> 404, wrong method -> 405, other HTTPExceptions -> their status;
- router.backend.BackendUnavailableError -> 503 with the error's client-facing
  reason only (its message, logged, may name actors, nodes and processes);
- anything else -> 500 with a generic message; the exception is logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParamsError
from router.backend import BackendUnavailableError

log = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request."
UNAVAILABLE_REASON = "no worker could serve the request"
# Long values are echoed back in validation messages only up to this many characters.
_MAX_ECHO_CHARS = 80
_MAX_DESCRIBED_ERRORS = 10    # a body with thousands of bad items gets a message of ten, and a count


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status: `server_error` for the server's
    failures, `invalid_request_error` for the client's (an unknown model's 404
    included; a 401 and a 429 set their own)."""
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIError(Exception):
    """An error to return as an OpenAI-format response with this status."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Response headers the error needs (Retry-After on a 429, say)."""
        return {}


def error_response(status: int, message: str, *, type: str | None = None,
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return to_response(OpenAIError(status, message, type=type, param=param, code=code))


class _ErrorJSONResponse(JSONResponse):
    """JSON in ASCII: a message that quotes the request (a model name holding a lone surrogate,
    say) has no UTF-8 encoding, and the error would itself fail as a 500."""
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def to_response(error: OpenAIError) -> JSONResponse:
    return _ErrorJSONResponse(error.body(), status_code=error.status, headers=error.headers() or None)


def _unparsable_body(cause: BaseException | None) -> str | None:
    """What to change in a body FastAPI could not parse for a reason other than JSON syntax
    (which it reports itself), or None."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"The request body is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at position "
                f"{cause.start}); send the JSON encoded as UTF-8.")
    if isinstance(cause, RecursionError):
        return "The request body's JSON is nested too deeply to parse; flatten it."
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"The request body holds a number too long to parse ({cause}); send a shorter number."
    return None


def from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAIError to report for `exc`; unexpected exceptions become a logged 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), param=exc.param)
    if isinstance(exc, SamplingParamsError):
        return OpenAIError(400, str(exc))
    if isinstance(exc, BackendUnavailableError):
        _UNSERVED_LOG.log("request not served: %s", exc)      # the details, for the operator only
        return OpenAIError(503, f"The model is temporarily unavailable: {exc.reason or UNAVAILABLE_REASON}. "
                                "Retry the request.")
    log.error("internal error", exc_info=exc)
    return OpenAIError(500, INTERNAL_ERROR_MESSAGE)


class SpacedLog:
    """A line at most every `every_s`, with how many were left out since: while no worker
    can serve, every request fails alike, and a line each would bury the log."""

    def __init__(self, logger: logging.Logger, every_s: float, level: int = logging.WARNING):
        self.logger, self.every_s, self.level = logger, every_s, level
        self._last, self._left_out = float("-inf"), 0

    def log(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._left_out += 1
            return
        more = f" (and {self._left_out} more like it since the last logged)" if self._left_out else ""
        self.logger.log(self.level, message + more, *args)
        self._last, self._left_out = now, 0


_UNSERVED_LOG = SpacedLog(log, every_s=10.0)


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """A 400 naming each invalid field of the request body (the first
    _MAX_DESCRIBED_ERRORS of them) and what is wrong with it."""
    messages = [_describe(e) for e in errors[:_MAX_DESCRIBED_ERRORS]] or ["Invalid request body."]
    if len(errors) > _MAX_DESCRIBED_ERRORS:
        messages.append(f"and {len(errors) - _MAX_DESCRIBED_ERRORS} more errors")
    # A JSON syntax error's loc holds a character position, not a field.
    params = (_field_path(e.get("loc", ())) for e in errors if e.get("type") != "json_invalid")
    return OpenAIError(400, "; ".join(dict.fromkeys(messages)), param=next((p for p in params if p), None))


def _field_path(loc: tuple | list) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _describe(error: dict[str, Any]) -> str:
    kind = error.get("type", "")
    loc = error.get("loc", ())
    ctx = error.get("ctx") or {}
    if kind == "json_invalid":
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        return f"The request body is not valid JSON: {ctx.get('error', 'decode error')}{where}."
    path = _field_path(loc)
    if not path:
        if kind == "missing":
            return "The request body is missing; send a JSON object."
        hint = " (set Content-Type: application/json)" if isinstance(error.get("input"), bytes) else ""
        return f"The request body must be a JSON object{hint}."
    if kind == "missing":
        return f"{path} is required."
    # Errors raised by our own validators carry the real message in ctx["error"].
    message = str(ctx["error"]) if kind == "value_error" and "error" in ctx else error.get("msg", kind)
    value = error.get("input")
    if isinstance(value, (str, int, float, bool)) or value is None:
        shown = repr(value)
        if len(shown) > _MAX_ECHO_CHARS:
            shown = shown[:_MAX_ECHO_CHARS] + "..."
        message += f" (got {shown})"
    return f"{path}: {message}"


def install_error_handlers(app: FastAPI, *, on_error: Callable[[int], None] | None = None) -> None:
    """Make every error `app` returns OpenAI-shaped; `on_error(status)` is called once per error response."""

    def respond(error: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return to_response(error)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}."
            error = OpenAIError(404, message, code="unknown_url")
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
            error = OpenAIError(405, message, code="method_not_allowed")
        elif exc.status_code == 400 and (why := _unparsable_body(exc.__cause__)):
            error = OpenAIError(400, why)
        else:
            error = OpenAIError(exc.status_code, str(exc.detail))
        response = respond(error)
        if exc.headers:
            response.headers.update(exc.headers)  # e.g. Allow on a 405
        return response

    async def on_known(request: Request, exc: Exception) -> JSONResponse:
        return respond(from_exception(exc))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for exc_class in (OpenAIError, InvalidRequestError, SamplingParamsError, BackendUnavailableError):
        app.add_exception_handler(exc_class, on_known)
    app.add_middleware(_InternalErrorMiddleware, respond=respond)


class _InternalErrorMiddleware:
    """Turns an exception no handler took into an OpenAI-format 500.

    Starlette's own fallback (ServerErrorMiddleware) re-raises after responding,
    so the server would log every such error twice; this logs it once.
    """

    def __init__(self, app: ASGIApp, respond: Callable[[OpenAIError], JSONResponse]):
        self.app = app
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise  # half a response is out; the server can only drop the connection
            await self.respond(from_exception(exc))(scope, receive, send)
