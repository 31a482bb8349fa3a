"""Latency and throughput metrics of a load-test run: pure functions of the records.

Per request (seconds here, milliseconds in the Summary):
- TTFT: first output chunk's arrival - send time.
- TPOT: (last output chunk's arrival - first one's) / (output tokens - 1); none
  for a one-token output (there is no decode step to time).
- ITL: the gaps between successive output chunks (one per chunk, not per token,
  as in vLLM: a chunk carrying several tokens is one gap).
- E2EL: end of the stream - send time.

Over a run:
- completed / failed: requests that succeeded / did not (errors, timeouts, and
  requests cut off in flight when the run stopped); requests never sent are
  neither.
- request_throughput = completed / duration; output_throughput = output tokens
  of completed requests / duration; total_token_throughput adds their prompt tokens.
- goodput: a request is good when it succeeded and meets every SLO given
  (`{"ttft": ms, "tpot": ms, "e2el": ms}`, any subset; a value equal to the
  limit meets it; a one-token request meets any TPOT limit).
  request_goodput = good / duration (vLLM's definition) and
  slo_attainment = good / (completed + failed), so failed requests count against
  it (DistServe's "fraction of requests that meet the SLOs"). Both are None
  when no SLO is given.
- Latency statistics are over completed requests (ITL over all their gaps):
  mean, median, standard deviation (population) and percentiles with linear
  interpolation (numpy's default), all None when there is no value.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: keeps `pdserve --help` from importing aiohttp
    from bench.loadtest.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def ttft(record: RequestRecord) -> float | None:
    if record.send_time is None or not record.chunk_times:
        return None
    return record.chunk_times[0] - record.send_time


def tpot(record: RequestRecord) -> float | None:
    tokens = record.output_tokens
    if not record.chunk_times or tokens is None or tokens < 2:
        return None
    return (record.chunk_times[-1] - record.chunk_times[0]) / (tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    return [b - a for a, b in pairwise(record.chunk_times)]


def e2el(record: RequestRecord) -> float | None:
    """From the send to the last output chunk, as vLLM's benchmark times it: not to
    the stream's close (a usage chunk and [DONE] later, or a server that holds the
    connection open after its finish_reason until --request-timeout)."""
    if record.send_time is None:
        return None
    if record.chunk_times:
        return record.chunk_times[-1] - record.send_time
    return None if record.end_time is None else record.end_time - record.send_time


def peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(max_output_tokens_per_s, max_concurrent_requests) over the successful requests,
    the figures `vllm bench serve` reports under these names, counted otherwise: output
    tokens arrived in each whole second from the first send, the highest; and the most
    requests in flight at one instant, each from its send to its last output (an end
    before a start at the same time; vLLM counts every request active at any time of
    a 1 s bucket). vLLM counts a token per chunk, which its server streams; a server
    that streams several tokens a chunk (pdserve's stream interval) has each chunk
    count its request's tokens over its chunks, so the peak is in tokens too
    (counted by chunks it read 16 tok/s beside a mean of 114)."""
    done = [r for r in records if r.succeeded and r.send_time is not None and r.end_time is not None]
    if not done:
        return 0.0, 0
    first = min(r.send_time for r in done)
    seconds = int(math.ceil(max(r.end_time for r in done) - first)) + 1
    tokens = [0.0] * seconds
    events = []      # (time, +1 a send / -1 a last output)
    for r in done:
        per_chunk = (r.output_tokens or len(r.chunk_times)) / max(1, len(r.chunk_times))
        for t in r.chunk_times:
            if 0 <= int(t - first) < seconds:
                tokens[int(t - first)] += per_chunk
        events += [(r.send_time, 1), (r.chunk_times[-1] if r.chunk_times else r.end_time, -1)]
    in_flight = most = 0
    for _, change in sorted(events):       # (-1 sorts before +1 at one time)
        in_flight += change
        most = max(most, in_flight)
    return float(max(tokens)), most


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether `record` succeeded and meets every SLO in `slos_ms` (limits in ms)."""
    if not record.succeeded:
        return False
    measured = {"ttft": ttft(record), "tpot": tpot(record), "e2el": e2el(record)}
    for name, limit_ms in slos_ms.items():
        if name not in measured:
            raise ValueError(f"unknown SLO metric {name!r}; use one of {', '.join(SLO_METRICS)}")
        value = measured[name]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of ascending values, interpolated linearly between ranks."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


@dataclass(frozen=True)
class LatencyStats:
    """One latency's statistics in ms; every field None when there were no values."""

    mean: float | None
    median: float | None
    std: float | None
    percentiles: Mapping[float, float | None]

    @classmethod
    def of(cls, values_s: Iterable[float], percentiles: Sequence[float]) -> LatencyStats:
        values = sorted(v * 1000.0 for v in values_s)
        if not values:
            return cls(None, None, None, {p: None for p in percentiles})
        return cls(statistics.fmean(values), percentile(values, 50), statistics.pstdev(values),
                   {p: percentile(values, p) for p in percentiles})


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of one run (see the module docstring for the definitions)."""

    num_requests: int
    completed: int
    failed: int
    unfinished: int
    not_sent: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    slos_ms: Mapping[str, float]
    good: int | None
    request_goodput: float | None
    slo_attainment: float | None
    latency: Mapping[str, LatencyStats]
    token_count_methods: Mapping[str, int]
    error_counts: Mapping[str, int]


def summarize(records: Sequence[RequestRecord], *, num_requests: int, duration: float,
              slos_ms: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = (90, 99)) -> Summary:
    """Aggregate `records` (the requests that were sent) of a run of `num_requests` planned
    requests that took `duration` seconds."""
    slos = dict(slos_ms or {})
    ok = [r for r in records if r.succeeded]
    failed = [r for r in records if not r.succeeded]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)

    def rate(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    good = sum(meets_slos(r, slos) for r in records) if slos else None
    latency = {
        "ttft": LatencyStats.of((v for r in ok if (v := ttft(r)) is not None), percentiles),
        "tpot": LatencyStats.of((v for r in ok if (v := tpot(r)) is not None), percentiles),
        "itl": LatencyStats.of((gap for r in ok for gap in itls(r)), percentiles),
        "e2el": LatencyStats.of((v for r in ok if (v := e2el(r)) is not None), percentiles),
    }
    return Summary(
        num_requests=num_requests, completed=len(ok), failed=len(failed),
        unfinished=sum(r.unfinished for r in records), not_sent=num_requests - len(records),
        duration=duration, total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=rate(len(ok)), output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens), slos_ms=slos, good=good,
        request_goodput=None if good is None else rate(good),
        slo_attainment=None if good is None else (good / len(records) if records else 0.0),
        latency=latency,
        token_count_methods=dict(Counter(r.token_count_method for r in ok if r.token_count_method)),
        error_counts=dict(Counter(r.error or "unknown error" for r in failed).most_common()),
    )
