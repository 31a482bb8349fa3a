"""The goodput autoscaling policy on synthetic inputs (no Ray, no engine)."""

from __future__ import annotations

import math
import random

import pytest

from cluster.autoscaler.capacity import (
    ReplicaLimits,
    colocated_capacity,
    decode_batch,
    decode_capacity,
    prefill_capacity,
)
from cluster.autoscaler.load_predictor import LoadPredictor
from cluster.autoscaler.policy import (
    AutoscaleSettings,
    GoodputPolicy,
    Observation,
    RoleObservation,
    StepSample,
)
from cluster.perf_model.linear_model import LinearStepModel
from cluster.perf_model.step_shape import StepShape

# 5 ms a step, 0.1 ms a prompt token, 1 ms a decoding sequence, 1 us per key a decode reads
MODEL = LinearStepModel((5e-3, 1e-4, 0.0, 1e-3, 1e-6))
SLOS = dict(ttft_slo_s=1.0, tpot_slo_s=0.05)


def settings(**kw) -> AutoscaleSettings:
    base = dict(SLOS, budget=8, interval_s=10.0, startup_s=10.0, downscale_cooldown_s=30.0)
    return AutoscaleSettings(**{**base, **kw})


def policy(**kw) -> GoodputPolicy:
    s = settings(**kw)
    return GoodputPolicy(s, {r: MODEL for r in s.roles})


def observe(now: float, rate: float, prompt: float, output: float, current: dict[str, int], *,
            starting: dict[str, int] | None = None, window: float = 10.0, **kw) -> Observation:
    starting = starting or {}
    kw.setdefault("ttft_p90_s", 0.1)          # requests finished, well within the SLOs
    kw.setdefault("tpot_p90_s", 0.01)
    roles = {r: RoleObservation(running=n, starting=starting.get(r, 0)) for r, n in current.items()}
    return Observation(now=now, window_s=window, arrivals=round(rate * window), mean_prompt_tokens=prompt,
                       mean_output_tokens=output, roles=roles, **kw)


def run_steady(p: GoodputPolicy, intervals: int, rate_of, prompt: float, output: float,
               start: dict[str, int]) -> tuple[dict[str, int], list[dict[str, int]]]:
    """Applies every decision at once (replicas start instantly); returns the
    final targets and the history."""
    current = dict(start)
    history = []
    for i in range(intervals):
        d = p.decide(observe(10.0 * (i + 1), rate_of(i), prompt, output, current))
        current = dict(d.targets)
        history.append(current)
    return current, history


# ---- capacity -------------------------------------------------------------------------------
def _md1_ttft_p90(rate: float, service_s: float, n: int = 40000) -> float:
    """The 90th percentile of time in system of an M/D/1 queue (a Lindley recursion)."""
    rng = random.Random(0)
    t = free = 0.0
    ttfts = []
    for _ in range(n):
        t += rng.expovariate(rate)
        free = max(t, free) + service_s
        ttfts.append(free - t)
    return sorted(ttfts)[int(0.9 * n)]


def test_prefill_capacity_holds_the_90th_percentile_ttft_of_the_md1_queue():
    s = MODEL.step_time(StepShape.build([(0, 1000)]))        # 0.105 s
    cap = prefill_capacity(MODEL, 1000, 0.5)
    # the mean TTFT at that rate is far inside the SLO: the tail sets the capacity
    rho = cap * s
    assert rho * s / (2 * (1 - rho)) + s < 0.35
    # a queue run at the capacity keeps its 90th percentile at the SLO; 20% more load breaks it
    assert _md1_ttft_p90(cap, s) == pytest.approx(0.5, rel=0.08)
    assert _md1_ttft_p90(1.2 * cap, s) > 0.56
    assert prefill_capacity(MODEL, 1000, 0.5, percentile=0.5) > 1.2 * cap   # a median is held at more load
    assert prefill_capacity(MODEL, 6000, 0.5) == 0.0          # a lone prompt (0.605 s) misses it


def test_decode_batch_is_the_largest_within_tpot_and_limits():
    # t(B) = 5 ms + B * (1 ms + 300 us): B <= 34 for 50 ms
    assert decode_batch(MODEL, 300, 0.05, ReplicaLimits()) == 34
    assert decode_batch(MODEL, 300, 0.05, ReplicaLimits(max_num_seqs=10)) == 10
    assert decode_batch(MODEL, 300, 0.05, ReplicaLimits(num_kv_blocks=100, block_size=16)) == 5   # 19 blocks each
    assert decode_batch(MODEL, 300, 0.004, ReplicaLimits()) == 0


def test_decode_and_colocated_capacity():
    b = 34
    step = 5e-3 + b * (1e-3 + 300e-6)
    assert decode_capacity(MODEL, 200, 200, 0.05) == pytest.approx(b / (200 * step))
    p, d = prefill_capacity(MODEL, 200, 1.0), decode_capacity(MODEL, 200, 200, 0.05)
    assert colocated_capacity(MODEL, 200, 200, 1.0, 0.05) == pytest.approx(1 / (1 / p + 1 / d))
    # unequal lengths: prompt and output are not interchangeable
    p, d = prefill_capacity(MODEL, 300, 1.0), decode_capacity(MODEL, 300, 100, 0.04)
    assert colocated_capacity(MODEL, 300, 100, 1.0, 0.04) == pytest.approx(1 / (1 / p + 1 / d))


def test_load_predictors():
    c, e, t = LoadPredictor("constant"), LoadPredictor("ewma", alpha=0.5), LoadPredictor("trend", 0.5, 0.5)
    for rate in (1.0, 2.0, 3.0, 4.0):
        for p in (c, e, t):
            p.observe(rate)
    assert c.predict(3) == 4.0
    assert e.predict(3) == pytest.approx(3.125)               # 1 -> 1.5 -> 2.25 -> 3.125
    # damped Holt, alpha = beta = 0.5, phi = 0.8: level 1 -> 1.5 -> 2.35 -> 3.385, slope 0 -> 0.25 -> 0.525
    # -> 0.7275 (each slope the newest level step and 0.8 of the slope before, half and half)
    assert t.predict(0) == pytest.approx(3.385)
    assert t.predict(3) == pytest.approx(3.385 + (0.8 + 0.64 + 0.512) * 0.7275)   # a rising load is extrapolated
    # ... over at most phi / (1 - phi) = 4 intervals of its slope, however far ahead
    assert t.predict(1000) == pytest.approx(3.385 + 4 * 0.7275)
    falling = LoadPredictor("trend", 0.5, 0.5)
    for rate in (4.0, 3.0, 2.0, 1.0):
        falling.observe(rate)
    assert falling.predict(0) > 0 and falling.predict(20) == 0.0    # never below zero
    with pytest.raises(ValueError, match="predictor must be one of"):
        LoadPredictor("magic")


# ---- policy ---------------------------------------------------------------------------------
def test_more_prompt_tokens_means_more_prefill():
    short, _ = run_steady(policy(), 6, lambda i: 4.0, 200, 200, {"prefill": 1, "decode": 1})
    long, _ = run_steady(policy(), 6, lambda i: 4.0, 2500, 200, {"prefill": 1, "decode": 1})
    assert long["prefill"] > short["prefill"]
    # 4 req/s of 0.255 s prompts is more than one replica's work
    assert long["prefill"] == math.ceil(4.0 / prefill_capacity(MODEL, 2500, 1.0)) == 2
    assert short["prefill"] == 1


