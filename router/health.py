"""The answer to GET /health, shared by the probes that come close together.

/health needs no API key (load balancers probe it), and each check asks every
decode replica for its stats: unshared, a flood of probes would be work for
the engines that neither the key nor admission control bounds. One check runs
at a time, its answer serves every probe within `ttl_s` of it, and a probe
that comes while one runs waits for that one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

HEALTH_TTL_S = 1.0


class SharedHealthCheck:
    """`await check()`: None when healthy, else the reason (the check's error)."""

    def __init__(self, probe: Callable[[], Awaitable[None]], ttl_s: float | None = None):
        """`ttl_s`: how long an answer serves (default HEALTH_TTL_S)."""
        self._probe = probe
        self._ttl_s = ttl_s
        self._answer: tuple[float, str | None] | None = None   # (when it was checked, reason or None)
        self._running: asyncio.Future | None = None

    async def __call__(self) -> str | None:
        ttl_s = HEALTH_TTL_S if self._ttl_s is None else self._ttl_s
        if self._answer is not None and time.monotonic() - self._answer[0] < ttl_s:
            return self._answer[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._check())
        return await asyncio.shield(self._running)     # one probe that leaves does not cancel the others'

    async def _check(self) -> str | None:
        try:
            await self._probe()
            reason = None
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            reason = str(exc) or type(exc).__name__
        finally:
            self._running = None
        self._answer = (time.monotonic(), reason)
        return reason
