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

On a GPU a step with prompt tokens runs eagerly, and the host's launches bound
it however little it computes (an 8B model on an H200, that profile's host: ~30
ms for any prompt under ~1,000 tokens, where decode-only steps replayed from
CUDA graphs took 5-12 ms). No linear term has that shape, so the fit also tries a floor under
such steps, t = max(linear, eager_floor_s), and keeps it when it lowers the
mean error by at least FLOOR_MIN_GAIN. On a CPU, where every step runs eagerly and
launches cost next to nothing, it is not tried (on a busy machine the noise alone
could pass for one).
"""

from __future__ import annotations

import itertools
import math

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.perf_model.step_shape import StepShape

COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_prefill_attention_s", "per_decode_seq_s",
                "per_decode_context_s")
FLOOR_MIN_GAIN = 0.01        # mean relative error a floor must remove to be kept
FLOOR_CANDIDATES = 32        # floors tried: quantiles of the prompt-carrying steps' times
# prompt-carrying steps a floor must leave above it (1.2x) to fit the prompt tokens' cost on: with none,
# the linear part is fitted to decode-only steps, prices prompt tokens at 0, and every prompt at the floor
FLOOR_MIN_PROMPT_STEPS = 3


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
    eager_floor_s: float = 0.0                   # the least a step with prompt tokens takes

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        linear = float(np.dot(self.coefficients, shape.features()))
        return max(linear, self.eager_floor_s) if shape.prefill_tokens else linear

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], meta: dict[str, Any] | None = None,
            eager_floor: bool = True) -> "LinearStepModel":
        """Non-negative least squares on relative error. Terms the points do not
        exercise (e.g. no decode steps) get 0. `eager_floor`: also try a floor under
        steps with prompt tokens (GPU profiles)."""
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError(f"need as many measured times as shapes, at least one; got {len(shapes)} and "
                             f"{len(seconds)}")
        if any(t <= 0 for t in seconds):
            raise ValueError("measured step times must be > 0")
        x = np.array([s.features() for s in shapes], dtype=np.float64)
        y = np.array(seconds, dtype=np.float64)
        prompted = np.array([s.prefill_tokens > 0 for s in shapes])
        coef, floor, rel = _fit_with_floor(x, y, prompted if eager_floor else np.zeros_like(prompted))
        return cls(tuple(float(c) for c in coef), FitError(float(rel.mean()), float(rel.max()), len(y)),
                   dict(meta or {}), floor)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "linear", "coefficients": dict(zip(COEFFICIENTS, self.coefficients)),
                "eager_floor_s": self.eager_floor_s,
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
        floor = float(data.get("eager_floor_s", 0.0))
        if not (math.isfinite(floor) and floor >= 0):
            raise ValueError(f"profile eager_floor_s must be finite and >= 0, got {data.get('eager_floor_s')!r}")
        error = data.get("fit_error")
        return cls(values, None if error is None else FitError(**error), dict(data.get("meta") or {}), floor)


def _fit_with_floor(x: np.ndarray, y: np.ndarray, prompted: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """(coefficients, eager floor, relative error per point). For each candidate
    floor F the linear part is fitted to the points F cannot explain (decode-only
    steps, and prompt-carrying steps measured above 1.2 F, at least
    FLOOR_MIN_PROMPT_STEPS of them); the floor whose max(linear, F) has the least
    mean error wins, and 0 unless it gains FLOOR_MIN_GAIN over no floor."""
    def errors(coef: np.ndarray, floor: float) -> np.ndarray:
        predicted = x @ coef
        predicted = np.where(prompted, np.maximum(predicted, floor), predicted)
        return np.abs(predicted - y) / y

    plain = _nnls_relative(x, y)
    no_floor = (plain, 0.0, errors(plain, 0.0))
    best = no_floor
    if prompted.any():
        candidates = np.unique(np.quantile(y[prompted], np.linspace(0.0, 1.0, FLOOR_CANDIDATES)))
        for floor in candidates:
            above = ~prompted | (y > 1.2 * floor)
            if above.sum() < x.shape[1] or (prompted & above).sum() < FLOOR_MIN_PROMPT_STEPS:
                continue
            coef = _nnls_relative(x[above], y[above])
            rel = errors(coef, float(floor))
            if rel.mean() < best[2].mean():
                best = (coef, float(floor), rel)
    return best if no_floor[2].mean() - best[2].mean() >= FLOOR_MIN_GAIN else no_floor


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_c>=0 || (x c - y) / y ||. The optimum's non-zero coefficients are
    the unconstrained least-squares solution on their own columns, so with five
    unknowns every subset of the exercised columns is solved and the best
    non-negative solution taken (32 small solves: exact, where dropping the most
    negative coefficient one at a time can drop one the optimum keeps)."""
    xs, ys = x / y[:, None], np.ones_like(y)
    exercised = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    best, best_residual = np.zeros(x.shape[1]), float(ys @ ys)
    for size in range(1, len(exercised) + 1):
        for columns in itertools.combinations(exercised, size):
            solution, *_ = np.linalg.lstsq(xs[:, columns], ys, rcond=None)
            if (solution < 0).any():
                continue
            residual = xs[:, columns] @ solution - ys
            if residual @ residual < best_residual - 1e-15:
                best = np.zeros(x.shape[1])
                best[list(columns)] = solution
                best_residual = float(residual @ residual)
    return best