def test_longer_outputs_mean_more_decode():
    short, _ = run_steady(policy(), 6, lambda i: 2.0, 200, 50, {"prefill": 1, "decode": 1})
    long, _ = run_steady(policy(), 6, lambda i: 2.0, 200, 800, {"prefill": 1, "decode": 1})
    assert long["decode"] > short["decode"]
    assert long["prefill"] == short["prefill"]


def test_budget_and_bounds_are_never_exceeded():
    rng = random.Random(0)
    p = policy(budget=6, max_replicas={"prefill": 3}, min_replicas={"decode": 2}, downscale_cooldown_s=0.0)
    current = {"prefill": 1, "decode": 2}
    for i in range(200):
        obs = observe(10.0 * i, rng.uniform(0, 30), rng.uniform(10, 4000), rng.uniform(1, 1000), current,
                      ttft_p90_s=rng.choice([None, 0.2, 3.0]), tpot_p90_s=rng.choice([None, 0.01, 0.2]))
        d = p.decide(obs)
        assert d.targets["prefill"] + d.targets["decode"] <= 6, d.describe()
        assert 1 <= d.targets["prefill"] <= 3 and d.targets["decode"] >= 2, d.describe()
        current = d.targets
    # loads that press each bound (unbounded, the same policy goes to 5 + 1, then 1 + 1): prefill at its
    # max_replicas, decode at its min_replicas (the budget's sixth rank would serve no more)
    for rate, settled in ((30.0, {"prefill": 3, "decode": 2}), (0.2, {"prefill": 1, "decode": 2})):
        for i in range(30):     # prompt-heavy (4,000-token prompts, 1 output token), then nearly idle
            current = p.decide(observe(2000.0 + 10.0 * i + (300.0 if rate < 1 else 0.0), rate, 4000, 1,
                                       current)).targets
        assert current == settled


def test_over_budget_the_split_follows_the_bottleneck():
    # 20 req/s of long prompts and short outputs cannot fit 8 ranks: prefill gets most of them
    final, _ = run_steady(policy(budget=8), 8, lambda i: 20.0, 3000, 20, {"prefill": 1, "decode": 1})
    assert final["prefill"] + final["decode"] == 8
    assert final["prefill"] >= 6


def test_past_the_budget_more_demand_fills_it_rather_than_holding():
    # demand past the budget held a replica short of it ("no split serves 20% more"), where a
    # demand just under the budget filled it: a split that only adds replicas needs no margin
    p = policy(mode="colocated")
    p.prompt_tokens, p.output_tokens = 1000, 200
    each = p._capacities()["colocated"]
    for replicas_worth in (7.9, 8.5, 10.0):
        final, _ = run_steady(policy(mode="colocated"), 9, lambda i: replicas_worth * each, 1000, 200,
                              {"colocated": 7})
        assert final == {"colocated": 8}, replicas_worth
    final, _ = run_steady(policy(), 9, lambda i: 16.0, 1000, 200, {"prefill": 2, "decode": 5})
    assert final == {"prefill": 2, "decode": 6}


def test_a_role_at_its_max_replicas_binds_no_budget_and_takes_no_rank():
    # decode needs 6 but may have 2: prefill still scales to what it needs (held at 1 before, as if
    # the budget were in use), and no role gives up a rank for decode, which cannot take it
    final, _ = run_steady(policy(max_replicas={"decode": 2}), 12, lambda i: 8.9, 2250, 150,
                          {"prefill": 1, "decode": 2})
    assert final == {"prefill": 3, "decode": 2}
    final, _ = run_steady(policy(budget=4, max_replicas={"decode": 2}), 15, lambda i: 7.5, 1000, 120,
                          {"prefill": 2, "decode": 2})
    assert final == {"prefill": 2, "decode": 2}       # before: 1 + 2, prefill at 90%, a rank idle
    # uncapped, the same load is a re-split to the role short of replicas
    final, _ = run_steady(policy(budget=4), 15, lambda i: 7.5, 1000, 120, {"prefill": 2, "decode": 2})
    assert final == {"prefill": 1, "decode": 3}


def test_no_rank_is_given_up_for_a_role_in_its_scale_up_cool_down():
    p = policy(budget=4, upscale_cooldown_s=300)
    current = {"prefill": 2, "decode": 1}
    for i in range(1, 16):      # decode scales up to 2 at once, then its outputs lengthen
        d = p.decide(observe(10.0 * i, 7.5 if i >= 5 else 3.0, 1000, 90 if i < 5 else 120, current))
        current = dict(d.targets)
    assert current == {"prefill": 2, "decode": 2}
    assert "scale-up cool-down" in d.reasons["decode"]


def test_noisy_steady_load_does_not_flap():
    rng = random.Random(1)
    p = policy(downscale_cooldown_s=0.0)
    _, history = run_steady(p, 40, lambda i: rng.gauss(6.0, 0.6), 1200, 150, {"prefill": 1, "decode": 1})
    settled = history[3:]                                      # after the ramp from 1 + 1
    changes = sum(a != b for a, b in zip(settled, settled[1:]))
    assert changes <= 1, history
    # and it did scale: 6 req/s of 1,200-token prompts needs more than the 1 + 1 it started with
    assert settled[-1]["prefill"] > 1 and settled[-1]["decode"] > 1, history


def test_scale_down_is_one_at_a_time_after_the_cooldown():
    p = policy(downscale_cooldown_s=30.0, downscale_window_s=0.0)
    current = {"prefill": 4, "decode": 4}
    d = p.decide(observe(10.0, 0.1, 200, 50, current))          # nearly idle, but just deployed
    assert d.targets == current and "cool-down" in d.reasons["prefill"]
    d = p.decide(observe(40.0, 0.1, 200, 50, current))
    assert d.targets == {"prefill": 3, "decode": 3}
    current = d.targets
    d = p.decide(observe(50.0, 0.1, 200, 50, current))
    assert d.targets == current and "cool-down" in d.reasons["prefill"]
    d = p.decide(observe(70.0, 0.1, 200, 50, current))
    assert d.targets == {"prefill": 2, "decode": 2}


def test_scale_down_keeps_replicas_the_load_still_needs():
    # Dynamo's N-1 rule: 2 -> 1 prefill replica only when one replica holds the load at 80% of capacity
    cap = prefill_capacity(MODEL, 1000, 1.0)
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=0.0)
    d = p.decide(observe(10.0, 0.9 * cap, 1000, 10, {"prefill": 2, "decode": 1}))
    assert d.targets["prefill"] == 2 and "would not hold" in d.reasons["prefill"]
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=0.0)
    d = p.decide(observe(10.0, 0.7 * cap, 1000, 10, {"prefill": 2, "decode": 1}))
    assert d.targets["prefill"] == 1


def test_a_lull_shorter_than_the_downscale_window_keeps_the_replicas_the_load_before_it_needed():
    # 0.9x one prefill replica's capacity needs 2 (N-1 rule); then a lull at 0.1x
    cap = prefill_capacity(MODEL, 1000, 1.0)
    current = {"prefill": 2, "decode": 1}
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=60.0)
    # busy until 80 s, past the 70 s at which the deployed pool's own place in the window lapses
    for now in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0):
        assert p.decide(observe(now, 0.9 * cap, 1000, 10, current)).targets == current
    for now in (90.0, 100.0, 110.0, 120.0, 130.0, 140.0):    # the busy interval is within the last 60 s
        d = p.decide(observe(now, 0.1 * cap, 1000, 10, current))
        assert d.targets["prefill"] == 2, now
        assert "would not hold the load within the last 60 s" in d.reasons["prefill"]
    d = p.decide(observe(150.0, 0.1 * cap, 1000, 10, current))  # 70 s after it: the window has let it go
    assert d.targets["prefill"] == 1
    # without a window the lull gives the replica back at once
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=0.0)
    p.decide(observe(10.0, 0.9 * cap, 1000, 10, current))
    assert p.decide(observe(20.0, 0.1 * cap, 1000, 10, current)).targets["prefill"] == 1


