"""Idle cores lent between one machine's replicas, as the autoscaler counts them.

On a CPU machine whose one-rank engines lend idle cores to each other
(engine/core_lending.py), a decode replica steps on its own threads plus the
owned cores of prefill replicas that are idle at the time. What a decode
replica sustains then depends on the split and the load: one decode replica
beside two mostly idle prefill replicas runs on nearly the whole machine, and
moving a rank from prefill to decode gains little compute there while the move
costs a replica's start-up. Prefill engines lend but never borrow (their steps
are long), so only the decode role's capacity changes.

- `decode_threads`: the threads one decode replica of a split runs with on
  average, in a fluid approximation: its own, plus its share of the cores
  the prefill replicas own and leave idle (each busy `prefill_busy` of the
  time), within what the machine has left after the threads at work.
- `LentCoreSpeedup`: how much faster a decode step runs on more threads, from
  the steps decode replicas ran with borrowed threads: the median of measured
  over own-thread prediction, and interpolated from there linearly in
  1 / threads (the simulator's `lent_step_time`), never faster than perfect
  scaling. Until a borrowed step is seen, lending counts for nothing.
- `ScaledStepModel`: a step model at that factor, for the capacity rules.
"""

from __future__ import annotations

import statistics
from collections import deque


def decode_threads(machine_cores: float, prefill_replicas: int, decode_replicas: int, prefill_busy: float,
                   prefill_own: float = 1.0, decode_own: float = 1.0) -> float:
    """Mean threads one decode replica steps with (decode replicas are taken to be
    always at work; `prefill_busy` in [0, 1] is one prefill replica's utilisation)."""
    if decode_replicas < 1:
        return decode_own
    busy = min(1.0, max(0.0, prefill_busy))
    idle_owned = prefill_replicas * prefill_own * (1 - busy)
    room = machine_cores - decode_replicas * decode_own - prefill_replicas * prefill_own * busy
    return decode_own + max(0.0, min(idle_owned, room)) / decode_replicas


class LentCoreSpeedup:
    """Step time on more threads than a replica's own, learned from its borrowed steps."""

    def __init__(self, window: int = 200):
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)   # (threads, measured / own-predicted)

    def observe(self, own_threads: int, threads: int, ratio: float) -> None:
        """One step run on `threads` (more than `own_threads`) that took `ratio`
        times what the own-thread model predicts for it."""
        if threads > own_threads >= 1 and ratio > 0:
            self._samples.append((threads, ratio))

    @property
    def num_observed(self) -> int:
        return len(self._samples)

    def factor(self, own_threads: float, threads: float) -> float:
        """Step time at `threads` over step time at `own_threads` (1.0 with no
        borrowed step seen, or no more threads than its own)."""
        if threads <= own_threads or not self._samples:
            return 1.0
        seen = statistics.fmean(t for t, _ in self._samples)
        ratio = min(1.0, statistics.median(r for _, r in self._samples))
        if seen <= own_threads:
            return 1.0
        share = (1 / own_threads - 1 / threads) / (1 / own_threads - 1 / seen)
        return min(1.0, max(own_threads / threads, 1 + (ratio - 1) * share))


class ScaledStepModel:
    """`base`'s step times times `factor` (a decode replica on lent cores)."""

    def __init__(self, base, factor: float):
        self.base = base
        self.factor = factor

    def step_time(self, shape) -> float:
        return self.base.step_time(shape) * self.factor

    def to_json(self) -> dict:
        return {**self.base.to_json(), "lent_core_factor": self.factor}
