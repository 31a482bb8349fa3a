"""What one replica of a role sustains while its requests meet their SLOs,
from a step-time model (cluster/perf_model).

- prefill: a replica runs one prompt of P tokens in S = step_time(P tokens).
  Arrivals are roughly Poisson, so a prompt waits in an M/D/1 queue: it waits
  at all with probability rho (the utilisation), and then about exponentially
  long with the M/D/1 mean W / rho, W = rho * S / (2 * (1 - rho)). The share of
  TTFTs (W + S) past the SLO B is then rho * exp(-2 * (1 - rho) * (B - S) / S);
  the replica sustains rho_max / S requests/s, with rho_max the utilisation at
  which that share is 1 - percentile (10% for the 90th). Goodput counts each
  request against the SLO, so the tail, not the mean, sets the capacity: at
  S = 0.45 s and B = 1 s the mean TTFT is 0.8 s at rho = 0.6, while 90% of
  TTFTs stay within 1 s only up to rho = 0.41 (an M/D/1 simulation with
  +-20% prompt lengths gives 0.42).
- decode: the replica holds B sequences; one step of B decodes (each attending
  to `context` keys) takes t(B). The largest B with t(B) <= `tpot_budget_s`,
  no more than max_num_seqs or the KV blocks allow, finishes B / (output_len *
  t(B)) requests/s.
- colocated: prefill and decode share the replica's time: at rate r a replica
  spends r * S on prompts and r / decode_capacity on decoding, so it sustains
  1 / (S / rho_max + 1 / decode_capacity).

The decode budget is the TPOT SLO times a headroom below 1: the model predicts
the mean step, the SLO bounds a request's average over its steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.perf_model.step_shape import StepShape, StepTimeModel


@dataclass(frozen=True)
class ReplicaLimits:
    """A replica's engine limits (the deployment's engine section and KV size)."""
    max_num_seqs: int = 256
    num_kv_blocks: int = 1 << 30
    block_size: int = 16


def prefill_seconds(model: StepTimeModel, prompt_len: float) -> float:
    """One prompt's prefill step alone on a replica."""
    n = max(1, round(prompt_len))
    return model.step_time(StepShape.build([(0, n)]))


def prefill_capacity(model: StepTimeModel, prompt_len: float, ttft_slo_s: float, percentile: float = 0.9) -> float:
    """Requests/s one prefill replica sustains with `percentile` of its TTFTs
    within `ttft_slo_s` (module doc; 0 when a lone prompt already takes longer)."""
    s = prefill_seconds(model, prompt_len)
    if s <= 0:
        return math.inf
    if s >= ttft_slo_s:
        return 0.0
    late = 1.0 - percentile
    slack = 2 * (ttft_slo_s - s) / s

    def share_late(rho: float) -> float:       # rises with rho, from 0 to 1
        return rho * math.exp(-slack * (1 - rho))

    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share_late(mid) <= late else (lo, mid)
    return lo / s


def decode_shape(batch: int, context: float) -> StepShape:
    """A step of `batch` decodes, each attending to `context` keys."""
    return StepShape(decode_seqs=batch, decode_context=batch * max(1, round(context)))


def decode_batch(model: StepTimeModel, context: float, tpot_budget_s: float, limits: ReplicaLimits) -> int:
    """The largest number of sequences a decode step may hold and stay within the
    TPOT budget, the engine's max_num_seqs and its KV blocks (0: not even one)."""
    blocks_per_seq = max(1, math.ceil(context / limits.block_size))
    cap = min(limits.max_num_seqs, limits.num_kv_blocks // blocks_per_seq)

    def fits(b: int) -> bool:
        return model.step_time(decode_shape(b, context)) <= tpot_budget_s

    if cap < 1 or not fits(1):
        return 0
    lo, hi = 1, cap                 # fits(lo); step time grows with the batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def decode_capacity(model: StepTimeModel, prompt_len: float, output_len: float, tpot_budget_s: float,
                    limits: ReplicaLimits = ReplicaLimits()) -> float:
    """Requests/s one decode replica finishes with every step within the TPOT
    budget; sequences attend on average to the prompt plus half the output."""
    context = prompt_len + output_len / 2
    b = decode_batch(model, context, tpot_budget_s, limits)
    if b == 0:
        return 0.0
    step = model.step_time(decode_shape(b, context))
    return b / (max(1.0, output_len) * step) if step > 0 else math.inf


def colocated_capacity(model: StepTimeModel, prompt_len: float, output_len: float, ttft_slo_s: float,
                       tpot_budget_s: float, limits: ReplicaLimits = ReplicaLimits(),
                       ttft_percentile: float = 0.9) -> float:
    """Requests/s one colocated replica sustains: prompts and decodes share its time."""
    p = prefill_capacity(model, prompt_len, ttft_slo_s, ttft_percentile)
    d = decode_capacity(model, prompt_len, output_len, tpot_budget_s, limits)
    if p == 0 or d == 0:
        return 0.0
    return 1.0 / (1.0 / p + 1.0 / d)
