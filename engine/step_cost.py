"""What one engine step costs, fitted on the engine's own recent steps:

    step_s ~= fixed_s + per_seq_s * decode_seqs + per_prefill_token_s * prefill_tokens

A loaded engine that prefills and decodes in the same steps (colocated, or a
decode worker that prefills short prompts) rarely runs a decode-only step, so
the decodes' share of a step can only come from separating the two terms. The
fit is least squares over the last WINDOW steps, redone every REFIT_EVERY
steps, with a term dropped when its coefficient comes out negative. It needs
steps with different batch sizes; until it has them every figure is None.

PrefillTokenCost is the simpler figure admission control and conditional
disaggregation price a prompt with: the recent prefill steps' seconds per
prompt token, whatever rode along. Until an engine has measured any, the
figure is `calibrate_prefill_cost`'s: throwaway prompts timed at start-up.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

WINDOW = 256
REFIT_EVERY = 32
MIN_STEPS = 32


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_s: float
    per_seq_s: float
    per_prefill_token_s: float
    prefill_s_per_step: float       # per_prefill_token_s x the window's mean prompt tokens a step: what steps carry now

    def step_s(self, seqs: float, prefill_tokens: float, *, carried: bool = False) -> float:
        """A step with `seqs` sequences and `prefill_tokens` prompt tokens (`carried`:
        plus the prefill work the steps carried lately)."""
        return self.fixed_s + (self.prefill_s_per_step if carried else 0.0) + \
            seqs * self.per_seq_s + prefill_tokens * self.per_prefill_token_s

    @classmethod
    def from_stats(cls, stats: Mapping[str, float]) -> "StepCost | None":
        """The figures EngineCosts.stats reported (None without a time per sequence).
        An engine with no fit yet reports only its time per sequence, which then
        holds its whole step."""
        if "decode_s_per_seq" not in stats:
            return None
        return cls(fixed_s=stats.get("decode_step_fixed_s", 0.0), per_seq_s=stats["decode_s_per_seq"],
                   per_prefill_token_s=stats.get("decode_s_per_prefill_token", 0.0),
                   prefill_s_per_step=stats.get("prefill_s_per_step", 0.0))


class StepCostFit:
    def __init__(self) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)   # (decode seqs, prefill tokens, s)
        self._since_fit = 0
        self.cost: StepCost | None = None

    def add(self, num_decode_seqs: int, num_prefill_tokens: int, duration_s: float) -> None:
        if num_decode_seqs == 0 and num_prefill_tokens == 0:
            return
        self._steps.append((num_decode_seqs, num_prefill_tokens, duration_s))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY and len(self._steps) >= MIN_STEPS:
            self._since_fit = 0
            self.cost = self._fit() or self.cost

    def _fit(self) -> StepCost | None:
        data = np.array(self._steps, dtype=np.float64)        # [steps, 3]
        seqs, tokens, seconds = data[:, 0], data[:, 1], data[:, 2]
        if np.ptp(seqs) == 0:          # one batch size only: the per-sequence term is not identifiable
            return None
        columns = {"fixed": np.ones_like(seqs), "seq": seqs}
        if tokens.any():
            columns["token"] = tokens
        while True:
            x = np.stack(list(columns.values()), axis=1)
            if np.linalg.matrix_rank(x) < x.shape[1]:
                # the shapes cannot tell the terms apart (prompt-only steps beside decode-only
                # steps of one batch size): a least-squares split of them would be arbitrary
                return None
            coef, *_ = np.linalg.lstsq(x, seconds, rcond=None)
            fitted = dict(zip(columns, coef))
            negative = [name for name, c in fitted.items() if c < 0 and name != "seq"]
            if not negative:
                break
            del columns[negative[0]]
        if fitted.get("seq", 0.0) <= 0:
            return None
        per_token = float(fitted.get("token", 0.0))
        return StepCost(fixed_s=float(fitted.get("fixed", 0.0)), per_seq_s=float(fitted["seq"]),
                        per_prefill_token_s=per_token, prefill_s_per_step=per_token * float(tokens.mean()))


PREFILL_WINDOW = 16


class PrefillTokenCost:
    """Seconds per prompt token of the steps that carried prefill, over the last
    PREFILL_WINDOW of them: their total time over their total prompt tokens, the
    decodes riding along included (they lengthen a prompt's step, hence its
    time to first token). A ratio of sums, not a mean of ratios: a step that
    carries a few prompt tokens beside many decodes (a prompt's last chunk, a
    short prompt) counts for its few tokens instead of setting the cost of
    every token to its own."""

    def __init__(self, window: int = PREFILL_WINDOW) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)   # (prefill tokens, seconds)

    def add(self, num_prefill_tokens: int, duration_s: float) -> None:
        if num_prefill_tokens > 0:
            self._steps.append((num_prefill_tokens, duration_s))

    @property
    def s_per_token(self) -> float | None:
        if not self._steps:
            return None
        return sum(s for _, s in self._steps) / sum(n for n, _ in self._steps)


# a new engine's first steps are slow (cold caches and allocator, first kernels, a replica
# that starts beside busy ones): they stay out of its cost estimates, as out of the
# autoscaler's fit, so a replica joining a pool does not make admission control refuse
COST_WARMUP_STEPS = 20
DECODE_COST_EWMA = 0.2    # weight of the newest decode-only step in the per-sequence decode cost


class EngineCosts:
    """Every cost figure one engine reports to the router (admission control,
    conditional disaggregation), from the steps it runs: the live engine's
    thread feeds it (engine/async_engine.py) and so does each simulated
    replica (cluster/simulator/), so both price requests the same way.

    A step counts once the engine is past its first `warmup_steps`, and only
    when it ran on the engine's own cores (a step on borrowed idle cores is
    faster than what the engine can count on while its neighbours are busy,
    engine/core_lending.py). Until a prefill step is measured, the prefill
    cost is `start_prefill_s_per_token` (calibrate_prefill_cost's)."""

    def __init__(self, *, warmup_steps: int = COST_WARMUP_STEPS, start_prefill_s_per_token: float | None = None):
        self.warmup_steps = warmup_steps
        self.num_steps = 0
        self.prefill_s_per_token = start_prefill_s_per_token
        self.decode_s_per_seq: float | None = None      # decode-only steps' time per sequence, one more (EWMA)
        self.step_cost = StepCostFit()                   # decode and prefill shares of mixed steps too
        self._prefill = PrefillTokenCost()

    def observe(self, num_decode_seqs: int, num_prefill_tokens: int, duration_s: float, *,
                borrowed_cores: bool = False) -> None:
        """One step the engine ran."""
        self.num_steps += 1
        if self.num_steps <= self.warmup_steps or borrowed_cores:
            return
        self.step_cost.add(num_decode_seqs, num_prefill_tokens, duration_s)
        if num_prefill_tokens == 0:
            if num_decode_seqs:
                # shared by one more sequence than the step ran: until the fit splits the fixed
                # cost from the per-sequence one, a batch one larger than any run yet is priced
                # at the step seen, so it gets run (at `duration / seqs` the router would refuse
                # it while the fixed cost is past the TPOT budget's share, and the fit would
                # never see a second batch size)
                cost = duration_s / (num_decode_seqs + 1)
                old = self.decode_s_per_seq
                self.decode_s_per_seq = cost if old is None else \
                    (1 - DECODE_COST_EWMA) * old + DECODE_COST_EWMA * cost
            return
        self._prefill.add(num_prefill_tokens, duration_s)
        self.prefill_s_per_token = self._prefill.s_per_token

    def stats(self) -> dict[str, float]:
        """The figures measured so far, by the names the router reads."""
        stats = {}
        if self.prefill_s_per_token is not None:
            stats["prefill_s_per_token"] = self.prefill_s_per_token
        cost = self.step_cost.cost
        if cost is not None:
            stats.update(decode_s_per_seq=cost.per_seq_s, decode_step_fixed_s=cost.fixed_s,
                         decode_s_per_prefill_token=cost.per_prefill_token_s,
                         prefill_s_per_step=cost.prefill_s_per_step)
        elif self.decode_s_per_seq is not None:
            stats["decode_s_per_seq"] = self.decode_s_per_seq
        return stats


# the start-up prompt: long enough that a step's fixed cost does not dominate its time
CALIBRATION_TOKENS = 256
# the first pass warms caches, allocator and kernels; the figure is the fastest of the rest
CALIBRATION_PASSES = 3


def calibrate_prefill_cost(engine: "LLMEngine", *, tokens: int = CALIBRATION_TOKENS,
                           passes: int = CALIBRATION_PASSES) -> float | None:
    """Seconds per prompt token of one prompt prefilled alone, timed on
    throwaway prompts (random token ids, a new one each pass, so none hits the
    prefix cache) on an idle engine; None where the engine is not idle or the
    context is too short to tell. The engine is idle again afterwards.

    A new server needs this figure before it has served anything: without it
    the router sees no backlog in a burst of prompts (conditional
    disaggregation sends them all to the prefill pool, admission control
    admits them all). Measured steps replace it once the engine has run them."""
    length = min(tokens, engine.scheduler.max_num_batched_tokens, engine.max_model_len - 1)
    if engine.has_unfinished_requests() or length < 16 or passes < 2:
        return None
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for index in range(passes):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        engine.add_request(f"prefill-cost-calibration-{index}", prompt, params)
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if index > 0:
            best = min(best, time.perf_counter() - started)
    engine.last_step = None   # not a step anyone asked for
    return best / length