def test_the_pools_as_deployed_are_held_for_the_first_downscale_window():
    # the first intervals' rates are a few arrivals each: a quiet start gives nothing back
    # until the window has seen enough of the load, as the deployment's own size counts in it
    cap = prefill_capacity(MODEL, 1000, 1.0)
    current = {"prefill": 2, "decode": 1}
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=60.0)
    for now in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0):
        d = p.decide(observe(now, 0.1 * cap, 1000, 10, current))
        assert d.targets["prefill"] == 2, now
    assert "would not hold the load within the last 60 s" in d.reasons["prefill"]
    assert p.decide(observe(80.0, 0.1 * cap, 1000, 10, current)).targets["prefill"] == 1


def test_at_the_budget_a_resplit_does_not_wait_for_the_downscale_window():
    # prompt-heavy, then output-heavy at the same rate: the budget moves a rank to decode at once
    p = policy(budget=4, downscale_cooldown_s=0.0, downscale_window_s=600.0, split_margin=0.0)
    current = {"prefill": 3, "decode": 1}
    d = p.decide(observe(10.0, 20.0, 4000, 4, current))
    assert d.targets == current
    d = p.decide(observe(20.0, 20.0, 50, 2000, current, mean_inflight_output_tokens=2000))
    assert d.targets["prefill"] < 3 and d.targets["decode"] > 1, d.reasons


def test_a_replica_added_for_a_missed_slo_is_not_given_back_within_the_downscale_window():
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=60.0)
    current = {"prefill": 1, "decode": 1}
    d = p.decide(observe(10.0, 0.5, 200, 50, current, tpot_p90_s=0.2))     # TPOT p90 4x the SLO
    assert d.targets == {"prefill": 1, "decode": 2} and "observed TPOT" in d.reasons["decode"]
    current = d.targets
    for now in (20.0, 30.0, 40.0, 50.0, 60.0, 70.0):                        # the model alone says 1
        d = p.decide(observe(now, 0.5, 200, 50, current))
        assert d.targets["decode"] == 2, (now, d.reasons)
    assert p.decide(observe(80.0, 0.5, 200, 50, current)).targets["decode"] == 1


def test_a_rank_another_role_needs_is_given_up_without_waiting_for_the_downscale_window():
    # budget 3 exactly fits 1 prefill + 2 decode, so this is not a split past the budget
    cap = prefill_capacity(MODEL, 1000, 1.0)
    p = policy(budget=3, downscale_cooldown_s=0.0, downscale_window_s=600.0, predictor="constant")
    current = {"prefill": 2, "decode": 1}
    d = p.decide(observe(10.0, 1.2 * cap, 1000, 4, current))     # long prompts: 2 prefill replicas
    assert d.targets == current
    # fewer of them, with longer outputs: one prefill replica holds the latest demand (not the
    # window's peak, which a lull alone would keep), and decode needs the rank now
    d = p.decide(observe(20.0, 0.7 * cap, 1000, 100, current, mean_inflight_output_tokens=100))
    assert d.targets == {"prefill": 1, "decode": 2}, d.reasons
    assert d.capacity["prefill"] == pytest.approx(cap)         # one replica's, not the pool's


def test_scale_down_waits_for_finished_requests_with_latency_to_spare():
    p = policy(downscale_cooldown_s=0.0, downscale_window_s=0.0)
    idle = dict(ttft_p90_s=None, tpot_p90_s=None)
    d = p.decide(observe(10.0, 0.1, 200, 50, {"prefill": 2, "decode": 2}, **idle))
    assert d.targets == {"prefill": 2, "decode": 2} and "no request finished" in d.reasons["decode"]
    # TPOT p90 at 90% of its SLO: decode holds; TTFT well within: prefill goes
    d = p.decide(observe(20.0, 0.1, 200, 50, {"prefill": 2, "decode": 2}, ttft_p90_s=0.1, tpot_p90_s=0.045))
    assert d.targets == {"prefill": 1, "decode": 2} and "within 20% of the SLO" in d.reasons["decode"]


def test_running_requests_show_longer_outputs_before_they_finish():
    p = policy()
    p.decide(observe(10.0, 2.0, 200, 50, {"prefill": 1, "decode": 1}))
    obs = observe(20.0, 2.0, 200, 50, {"prefill": 1, "decode": 1})
    obs.mean_inflight_output_tokens = 400.0
    p.decide(obs)
    assert p.output_tokens == 400.0


def test_arrivals_max_tokens_show_longer_outputs_where_requests_run_to_it():
    """Where finished requests run to their max_tokens, a larger max_tokens on the
    arrivals is their output length, and the decode pool grows in the same
    interval; where they stop on their own, max_tokens says nothing."""
    current = {"prefill": 1, "decode": 2}
    rate = 2.5 * decode_capacity(MODEL, 200, 1000, 0.8 * SLOS["tpot_slo_s"])   # at 1k-token outputs: 3 replicas

    def run(by_length: int, max_tokens: float) -> tuple[GoodputPolicy, dict[str, int]]:
        p = policy(downscale_cooldown_s=0.0)
        p.decide(observe(10.0, rate, 200, 128, current, finished=20, finished_by_length=by_length,
                         mean_max_tokens=128))
        d = p.decide(observe(20.0, rate, 200, 128, current, finished=20, finished_by_length=by_length,
                             mean_max_tokens=max_tokens))
        return p, d.targets

    p, targets = run(by_length=20, max_tokens=1000)
    assert p.output_tokens == 1000 and targets["decode"] > current["decode"]
    p, targets = run(by_length=19, max_tokens=1000)          # 95% ran to max_tokens: still the limit
    assert p.output_tokens == 1000
    p, targets = run(by_length=10, max_tokens=1000)          # half stopped on their own
    assert p.output_tokens == 128 and targets["decode"] == current["decode"]
    p, _ = run(by_length=20, max_tokens=64)                  # shorter limits: only finished requests lower it
    assert p.output_tokens == 128
    p = GoodputPolicy(settings(length_finish_share=1.01), {r: MODEL for r in ("prefill", "decode")})
    p.decide(observe(10.0, rate, 200, 128, current, finished=20, finished_by_length=20, mean_max_tokens=1000))
    assert p.output_tokens == 128                            # above 1: never taken
    with pytest.raises(ValueError, match="length_finish_share"):
        settings(length_finish_share=0.0)


def test_a_starting_replica_is_not_counted_twice():
    p = policy()
    rate = 2.5 * prefill_capacity(MODEL, 2000, 1.0)             # needs 3 prefill replicas
    d = p.decide(observe(10.0, rate, 2000, 10, {"prefill": 1, "decode": 1}))
    assert d.targets["prefill"] == 3
    # two of them are still starting: the target stays 3, no more asked for
    d = p.decide(observe(20.0, rate, 2000, 10, {"prefill": 1, "decode": 1}, starting={"prefill": 2}))
    assert d.targets["prefill"] == 3


