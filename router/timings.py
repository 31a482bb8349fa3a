"""How long one request spent in each phase.

`RequestTimings` is what the router saw (arrival, first token, finish: its own
`time.monotonic()` readings) plus the `PhaseTimings` the workers measured.
Worker phases are durations, never timestamps, because a worker's monotonic clock
is not comparable with the router's (another process, often another host).
`router/metrics.py` turns a finished request's timings into Prometheus samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Durations the workers measured, in seconds; None = not measured or did not happen."""

    queue_time: float | None = None      # waiting on the prefill side until first scheduled
    prefill_time: float | None = None    # first scheduled -> first token sampled
    reserve_time: float | None = None    # the decode worker waiting for free KV blocks for the hand-off
    transfer_time: float | None = None   # KV hand-off prefill -> decode (None when colocated)
    transfer_bytes: int | None = None    # KV bytes that hand-off moved
    prefilled_on: str | None = None      # "prefill" (a prefill worker) | "decode" (the decode worker itself)
    migrations: int = 0                  # times the request was continued on another worker after one failed


@dataclass(slots=True)
class RequestTimings:
    """One request as the router saw it; every time is a `time.monotonic()` reading."""

    arrival_time: float
    prompt_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    generation_tokens: int = 0
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None (failed)
    phases: PhaseTimings = field(default_factory=PhaseTimings)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first; None below two tokens."""
        if self.first_token_time is None or self.finished_time is None or self.generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.generation_tokens - 1)
