"""Admission control: bounded queues and the TTFT SLO, at the router's HTTP API."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest
from fastapi.testclient import TestClient

from router.admission import AdmissionControl, AdmissionSettings, Overloaded
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from tests.test_openai_api import MODEL, FakeBackend


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_retry_after_is_at_least_a_second_and_at_most_a_minute():
    # 100,000 tokens waiting on one replica at 4 ms a token: 400 s predicted, told 60
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=2), clock=_Clock())
    a.observe_workers("prefill", [{"prefill_s_per_token": 0.004}])
    a.admit(50_000)
    a.admit(50_000)
    with pytest.raises(Overloaded) as exc:
        a.check_before_tokenizing()
    assert a.predicted_wait_s() == pytest.approx(400.0)
    assert exc.value.headers() == {"Retry-After": "60"}
    assert Overloaded("busy", "overload", 0.01).headers() == {"Retry-After": "1"}


def test_queue_bounds_refuse_with_the_drain_time():
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=2, max_waiting_prompt_tokens=1000),
                         clock=_Clock())
    a.observe_workers("prefill", [{"prefill_s_per_token": 0.004}, {"prefill_s_per_token": 0.002}])
    a.admit(300)
    five_hundred = a.admit(500)
    with pytest.raises(Overloaded) as exc:
        a.check_before_tokenizing()
    # 800 tokens over 2 replicas at 3 ms a token: 1.2 s to drain -> Retry-After 2
    assert exc.value.reason == "queue_requests" and exc.value.headers() == {"Retry-After": "2"}
    a.first_token(five_hundred)
    a.check_before_tokenizing()
    with pytest.raises(Overloaded) as exc:
        a.admit(701)                                   # 300 + 701 tokens > 1000
    assert exc.value.reason == "queue_tokens" and exc.value.status == 429
    a.admit(700)
    assert (a.waiting_requests, a.waiting_tokens) == (2, 1000)


def test_the_ttft_slo_refuses_what_would_miss_it():
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, slo_factor=1.5), clock=_Clock())
    a.admit(10_000)                                    # no cost measured yet: no prediction, admitted
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-4}])
    a.observe_workers("decode", [{"prefill_s_per_token": 1.0}])       # not a prefill role: ignored
    assert a.predicted_ttft_s(2000) == pytest.approx(1.2)
    a.admit(2000)                                      # 1.2 s <= 1.5 s
    with pytest.raises(Overloaded) as exc:
        a.admit(5000)                                  # (12000 waiting + 5000) x 0.1 ms = 1.7 s > 1.5 s
    assert exc.value.reason == "ttft_slo" and "past the 1500 ms" in exc.value.message
    assert a.waiting_requests == 2                     # the refused one is not counted


def test_a_prompt_a_decode_replica_prefills_is_judged_on_that_replicas_wait_not_the_prefill_pools():
    # conditional disaggregation: a short prompt behind a second of long ones in the prefill pool
    # was refused though a decode replica would give it its first token at once
    from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
    policy = DisaggregationPolicy(DisaggregationSettings("conditional", local_prefill_max_tokens=128))
    settings = AdmissionSettings(ttft_slo_s=1.0, slo_factor=1.0)
    a = AdmissionControl(settings, clock=_Clock(), local_prefill=policy.local_prefill_s)
    plain = AdmissionControl(settings, clock=_Clock())
    for role in ("prefill", "decode"):
        for observer in (a, plain, policy):
            observer.observe_workers(role, [{"prefill_s_per_token": 1e-3}])
    long_prompt = a.admit(1000)                        # to the prefill pool
    plain.admit(1000)
    policy.started(False, 1000)
    assert a.predicted_ttft_s(50) == plain.predicted_ttft_s(50) == pytest.approx(1.05)
    with pytest.raises(Overloaded):                    # without the policy: priced on the prefill pool
        plain.admit(50)
    a.check_before_tokenizing()
    a.admit(50)                                        # on a decode replica: ~50 ms
    policy.started(True, 50)
    policy.started(True, 1500)                         # the decode replicas fall behind too: refused
    with pytest.raises(Overloaded) as exc:
        a.admit(60)
    assert exc.value.reason == "ttft_slo" and "predicted time to first token is 1610 ms" in exc.value.message
    assert exc.value.headers() == {"Retry-After": "2"}       # the decode replicas' 1.55 s wait
    # before tokenizing, with the decode replicas behind, a longer prompt may still go to the prefill
    # pool: refused only once that one would miss too
    a.first_token(long_prompt)
    policy.first_token(False, 1000)
    a.check_before_tokenizing()
    a.admit(900)                                       # to the prefill pool: ~0.95 s
    a.observe_workers("prefill", [{"prefill_s_per_token": 2e-3}])
    with pytest.raises(Overloaded) as exc:
        a.check_before_tokenizing()
    # the 900 tokens at 2 ms each; the 50 that wait on a decode replica are no wait in the prefill pool
    assert exc.value.reason == "ttft_slo" and "1800 ms" in exc.value.message


def test_prompts_a_decode_replica_prefills_add_nothing_to_the_prefill_pools_wait_or_arrivals():
    # conditional disaggregation: short prompts prefilled on decode replicas counted in the prefill
    # pool's queue and arrival rate, and refused the long prompts bound for an idle prefill pool
    from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
    clock = _Clock()
    policy = DisaggregationPolicy(DisaggregationSettings("conditional", local_prefill_max_tokens=128))
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_wait_factor=0.25), clock=clock,
                         local_prefill=policy.local_prefill_s)
    for observer in (a, policy):
        observer.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])
        observer.observe_workers("decode", [{"prefill_s_per_token": 1e-3}, {"prefill_s_per_token": 1e-3}])
    remote = a.admit(400, arrival=a.check_before_tokenizing())     # to the prefill pool: 0.4 s
    local = []
    for _ in range(40):                                # 40 x 100 tokens, 20 arrivals a second
        clock.now += 0.05
        local.append(a.admit(100, arrival=a.check_before_tokenizing()))
    assert local[0].local and not remote.local
    assert (a.waiting_requests, a.waiting_tokens) == (41, 4400)   # the queue bounds count every prompt
    assert a.predicted_wait_s() == pytest.approx(0.0)  # the long prompt has had its 0.4 s
    assert a.predicted_ttft_s(500) == pytest.approx(0.5)
    assert not a.overloaded()                          # 1 of 41 arrivals is the prefill pool's
    a.admit(500, arrival=a.check_before_tokenizing())
    a.first_token(local[0])
    assert (a.waiting_tokens, a.waiting_local_tokens) == (4800, 3900)
    # a batch of short prompts is no arrival at the prefill pool; one with a long prompt is
    clock.now += 0.05
    arrival = a.check_before_tokenizing()
    a.admit_prompts([(50, None), (60, None)], 1, arrival)
    assert arrival not in a._arrivals
    clock.now += 0.05
    arrival = a.check_before_tokenizing()
    a.admit_prompts([(50, None), (600, None)], 1, arrival)
    assert arrival in a._arrivals


def test_a_request_alone_is_admitted_whatever_its_own_prefill_is_predicted_to_take():
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0))
    a.observe_workers("colocated", [{"prefill_s_per_token": 3.7e-3}])   # an inflated estimate
    first = a.admit(280)                               # 1.04 s predicted, but nothing waits ahead
    with pytest.raises(Overloaded) as exc:
        a.admit(280)                                   # 2.07 s with the first one ahead
    assert exc.value.reason == "ttft_slo"
    a.first_token(first)
    a.admit(280)                                       # alone again


def _conditional(clock: _Clock, ttft_slo_s: float) -> AdmissionControl:
    """Admission control beside a conditional-disaggregation policy (prompts of up to 128
    tokens on a decode replica), every worker measured at 0.5 ms a prompt token."""
    from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
    policy = DisaggregationPolicy(DisaggregationSettings("conditional", local_prefill_max_tokens=128))
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=ttft_slo_s), clock=clock, local_prefill=policy.local_prefill_s)
    for observer in (a, policy):
        for role in ("prefill", "decode"):
            observer.observe_workers(role, [{"prefill_s_per_token": 5e-4}])
    return a


def test_a_long_prompt_alone_in_the_prefill_pool_is_admitted_beside_prompts_waiting_elsewhere():
    # a short prompt waiting on a decode replica, or a second choice, is not ahead of it in the
    # prefill pool: the long prompt is alone there, and no retry would do better
    a = _conditional(_Clock(), ttft_slo_s=1.0)
    short = a.admit(50)                                # on a decode replica
    assert short.local and a.predicted_wait_s() == 0.0
    a.admit(2400)                                      # 1.2 s predicted, its own prefill only
    with pytest.raises(Overloaded):                    # behind it, a second long prompt is refused
        a.admit(2400)
    choices = _conditional(_Clock(), ttft_slo_s=1.0)
    choices.admit_choices(100, None, 2)                # the second choice waits for its first token
    choices.admit(2400)


def test_only_the_prefill_pools_own_first_tokens_move_the_head_of_its_queue():
    # a locally prefilled prompt's first token restarted the pool's head clock: the 3 s prompt at
    # the head counted as not started, and a request that would make its SLO was refused
    clock = _Clock()
    a = _conditional(clock, ttft_slo_s=2.0)
    head = a.admit(6000)                               # 3 s at the head of the prefill pool
    clock.now += 0.1
    local = a.admit(50)
    clock.now += 2.4
    assert a.predicted_wait_s() == pytest.approx(0.5)  # 2.5 s of the head's 3 s done
    a.first_token(local)
    assert a.predicted_wait_s() == pytest.approx(0.5)
    a.admit(2000)                                      # 0.5 + 1.0 s, within the 2 s SLO
    clock.now += 0.5
    a.first_token(head)                                # the pool's own progress moves its head
    assert a.predicted_wait_s() == pytest.approx(1.0)
    clock.now += 0.25
    assert a.predicted_wait_s() == pytest.approx(0.75)


def test_a_retry_header_counts_once_per_refusal_not_as_a_pass_around_the_overload_rule():
    # X-Stainless-Retry-Count is the client's word: a request that says it is a retry, with no
    # refusal to be the retry of, is an arrival like any other
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=1), clock=clock)
    assert not a.takes_retry()                         # nothing was refused
    a.admit(10, arrival=a.check_before_tokenizing())
    with pytest.raises(Overloaded):
        a.check_before_tokenizing()
    assert a.takes_retry() and not a.takes_retry()     # one refusal, one retry
    with pytest.raises(Overloaded):
        a.check_before_tokenizing()
    clock.now += 80                                    # past the longest Retry-After and a backoff
    assert not a.takes_retry()


def test_the_prefill_cost_is_total_time_over_total_prompt_tokens_of_recent_steps():
    from engine.step_cost import PREFILL_WINDOW, PrefillTokenCost
    cost = PrefillTokenCost()
    assert cost.s_per_token is None
    cost.add(0, 0.02)                                  # a decode-only step: not a prefill step
    assert cost.s_per_token is None
    for _ in range(PREFILL_WINDOW - 1):
        cost.add(280, 0.125)                           # a prompt beside the running decodes
    cost.add(4, 0.030)                                 # a 4-token chunk beside them: 7.5 ms a token alone
    assert cost.s_per_token == pytest.approx((15 * 0.125 + 0.030) / (15 * 280 + 4))
    for _ in range(PREFILL_WINDOW):
        cost.add(100, 0.01)                            # the window moves on
    assert cost.s_per_token == pytest.approx(1e-4)


def _arrivals(a: AdmissionControl, clock: _Clock, rate: float, seconds: float, prompt: int) -> None:
    """Requests of `prompt` tokens at `rate` for `seconds`, each served before the next arrives."""
    for _ in range(int(rate * seconds)):
        clock.now += 1 / rate
        a.check_before_tokenizing()
        ticket = a.admit(prompt)
        a.first_token(ticket)
        a.finished(ticket)


@pytest.mark.parametrize("factor", [1.0, None], ids=["overload-wait-bound", "up-to-the-slo"])
def test_in_overload_only_what_keeps_the_prefill_busy_is_admitted(factor):
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_wait_factor=factor, overload_window_s=5.0),
                         clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])    # 100-token prompts: 0.1 s, 10 req/s
    _arrivals(a, clock, rate=5.0, seconds=5.0, prompt=100)             # half the prefill capacity
    assert not a.overloaded()
    tickets = [a.admit(100) for _ in range(3)]         # the third: 0.2 s waits ahead, within the SLO
    for ticket in tickets:
        a.first_token(ticket)
    _arrivals(a, clock, rate=20.0, seconds=5.0, prompt=100)            # twice what the replica prefills
    assert a.overloaded()
    first = a.admit(100)                               # nothing waits ahead
    second = a.admit(100)                              # 0.1 s ahead: 1x its own prefill
    if factor is None:
        a.admit(100)                                   # 0.2 s ahead, 0.3 s predicted: within the SLO
        return
    with pytest.raises(Overloaded) as exc:
        a.admit(100)                                   # 0.2 s ahead > 1x its own 0.1 s
    assert exc.value.reason == "overload" and "faster than this server prefills" in exc.value.message
    with pytest.raises(Overloaded):
        a.check_before_tokenizing()                    # refused before tokenizing, at the mean prompt's cost
    a.first_token(first)
    a.first_token(second)
    clock.now += 10.0                                  # the burst is over: nothing arrived for a window
    a.check_before_tokenizing()
    assert not a.overloaded()
    a.admit(100)
    a.admit(100)
    a.admit(100)


def test_in_overload_the_wait_ahead_is_what_the_head_of_the_queue_has_left():
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_wait_factor=0.25), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])    # 100-token prompts: 0.1 s, 10 req/s
    _arrivals(a, clock, rate=20.0, seconds=5.0, prompt=100)
    assert a.overloaded()
    first = a.admit(100)                               # into an empty queue: its prefill starts now
    assert a.predicted_wait_s() == pytest.approx(0.1)
    clock.now += 0.06
    assert a.predicted_wait_s() == pytest.approx(0.04)
    with pytest.raises(Overloaded) as exc:
        a.admit(100)                                   # 40 ms left ahead > 0.25 x its own 100 ms
    assert exc.value.reason == "overload"
    clock.now += 0.02
    second = a.admit(100)                              # 20 ms left ahead
    assert a.predicted_wait_s() == pytest.approx(0.12)
    clock.now += 0.05                                  # the first is late: no credit past its prefill
    assert a.predicted_wait_s() == pytest.approx(0.1)
    a.first_token(first)                               # the second starts now
    assert a.predicted_wait_s() == pytest.approx(0.1)
    clock.now += 0.08
    a.admit(100)
    a.first_token(second)
    assert a.predicted_wait_s() == pytest.approx(0.1)  # the third is the head now
    two = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0), clock=clock)
    two.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}, {"prefill_s_per_token": 1e-3}])
    two.admit(100)
    two.admit(100)
    two.admit(100)
    clock.now += 0.05                                  # two replicas each 50 ms into a prompt
    assert two.predicted_wait_s() == pytest.approx((0.3 - 2 * 0.05) / 2)


def test_a_burst_after_a_quiet_spell_is_overload_within_a_few_arrivals():
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_window_s=5.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])    # 100-token prompts: 10 req/s
    _arrivals(a, clock, rate=5.0, seconds=10.0, prompt=100)
    _arrivals(a, clock, rate=20.0, seconds=8 / 20, prompt=100)
    assert not a.overloaded()                          # the last 16: 8 at 20/s after 8 at 5/s, 8.3 req/s
    _arrivals(a, clock, rate=20.0, seconds=8 / 20, prompt=100)
    # over the last 16 arrivals, 20 req/s; over the window, 16 at 20/s and 21 at 5/s in 5 s, 7.4 req/s
    assert a.overloaded()
    clock.now += 1.0                                   # the burst paused: the last 16 span 1.75 s
    assert not a.overloaded()


def test_a_burst_of_many_times_the_capacity_is_overload_within_four_arrivals():
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_window_s=5.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])    # 100-token prompts: 10 req/s
    _arrivals(a, clock, rate=6.0, seconds=10.0, prompt=100)            # under capacity, evenly spaced
    assert not a.overloaded()
    _arrivals(a, clock, rate=50.0, seconds=2 / 50, prompt=100)
    assert not a.overloaded()                          # the last 4 span 1/6 s + 2/50 s: 14.5 req/s
    _arrivals(a, clock, rate=50.0, seconds=1 / 50, prompt=100)
    assert a.overloaded()                              # the last 4 span 3/50 s: 50 req/s, past 3.7x the capacity
    _arrivals(a, clock, rate=25.0, seconds=10.0, prompt=100)
    assert a.overloaded()                              # 2.5x: every 8 latest arrivals, past 2.1x


def _share_judged_overloaded(rate: float, capacity: float, arrivals: int, seed: int) -> float:
    """Of Poisson arrivals at `rate` against one replica serving `capacity` req/s (each
    served before the next arrives), the share at which the router judges overload."""
    rng = random.Random(seed)
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_window_s=5.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1 / (100 * capacity)}])   # 100-token prompts
    judged = 0
    for _ in range(arrivals):
        clock.now += rng.expovariate(rate)
        a.check_before_tokenizing()
        judged += a.overloaded()
        a.first_token(a.admit(100))
    return judged / arrivals


def test_a_load_under_the_capacity_is_rarely_judged_overload_by_chance():
    # The 5 s window's rate alone passes the capacity at 3% of these arrivals by chance;
    # with a 16-arrival rule at 1x the capacity (no margin for chance) it was 19%.
    assert _share_judged_overloaded(7.5, 10.0, 4000, seed=1) < 0.1
    assert _share_judged_overloaded(15.0, 10.0, 4000, seed=1) > 0.9    # while overload is still seen


def test_a_burst_of_ten_times_the_capacity_is_overload_at_its_third_arrival():
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, overload_window_s=5.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])    # 100-token prompts: 10 req/s
    _arrivals(a, clock, rate=1.0, seconds=10.0, prompt=100)
    clock.now += 0.5
    _arrivals(a, clock, rate=100.0, seconds=2 / 100, prompt=100)
    assert not a.overloaded()                          # two arrivals 10 ms apart: chance, for all it knows
    _arrivals(a, clock, rate=100.0, seconds=1 / 100, prompt=100)
    assert a.overloaded()                              # three in 20 ms: 100 req/s, past 5.6x the capacity


def test_arrivals_at_one_instant_are_overload_from_the_third():
    # a simulated burst (no --request-rate) arrives all at t = 0: no time between arrivals is
    # an unbounded rate, not "too few to tell" (before, the burst was admitted up to the
    # 1 s SLO: ten 100 ms prompts)
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])
    outcomes = []
    for _ in range(6):
        try:
            a.check_before_tokenizing()
            a.admit(100)
            outcomes.append("admitted")
        except Overloaded as exc:
            outcomes.append(exc.reason)
    assert outcomes == ["admitted"] * 2 + ["overload"] * 4


def test_the_tpot_slo_bounds_the_requests_running_at_once():
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=None, max_waiting_prompt_tokens=None,
                                           tpot_slo_s=0.1))
    tickets = [a.admit(10, max_tokens=100) for _ in range(100)]   # nothing measured yet: no bound
    a.observe_workers("decode", [{"decode_s_per_seq": 0.002}, {"decode_s_per_seq": 0.004}])
    # the slower replica's cost: 101 sequences over 2 replicas, 4 ms each, a 202 ms step
    assert a.predicted_step_s(extra_seqs=1) == pytest.approx(0.202)
    with pytest.raises(Overloaded) as exc:
        a.check_before_tokenizing()
    assert exc.value.reason == "tpot_slo" and "202 ms, past 80% of the 100 ms TPOT SLO" in exc.value.message
    for ticket in tickets[39:]:
        a.finished(ticket)
    a.check_before_tokenizing()                        # 39 running: a 40th keeps the step at 80 ms
    tickets = tickets[:39] + [a.admit(10, max_tokens=100)]
    with pytest.raises(Overloaded):
        a.admit(10, max_tokens=100)
    # fitted on mixed steps: 10 ms fixed and 30 ms of prefill chunks per step leave 40 ms of the 80
    a.observe_workers("decode", [{"decode_s_per_seq": 0.004, "decode_step_fixed_s": 0.01,
                                  "prefill_s_per_step": 0.03}])
    for ticket in tickets[9:]:
        a.finished(ticket)
    a.admit(10, max_tokens=100)                        # the 10th: 10 x 4 ms / 1 replica + 40 ms
    with pytest.raises(Overloaded):
        a.admit(10, max_tokens=100)
    a.observe_workers("decode", [{"decode_s_per_seq": 0.004, "decode_step_fixed_s": 0.01,
                                  "prefill_s_per_step": 0.2}])
    with pytest.raises(Overloaded):
        a.check_before_tokenizing()                    # past the budget with any one running
    drained = AdmissionControl(a.settings)
    drained.observe_workers("decode", [{"decode_s_per_seq": 0.004, "decode_step_fixed_s": 0.01,
                                        "prefill_s_per_step": 0.2}])
    drained.admit(10, max_tokens=100)                  # none running: one at a time still drains


def test_a_tpot_refusal_retries_after_a_decode_slot_frees_not_the_prefill_queue():
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=None, max_waiting_prompt_tokens=None,
                                           tpot_slo_s=0.1))
    ended = a.admit(10, max_tokens=4000)
    a.first_token(ended)
    a.finished(ended, output_tokens=4000)              # outputs of 4,000 tokens
    a.observe_workers("decode", [{"decode_s_per_seq": 0.002}, {"decode_s_per_seq": 0.002}])
    for _ in range(80):                                # 80 running, 40 a replica: an 80 ms step
        a.first_token(a.admit(10, max_tokens=4000))
    with pytest.raises(Overloaded) as exc:
        a.admit(10, max_tokens=4000)
    assert exc.value.reason == "tpot_slo" and a.predicted_wait_s() == 0.0   # no prompt waits
    # each of a replica's 40 requests runs 4,000 steps of 82 ms: one ends every 8.2 s
    assert exc.value.retry_after_s == math.ceil(4000 * 0.082 / 40) == 9


def test_each_decode_replica_is_priced_with_its_own_figures_and_fitted_ones_first():
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=None, max_waiting_prompt_tokens=None,
                                           tpot_slo_s=0.05))
    tickets = [a.admit(10, max_tokens=100) for _ in range(30)]
    # a 70B decode pool: steps of 34 ms whatever the batch (one replica's fit), and a replica
    # that joined and has only run single sequences (no fit: 34 ms a sequence)
    fitted = {"decode_s_per_seq": 1e-4, "decode_step_fixed_s": 0.034}
    a.observe_workers("decode", [fitted, fitted, {"decode_s_per_seq": 0.034}])
    assert a.predicted_step_s() == pytest.approx(0.034 + 10 * 1e-4)      # 30 sequences over 3 replicas
    a.check_before_tokenizing()
    # two fits: the slower replica's whole step, not one's fixed cost beside the other's slope
    a.observe_workers("decode", [{"decode_s_per_seq": 1e-4, "decode_step_fixed_s": 0.034},
                                 {"decode_s_per_seq": 0.003, "decode_step_fixed_s": 0.0}])
    assert a.predicted_step_s() == pytest.approx(max(0.034 + 15 * 1e-4, 15 * 0.003))
    # with no fit anywhere, the per-sequence figures are all there is
    a.observe_workers("decode", [{"decode_s_per_seq": 0.034}])
    assert a.predicted_step_s() == pytest.approx(30 * 0.034)
    with pytest.raises(Overloaded):
        a.check_before_tokenizing()
    assert len(tickets) == 30


def test_colocated_requests_are_priced_with_the_prefill_they_bring_to_the_decode_steps():
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=None, max_waiting_prompt_tokens=None,
                                           tpot_slo_s=0.1), prefill_on_decode_steps=True)
    # 5 ms fixed, 1 ms a sequence, 0.25 ms a prompt token; the steps' recent prefill is not counted
    # twice: the running requests' prompts stand for it
    a.observe_workers("colocated", [{"decode_s_per_seq": 0.001, "decode_step_fixed_s": 0.005,
                                     "decode_s_per_prefill_token": 0.00025, "prefill_s_per_step": 0.05}])
    # a 256-token prompt over 64 output tokens: 4 prompt tokens per step, 1 ms; 2 ms a step in all
    tickets = [a.admit(256, max_tokens=64) for _ in range(37)]
    assert a.prefill_tokens_per_step == pytest.approx(37 * 4)
    assert a.predicted_step_s() == pytest.approx(0.005 + 37 * 0.002)
    with pytest.raises(Overloaded) as exc:
        a.admit(256, max_tokens=64)                    # the 38th: 81 ms
    assert exc.value.reason == "tpot_slo"
    a.finished(tickets.pop())                          # 77 ms
    tickets.append(a.admit(16, max_tokens=64))         # a short prompt fits: 78.06 ms
    with pytest.raises(Overloaded):
        a.admit(256, max_tokens=64)                    # a long one does not: 80.06 ms
    for ticket in tickets:
        a.finished(ticket, output_tokens=16)           # they stopped early: 16 tokens each
    assert a.mean_output_tokens < 40
    short = a.admit(256, max_tokens=64)                # expected to run ~16+ steps, not 64
    assert short.prefill_tokens_per_step == pytest.approx(256 / a.mean_output_tokens)
    assert short.prefill_tokens_per_step > 256 / 40
    disaggregated = AdmissionControl(a.settings)       # its decode replicas do not prefill
    assert disaggregated.admit(256, max_tokens=64).prefill_tokens_per_step == 0.0


def test_the_step_cost_fit_separates_decodes_from_prefill_chunks_in_mixed_steps():
    import random

    from engine.step_cost import REFIT_EVERY, StepCostFit
    rng = random.Random(0)
    fit = StepCostFit()
    tokens_seen = []
    for i in range(256):
        seqs, tokens = rng.randint(1, 48), rng.choice([64, 128, 256, 512])   # every step also prefills
        tokens_seen.append(tokens)
        fit.add(seqs, tokens, (0.004 + 0.0015 * seqs + 0.0002 * tokens) * rng.uniform(0.97, 1.03))
        if i + 1 < REFIT_EVERY:
            assert fit.cost is None                    # too few steps to fit yet
    cost = fit.cost
    assert cost.per_seq_s == pytest.approx(0.0015, rel=0.05)
    assert cost.per_prefill_token_s == pytest.approx(0.0002, rel=0.05)
    assert cost.fixed_s == pytest.approx(0.004, abs=0.002)
    assert cost.prefill_s_per_step == pytest.approx(0.0002 * sum(tokens_seen) / 256, rel=0.05)
    same_batch = StepCostFit()
    for _ in range(64):
        same_batch.add(8, 128, 0.05)
    assert same_batch.cost is None                     # one batch size: the per-sequence cost is unknown


def test_a_replica_that_decoded_only_lone_requests_is_not_held_to_one_for_good():
    # A 70B decode step: 34 ms fixed, 0.5 ms a sequence; TPOT SLO 50 ms (40 ms with the headroom).
    # One request decoded alone before the load came: one batch size, no fit yet.
    from engine.step_cost import EngineCosts

    def step(seqs, tokens=0):
        return 0.034 + 0.0005 * seqs + 0.0002 * tokens

    for colocated in (False, True):
        costs = EngineCosts(warmup_steps=0)
        a = AdmissionControl(AdmissionSettings(max_waiting_requests=None, max_waiting_prompt_tokens=None,
                                               tpot_slo_s=0.05), prefill_on_decode_steps=colocated)
        role = "colocated" if colocated else "decode"
        if colocated:
            costs.observe(0, 100, step(0, 100))       # the lone request's prompt step
        for _ in range(64):
            costs.observe(1, 0, step(1))
        admitted = []
        for _ in range(40):                            # rounds of 4 arrivals that decode together
            a.observe_workers(role, [costs.stats()])
            tickets = []
            for _ in range(4):
                try:
                    tickets.append(a.admit(100, max_tokens=64))
                except Overloaded:
                    pass
            for ticket in tickets:
                a.first_token(ticket)
            if colocated:
                costs.observe(len(tickets) - 1, 100, step(len(tickets) - 1, 100))
            for _ in range(64):
                costs.observe(len(tickets), 0, step(len(tickets)))
            for ticket in tickets:
                a.finished(ticket, 64)
            admitted.append(len(tickets))
        # two are priced at the step seen (34.5 ms); once it has run two the fit finds 0.5 ms a
        # sequence, and four (36 ms) fit the budget (before: one each round, for good)
        assert admitted[0] == 2, (colocated, admitted)
        assert admitted[-1] == 4, (colocated, admitted)
        assert costs.step_cost.cost.per_seq_s == pytest.approx(0.0005, rel=1e-3)


def test_the_step_cost_fit_refuses_a_split_its_steps_cannot_tell():
    from engine.step_cost import StepCostFit
    fit = StepCostFit()
    for i in range(64):                                # prompt-only steps and lone decodes, alternating
        fit.add(*((0, 100, 0.054) if i % 2 else (1, 0, 0.0345)))
    # three terms, two shapes: any split fits them, so none is reported (least squares had
    # given half the 34 ms to a fixed cost and half to each sequence)
    assert fit.cost is None
    decode_only = StepCostFit()
    for i in range(64):
        decode_only.add(1 + i % 2, 0, 0.034 + 0.0005 * (1 + i % 2))
    assert decode_only.cost.per_seq_s == pytest.approx(0.0005) and decode_only.cost.per_prefill_token_s == 0.0


class SlowBackend(FakeBackend):
    """Holds every request before its first token until released."""

    def __init__(self, tokenizer, vocab_size):
        super().__init__(tokenizer, vocab_size)
        self.release = threading.Event()

    async def generate(self, request_id, prompt_token_ids, params):
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out


def test_requests_answered_400_are_not_arrivals_that_make_the_server_look_overloaded():
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ensure_default_model())
    admission = AdmissionControl(AdmissionSettings(ttft_slo_s=10.0))
    admission.observe_workers("prefill", [{"prefill_s_per_token": 0.3}])    # ~1 req/s of short prompts
    app = build_openai_app(FakeBackend(tokenizer, len(tokenizer)), tokenizer, ServingMetrics(),
                           admission=admission)
    valid = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/completions", json=valid).status_code == 200
        # past the context: checked after the arrival was counted, and withdrawn
        codes = [client.post("/v1/completions", json={**valid, "max_tokens": 100_000}).status_code
                 for _ in range(8)]
        assert codes == [400] * 8
        assert not admission.overloaded()      # before: 9 arrivals in a few ms, a burst of ~100x
        assert client.post("/v1/completions", json=valid).status_code == 200
        assert admission.overloaded() is False


def test_a_busy_server_answers_429_at_once_and_serves_what_it_admitted():
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ensure_default_model())
    backend = SlowBackend(tokenizer, len(tokenizer))
    metrics = ServingMetrics()
    offered, refused = [], []                         # what an autoscaler listening to the metrics sees

    class Listener:
        def on_arrival(self, prompt_tokens, max_tokens):
            offered.append((prompt_tokens, max_tokens))

        def on_refusal(self, reason):
            refused.append(reason)

        def on_request(self, timings):
            pass
    metrics.add_listener(Listener())
    admission = AdmissionControl(AdmissionSettings(max_waiting_requests=3))
    app = build_openai_app(backend, tokenizer, metrics, admission=admission)
    with TestClient(app, raise_server_exceptions=False) as client:
        results = []

        def send():
            results.append(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}))

        held = [threading.Thread(target=send) for _ in range(3)]
        for t in held:
            t.start()
        try:       # (released whatever fails: the held requests would hold the client for ever)
            deadline = time.monotonic() + 10
            while admission.waiting_requests < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert admission.waiting_requests == 3
            # refused at once: one that joined the queue would wait as long as the held ones (for ever)
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
            r = client.post("/v1/completions", json=body, headers={"X-Stainless-Retry-Count": "0"})   # a first try
            assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
            assert int(r.headers["Retry-After"]) >= 1
            arrivals = len(admission._arrivals)
            # the openai client's retry of it: refused again, and no second arrival of the same demand
            retry = client.post("/v1/completions", json=body, headers={"X-Stainless-Retry-Count": "1"})
            assert retry.status_code == 429 and len(admission._arrivals) == arrivals == 4
        finally:
            backend.release.set()
        for t in held:
            t.join(timeout=30)
        # its second retry is served, as demand counted once (at the first try)
        assert client.post("/v1/completions", json=body, headers={"X-Stainless-Retry-Count": "2"}).status_code == 200
        assert len(admission._arrivals) == arrivals
        # every refusal retried: a request that says it is a retry now is an arrival (the header is the client's)
        assert client.post("/v1/completions", json=body, headers={"X-Stainless-Retry-Count": "1"}).status_code == 200
        assert len(admission._arrivals) == arrivals + 1
        assert [x.status_code for x in results] == [200, 200, 200]
        assert admission.waiting_requests == 0 and admission.waiting_tokens == 0
        # each ended with its 3 tokens: the output length the TPOT bound expects next
        assert admission.running == 0 and admission.mean_output_tokens == pytest.approx(3)
        text = client.get("/metrics").text
        assert 'pdserve_requests_rejected_total{reason="queue_requests"} 2.0' in text     # every 429
    # the refused request is demand too (refused before tokenizing: no prompt length)
    prompt_len = len(tokenizer("Hi")["input_ids"])
    # (the three held, the last one, that says it is a retry of nothing)
    assert sorted(offered, key=lambda n: n[0] is None) == [(prompt_len, 3)] * 4 + [(None, None)]
    assert refused == ["queue_requests"]


def test_the_deployment_file_sets_the_overload_wait_bound():
    from cluster.config import DeploymentConfig
    config = DeploymentConfig.model_validate({"slo": {"ttft_ms": 800}, "admission": {"overload_wait_factor": 0.5}})
    settings = config.admission.settings(config.slo)
    assert (settings.ttft_slo_s, settings.overload_wait_factor) == (0.8, 0.5)
    off = DeploymentConfig.model_validate({"admission": {"overload_wait_factor": None}})
    assert off.admission.settings(off.slo).overload_wait_factor is None
    assert DeploymentConfig().admission.settings(DeploymentConfig().slo).overload_wait_factor == 0.25


def test_the_choices_of_one_prompt_are_admitted_as_one_prompt_on_an_idle_server():
    """n choices share one prompt: its prefill is checked once, so an idle server admits
    them whatever the TTFT or overload rules say of a second copy of the prompt (each
    choice checked on its own refused the second on every retry, for ever)."""
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0, max_waiting_prompt_tokens=1000), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 2e-3}])      # 600 tokens: 1.2 s, alone
    tickets = a.admit_choices(600, 16, 4)
    assert [t.prompt_tokens for t in tickets] == [600, 0, 0, 0]
    assert (a.waiting_requests, a.waiting_tokens, a.running) == (4, 600, 4)
    with pytest.raises(Overloaded) as exc:
        a.admit_choices(100, 16, 2)                 # behind them: 1.4 s predicted
    assert exc.value.reason == "ttft_slo" and (a.waiting_requests, a.running) == (4, 4)
    for t in tickets:
        a.first_token(t)
        a.finished(t, 16)
    assert (a.waiting_requests, a.waiting_tokens, a.running) == (0, 0, 0)


def test_a_request_of_many_sequences_is_held_to_the_request_bound_whole():
    # n's choices and a batch's prompts: 1,000 waiting under a bound of 1,024 let a batch of 256 prompts x 16
    # choices queue 5,096 (the bound was checked before tokenizing only); an idle server still takes it
    a = AdmissionControl(AdmissionSettings(max_waiting_requests=8), clock=_Clock())
    assert len(a.admit_prompts([(10, 4)] * 4, 4)) == 4 and a.waiting_requests == 16    # nothing waited
    b = AdmissionControl(AdmissionSettings(max_waiting_requests=8), clock=_Clock())
    b.admit(10)
    for too_many in (lambda: b.admit_prompts([(10, 4)] * 4, 2), lambda: b.admit_choices(10, 4, 8)):
        with pytest.raises(Overloaded) as exc:
            too_many()
        assert exc.value.reason == "queue_requests" and "this one brings" in exc.value.message
        assert b.waiting_requests == 1
    assert len(b.admit_choices(10, 4, 7)) == 7 and b.waiting_requests == 8


def test_choices_refused_on_the_tpot_bound_count_nothing_and_keep_the_queue_heads_progress():
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(ttft_slo_s=10.0, tpot_slo_s=0.1, tpot_headroom=1.0), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}])
    a.observe_workers("decode", [{"decode_step_fixed_s": 0.02, "decode_s_per_seq": 0.02}])
    head = a.admit(500)
    clock.now += 0.3                                 # the head has had 0.3 s of its 0.5 s prefill
    assert a.predicted_wait_s() == pytest.approx(0.2)
    with pytest.raises(Overloaded) as exc:
        a.admit_choices(100, 16, 4)                 # 5 running: 0.02 + 5 x 0.02 = 0.12 s > 0.1 s
    assert exc.value.reason == "tpot_slo"
    assert (a.waiting_requests, a.waiting_tokens, a.running) == (1, 500, 1)
    assert a.predicted_wait_s() == pytest.approx(0.2)             # the head's progress is kept
    a.first_token(head)


def test_an_idle_server_admits_every_choice_of_a_request_past_the_tpot_bound():
    # 6 sequences on one decode replica: 0.02 + 6 x 0.02 = 0.14 s > 0.1 s; refused (and on every
    # retry) though nothing else ran, where one request alone is always admitted
    a = AdmissionControl(AdmissionSettings(tpot_slo_s=0.1, tpot_headroom=1.0), clock=_Clock())
    a.observe_workers("decode", [{"decode_step_fixed_s": 0.02, "decode_s_per_seq": 0.02}])
    tickets = a.admit_choices(100, 16, 6)
    assert len(tickets) == 6 and a.running == 6
    with pytest.raises(Overloaded) as exc:
        a.admit_choices(100, 16, 2)                 # behind them: the bound holds
    assert exc.value.reason == "tpot_slo" and a.running == 6


def test_the_later_choices_of_a_prompt_are_no_queue_heads_in_the_predicted_wait():
    # 4 prefill replicas, one 2,000-token prompt of 4 choices: one prefill runs, not four; its
    # choices counted as heads drained the queue 4x as fast as it drains
    clock = _Clock()
    a = AdmissionControl(AdmissionSettings(), clock=clock)
    a.observe_workers("prefill", [{"prefill_s_per_token": 1e-3}] * 4)
    a.admit_choices(2000, 16, 4)
    clock.now += 0.5
    assert a.predicted_wait_s() == pytest.approx((2.0 - 0.5) / 4)


def test_an_idle_server_answers_a_request_of_several_choices():
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ensure_default_model())
    admission = AdmissionControl(AdmissionSettings(ttft_slo_s=1.0))
    admission.observe_workers("prefill", [{"prefill_s_per_token": 0.03}])   # 20 tokens: 0.6 s, alone
    app = build_openai_app(FakeBackend(tokenizer, len(tokenizer)), tokenizer, ServingMetrics(),
                           admission=admission)
    body = {"model": MODEL, "prompt": list(range(10, 30)), "max_tokens": 3, "n": 3}
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(2):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text         # before: 429 every time (1.2 s for a second copy)
            assert len(r.json()["choices"]) == 3
    assert (admission.waiting_requests, admission.running) == (0, 0)


def test_a_close_cancelled_while_it_aborts_one_choice_still_closes_the_others():
    """Serve cancels the handler of a client that left while the router aborts its first
    choice: the other choices are closed all the same, their admission tickets returned
    (before, they stayed counted as waiting and running for good)."""
    from engine.sampling_params import SamplingParams
    from router.choices import Choices, Generation

    closed = []

    class Stream:
        def __init__(self, request_id):
            self.request_id = request_id

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.Event().wait()

        async def aclose(self):
            closed.append(self.request_id)
            if self.request_id.endswith("-0"):
                await asyncio.sleep(30)         # a remote abort that takes its time

    class Backend:
        def generate(self, request_id, prompt_ids, params):
            return Stream(request_id)

        def phase_timings(self, request_id):
            phases_taken.append(request_id)     # the real backend drops the request's phases here
            return None

    admission = AdmissionControl(AdmissionSettings())
    metrics = ServingMetrics()
    phases_taken = []

    async def main():
        tickets = admission.admit_choices(5, 3, 3)
        choices = Choices([Generation(Backend(), metrics, admission, f"r-{i}", [1, 2, 3, 4, 5],
                                      SamplingParams(max_tokens=3), time.monotonic(), tickets[i])
                           for i in range(3)])
        closing = asyncio.create_task(choices.close("abort"))
        await asyncio.sleep(0.05)               # in the first choice's abort
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    asyncio.run(main())
    assert closed == ["r-0", "r-1", "r-2"]
    # every choice is counted as ended and its phase record dropped, the cancelled one's too
    assert sorted(phases_taken) == ["r-0", "r-1", "r-2"]
    assert 'pdserve_requests_total{finish_reason="abort"} 3.0' in metrics.render()[0].decode()
    assert (admission.waiting_requests, admission.running) == (0, 0)


def test_a_choice_whose_stream_is_cancelled_from_below_fails_the_request_instead_of_hanging_it():
    """A cancel raised out of a choice's stream (a call its replica ended) killed the
    choice's reader without a word: the request of n choices waited for ever."""
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from router.backend import BackendUnavailableError
    from router.choices import Choices, Generation

    class Stream:
        def __init__(self, request_id):
            self.request_id, self.sent = request_id, False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.request_id.endswith("-1"):
                raise asyncio.CancelledError        # not this task's own cancel
            if self.sent:
                await asyncio.Event().wait()
            self.sent = True
            return RequestOutput(self.request_id, [1, 2, 3], "a", [7], delta_text="a", delta_token_ids=[7])

        async def aclose(self):
            pass

    class Backend:
        def generate(self, request_id, prompt_ids, params):
            return Stream(request_id)

        def phase_timings(self, request_id):
            return None

    async def main():
        choices = Choices([Generation(Backend(), ServingMetrics(), None, f"r-{i}", [1, 2, 3],
                                      SamplingParams(max_tokens=3), time.monotonic(), None) for i in range(2)])
        try:
            assert (await asyncio.wait_for(choices.next(), 5))[0] == 0
            with pytest.raises(BackendUnavailableError, match="choice 1's stream was cancelled"):
                await asyncio.wait_for(choices.next(), 5)
        finally:
            await choices.close("abort")

    asyncio.run(main())