def test_a_new_replicas_slow_first_steps_do_not_inflate_targets():
    shape = StepShape.build([(0, 2000)])
    slow = [StepSample(shape, 2 * MODEL.step_time(shape), warm=False) for _ in range(30)]
    rate = 1.5 * prefill_capacity(MODEL, 2000, 1.0)             # needs 2

    def target(samples):
        p = policy()
        obs = observe(10.0, rate, 2000, 10, {"prefill": 2, "decode": 1})
        obs.roles["prefill"].steps = samples
        return p.decide(obs).targets["prefill"]

    assert target([]) == 2
    assert target(slow) == 2                                    # warming up: left out
    warm_slow = [StepSample(s.shape, s.seconds, warm=True) for s in slow]
    assert target(warm_slow) > 2                                # the same steps from a warm replica count


def test_observed_latency_over_the_slo_adds_a_replica_of_the_right_role():
    p = policy()
    d = p.decide(observe(10.0, 0.5, 200, 50, {"prefill": 1, "decode": 1}, ttft_p90_s=2.5))
    assert d.targets == {"prefill": 2, "decode": 1} and "TTFT" in d.reasons["prefill"]
    p = policy()
    d = p.decide(observe(10.0, 0.5, 200, 50, {"prefill": 1, "decode": 1}, tpot_p90_s=0.2))
    assert d.targets == {"prefill": 1, "decode": 2} and "TPOT" in d.reasons["decode"]


def test_colocated_mode_scales_one_pool():
    p = policy(mode="colocated", budget=4)
    cap = colocated_capacity(MODEL, 500, 100, 0.8, 0.04)
    d = p.decide(observe(10.0, 2.2 * cap, 500, 100, {"colocated": 1}))
    assert d.targets == {"colocated": 3}


def test_no_traffic_holds_and_the_predictions_are_reported():
    p = policy()
    d = p.decide(Observation(now=10.0, window_s=10.0, arrivals=0,
                             roles={"prefill": RoleObservation(1), "decode": RoleObservation(2)}))
    assert d.targets == {"prefill": 1, "decode": 2} and not d.changed({"prefill": 1, "decode": 2})
    d = p.decide(observe(20.0, 1.0, 500, 100, {"prefill": 1, "decode": 2}))
    s = MODEL.step_time(StepShape.build([(0, 500)]))
    rho = 1.0 * s            # the EWMA predicts 1 req/s: an idle interval before any traffic is no rate of 0
    assert d.predicted_ttft_s == pytest.approx(s + rho * s / (2 * (1 - rho)), rel=1e-6)
    assert 0 < d.predicted_tpot_s < 0.05
    # one sequence in the batch at context prompt + output / 2: 5 ms + 1 ms + 550 x 1 us
    assert d.predicted_tpot_s == pytest.approx(5e-3 + 1e-3 + 550e-6, rel=1e-9)
    # Little's law per decode replica: 4 req/s x 100 tokens x t(B) / 2 replicas gives B = 2
    d = policy().decide(observe(10.0, 4.0, 500, 100, {"prefill": 1, "decode": 2}))
    assert d.targets == {"prefill": 1, "decode": 2}
    assert d.predicted_tpot_s == pytest.approx(5e-3 + 2 * 1.55e-3, rel=1e-9)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="more than the budget"):
        settings(budget=3, min_replicas={"prefill": 2, "decode": 2})
    with pytest.raises(ValueError, match="max_replicas"):
        settings(min_replicas={"decode": 3}, max_replicas={"decode": 2})
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        AutoscaleSettings(ttft_slo_s=0, tpot_slo_s=0.05)
    assert settings().max_for("decode") == 8                  # default max: the budget's ranks / TP


def test_at_the_budget_a_near_equal_split_is_not_worth_a_move():
    # 40 req/s of 1200 -> 400 tokens is more than 8 ranks serve; decode is the narrow pool
    p = policy(budget=8, downscale_cooldown_s=0.0)
    d = p.decide(observe(10.0, 40.0, 1200, 400, {"prefill": 4, "decode": 4}))
    cap = d.capacity
    assert d.targets == {"prefill": 3, "decode": 5} and "best split gives" in d.reasons["prefill"]
    # from 2P+6D the best split (1P+7D) serves 7/6 as much (decode stays the narrow pool),
    # under the 20% margin: hold
    assert 7 * cap["decode"] < cap["prefill"]
    p = policy(budget=8, downscale_cooldown_s=0.0)
    d = p.decide(observe(10.0, 40.0, 1200, 400, {"prefill": 2, "decode": 6}))
    assert d.targets == {"prefill": 2, "decode": 6} and "no split serves 20% more" in d.reasons["prefill"]


def test_refusals_on_a_roles_account_add_a_replica_as_a_missed_slo_does():
    """Admission control keeps the admitted requests' latency within the SLO by
    refusing the rest: the refusals are the misses the latency does not show."""
    def decide(refused):
        p = policy()
        return p.decide(observe(10.0, 0.5, 200, 50, {"prefill": 1, "decode": 1}, refused=refused))
    assert decide({}).targets == {"prefill": 1, "decode": 1}
    assert decide({"prefill": 0}).targets == {"prefill": 1, "decode": 1}
    d = decide({"prefill": 2})                 # 2 of the interval's 5 arrivals: 40% > 10%
    assert d.targets == {"prefill": 2, "decode": 1} and "refused 40%" in d.reasons["prefill"]
    d = decide({"decode": 2})
    assert d.targets == {"prefill": 1, "decode": 2} and "refused 40%" in d.reasons["decode"]
    assert decide({"decode": 0.5}).targets == {"prefill": 1, "decode": 1}    # 10%: within refusal_pressure


def test_at_the_budget_a_near_equal_split_is_taken_for_a_role_seen_short():
    # as above, 2P+6D against the best split 1P+7D (7/6 as much, under the 20% margin): the
    # decode pool refusing a fifth of the arrivals on the TPOT bound tips it
    p = policy(budget=8, downscale_cooldown_s=0.0)
    d = p.decide(observe(10.0, 40.0, 1200, 400, {"prefill": 2, "decode": 6}, refused={"decode": 80}))
    assert d.targets == {"prefill": 1, "decode": 7} and "refused on its account" in d.reasons["decode"]
    # refusals on the prefill pool's account do not move a rank to decode
    p = policy(budget=8, downscale_cooldown_s=0.0)
    d = p.decide(observe(10.0, 40.0, 1200, 400, {"prefill": 2, "decode": 6}, refused={"prefill": 80}))
    assert d.targets == {"prefill": 2, "decode": 6}


def test_the_live_loop_counts_refused_requests_as_arrivals():
    """Admission control's refusals are demand the autoscaler must see: a pool
    that refuses a quarter of its requests would otherwise look big enough."""
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    metrics = ServingMetrics()
    loop = AutoscaleLoop(AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.1, interval_s=5.0), {}, metrics)
    metrics.observe_arrival(100)
    metrics.observe_arrival(None)         # refused before its prompt was tokenized
    metrics.observe_arrival(300)
    obs = loop._observation(now=5.0, window=5.0, roles={}, counts=loop._take_counts())
    assert obs.arrivals == 3
    assert obs.mean_prompt_tokens == 200  # of the two whose length is known
    assert loop._observation(now=10.0, window=5.0, roles={}, counts=loop._take_counts()).arrivals == 0


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_live_loop_counts_refusals_on_the_account_of_the_pool_they_speak_for(mode):
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    metrics = ServingMetrics()
    loop = AutoscaleLoop(AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.1, interval_s=5.0, mode=mode), {}, metrics)
    for reason in ("tpot_slo", "tpot_slo", "ttft_slo", "overload", "queue_requests", "queue_tokens"):
        metrics.observe_rejection(reason)
    obs = loop._observation(now=5.0, window=5.0, roles={}, counts=loop._take_counts())
    assert obs.refused == ({"decode": 2, "prefill": 4} if mode == "disaggregated" else {"colocated": 6})
    assert loop._observation(now=10.0, window=5.0, roles={}, counts=loop._take_counts()).refused == {}


