"""What the router checks before a request reaches a route: the API key and
the body size. An ASGI middleware, so a refused request costs no parsing.

- API key (optional): every route but GET /health (and GET /metrics, unless
  `protect_metrics`) needs `Authorization: Bearer KEY`, else 401 with
  OpenAI's body (code "invalid_api_key"). The router holds only the key's
  SHA-256, so the key itself is in no deployment file, Serve config or actor
  argument; the comparison is constant-time.
- Body limit: a request whose body is larger than `max_body_bytes` gets 413,
  from its Content-Length before anything is read, or once the bytes read pass
  the limit (chunked uploads: the body is read here and replayed to the app).
  A body that stops arriving (no bytes for BODY_READ_GAP_S, nginx's
  client_body_timeout) gets 408: a client trickling bodies cannot hold the
  router's coroutines and buffers for ever.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import OpenAIError, to_response

OPEN_PATHS = ("/health",)
BODY_READ_GAP_S = 60.0


def api_key_digest(key: str) -> str:
    """The SHA-256 (hex) the router checks a presented key against."""
    return hashlib.sha256(key.encode()).hexdigest()


def configured_key_digest(key: str, source: str) -> str:
    """api_key_digest of the key a server is started with (`source`: where it came from, for the
    message); ValueError for a key no client could present: HTTP drops the whitespace around a
    header's value, and a header carries bytes, not the key's characters as typed."""
    if key != key.strip():
        raise ValueError(f"{source}: the API key begins or ends with whitespace (a trailing newline or "
                         "carriage return from a file?), which no client can send in a header; remove it")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{source}: the API key has characters other than printable ASCII, which clients "
                         "cannot send as typed in a header; use a key of letters, digits and punctuation")
    return api_key_digest(key)


class HttpGuard:
    def __init__(self, app: ASGIApp, *, api_key_sha256: str | None = None, protect_metrics: bool = True,
                 max_body_bytes: int | None = None, on_error: Callable[[int], None] | None = None):
        """`on_error(status)`: called for each request refused here (401, 408, 413)."""
        self.app = app
        self.digest = api_key_sha256.lower() if api_key_sha256 else None
        self.protect_metrics = protect_metrics
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.digest is not None and self._needs_key(scope["method"], _app_path(scope)) and \
                not self._authorized(scope):
            await self._refuse(scope, receive, send, 401, "Incorrect API key provided: send it as 'Authorization: "
                               "Bearer KEY'.", "invalid_api_key", {"www-authenticate": "Bearer"})
            return
        limit = self.max_body_bytes
        if limit is None:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
            await self._refuse(scope, receive, send, 413, _too_large(limit), "request_too_large")
            return
        # Read the body here (the routes read all of it anyway), so that one sent without a
        # Content-Length is refused as soon as it passes the limit; the app gets it replayed.
        chunks, size, more = [], 0, True
        while more:
            try:
                async with asyncio.timeout(BODY_READ_GAP_S) as gap:
                    message = await receive()
            except TimeoutError:
                if not gap.expired():
                    raise                                # receive's own, not the gap's
                await self._refuse(scope, receive, send, 408, f"The request body stopped arriving: no bytes for "
                                   f"{BODY_READ_GAP_S:g} s. Send the body without pauses.", "request_timeout")
                return
            if message["type"] != "http.request":
                return                                   # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                await self._refuse(scope, receive, send, 413, _too_large(limit), "request_too_large")
                return
        body = b"".join(chunks)
        del chunks        # held for the whole request otherwise (a stream's too), beside the body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()                       # later reads wait for a disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
        if self.on_error is not None:
            self.on_error(status)
        response = to_response(OpenAIError(status, message, type="invalid_request_error", code=code))
        response.headers.update(headers or {})
        await response(scope, receive, send)

    def _needs_key(self, method: str, path: str) -> bool:
        """`path`: within the application (its route prefix left out)."""
        if path in OPEN_PATHS and method in ("GET", "HEAD"):    # a probe; any other method is no probe
            return False
        return self.protect_metrics or path != "/metrics"

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        return hmac.compare_digest(api_key_digest(key.strip()), self.digest)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server accepts ({limit} bytes)."


def _app_path(scope: Scope) -> str:
    """The request's path within the application: Serve's proxy keeps the full path
    and puts an application's route prefix (`serve deploy` with route_prefix /llm)
    in root_path, so /llm/health is the application's /health."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and root != "/" and path.startswith(root):
        return path[len(root):] or "/"
    return path