def test_a_replica_too_slow_to_answer_its_stats_still_counts_as_running():
    """The router refreshes the replicas' figures with a bounded wait: one that did not
    answer in time is still running, and its pool's capacity is not cut to those that
    answered (admission then predicted waits for a pool of one and refused)."""
    from router.disaggregation_policy import DisaggregationPolicy, DisaggregationSettings
    a = AdmissionControl(AdmissionSettings(), clock=_Clock())
    a.observe_workers("prefill", [{"prefill_s_per_token": 0.004}], replicas=3)
    a.observe_workers("decode", [{"decode_s_per_seq": 1e-3, "decode_step_fixed_s": 5e-3}], replicas=2)
    assert (a.replicas, a.decode_replicas) == (3, 2)
    a.observe_workers("prefill", [{"prefill_s_per_token": 0.004}])          # as many as answered, by default
    assert a.replicas == 1
    policy = DisaggregationPolicy(DisaggregationSettings("always", 0, 1.0))
    policy.observe_workers("prefill", [], replicas=2)                        # none answered in time, two run
    assert not policy.prefill_pool_empty
    policy.observe_workers("prefill", [], replicas=0)
    assert policy.prefill_pool_empty


def _router_reading_stats(monkeypatch, rounds: list):
    """A Router (none of Serve's machinery) with one decode pool whose stats passes get
    `rounds` in turn (an exception there: raised by the broadcast)."""
    import router.ingress as ingress
    rounds = iter(rounds)

    async def answers(handle, method, timeout_s):
        answer = next(rounds)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ingress, "replica_answers", answers)
    router = object.__new__(ingress.Router.func_or_class)
    router._workers = {"decode": object()}
    router.policy = router.admission = router.autoscaler = None
    router.metrics = ServingMetrics()
    router._failed_passes, router._stats_failing, router._running, router._said_empty = {}, set(), {}, set()
    return router