class _FakeRole:
    """A Serve handle whose broadcast reaches `answering` replicas, each with no steps."""

    def __init__(self, answering: int):
        self.answering = answering

    def broadcast(self, method: str):
        replies = [{"steps": []} for _ in range(self.answering)]

        class _Result:
            async def results_async(self, **kwargs):
                return replies
        return _Result()


def _live_loop(answering: dict[str, int], deployed: dict[str, int] | None, kept_replicas=None, **kw):
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    s = settings(min_replicas={"prefill": 1, "decode": 1}, **kw)
    workers = {role: _FakeRole(n) for role, n in answering.items()}
    return AutoscaleLoop(s, workers, ServingMetrics(), profile=MODEL, deployed=deployed,
                         kept_replicas=kept_replicas)


def test_a_restarted_router_starts_from_the_replicas_serve_keeps_not_the_deployed_pools():
    # deployed 2 + 2 within a budget of 8, scaled down to 1 + 1 when the load went; the router
    # restarts: from the deployed pools it counted one of each as starting and published 2 + 2 again
    import asyncio
    kept = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, budget=8,
                      kept_replicas=lambda workers: {"prefill": 1, "decode": 1})
    asyncio.run(kept.tick())
    assert kept.targets == {"prefill": 1, "decode": 1}
    # Serve cannot say (busy, not reachable): the deployed pools stand, as before
    def unreachable(workers):
        raise TimeoutError("the controller did not answer")
    blind = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, budget=8,
                       kept_replicas=unreachable)
    asyncio.run(blind.tick())
    assert blind.targets == {"prefill": 2, "decode": 2}
    # nor when it does not answer in time (a stuck controller must not stop the autoscaler)
    import time

    from router import autoscale_loop
    slow = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, budget=8,
                      kept_replicas=lambda workers: time.sleep(1.0) or {"prefill": 1, "decode": 1})
    saved, autoscale_loop.SERVE_STATUS_TIMEOUT_S = autoscale_loop.SERVE_STATUS_TIMEOUT_S, 0.1
    try:
        asyncio.run(asyncio.wait_for(slow.tick(), 30))
    finally:
        autoscale_loop.SERVE_STATUS_TIMEOUT_S = saved
    assert slow.targets == {"prefill": 2, "decode": 2}


def test_replicas_that_never_start_are_counted_out_after_the_deadline(caplog, monkeypatch):
    # a replica asked for that Serve can never place (a TP gang with no node to hold it) counted as
    # starting for ever: the budget held, every scale-down of its role held back
    import asyncio
    from types import SimpleNamespace

    from router import autoscale_loop
    now = [1000.0]     # the loop's clock, the test's: only its moves count, never the machine's load
    monkeypatch.setattr(autoscale_loop, "time", SimpleNamespace(monotonic=lambda: now[0]))
    loop = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}, budget=8)
    assert loop.start_deadline_s == 600.0
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 1, "decode": 2}      # one decode replica starting: held
    now[0] += 599.0
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 1, "decode": 2}      # within the deadline still
    now[0] += 2.0
    autoscale_loop.log.addHandler(caplog.handler)     # (Serve's logger does not propagate)
    try:
        asyncio.run(loop.tick())
    finally:
        autoscale_loop.log.removeHandler(caplog.handler)
    assert loop.targets == {"prefill": 1, "decode": 1}
    assert "1 decode replica(s) asked for have not started in" in caplog.text
    # one coming up restarts the clock: a long scale-up that makes progress is not stuck
    loop = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 3}, budget=8)
    asyncio.run(loop.tick())
    now[0] += 601.0
    loop.workers["decode"].answering = 2
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 1, "decode": 3}
    now[0] += 601.0                                          # then none for a deadline: counted out
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 1, "decode": 2}


def test_the_live_loop_counts_the_deployed_replicas_still_loading_as_starting():
    # deployed 2 + 2, one of each answering at the first interval (the other still loading its
    # model): they are starting, not gone, and nothing is published below the deployment
    import asyncio
    loop = _live_loop({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2})
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 2, "decode": 2}
    # none answering yet: the targets stay the deployed pools, never under min_replicas
    loop = _live_loop({"prefill": 0, "decode": 0}, {"prefill": 2, "decode": 2})
    asyncio.run(loop.tick())
    assert loop.targets == {"prefill": 2, "decode": 2}


def test_the_live_loop_prices_decode_with_the_workers_kv_blocks_and_max_num_seqs():
    from cluster.autoscaler.capacity import ReplicaLimits
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    loop = AutoscaleLoop(settings(), {}, ServingMetrics(), profile=MODEL, limits=ReplicaLimits(64, block_size=16))
    loop.observe_workers("decode", [{"num_kv_blocks": 900.0}, {"num_kv_blocks": 700.0}])
    assert loop._role_limits() == {"decode": ReplicaLimits(64, 700, 16)}   # the smallest replica's
    policy = loop._make_policy()
    assert policy.limits["decode"] == ReplicaLimits(64, 700, 16)
    assert policy.limits["prefill"] == ReplicaLimits()     # no stats from prefill yet: unbounded


def test_the_live_loop_counts_max_tokens_and_requests_that_ran_to_it():
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    from router.timings import RequestTimings
    metrics = ServingMetrics()
    loop = AutoscaleLoop(settings(), {}, metrics)
    metrics.observe_arrival(100, 64)
    metrics.observe_arrival(100, 192)
    metrics.observe_arrival(None)          # refused before tokenizing: no limit known
    for reason in ("length", "length", "stop", "abort"):
        metrics.observe_request(RequestTimings(arrival_time=0.0, finished_time=1.0, generation_tokens=64,
                                               finish_reason=reason))
    obs = loop._observation(10.0, 10.0, {}, loop._take_counts())
    assert (obs.mean_max_tokens, obs.finished, obs.finished_by_length) == (128, 3, 2)   # an abort did not finish
    obs = loop._observation(20.0, 10.0, {}, loop._take_counts())
    assert (obs.mean_max_tokens, obs.finished, obs.finished_by_length) == (None, 0, 0)


def test_an_arrival_bound_only_by_the_context_brings_no_max_tokens(tokenizer):
    # a chat request without max_tokens may run to the end of the context: reported as its
    # output bound, a few such chats made the policy expect outputs of thousands of tokens
    from fastapi.testclient import TestClient

    from router.metrics import ServingMetrics
    from router.openai_api import build_openai_app
    from tests.test_openai_api import MODEL, FakeBackend
    offered = []

    class Listener:
        def on_arrival(self, prompt_tokens, max_tokens):
            offered.append(max_tokens)

        def on_refusal(self, reason):
            pass

        def on_request(self, timings):
            pass
    metrics = ServingMetrics()
    metrics.add_listener(Listener())
    with TestClient(build_openai_app(FakeBackend(tokenizer, len(tokenizer)), tokenizer, metrics)) as client:
        messages = [{"role": "user", "content": "Hi"}]
        for extra in ({}, {"max_tokens": 5}):
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})
            assert r.status_code == 200
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})    # OpenAI's default 16
        assert r.status_code == 200
    assert offered == [None, 5, 16]


