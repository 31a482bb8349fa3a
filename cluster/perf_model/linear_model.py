"""Step time as a linear function of the batch, fitted to measured steps:

    t = a + b * prefill_tokens + c * prefill_attention + d * decode_seqs + e * decode_context

The terms match how the engine spends a step: a fixed cost (launches, the
host's scheduling, sampling), the matmuls (per token: prefill tokens and decode
sequences alike, but a decode row also pays its own sampling and bookkeeping,
hence separate b and d), and attention (quadratic in a prompt, linear in a
decode's context). DistServe fits the prefill and decode halves separately;
one model covers our mixed steps (chunked prefill next to decodes).

The fit minimises relative error (every point counts alike, a 2 ms decode
step as much as a 2 s prefill) with non-negative coefficients.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.perf_model.step_shape import StepShape

COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_prefill_attention_s", "per_decode_seq_s",
                "per_decode_context_s")


@dataclass(frozen=True)
class FitError:
    mean_abs_rel: float      # mean |predicted - measured| / measured over the points
    max_abs_rel: float
    num_points: int


@dataclass(frozen=True)
class LinearStepModel:
    coefficients: tuple[float, ...]              # in COEFFICIENTS order, seconds per unit
    error: FitError | None = None
    meta: dict[str, Any] = field(default_factory=dict)   # model, device, dtype, tp, ...

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        return float(np.dot(self.coefficients, shape.features()))

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], meta: dict[str, Any] | None = None
            ) -> "LinearStepModel":
        """Non-negative least squares on relative error. Terms the points do not
        exercise (e.g. no decode steps) get 0."""
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError(f"need as many measured times as shapes, at least one; got {len(shapes)} and "
                             f"{len(seconds)}")
        if any(t <= 0 for t in seconds):
            raise ValueError("measured step times must be > 0")
        x = np.array([s.features() for s in shapes], dtype=np.float64)
        y = np.array(seconds, dtype=np.float64)
        coef = _nnls_relative(x, y)
        rel = np.abs(x @ coef - y) / y
        return cls(tuple(float(c) for c in coef), FitError(float(rel.mean()), float(rel.max()), len(y)),
                   dict(meta or {}))

    def to_json(self) -> dict[str, Any]:
        return {"kind": "linear", "coefficients": dict(zip(COEFFICIENTS, self.coefficients)),
                "fit_error": None if self.error is None else vars(self.error), "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LinearStepModel":
        coefficients = data["coefficients"]
        missing = [c for c in COEFFICIENTS if c not in coefficients]
        if missing:
            raise ValueError(f"profile is missing coefficients {missing}")
        values = tuple(float(coefficients[c]) for c in COEFFICIENTS)
        bad = [c for c, v in zip(COEFFICIENTS, values) if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"profile coefficients {bad} must be finite and >= 0 (a step never takes "
                             "negative time)")
        error = data.get("fit_error")
        return cls(values, None if error is None else FitError(**error), dict(data.get("meta") or {}))


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_c>=0 || (x c - y) / y ||: least squares with the negative
    coefficients dropped one by one (an active-set method; five unknowns)."""
    xs, ys = x / y[:, None], np.ones_like(y)
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while True:
        coef = np.zeros(x.shape[1])
        if not active:
            return coef
        solution, *_ = np.linalg.lstsq(xs[:, active], ys, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            return coef
        del active[int(np.argmin(solution))]
