"""The autoscaler on a CPU machine whose replicas lend idle cores to each other
(cluster/autoscaler/lending.py): no Ray, no engine."""

from __future__ import annotations

import pytest

from cluster.autoscaler.lending import LentCoreSpeedup, decode_threads
from cluster.autoscaler.policy import AutoscaleSettings, GoodputPolicy, Observation, RoleObservation, StepSample
from cluster.config import DeploymentConfig
from cluster.perf_model.linear_model import LinearStepModel
from cluster.perf_model.step_shape import StepShape

# 5 ms a step, 0.1 ms a prompt token, 1 ms a decoding sequence, 1 us per key a decode reads
MODEL = LinearStepModel((5e-3, 1e-4, 0.0, 1e-3, 1e-6))
DECODE_STEP = StepShape(decode_seqs=20, decode_context=20 * 300)


@pytest.mark.parametrize("cores, prefill, decode, busy, threads", [
    (2, 2, 1, 0.0, 2.0),      # both prefill replicas idle: the decode replica takes the machine's other core
    (2, 2, 1, 0.25, 1.5),     # the busy prefill quarter-threads leave 0.5 of a core
    (2, 2, 1, 1.0, 1.0),      # prefill at work all the time: nothing to borrow
    (2, 1, 2, 0.5, 1.0),      # two decode threads fill the machine already
    (4, 2, 1, 0.0, 3.0),      # two idle prefill cores, room for both
    (3, 2, 2, 0.0, 1.5),      # one spare core for two decode replicas: half each
])
def test_decode_threads_take_idle_prefill_cores_within_the_machine(cores, prefill, decode, busy, threads):
    assert decode_threads(cores, prefill, decode, busy) == pytest.approx(threads)


def test_speedup_is_learned_from_borrowed_steps_and_interpolated_in_inverse_threads():
    speedup = LentCoreSpeedup()
    assert speedup.factor(1, 2) == 1.0                  # nothing seen: lending counts for nothing
    for ratio in (0.5, 0.6, 0.7):
        speedup.observe(1, 2, ratio)
    speedup.observe(1, 1, 0.1)                          # not a borrowed step: ignored
    assert speedup.num_observed == 3
    assert speedup.factor(1, 2) == pytest.approx(0.6)   # the median, at the threads seen
    # 1.5 threads: 1 + (0.6 - 1) * (1 - 1/1.5) / (1 - 1/2)
    assert speedup.factor(1, 1.5) == pytest.approx(1 - 0.4 * (1 / 3) / 0.5)
    assert speedup.factor(1, 1) == 1.0
    fast = LentCoreSpeedup()
    fast.observe(1, 2, 0.3)                              # faster than two threads can be (noise)
    assert fast.factor(1, 2) == pytest.approx(0.5)       # no better than perfect scaling


def _observation(now: float, rate: float, current: dict[str, int], decode_steps: list[StepSample],
                 tpot_p90_s: float = 0.02, refused: dict[str, int] | None = None,
                 mean_prompt_tokens: float = 200) -> Observation:
    roles = {"prefill": RoleObservation(running=current["prefill"]),
             "decode": RoleObservation(running=current["decode"], steps=decode_steps)}
    return Observation(now=now, window_s=10.0, arrivals=round(rate * 10), mean_prompt_tokens=mean_prompt_tokens,
                       mean_output_tokens=256, ttft_p90_s=0.1, tpot_p90_s=tpot_p90_s, roles=roles,
                       refused=refused or {})


PAST_HEADROOM_TPOT_S = 0.045   # p90 within the 50 ms SLO but past 80% of it