def _stats_passes(router, n: int) -> None:
    async def main():
        seen = set()
        for _ in range(n):
            seen = await router._refresh_worker_stats_once(seen)
    asyncio.run(main())


def test_a_replica_slow_to_answer_its_stats_keeps_its_metrics_series(monkeypatch, caplog):
    """/metrics keeps the series of a replica that did not answer in time (before, they
    vanished for a second whenever a loaded replica was slow, and came back after); a
    replica gone from the pool loses them."""
    from router.serve_pools import ReplicaAnswers

    router = _router_reading_stats(monkeypatch, [
        ReplicaAnswers([{"replica": "a", "num_running": 3}, {"replica": "b", "num_running": 4}], 0, 0),
        ReplicaAnswers([{"replica": "a", "num_running": 5}], 1, 0),   # b is slow
        ReplicaAnswers([{"replica": "a", "num_running": 6}], 0, 0),   # b is gone
        ReplicaAnswers([], 1, 0),                                     # a is slow, alone
        ReplicaAnswers([], 0, 1),      # a's stats call fails once (Ray: "actor unavailable")
        ReplicaAnswers([], 0, 1)])     # and again: its engine stopped

    def series():
        text = router.metrics.render()[0].decode()
        return sorted(line for line in text.splitlines() if line.startswith("pdserve_num_requests_running"))

    async def main():
        seen = await router._refresh_worker_stats_once(set())
        assert series() == ['pdserve_num_requests_running{worker="decode-a"} 3.0',
                            'pdserve_num_requests_running{worker="decode-b"} 4.0']
        seen = await router._refresh_worker_stats_once(seen)
        assert series() == ['pdserve_num_requests_running{worker="decode-a"} 5.0',
                            'pdserve_num_requests_running{worker="decode-b"} 4.0']
        seen = await router._refresh_worker_stats_once(seen)
        assert series() == ['pdserve_num_requests_running{worker="decode-a"} 6.0']
        seen = await router._refresh_worker_stats_once(seen)
        assert series() == ['pdserve_num_requests_running{worker="decode-a"} 6.0']    # kept: only slow
        seen = await router._refresh_worker_stats_once(seen)
        assert series() == ['pdserve_num_requests_running{worker="decode-a"} 6.0']    # kept: failed once
        # the role's only replica cannot serve: its last load is not shown as if it still ran
        assert await router._refresh_worker_stats_once(seen) == set() and series() == []

    with caplog.at_level("WARNING", logger="router.ingress"):
        asyncio.run(main())
    # said when the pool became empty, not at each pass before
    assert [r.getMessage() for r in caplog.records] == \
        ["no decode worker serves: none answers its stats (routed around, or refused, until one does)"]


