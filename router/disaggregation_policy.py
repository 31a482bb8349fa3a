"""Where a request's prompt is prefilled: on a prefill replica (then the KV
moves to a decode replica), or on the decode replica itself (conditional
disaggregation, as Dynamo's conditional disaggregation and llm-d's selective
P/D do).

    prompt ≤ local_prefill_max_tokens                                → local
    predicted wait in the prefill pool ≤ max_remote_wait_s           → remote
    otherwise, the side whose first token is predicted sooner:
      remote = (prefill-pool tokens in flight / replicas + prompt) × prefill s/token + hand-off time
      local  = (local tokens in flight / decode replicas + prompt) × decode-side s/token

A prompt prefilled on a decode replica stalls every request decoding there for
its prefill time, so longer prompts go local only as an overflow valve: when
the prefill pool has fallen behind by more than `max_remote_wait_s`.
Per-token costs are what the running workers measure on their own steps
(reported with their stats); until a worker has measured its own, the figure
it timed on throwaway prompts when it started (engine/step_cost.py,
calibrate_prefill_cost), so a burst on a new deployment is priced from its
first prompt. The hand-off time is the router's own average of measured
transfers. Where one side has no figure, the other side's stands in (the same
model runs on both); with none at all there is no evidence of a backlog and
longer prompts go remote. Tokens in
flight are this router's: sent to a pool and not yet answered with a first
token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

_EWMA = 0.2


@dataclass(frozen=True, slots=True)
class DisaggregationSettings:
    policy: Literal["always", "conditional"] = "conditional"
    local_prefill_max_tokens: int = 128    # prompts this short always prefill on the decode replica
    max_remote_wait_s: float = 0.5         # longer ones go local only when the prefill pool is further behind


@dataclass(slots=True)
class _Pool:
    replicas: int = 1
    s_per_token: float | None = None       # mean of the replicas' measured prefill cost
    tokens_in_flight: int = 0


class DisaggregationPolicy:
    """Decides per request; fed by the router (stats, in-flight prompts, transfer times)."""

    def __init__(self, settings: DisaggregationSettings):
        self.settings = settings
        self._remote, self._local = _Pool(), _Pool()
        self.handoff_s = 0.0               # EWMA of measured KV hand-offs
        self._prefill_pool_empty = asyncio.Event()   # set: the last stats refresh found no prefill replica

    @property
    def prefill_pool_empty(self) -> bool:
        return self._prefill_pool_empty.is_set()

    async def prefill_pool_emptied(self) -> None:
        """Returns once a stats refresh finds no prefill replica running (at once if so now)."""
        await self._prefill_pool_empty.wait()

    def prefill_locally(self, num_prompt_tokens: int) -> bool:
        if self.prefill_pool_empty:   # its replicas died and no replacement runs yet: nowhere else to go
            return True
        if self.settings.policy == "always":
            return False
        if num_prompt_tokens <= self.settings.local_prefill_max_tokens:
            return True
        if self.predict_remote_wait_s() <= self.settings.max_remote_wait_s:
            return False
        return self.predict_local_s(num_prompt_tokens) < self.predict_remote_s(num_prompt_tokens)

    def predict_remote_wait_s(self) -> float:
        """Predicted wait in the prefill pool before a new prompt starts (0 before anything is measured)."""
        pool = self._remote
        cost = _first_known(pool.s_per_token, self._local.s_per_token)
        return pool.tokens_in_flight / max(1, pool.replicas) * cost

    def predict_remote_s(self, num_prompt_tokens: int) -> float:
        """Predicted time to the first token on the prefill pool, plus the hand-off."""
        cost = _first_known(self._remote.s_per_token, self._local.s_per_token)
        return self.predict_remote_wait_s() + num_prompt_tokens * cost + self.handoff_s

    def predict_local_s(self, num_prompt_tokens: int) -> float:
        """Predicted time to the first token when a decode replica prefills it."""
        wait, own = self._local_wait_and_own_s(num_prompt_tokens)
        return wait + own

    def local_prefill_s(self, num_prompt_tokens: int) -> tuple[float, float] | None:
        """Where a prompt of this length would be prefilled on a decode replica: the
        predicted wait there before it starts and its own prefill (admission control
        prices it so); None where it would go to the prefill pool."""
        return self._local_wait_and_own_s(num_prompt_tokens) if self.prefill_locally(num_prompt_tokens) else None

    def _local_wait_and_own_s(self, num_prompt_tokens: int) -> tuple[float, float]:
        pool = self._local
        cost = _first_known(pool.s_per_token, self._remote.s_per_token)
        return pool.tokens_in_flight / max(1, pool.replicas) * cost, num_prompt_tokens * cost

    # ---- what the router tells it --------------------------------------------------------------
    def started(self, local: bool, num_prompt_tokens: int) -> None:
        (self._local if local else self._remote).tokens_in_flight += num_prompt_tokens

    def first_token(self, local: bool, num_prompt_tokens: int) -> None:
        """The prompt is done (or failed): no longer in flight."""
        pool = self._local if local else self._remote
        pool.tokens_in_flight = max(0, pool.tokens_in_flight - num_prompt_tokens)

    @contextmanager
    def in_flight(self, local: bool, num_prompt_tokens: int) -> Iterator[None]:
        """`started` on entry, `first_token` on exit, however the block ends."""
        self.started(local, num_prompt_tokens)
        try:
            yield
        finally:
            self.first_token(local, num_prompt_tokens)

    def observe_handoff(self, seconds: float) -> None:
        self.handoff_s = seconds if self.handoff_s == 0.0 else (1 - _EWMA) * self.handoff_s + _EWMA * seconds

    def observe_workers(self, role: str, stats: Iterable[Mapping[str, float]], replicas: int | None = None) -> None:
        """The latest stats of the replicas of `role` ("prefill" or "decode") that
        answered, of `replicas` running (default: as many as answered)."""
        stats = list(stats)
        replicas = len(stats) if replicas is None else replicas
        pool = self._remote if role == "prefill" else self._local
        if role == "prefill" and replicas:
            self._prefill_pool_empty.clear()
        elif role == "prefill":
            self._prefill_pool_empty.set()
        pool.replicas = max(1, replicas)
        costs = [s["prefill_s_per_token"] for s in stats if "prefill_s_per_token" in s]
        if costs:
            pool.s_per_token = sum(costs) / len(costs)


def _first_known(*costs: float | None) -> float:
    """The first measured cost; 0 when none is (no evidence of a backlog)."""
    return next((c for c in costs if c is not None), 0.0)