def _output_heavy_targets(shared_cores: int | None, borrowed_ratio: float | None,
                          tpot_p90_s: float = PAST_HEADROOM_TPOT_S) -> tuple[dict[str, int], str]:
    """2 prefill + 1 decode at a budget of 3 ranks, 4 req/s of 200-token prompts
    and 256-token outputs: one decode replica on its own core holds ~2.6 req/s
    within the TPOT budget, on two cores (steps at `borrowed_ratio`) ~4.8.
    (targets after three intervals, the decode role's last reason)"""
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=10.0,
                                 downscale_cooldown_s=0.0, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=shared_cores)
    steps = []
    if borrowed_ratio is not None:
        steps = [StepSample(DECODE_STEP, MODEL.step_time(DECODE_STEP) * borrowed_ratio, threads=2,
                            borrowed_threads=1)] * 30
    current, reason = {"prefill": 2, "decode": 1}, ""
    for i in range(3):
        decision = policy.decide(_observation(10.0 * (i + 1), 4.0, current, steps, tpot_p90_s))
        current, reason = dict(decision.targets), decision.reasons["decode"]
    return current, reason


def test_a_decode_replica_on_lent_cores_is_not_resplit_for_compute_it_already_has():
    assert _output_heavy_targets(shared_cores=2, borrowed_ratio=0.55)[0] == {"prefill": 2, "decode": 1}


def test_without_lent_cores_or_before_any_borrowed_step_the_split_moves_to_decode():
    assert _output_heavy_targets(shared_cores=None, borrowed_ratio=0.55)[0] == {"prefill": 1, "decode": 2}
    assert _output_heavy_targets(shared_cores=2, borrowed_ratio=None)[0] == {"prefill": 1, "decode": 2}


@pytest.mark.parametrize("tpot_p90_s", [0.02, None])
def test_on_shared_cores_the_model_alone_does_not_resplit_while_the_role_meets_its_latency(tpot_p90_s):
    # the model rates the lone decode replica short of 4 req/s (no borrowed step seen), but its
    # observed TPOT p90 is well within the SLO (or nothing finished yet): the split holds
    targets, reason = _output_heavy_targets(shared_cores=2, borrowed_ratio=None, tpot_p90_s=tpot_p90_s)
    assert targets == {"prefill": 2, "decode": 1}
    assert "moves no compute" in reason
    # with a device per rank the same figures move the rank at once
    assert _output_heavy_targets(shared_cores=None, borrowed_ratio=None, tpot_p90_s=tpot_p90_s)[0] == \
        {"prefill": 1, "decode": 2}


def test_lent_cores_too_few_for_the_load_still_add_a_decode_replica():
    # 4 cores, budget 4: the one decode replica borrows ~1.8 idle prefill cores, ~6 req/s; 7 arrive
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=4, interval_s=10.0, startup_s=10.0,
                                 downscale_cooldown_s=0.0, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=4)
    steps = [StepSample(DECODE_STEP, MODEL.step_time(DECODE_STEP) * 0.55, threads=2, borrowed_threads=1)] * 30
    decision = policy.decide(_observation(10.0, 7.0, {"prefill": 2, "decode": 1}, steps))
    assert decision.targets == {"prefill": 2, "decode": 2}
    assert 5.0 < decision.capacity["decode"] < 7.0      # the lent replica's, reported per replica


def test_borrowed_steps_stay_out_of_the_own_core_correction():
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=2)
    steps = [StepSample(DECODE_STEP, MODEL.step_time(DECODE_STEP) * 1.2)] * 10
    steps += [StepSample(DECODE_STEP, MODEL.step_time(DECODE_STEP) * 0.72, threads=2, borrowed_threads=1)] * 10
    policy.decide(_observation(10.0, 1.0, {"prefill": 2, "decode": 1}, steps))
    assert policy.models["decode"].factor == pytest.approx(1.2)
    assert policy.lent_speedup.factor(1, 2) == pytest.approx(0.72 / 1.2)   # against the corrected model


def test_lending_is_set_for_cpu_deployments_that_lend_only():
    assert DeploymentConfig.model_validate(_autoscaled("cpu", True)).autoscaling_settings().lend_idle_cores
    assert not DeploymentConfig.model_validate(_autoscaled("cpu", False)).autoscaling_settings().lend_idle_cores
    assert not DeploymentConfig.model_validate(_autoscaled("cuda", True)).autoscaling_settings().lend_idle_cores


def _autoscaled(device: str, lend: bool) -> dict:
    return {"device": device, "resources": {"lend_idle_cores": lend}, "slo": {"ttft_ms": 1000, "tpot_ms": 100},
            "autoscaling": {"enabled": True, "budget": 3}}


