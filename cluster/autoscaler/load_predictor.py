"""The request rate expected over the next start-up horizon, from the rates
measured in past intervals.

- constant: the last interval's rate;
- ewma: an exponentially weighted mean (alpha per interval);
- trend: Holt's linear smoothing with a damped trend (Gardner and McKenzie,
  1985): level + slope x (phi + phi^2 + ... + phi^h) over a horizon of h
  intervals, never below zero. Damped, a slope counts at most phi / (1 - phi)
  intervals (4 at phi 0.8) however long the horizon: undamped, a start-up of
  12 intervals multiplied one interval's Poisson noise twelvefold into the
  prediction, and a steady load flapped.
"""

from __future__ import annotations

from dataclasses import dataclass

PREDICTORS = ("constant", "ewma", "trend")


@dataclass
class LoadPredictor:
    kind: str = "ewma"
    alpha: float = 0.5            # weight of the newest interval (level)
    beta: float = 0.3             # weight of the newest slope (trend only)
    phi: float = 0.8              # damping of the slope per interval (trend only)
    level: float | None = None
    slope: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {self.kind!r}")
        if not 0 < self.alpha <= 1 or not 0 <= self.beta <= 1 or not 0 < self.phi < 1:
            raise ValueError(f"alpha must be in (0, 1], beta in [0, 1] and phi in (0, 1), got {self.alpha}, "
                             f"{self.beta}, {self.phi}")

    def observe(self, rate: float) -> None:
        """One interval's measured rate (requests/s)."""
        if self.level is None or self.kind == "constant":
            self.level = rate
            return
        if self.kind == "ewma":
            self.level += self.alpha * (rate - self.level)
            return
        previous = self.level
        self.level = self.alpha * rate + (1 - self.alpha) * (self.level + self.phi * self.slope)
        self.slope = self.beta * (self.level - previous) + (1 - self.beta) * self.phi * self.slope

    def predict(self, intervals_ahead: float) -> float:
        """The rate expected `intervals_ahead` intervals from now (0 before any data)."""
        if self.level is None:
            return 0.0
        if self.kind == "trend":
            damped_intervals = self.phi * (1 - self.phi ** intervals_ahead) / (1 - self.phi)
            return max(0.0, self.level + self.slope * damped_intervals)
        return self.level
