"""Admission control: the router refuses work it cannot serve in time, at
once, instead of queueing it without bound.

A request is waiting from its admission until its first token (or its end).
The router bounds what waits: `max_waiting_requests` requests and
`max_waiting_prompt_tokens` prompt tokens. With a TTFT SLO it also predicts
each request's time to first token,

    TTFT = (prompt tokens waiting / prefill replicas + this prompt) x prefill s/token

with the per-token cost the workers measure on their own steps, and refuses
it when that exceeds `slo_factor` x the SLO. When prompts arrive faster than
the prefill replicas serve them (over the last `overload_window_s`, refused
ones included), queueing more cannot raise throughput, only every admitted
request's TTFT: then a request is admitted only while what waits ahead of it
takes at most `overload_wait_factor` x its own prefill, so the queue holds
about what keeps the replicas busy and admitted TTFT stays near its unloaded
value instead of climbing to the SLO. With a TPOT SLO it bounds the
requests running at once to what the decode replicas hold with each step
within `tpot_headroom` of the SLO (their measured step time per sequence):
past that, every admitted request would miss TPOT. A refusal is a 429 with
`Retry-After`: the predicted time for what waits now to drain. The checks
that need no prompt length run before the prompt is tokenized.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from router.errors import OpenAIError


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    max_waiting_requests: int | None = 1024
    max_waiting_prompt_tokens: int | None = 1 << 18
    ttft_slo_s: float | None = None
    slo_factor: float = 1.0
    tpot_slo_s: float | None = None
    tpot_headroom: float = 0.8          # decode steps are held to this share of the TPOT SLO
    overload_wait_factor: float | None = 1.0   # with a TTFT SLO, in overload: wait <= this x own prefill
    overload_window_s: float = 5.0      # arrivals over this long decide whether prompts outpace prefill


class Overloaded(OpenAIError):
    """429 with the seconds after which a retry is predicted to be admitted."""

    def __init__(self, message: str, reason: str, retry_after_s: float):
        super().__init__(429, message, type="rate_limit_error", code="server_overloaded")
        self.reason = reason
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class AdmissionControl:
    def __init__(self, settings: AdmissionSettings, *, prefill_roles: tuple[str, ...] = ("prefill", "colocated"),
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.prefill_roles = prefill_roles
        self.clock = clock
        self._arrivals: deque[float] = deque()       # arrival times within overload_window_s, refused ones too
        self._first_arrival: float | None = None
        self.mean_prompt_tokens: float | None = None  # of the requests checked with their prompt, running mean
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.replicas = 1
        self.s_per_token: float | None = None      # the prefill replicas' measured cost, mean
        self.running = 0                           # admitted and not ended
        self.decode_replicas = 1
        self.decode_s_per_seq: float | None = None # the decode replicas' measured step time per sequence
        self.decode_step_fixed_s = 0.0             # what a decode step costs whatever its batch
        self.prefill_s_per_step = 0.0              # prefill work the decode replicas' steps carry now

    # ---- the checks ---------------------------------------------------------------------------
    def check_before_tokenizing(self) -> None:
        """Counts the request's arrival; raises Overloaded when the queue alone is
        past a bound or the SLO."""
        s = self.settings
        now = self.clock()
        if self._first_arrival is None:
            self._first_arrival = now
        self._arrivals.append(now)
        while self._arrivals and self._arrivals[0] < now - s.overload_window_s:
            self._arrivals.popleft()
        if s.max_waiting_requests is not None and self.waiting_requests >= s.max_waiting_requests:
            raise self._refuse("queue_requests", f"{self.waiting_requests} requests are waiting for their first "
                               f"token, the most this server queues ({s.max_waiting_requests})")
        if s.max_waiting_prompt_tokens is not None and self.waiting_tokens >= s.max_waiting_prompt_tokens:
            raise self._refuse("queue_tokens", f"{self.waiting_tokens} prompt tokens are waiting, the most this "
                               f"server queues ({s.max_waiting_prompt_tokens})")
        self._check_slo(0)
        limit = self.max_running()
        if limit is not None and self.running >= limit:
            raise self._refuse("tpot_slo", f"{self.running} requests are running, the most that keep a decode "
                               f"step within {s.tpot_headroom:.0%} of the {s.tpot_slo_s * 1000:.0f} ms TPOT SLO")

    def max_running(self) -> int | None:
        """Requests the decode replicas hold with each step within the TPOT budget (None:
        no TPOT SLO or nothing measured yet): a step costs its fixed part, the prefill
        chunks steps carry at the current load, and a share per sequence (the workers
        fit these on their steps, mixed ones too; engine/step_cost.py). At least one
        per replica, so that a prefill load past the budget still drains."""
        s = self.settings
        if s.tpot_slo_s is None or not self.decode_s_per_seq:
            return None
        budget = s.tpot_slo_s * s.tpot_headroom - self.decode_step_fixed_s - self.prefill_s_per_step
        per_replica = max(1, int(budget / self.decode_s_per_seq))
        return per_replica * self.decode_replicas

    def admit(self, num_prompt_tokens: int) -> None:
        """Checks the request with its prompt length, then counts it as waiting.
        Raises Overloaded (and counts nothing) when it must be refused."""
        s = self.settings
        if s.max_waiting_prompt_tokens is not None and \
                self.waiting_tokens + num_prompt_tokens > s.max_waiting_prompt_tokens and self.waiting_requests:
            raise self._refuse("queue_tokens", f"{self.waiting_tokens} prompt tokens are waiting and this prompt "
                               f"has {num_prompt_tokens}; this server queues at most {s.max_waiting_prompt_tokens}")
        old = self.mean_prompt_tokens
        self.mean_prompt_tokens = num_prompt_tokens if old is None else 0.95 * old + 0.05 * num_prompt_tokens
        self._check_slo(num_prompt_tokens)
        self.waiting_requests += 1
        self.waiting_tokens += num_prompt_tokens
        self.running += 1

    def finished(self) -> None:
        """An admitted request ended (however)."""
        self.running = max(0, self.running - 1)

    def first_token(self, num_prompt_tokens: int) -> None:
        """An admitted request got its first token, or ended without one."""
        self.waiting_requests = max(0, self.waiting_requests - 1)
        self.waiting_tokens = max(0, self.waiting_tokens - num_prompt_tokens)

    # ---- predictions --------------------------------------------------------------------------
    def predicted_wait_s(self) -> float:
        """Until what waits now has had its first token (0 before any cost is measured)."""
        return self.waiting_tokens / self.replicas * (self.s_per_token or 0.0)

    def predicted_ttft_s(self, num_prompt_tokens: int) -> float:
        return self.predicted_wait_s() + num_prompt_tokens * (self.s_per_token or 0.0)

    def overloaded(self) -> bool:
        """Whether prompt tokens arrived over the last overload_window_s faster than the
        prefill replicas serve them (at their measured cost)."""
        if not self.s_per_token or not self.mean_prompt_tokens or not self._arrivals:
            return False
        window = self.settings.overload_window_s
        seen = self.clock() - self._first_arrival
        if seen < window / 2:
            return False     # too little history to tell a burst from a rate
        offered = len(self._arrivals) / min(window, seen) * self.mean_prompt_tokens   # prompt tokens per second
        return offered * self.s_per_token > self.replicas

    def observe_workers(self, role: str, stats: Iterable[Mapping[str, float]]) -> None:
        """The latest stats of every replica of `role`: prefill costs from the prefill roles,
        decode costs from the decode ones (decode, colocated)."""
        stats = list(stats)
        if role in ("decode", "colocated"):
            self.decode_replicas = max(1, len(stats))
            costs = [s for s in stats if "decode_s_per_seq" in s]
            if costs:   # the slowest replica's
                self.decode_s_per_seq = max(s["decode_s_per_seq"] for s in costs)
                self.decode_step_fixed_s = max(s.get("decode_step_fixed_s", 0.0) for s in costs)
                self.prefill_s_per_step = max(s.get("prefill_s_per_step", 0.0) for s in costs)
        if role not in self.prefill_roles:
            return
        self.replicas = max(1, len(stats))
        costs = [s["prefill_s_per_token"] for s in stats if "prefill_s_per_token" in s]
        if costs:
            self.s_per_token = sum(costs) / len(costs)

    def _check_slo(self, num_prompt_tokens: int) -> None:
        s = self.settings
        if s.ttft_slo_s is None or self.s_per_token is None:
            return
        limit = s.ttft_slo_s * s.slo_factor
        predicted = self.predicted_ttft_s(num_prompt_tokens)
        if predicted > limit:
            raise self._refuse("ttft_slo", f"its predicted time to first token is {predicted * 1000:.0f} ms, past "
                               f"the {limit * 1000:.0f} ms this server admits")
        if s.overload_wait_factor is None or not self.overloaded():
            return
        own = (num_prompt_tokens or self.mean_prompt_tokens or 0.0) * self.s_per_token
        wait = self.predicted_wait_s()
        if wait > s.overload_wait_factor * own:
            raise self._refuse("overload", f"prompts are arriving faster than this server prefills them, and "
                               f"{wait * 1000:.0f} ms of prompts wait ahead of this one; it admits a request "
                               f"only while at most {s.overload_wait_factor:g}x its own prefill "
                               f"({own * 1000:.0f} ms) waits ahead")

    def _refuse(self, reason: str, why: str) -> Overloaded:
        return Overloaded(f"The server is overloaded: {why}. Retry after the Retry-After header's seconds.",
                          reason, self.predicted_wait_s())
