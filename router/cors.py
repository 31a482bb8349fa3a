"""Cross-origin access for browser clients (CORS): which web pages, by origin,
may call the API and read its answers. Off unless origins are listed
(`http.allowed_origins`, `pdserve serve --allowed-origins`): browsers then let
only pages served from the API's own origin read it. The methods are the ones
the API serves; any request header is allowed (Authorization for the API key,
Content-Type, the OpenAI client's own headers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("GET", "POST", "HEAD", "OPTIONS")
PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...]        # "scheme://host[:port]" each, or ("*",)
    allow_credentials: bool = False         # cookies and HTTP authentication (never with "*")

    def middleware_options(self) -> dict[str, Any]:
        """Keyword arguments of Starlette's CORSMiddleware."""
        return {"allow_origins": list(self.allowed_origins), "allow_credentials": self.allow_credentials,
                "allow_methods": list(METHODS), "allow_headers": ["*"], "max_age": PREFLIGHT_MAX_AGE_S}