def test_the_live_loop_reports_the_running_requests_output_so_far():
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    loop = AutoscaleLoop(settings(), {}, ServingMetrics(), running_output_tokens=lambda: 180.0)
    assert loop._observation(10.0, 10.0, {}, loop._take_counts()).mean_inflight_output_tokens == 180.0


def test_the_live_loop_takes_an_intervals_counts_before_asking_the_workers():
    # a worker that answers late must not move arrivals from the next interval into this one
    import asyncio
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    metrics = ServingMetrics()

    class _Slow(_FakeRole):
        def broadcast(self, method):
            inner = super().broadcast(method)

            class _Result:
                async def results_async(self, **kwargs):
                    for _ in range(3):
                        metrics.observe_arrival(100)     # arrivals while the broadcast is out
                    return await inner.results_async()
            return _Result()

    loop = AutoscaleLoop(settings(), {"prefill": _Slow(1), "decode": _FakeRole(1)}, metrics, profile=MODEL,
                         deployed={"prefill": 1, "decode": 1})
    seen = []
    original = loop._observation
    loop._observation = lambda *a: seen.append(original(*a)) or seen[-1]
    metrics.observe_arrival(100)
    asyncio.run(loop.tick())
    asyncio.run(loop.tick())
    assert [o.arrivals for o in seen] == [1, 3]


def test_observed_latency_adds_one_replica_not_one_per_interval_while_it_starts():
    # TTFT p90 past the SLO until the replica asked for serves (startup 30 s, interval 10 s):
    # one replica, not one every interval
    p = policy(startup_s=30.0)
    current, starting = {"prefill": 1, "decode": 1}, {}
    for i in range(5):
        now = 10.0 * (i + 1)
        d = p.decide(observe(now, 0.5, 200, 50, current, starting=starting, ttft_p90_s=2.5))
        added = {r: d.targets[r] - current[r] - starting.get(r, 0) for r in current}
        starting = {r: starting.get(r, 0) + max(0, added[r]) for r in current}
    assert d.targets["prefill"] == 2


def test_refusals_before_the_replica_they_asked_for_served_do_not_ask_again():
    p = policy(startup_s=10.0, pressure_window_s=30.0)
    current = {"prefill": 1, "decode": 1}
    d = p.decide(observe(10.0, 4.0, 200, 50, current, refused={"decode": 10}))
    assert d.targets["decode"] == 2                          # a quarter refused on decode's account
    current = dict(d.targets)
    for now in (20.0, 30.0, 40.0):                           # served from 20 s; the old refusals still
        d = p.decide(observe(now, 4.0, 200, 50, current))    # in the 30 s window count no more
        assert d.targets["decode"] == 2, now


def test_p90_is_the_nearest_rank():
    from cluster.autoscaler.policy import p90
    assert p90(list(range(1, 11))) == 9
    assert p90(list(range(1, 21))) == 18
    assert p90(list(range(1, 101))) == 90
    assert (p90([5.0]), p90([])) == (5.0, None)


def test_a_re_split_right_after_deployment_needs_a_missed_slo_and_only_the_givers_capacity():
    # the even split as deployed, then a load whose decode side needs a third replica. Within the
    # cool-down after deployment the model alone moves nothing (its first figures rest on a few
    # arrivals); once finished requests miss the TPOT SLO, the prefill pool gives up its rank at
    # once, though its one replica then runs at 90% of its capacity (a plain scale-down keeps 20%
    # to spare)
    rate = 0.9 * prefill_capacity(MODEL, 1000, 1.0)
    assert 2 < rate / decode_capacity(MODEL, 1000, 130, 0.05 * 0.8, ReplicaLimits()) <= 3
    deployed = {"prefill": 2, "decode": 2}
    d = policy(budget=4, downscale_cooldown_s=60.0).decide(observe(10.0, rate, 1000, 130, deployed))
    assert d.targets == deployed and "cool-down" in d.reasons["prefill"], d.reasons
    d = policy(budget=4, downscale_cooldown_s=60.0).decide(observe(10.0, rate, 1000, 130, deployed,
                                                                   tpot_p90_s=0.06))
    assert d.targets == {"prefill": 1, "decode": 3}, d.reasons
    assert d.reasons["prefill"].startswith("scale down by one")


def test_an_idle_deployment_scales_down_to_its_minimum():
    # no arrivals, nothing running or waiting: no finished request can confirm the SLOs, and
    # none is needed (before, every role held its peak for good)
    p = policy(budget=8, min_replicas={"prefill": 0, "decode": 1})
    current = {"prefill": 1, "decode": 1}
    t = 0.0
    for _ in range(20):
        t += 10.0
        current = dict(p.decide(observe(t, 60.0, 1000, 200, current)).targets)
    assert current["prefill"] >= 2 and current["decode"] >= 4
    peak, history = dict(current), []
    for _ in range(200):
        t += 10.0
        roles = {r: RoleObservation(running=n) for r, n in current.items()}
        current = dict(p.decide(Observation(now=t, window_s=10.0, arrivals=0, roles=roles)).targets)
        history.append(current)
    assert current == {"prefill": 0, "decode": 1}
    # one replica at a time, and not before the window of what the peak needed has passed
    assert all(sum(peak.values()) - sum(h.values()) <= i + 1 for i, h in enumerate(history))
    assert all(sum(a.values()) - sum(b.values()) <= 1 for a, b in zip([peak] + history, history))
    assert history[:12] == [peak] * 12   # the 120 s window holds the peak's pools through t = 320 s
    # requests still running (an interval with no arrival): no scale-down without latency
    p = policy(budget=8)
    p.decide(observe(10.0, 60.0, 1000, 200, peak))
    roles = {r: RoleObservation(running=n) for r, n in peak.items()}
    for i in range(30):
        d = p.decide(Observation(now=20.0 + 10 * i, window_s=10.0, arrivals=0, roles=roles,
                                 mean_inflight_output_tokens=50.0))
    assert d.targets == peak and "no request finished" in d.reasons["decode"]


def test_a_restarted_router_does_not_count_replicas_given_back_as_starting():
    # deployed 3 prefill + 1 decode (budget 4); the autoscaler has since moved two ranks to
    # decode, and the router restarts knowing only the deployed pools: 2 prefill replicas
    # "asked for" do not run and will not, and counting them as starting over-asked the budget
    import asyncio
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    metrics = ServingMetrics()
    loop = AutoscaleLoop(settings(budget=4), {"prefill": _FakeRole(1), "decode": _FakeRole(3)}, metrics,
                         profile=MODEL, deployed={"prefill": 3, "decode": 1})
    for _ in range(3):
        for _ in range(20):
            metrics.observe_arrival(1000, 200)
        asyncio.run(loop.tick())
        assert sum(loop.targets.values()) <= 4, loop.targets
    assert loop.targets == {"prefill": 1, "decode": 3}


