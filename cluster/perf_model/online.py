"""A step model kept honest by a live worker's measurements.

Each measured step (its shape and wall time) updates an exponentially
weighted ratio measured / predicted; predictions are the base model's times
that ratio, plus a fixed per-step overhead when one is known (the serving
path's cost around each engine step: handing outputs to the router, the
event loop). A model profiled on an idle machine thus follows a worker that
shares its cores, runs hotter, or runs a different build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.perf_model.step_shape import StepShape, StepTimeModel


# how far one measured step may stand from the running factor (measured / predicted) when it moves it
MAX_STEP_RATIO = 4.0


@dataclass
class OnlineCorrection:
    base: StepTimeModel
    weight: float = 0.05              # of each new measurement in the running ratio
    factor: float = 1.0               # measured / predicted, smoothed
    overhead_s: float = 0.0           # added to every step, after the factor
    num_observed: int = field(default=0)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step. Steps the base model predicts no time for are ignored."""
        predicted = self.base.step_time(shape)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        if self.num_observed:
            # one step far off the rest (a GC pause, a kernel's first use, a stalled rank) moves the
            # factor as one MAX_STEP_RATIO x off would, not by itself (a 500 ms stall on a 10 ms
            # prediction took a factor of 1 to 3.5 at weight 0.05)
            ratio = min(max(ratio, self.factor / MAX_STEP_RATIO), self.factor * MAX_STEP_RATIO)
        # the first measurements move the factor at once rather than from 1.0
        w = max(self.weight, 1.0 / (self.num_observed + 1))
        self.factor += w * (ratio - self.factor)
        self.num_observed += 1

    def step_time(self, shape: StepShape) -> float:
        base = self.base.step_time(shape)
        return self.factor * base + self.overhead_s if base > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        data = dict(self.base.to_json())
        data["online_factor"] = self.factor
        data["online_overhead_s"] = self.overhead_s
        return data