def test_stats_that_cannot_be_had_are_said_once_and_when_they_come_again(monkeypatch, caplog):
    from router.serve_pools import ReplicaAnswers

    router = _router_reading_stats(monkeypatch, [
        RuntimeError("the controller is away"), RuntimeError("the controller is away"),
        ReplicaAnswers([{"replica": "a", "num_running": 1}], 0, 0)])
    with caplog.at_level("WARNING", logger="router.ingress"):
        _stats_passes(router, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "no decode stats (routing, admission and autoscaling keep the last ones): "
        "RuntimeError('the controller is away')", "decode stats come again"]


def test_a_stats_pass_that_fails_does_not_freeze_the_figures_for_good(monkeypatch):
    # the refresh loop had no guard: one exception (a stat that is not a number, say) ended its task,
    # and every worker figure, the policy's and admission control's inputs with them, stayed as it was
    import router.ingress as ingress
    monkeypatch.setattr(ingress, "STATS_PERIOD_S", 0.01)
    router = object.__new__(ingress.Router.func_or_class)
    passes = []

    async def once(seen):
        passes.append(len(passes))
        if len(passes) == 1:
            raise TypeError("a stat that is not a number")
        return seen
    router._refresh_worker_stats_once = once

    async def main():
        task = asyncio.ensure_future(router._refresh_worker_stats())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(passes) > 2


def test_a_pool_with_no_worker_is_said_when_it_empties_and_again_when_one_serves_not_at_start(monkeypatch, caplog):
    from router.serve_pools import ReplicaAnswers

    one = ReplicaAnswers([{"replica": "a", "num_running": 1}], 0, 0)
    none = ReplicaAnswers([], 0, 2)
    # starting; serving; gone (failing once is not gone, twice is); back
    router = _router_reading_stats(monkeypatch, [ReplicaAnswers([], 0, 0), one, none, none, none, one])
    with caplog.at_level("WARNING", logger="router.ingress"):
        _stats_passes(router, 6)
    assert [r.getMessage() for r in caplog.records] == [
        "no decode worker serves: none answers its stats (routed around, or refused, until one does)",
        "decode workers serving again: 1"]