def test_a_replica_that_fails_to_answer_leaves_the_others_replies(monkeypatch):
    import asyncio
    from router.serve_pools import NoReplicaAnswered, replica_replies

    class _OneDying:
        def broadcast(self, method):
            class _Result:
                async def results_async(self, return_exceptions=False):
                    replies = [{"steps": []}, RuntimeError("the actor died"), {"steps": []}]
                    if not return_exceptions:
                        raise replies[1]
                    return replies
            return _Result()
    assert asyncio.run(replica_replies(_OneDying(), "step_samples", 1.0)) == [{"steps": []}] * 2

    class _Replies:
        def __init__(self, *replies):
            self.replies = replies

        def broadcast(self, method):
            replies = self.replies

            class _Result:
                async def results_async(self, return_exceptions=False):
                    return list(replies)
            return _Result()
    # reached, and not one answered: unknown, not a pool of none (the router keeps its figures)
    with pytest.raises(NoReplicaAnswered, match="none of 2 replicas answered stats"):
        asyncio.run(replica_replies(_Replies(TimeoutError(), RuntimeError("died")), "stats", 1.0))
    assert asyncio.run(replica_replies(_Replies(), "stats", 1.0)) == []    # no replica runs

    class _OneHanging:
        """Serve's per-replica results: one replica never answers (cut off, its loop blocked)."""
        def broadcast(self, method):
            class _Reply:
                def __init__(self, value):
                    self.value = value

                async def get_async(self):
                    if self.value is None:
                        await asyncio.sleep(3600)
                    return self.value

            class _Response:
                async def _fetch_replica_results_async(self):
                    return [_Reply({"steps": [1]}), _Reply(None), _Reply({"steps": [2]})]
            return _Response()
    # before: one timeout for the whole broadcast, so the two that answered were lost with it
    assert asyncio.run(replica_replies(_OneHanging(), "step_samples", 0.3)) == [{"steps": [1]}, {"steps": [2]}]
    loop = _live_loop({"prefill": 1}, {"prefill": 1, "decode": 3})
    loop.workers["decode"] = _OneDying()
    observed = asyncio.run(loop._observe_role("decode"))
    assert (observed.running, observed.starting) == (2, 1)     # before: 0 running, 3 starting
    # one alive but too slow to answer (its loop busy): running, not starting (which held back every
    # scale-down and the latency evidence), its steps left for the next interval
    from router import autoscale_loop

    class _OneSlow(_OneHanging):
        def broadcast(self, method):
            response = super().broadcast(method)
            fetch = response._fetch_replica_results_async

            async def without_steps():
                replies = await fetch()
                for reply in replies:
                    if reply.value is not None:
                        reply.value = {"steps": []}
                return replies
            response._fetch_replica_results_async = without_steps
            return response
    loop.workers["decode"] = _OneSlow()
    monkeypatch.setattr(autoscale_loop, "STEP_SAMPLES_TIMEOUT_S", 0.3)
    observed = asyncio.run(asyncio.wait_for(loop._observe_role("decode"), 10))
    assert (observed.running, observed.starting) == (3, 0)

    # the call fails before reaching any replica: once, the three seen last time still run; twice, none does
    class _Unreachable:
        def broadcast(self, method):
            raise TimeoutError("the controller did not answer")
    loop.workers["decode"] = _Unreachable()
    for expected in [(3, 0), (0, 3)]:
        observed = asyncio.run(loop._observe_role("decode"))
        assert (observed.running, observed.starting) == expected      # before: (0, 3) the first time too
    loop.workers["decode"] = _OneSlow()
    assert asyncio.run(asyncio.wait_for(loop._observe_role("decode"), 10)).running == 3
    loop.workers["decode"] = _Unreachable()
    assert asyncio.run(loop._observe_role("decode")).running == 3     # a failure after answers: once again


def test_running_requests_raise_the_output_length_only_past_their_sampling_by_length():
    # Poisson 4 req/s; 90% of outputs 20 tokens, 10% 2,000; 20 ms a token. A long request runs
    # 100x longer, so the running ones are mostly long: their mean output so far is ~4x the
    # mean output. Read as a lower bound of it, it had given decode 12 replicas for 2.
    rng = random.Random(0)
    arrivals, t = [], 0.0
    while t < 600:
        t += rng.expovariate(4.0)
        arrivals.append((t, 20 if rng.random() < 0.9 else 2000))
    lengths = [n for _, n in arrivals]
    mean, mean_sq = sum(lengths) / len(lengths), sum(n * n for n in lengths) / len(lengths)

    def running_mean_so_far(now):
        running = [min(n, (now - a) / 0.02) for a, n in arrivals if a <= now < a + n * 0.02]
        return sum(running) / len(running)

    def last(inflight: bool, squares: bool):
        p = policy(budget=16)
        current = {"prefill": 1, "decode": 1}
        for i in range(20):
            now = 100.0 + 10 * i
            current = dict(p.decide(observe(
                now, 4.0, 500, mean, current, finished=40, finished_by_length=4,
                mean_squared_output_tokens=mean_sq if squares else None,
                mean_inflight_output_tokens=running_mean_so_far(now) if inflight else None)).targets)
        return current["decode"], p.output_tokens
    assert sum(running_mean_so_far(100.0 + 10 * i) for i in range(20)) / 20 > 3 * mean
    decode, output = last(inflight=False, squares=True)
    assert output == pytest.approx(mean)
    assert last(inflight=True, squares=True) == (decode, pytest.approx(mean, rel=0.35))
    assert last(inflight=True, squares=False)[0] >= 4 * decode      # uncorrected (before)


def test_ttft_from_before_the_latest_prefill_replica_served_asks_for_no_more():
    # TTFT p90 is 2 s (SLO 1 s) while one prefill replica serves, 0.3 s with two; outputs take
    # 60 s, so a request finishing now got its first token a minute ago. Counted, those late
    # first tokens asked for a third and a fourth replica after the second had fixed it.
    def prefill_replicas(with_first_token_times: bool) -> int:
        p = policy(budget=8, startup_s=30.0, downscale_cooldown_s=600)
        current, starting, serving = {"prefill": 1, "decode": 2}, [], {}
        for i in range(1, 30):
            t = 10.0 * i
            current["prefill"] += sum(ready <= t for ready in starting)
            starting = [ready for ready in starting if ready > t]
            serving[t] = current["prefill"]
            first_token = t - 60.0                   # of the requests that finish in this interval
            ttft = None if first_token <= 0 else (2.0 if serving.get(first_token, 1) < 2 else 0.3)
            samples = None if not with_first_token_times else [] if ttft is None else [(first_token, ttft)] * 20
            roles = {"prefill": RoleObservation(current["prefill"], starting=len(starting)),
                     "decode": RoleObservation(current["decode"])}
            d = p.decide(Observation(now=t, window_s=10, arrivals=20, mean_prompt_tokens=200, mean_output_tokens=50,
                                     finished=20, ttft_p90_s=ttft, tpot_p90_s=0.01, ttft_samples=samples,
                                     roles=roles))
            starting += [t + 30.0] * max(0, d.targets["prefill"] - current["prefill"] - len(starting))
        return current["prefill"] + len(starting)
    assert prefill_replicas(with_first_token_times=True) == 2
    assert prefill_replicas(with_first_token_times=False) >= 3      # the lagging evidence alone (before)


def test_the_live_loop_reports_each_finished_requests_first_token_time_and_ttft():
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    from router.timings import RequestTimings
    metrics = ServingMetrics()
    loop = AutoscaleLoop(settings(), {}, metrics)
    metrics.observe_request(RequestTimings(arrival_time=0.0, first_token_time=3.0, finished_time=90.0,
                                           generation_tokens=900, finish_reason="length"))
    obs = loop._observation(100.0, 10.0, {}, loop._take_counts())
    assert obs.ttft_samples == [(3.0, 3.0)] and obs.ttft_p90_s == 3.0


