"""Cross-origin access for browser clients (CORS): which web pages, by origin,
may call the API and read its answers. Off unless origins are listed
(`http.allowed_origins`, `pdserve serve --allowed-origins`): browsers then let
only pages served from the API's own origin read it. The methods are the ones
the API serves; any request header is allowed (Authorization for the API key,
Content-Type, the OpenAI client's own headers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from router.errors import OpenAIError, to_response

METHODS = ("GET", "POST", "HEAD", "OPTIONS")
PREFLIGHT_MAX_AGE_S = 600
# response headers a page may read beyond CORS's safelisted ones: a 429's wait, the request's id
EXPOSED_HEADERS = ("Retry-After", "X-Request-Id")


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...]        # "scheme://host[:port]" each, or ("*",)
    allow_credentials: bool = False         # cookies and HTTP authentication (never with "*")

    def middleware_options(self) -> dict[str, Any]:
        """Keyword arguments of Starlette's CORSMiddleware."""
        return {"allow_origins": list(self.allowed_origins), "allow_credentials": self.allow_credentials,
                "allow_methods": list(METHODS), "allow_headers": ["*"], "expose_headers": list(EXPOSED_HEADERS),
                "max_age": PREFLIGHT_MAX_AGE_S}


class OpenAICorsMiddleware(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflight (an origin not listed, a
    method the API does not serve) is a 400 in OpenAI's error format, not plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        origin, method = request_headers["origin"], request_headers["access-control-request-method"]
        error = OpenAIError(
            400, f"This cross-origin request is not allowed ({refused}): origin {origin!r:.100}, method {method!r:.20}. "
            f"The server lets pages of the origins in http.allowed_origins (pdserve serve --allowed-origins) "
            f"call {', '.join(METHODS)}.", code="cors_refused")
        answer = to_response(error)
        for name, value in response.headers.items():
            if name.lower().startswith("access-control-") or name.lower() == "vary":
                answer.headers[name] = value
        return answer
