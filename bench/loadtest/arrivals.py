"""When each request is sent: Poisson, gamma (bursty) or all at once.

The gaps between requests are gamma-distributed with shape = burstiness and
scale = 1 / (rate * burstiness), as in `vllm bench serve`, so the mean gap is
1 / rate whatever the burstiness and the squared coefficient of variation of
the gaps is 1 / burstiness. Unlike vLLM 0.32, the first request goes at time 0
and the sum of the gaps is not rescaled to exactly N / rate: the schedule is a
plain renewal process, the one the simulator and the planner replay.
burstiness 1 is a Poisson process; below 1 the arrivals are burstier, above 1
more regular. rate = inf sends everything at time 0.

The schedule is computed up front (a pure function) and then paced against
one start time, so a slow event loop delays requests without shifting every
later one.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times in seconds from the start, non-decreasing, the first 0.0.

    Deterministic for a seed; uses a private generator. Raises ValueError for a
    rate or burstiness that is not positive.
    """
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, now = [0.0], 0.0
    for _ in range(num_requests - 1):
        now += rng.gammavariate(burstiness, scale)
        offsets.append(now)
    return offsets


async def paced(offsets: Sequence[float], start: float,
                clock: Callable[[], float] = time.perf_counter) -> AsyncIterator[int]:
    """Yield each request's index once `clock()` has reached `start + offsets[index]`."""
    for index, offset in enumerate(offsets):
        delay = start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        yield index
