"""The router's admission control in the simulator (cluster/simulator/cluster_sim.py):
refusals on a case computed by hand, the cost figures replicas report from
their simulated steps (engine/step_cost.py EngineCosts), the refusals the
autoscaler sees per role, and `pdserve simulate` reporting them as
`pdserve loadtest` would."""

from __future__ import annotations

import json

import pytest

from cluster.perf_model import LinearStepModel
from cluster.simulator import ClusterSpec, simulate
from cluster.simulator.cluster_sim import ReplicaSpec
from engine.step_cost import EngineCosts
from router.admission import AdmissionSettings

MS_PER_TOKEN = LinearStepModel((0.0, 1e-3, 0.0, 0.0, 0.0))     # a step: 1 ms per prompt token, nothing else


def _one_prompt_per_step(admission: AdmissionSettings | None) -> ClusterSpec:
    # a 100-token step budget: one 100-token prompt a step, 0.1 s each
    return ClusterSpec("colocated", decode=ReplicaSpec(MS_PER_TOKEN, 1000, 16, 64, 100), admission=admission)


def test_requests_predicted_past_the_ttft_slo_are_refused_and_the_rest_keep_it():
    # Five 100-token prompts at t=0: the k-th is predicted to wait k x 0.1 s (the replica's
    # start-up figure, 1 ms/token) and take 0.1 s more, so with a 250 ms SLO the first two
    # are admitted and the other three refused at once. At t=0.15 the second prompt has
    # had 0.05 s of its 0.1 s: a sixth is predicted at 0.05 + 0.1 s and admitted.
    settings = AdmissionSettings(ttft_slo_s=0.25, overload_wait_factor=None)
    result = simulate(_one_prompt_per_step(settings), [(100, 1)] * 6, [0.0] * 5 + [0.15])
    refused = [r.index for r in result.requests if r.refused is not None]
    assert refused == [2, 3, 4]
    assert result.refusals == {"ttft_slo": 3}
    assert [result.requests[i].refused.retry_after_s for i in refused] == [1, 1, 1]
    ttfts = {r.index: r.token_times[0] - r.send_time for r in result.requests if r.refused is None}
    assert ttfts == pytest.approx({0: 0.1, 1: 0.2, 5: 0.15})
    # without admission control every prompt queues: the fifth waits 0.4 s
    unguarded = simulate(_one_prompt_per_step(None), [(100, 1)] * 6, [0.0] * 5 + [0.15])
    assert unguarded.refusals == {} and unguarded.requests[4].token_times[0] == pytest.approx(0.5)


def test_refused_requests_are_429_records_and_count_as_failed():
    from bench.loadtest.metrics import summarize
    settings = AdmissionSettings(ttft_slo_s=0.25, overload_wait_factor=None)
    result = simulate(_one_prompt_per_step(settings), [(100, 1)] * 5, [0.0] * 5)
    records = result.records()
    assert [r.status for r in records] == [200, 200, 429, 429, 429]
    assert "past the 250 ms this server admits" in records[2].error
    summary = summarize(records, num_requests=5, duration=result.duration, slos_ms={"ttft": 250})
    assert (summary.completed, summary.failed) == (2, 3)
    assert summary.slo_attainment == pytest.approx(2 / 5)


def test_the_queue_bound_refuses_past_it_without_an_slo():
    result = simulate(_one_prompt_per_step(AdmissionSettings(max_waiting_requests=3)), [(100, 1)] * 5, [0.0] * 5)
    assert result.refusals == {"queue_requests": 2}
    assert [r.refused is not None for r in result.requests] == [False, False, False, True, True]


def test_replicas_report_what_their_steps_measured_once_warm():
    costs = EngineCosts(warmup_steps=2, start_prefill_s_per_token=0.004)
    costs.observe(0, 100, 1.0)                 # warm-up: left out
    costs.observe(4, 0, 1.0)
    assert costs.stats() == {"prefill_s_per_token": 0.004}
    costs.observe(0, 100, 0.2)                 # 2 ms a prompt token
    costs.observe(0, 100, 0.9, borrowed_cores=True)   # faster or slower on lent cores: not its own figure
    costs.observe(4, 0, 0.04)                  # 8 ms a sequence, for one more than it ran (no fit yet)
    costs.observe(2, 0, 0.04)                  # 13.3 ms: the EWMA moves a fifth of the way
    assert costs.stats() == pytest.approx({"prefill_s_per_token": 0.002,
                                           "decode_s_per_seq": 0.8 * 0.008 + 0.2 * 0.04 / 3})