def test_a_replica_slower_to_start_than_startup_s_is_not_asked_for_twice():
    # admission control refuses 30% on decode's account while one decode replica serves; the
    # second takes 70 s to load where startup_s says 30: the refusals from before it served are
    # what it was asked for, not a reason for a third
    def replicas(real_startup_s: float) -> int:
        p = policy(budget=8, startup_s=30.0, pressure_window_s=30.0, downscale_cooldown_s=600)
        current, starting = {"prefill": 1, "decode": 1}, []
        for i in range(1, 25):
            t = 10.0 * i
            current["decode"] += sum(ready <= t for ready in starting)
            starting = [ready for ready in starting if ready > t]
            roles = {"prefill": RoleObservation(current["prefill"]),
                     "decode": RoleObservation(current["decode"], starting=len(starting))}
            d = p.decide(Observation(now=t, window_s=10, arrivals=10, mean_prompt_tokens=200,
                                     mean_output_tokens=20, finished=7, ttft_p90_s=0.1, tpot_p90_s=0.01,
                                     roles=roles, refused={"decode": 3} if current["decode"] < 2 else {}))
            starting += [t + real_startup_s] * max(0, d.targets["decode"] - current["decode"] - len(starting))
        return current["decode"] + len(starting)
    assert replicas(30.0) == 2
    assert replicas(70.0) == 2          # before: 3


def test_an_idle_start_gives_back_no_replica_when_traffic_comes():
    # deployed 2 prefill + 2 decode; a load that needs 1.6 decode replicas arrives only after
    # the deployment sat idle past the downscale window: the idle intervals are no rate of 0
    # to predict from, and the deployed pools count from when the traffic came
    rate = 1.6 * decode_capacity(MODEL, 1000, 200, 0.05 * 0.8, ReplicaLimits())

    def decode_targets(idle_s: float) -> list[int]:
        p = policy(budget=8)
        current, t, targets = {"prefill": 2, "decode": 2}, 0.0, []
        while t < idle_s:
            t += 10.0
            roles = {r: RoleObservation(n) for r, n in current.items()}
            current = dict(p.decide(Observation(now=t, window_s=10.0, arrivals=0, roles=roles)).targets)
        for _ in range(6):
            t += 10.0
            current = dict(p.decide(observe(t, rate, 1000, 200, current)).targets)
            targets.append(current["decode"])
        return targets
    assert decode_targets(0.0) == [2] * 6
    assert decode_targets(200.0) == [2] * 6     # before: 1 at first, then 2 (a start-up lost)


def test_a_re_split_frees_the_ranks_of_one_replica_of_a_role_with_a_larger_tp():
    """Decode replicas of TP 2 beside prefill replicas of TP 1, at the budget: a rank
    moved to decode is no replica there. The givers give two at once, so decode grows
    in the same interval (it stalled, one rank idle, until the next scale-down)."""
    p = policy(budget=8, tensor_parallel={"prefill": 1, "decode": 2}, downscale_cooldown_s=0.0,
               downscale_window_s=600.0, split_margin=0.0)
    current = {"prefill": 4, "decode": 2}
    d = p.decide(observe(20.0, 20.0, 50, 2000, current, mean_inflight_output_tokens=2000))
    assert d.targets["decode"] == 3 and d.targets["prefill"] == 2, (d.targets, d.reasons)
    assert sum(n * {"prefill": 1, "decode": 2}[r] for r, n in d.targets.items()) <= 8


def test_serves_policy_applies_the_targets_the_router_reported_last():
    """Serve's aggregate is a mean over its look-back: mid-move (prefill 4 -> 3, decode
    3 -> 4) both means are 3.5 and round to 4, past the budget. The latest values are
    the router's decision."""
    from types import SimpleNamespace

    from ray.serve._private.common import TimeStampedValue

    from cluster.autoscaler.serve_policy import router_targets
    from typing import NamedTuple

    class DeploymentID(NamedTuple):
        name: str
    ids = {name: DeploymentID(name) for name in ("Router", "PrefillServer", "DecodeServer")}

    def series(*values):
        return {"router-replica": [TimeStampedValue(t, v) for t, v in enumerate(values)]}
    router = SimpleNamespace(raw_metrics={"target_prefill": series(4, 3), "target_decode": series(3, 4)},
                             aggregated_metrics={"target_prefill": {"r": 3.5}, "target_decode": {"r": 3.5}})
    contexts = {ids["Router"]: router, ids["PrefillServer"]: SimpleNamespace(), ids["DecodeServer"]: SimpleNamespace()}
    assert router_targets(contexts) == ({ids["PrefillServer"]: 3, ids["DecodeServer"]: 4}, None)
    router.raw_metrics = None                      # no raw series: the aggregate, as before
    router.aggregated_metrics = {"target_prefill": {"r": 2.0}}
    assert router_targets(contexts) == ({ids["PrefillServer"]: 2}, None)


def test_tpot_evidence_counts_the_requests_that_began_decoding_after_the_new_replica_served():
    """A long answer that decoded mostly before the decode replica asked for served
    says nothing about the pool with it: TPOT counts, like TTFT, only the requests
    whose first token came after it (counted, it asked for one decode replica too many)."""
    p = policy(downscale_cooldown_s=0.0, upscale_cooldown_s=0.0, startup_s=10.0)
    current = {"prefill": 1, "decode": 1}
    d = p.decide(observe(10.0, 0.5, 200, 50, current, tpot_p90_s=0.2))     # TPOT p90 4x the SLO
    assert d.targets == {"prefill": 1, "decode": 2}
    current = d.targets                                                      # serving from 20 s
    before = [(15.0, 0.2)] * 10                                              # (first token, TPOT)
    d = p.decide(observe(40.0, 0.5, 200, 50, current, tpot_p90_s=0.2, tpot_samples=before))
    assert d.targets["decode"] == 2, d.reasons
    after = [(35.0, 0.2)] * 10                                               # with it, and still missing
    d = p.decide(observe(50.0, 0.5, 200, 50, current, tpot_p90_s=0.2, tpot_samples=after))
    assert d.targets["decode"] == 3 and "observed TPOT" in d.reasons["decode"]


def test_an_autoscaler_with_no_step_model_yet_says_so_as_steps_come_not_every_interval():
    # an idle deployment with no profile held with a log line every interval, for ever
    import asyncio
    import logging

    from router import autoscale_loop
    from router.autoscale_loop import AutoscaleLoop
    from router.metrics import ServingMetrics
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    autoscale_loop.log.addHandler(handler)
    level = autoscale_loop.log.level
    autoscale_loop.log.setLevel(logging.INFO)
    try:
        loop = AutoscaleLoop(settings(min_replicas={"prefill": 1, "decode": 1}),
                             {"prefill": _FakeRole(1), "decode": _FakeRole(1)}, ServingMetrics(),
                             kept_replicas=lambda workers: {"prefill": 1, "decode": 1})
        for _ in range(3):
            asyncio.run(loop.tick())
    finally:
        autoscale_loop.log.removeHandler(handler)
        autoscale_loop.log.setLevel(level)
    assert lines == ["autoscaler: holding, no step-time model yet (prefill: 0 steps, decode: 0 steps)"]