@pytest.mark.parametrize("split_margin, targets", [(0.2, {"prefill": 2, "decode": 1}),
                                                   (0.0, {"prefill": 1, "decode": 2})])
def test_on_a_lending_machine_a_shortfall_within_the_split_margin_is_not_worth_a_resplit(split_margin, targets):
    # 4 cores, budget 3: the lent decode replica serves ~6.1 req/s, 6.8 are predicted; 1P+2D would serve ~7
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=10.0,
                                 downscale_cooldown_s=0.0, split_margin=split_margin, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=4)
    steps = [StepSample(DECODE_STEP, MODEL.step_time(DECODE_STEP) * 0.55, threads=2, borrowed_threads=1)] * 30
    decision = policy.decide(_observation(10.0, 6.8, {"prefill": 2, "decode": 1}, steps, PAST_HEADROOM_TPOT_S))
    assert 5.7 < decision.capacity["decode"] < 6.8
    assert decision.targets == targets
    if split_margin:
        assert "not worth a re-split" in decision.reasons["decode"]


def _past_budget_targets(shared_cores: int | None, tpot_p90_s: float,
                         decode_refused_per_interval: int = 0) -> tuple[dict[str, int], str]:
    """2 prefill + 1 decode at a budget of 3 ranks, 6 req/s of 800-token prompts
    and 256-token outputs: both roles' demand is past the budget, and the
    model's best split is 1 prefill + 2 decode. (targets after three
    intervals, the decode role's last reason)"""
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=10.0,
                                 downscale_cooldown_s=0.0, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=shared_cores)
    current, reason = {"prefill": 2, "decode": 1}, ""
    for i in range(3):
        decision = policy.decide(_observation(10.0 * (i + 1), 6.0, current, [], tpot_p90_s,
                                              {"decode": decode_refused_per_interval}, mean_prompt_tokens=800))
        current, reason = dict(decision.targets), decision.reasons["decode"]
    return current, reason


def test_past_the_budget_on_shared_cores_the_best_split_waits_for_the_role_to_be_seen_short():
    # with a device per rank the model's best split is taken at once
    assert _past_budget_targets(shared_cores=None, tpot_p90_s=0.02)[0] == {"prefill": 1, "decode": 2}
    # on shared cores, while the decode role meets its latency and is refused nothing, the split holds
    targets, reason = _past_budget_targets(shared_cores=2, tpot_p90_s=0.02)
    assert targets == {"prefill": 2, "decode": 1}
    assert "taken only for a role seen short" in reason and "0% refused" in reason
    # seen short: its TPOT p90 past 80% of the SLO ...
    assert _past_budget_targets(shared_cores=2, tpot_p90_s=0.045)[0] == {"prefill": 1, "decode": 2}
    # ... or admission control refusing more than 10% of the arrivals on its account (10 of 60)
    assert _past_budget_targets(shared_cores=2, tpot_p90_s=0.02, decode_refused_per_interval=10)[0] == \
        {"prefill": 1, "decode": 2}
    assert _past_budget_targets(shared_cores=2, tpot_p90_s=0.02, decode_refused_per_interval=3)[0] == \
        {"prefill": 2, "decode": 1}


def test_refusals_count_as_pressure_within_the_budget_too():
    # the within-budget hold (latency well within the SLO) gives way to refusals on the role's account
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=10.0,
                                 downscale_cooldown_s=0.0, lend_idle_cores=True)
    policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=2)
    current = {"prefill": 2, "decode": 1}
    for i in range(3):
        current = dict(policy.decide(_observation(10.0 * (i + 1), 4.0, current, [], 0.02, {"decode": 8})).targets)
    assert current == {"prefill": 1, "decode": 2}
    # refusals age out of the pressure window: 30 s later only calm intervals count
    assert policy._refused_share("decode") > 0.1
    for i in range(3, 7):
        policy.decide(_observation(10.0 * (i + 1), 4.0, current, [], 0.02))
    assert policy._refused_share("decode") == 0.0