def test_the_simulated_router_prices_prompts_with_the_replicas_measured_cost():
    # a step costs 50 ms plus 1 ms a prompt token: the start-up figure, from one 100-token
    # calibration prompt, is 1.5 ms/token; 50-token prompts measure 2 ms/token once the
    # replica is past its 20 warm-up steps, and the router's figure follows them
    model = LinearStepModel((0.05, 1e-3, 0.0, 0.0, 0.0))
    spec = ClusterSpec("colocated", decode=ReplicaSpec(model, 1000, 16, 64, 100),
                       admission=AdmissionSettings(ttft_slo_s=10.0))
    from cluster.simulator.cluster_sim import _Simulation
    sim = _Simulation(spec, None, float("inf"))
    refreshed = []
    sim.admission.observe_workers = lambda role, stats: refreshed.append((sim.now, stats[0]["prefill_s_per_token"]))
    sim.run([(50, 1)] * 30, [i * 0.2 for i in range(30)])
    assert refreshed[0] == (0.0, pytest.approx(1.5e-3))
    assert refreshed[-1][1] == pytest.approx(2e-3)
    assert [t for t, _ in refreshed[:3]] == pytest.approx([0.0, 1.0, 2.0])      # the router's period
    assert sim.decode_pool[0].costs.num_steps == 30


def test_the_autoscaler_sees_refusals_on_the_role_they_count_against():
    from cluster.autoscaler.policy import AutoscaleSettings, Decision
    from cluster.simulator.autoscaling import SimAutoscaler

    class RecordingPolicy:
        def __init__(self, settings):
            self.settings = settings
            self.observations = []

        def decide(self, obs):
            self.observations.append(obs)
            targets = {r: obs.roles[r].running for r in self.settings.roles}
            return Decision(targets, {r: "held" for r in targets}, 0.0, {})

    replica = ReplicaSpec(MS_PER_TOKEN, 1000, 16, 64, 100)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       admission=AdmissionSettings(ttft_slo_s=0.25, overload_wait_factor=None))
    policy = RecordingPolicy(AutoscaleSettings(ttft_slo_s=0.25, tpot_slo_s=0.1, interval_s=1.0))
    result = simulate(spec, [(100, 2)] * 5, [0.0] * 5, autoscaler=SimAutoscaler(policy))
    assert result.refusals == {"ttft_slo": 3}
    first = policy.observations[0]
    assert (first.arrivals, first.refused) == (5, {"prefill": 3})


def test_pdserve_simulate_refuses_with_the_slo_given(tmp_path):
    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-4, 0.0, 5e-4, 0.0)).to_json()))
    results = {}
    for name, flags in {"no slo": [], "slo": ["--slo", "ttft:300", "tpot:50"]}.items():
        code = main(["simulate", "--config", "configs/tiny-cpu.yaml", "--profile", str(profile), "--num-prompts",
                     "200", "--request-rate", "100", "--random-input-len", "400", "--random-output-len", "16",
                     "--save-result", "--result-dir", str(tmp_path), "--result-file", "r.json", *flags])
        assert code == 0
        results[name] = json.loads((tmp_path / "r.json").read_text())
    # ~0.04 s a 400-token prompt on one prefill replica: ~25 req/s, offered 100
    assert results["no slo"]["refusals"] == {} and results["no slo"]["completed"] == 200
    refused = results["slo"]["refusals"]
    assert set(refused) <= {"ttft_slo", "overload", "tpot_slo"} and sum(refused.values()) >= 100
    assert results["slo"]["completed"] + sum(refused.values()) == 200
    assert results["slo"]["p99_ttft_ms"] < 0.5 * results["no slo"]["p99_ttft_ms"]
