"""The simulator with the autoscaling policy driving its pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.autoscaler.capacity import prefill_capacity
from cluster.autoscaler.policy import AutoscaleSettings, Decision, GoodputPolicy
from cluster.perf_model.linear_model import LinearStepModel
from cluster.simulator.autoscaling import SimAutoscaler
from cluster.simulator.cluster_sim import ClusterSpec, ReplicaSpec, simulate

MODEL = LinearStepModel((5e-3, 1e-4, 0.0, 1e-3, 1e-6))
SPEC = ReplicaSpec(MODEL, num_kv_blocks=100_000)


def run(prefill: int, decode: int, lengths, arrivals, **settings):
    spec = ClusterSpec("disaggregated", prefill=SPEC, decode=SPEC, prefill_replicas=prefill,
                       decode_replicas=decode, kv_bytes_per_token=1000)
    s = AutoscaleSettings(**{"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "budget": 4, "interval_s": 10.0,
                             "startup_s": 5.0, **settings})
    return simulate(spec, lengths, arrivals, autoscaler=SimAutoscaler(GoodputPolicy(s, {"prefill": MODEL,
                                                                                        "decode": MODEL})))


def steady(rate: float, seconds: float, prompt: int, output: int):
    n = int(rate * seconds)
    return [(prompt, output)] * n, [i / rate for i in range(n)]


def test_a_replica_asked_for_serves_after_startup_and_counts_from_the_asking():
    cap = prefill_capacity(MODEL, 2000, 1.0)
    lengths, arrivals = steady(1.5 * cap, 60.0, 2000, 4)          # needs two prefill replicas
    result = run(1, 1, lengths, arrivals, budget=3, downscale_cooldown_s=1000.0)
    first = result.timeline[0]
    assert first["time_s"] == 10.0 and first["targets"]["prefill"] == 2 and first["running"]["prefill"] == 1
    assert result.timeline[1]["running"]["prefill"] == 2          # ready at 15 s, seen at 20 s
    # one prefill replica from 0, one from its asking at 10 s; one decode replica throughout
    assert result.replica_seconds["prefill"] == pytest.approx(result.duration + (result.duration - 10.0))
    assert result.replica_seconds["decode"] == pytest.approx(result.duration)
    assert all(r.end_time is not None for r in result.requests)


def test_scaled_down_replicas_finish_what_they_hold_and_leave():
    lengths, arrivals = steady(0.5, 120.0, 100, 400)               # light: 3 decode replicas are too many
    result = run(1, 3, lengths, arrivals, downscale_cooldown_s=0.0, downscale_window_s=0.0)
    decode_running = [e["running"]["decode"] for e in result.timeline]
    assert decode_running[0] == 3 and decode_running[-1] == 1
    assert all(b >= a - 1 for a, b in zip(decode_running, decode_running[1:]))   # one at a time
    assert all(r.end_time is not None and len(r.token_times) == 400 for r in result.requests)
    assert result.replica_seconds["decode"] < 3 * result.duration


def _most_ranks_at_once(spans, tp: dict[str, int]) -> int:
    events = sorted([(start, tp[role]) for role, start, _ in spans] + [(stop, -tp[role]) for role, _, stop in spans],
                    key=lambda e: (e[0], e[1]))        # a replica leaving frees its ranks before one arrives
    held = most = 0
    for _, change in events:
        held += change
        most = max(most, held)
    return most


class ScriptedPolicy:
    """Targets by time (the latest entry at or before the decision), recording what it was shown."""

    def __init__(self, settings: AutoscaleSettings, script: list[tuple[float, dict[str, int]]]):
        self.settings, self.script, self.seen = settings, script, []

    def decide(self, obs):
        self.seen.append(obs)
        targets = [t for at, t in self.script if at <= obs.now][-1]
        return Decision(dict(targets), {r: "scripted" for r in targets}, 0.0, {})


def test_a_re_split_at_the_budget_starts_the_new_replica_once_the_old_one_drained():
    """Budget 3 ranks, 1 prefill + 2 decode, both decoders running long answers;
    at 10 s the split becomes 2 + 1. The decode replica scaled down holds its
    device until its answers end; the new prefill replica is placed then (and
    counted as starting meanwhile), not beside it."""
    lengths, arrivals = steady(2.0, 4.0, 100, 2000)                # 8 answers of ~12 s, on both decoders
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=5.0)
    policy = ScriptedPolicy(settings, [(0.0, {"prefill": 1, "decode": 2}), (10.0, {"prefill": 2, "decode": 1})])
    spec = ClusterSpec("disaggregated", prefill=SPEC, decode=SPEC, prefill_replicas=1, decode_replicas=2,
                       kv_bytes_per_token=1000)
    result = simulate(spec, lengths, arrivals, autoscaler=SimAutoscaler(policy))
    drained = [stop for role, _, stop in result.replica_spans if role == "decode" and stop < result.duration]
    added = [start for role, start, _ in result.replica_spans if role == "prefill" and start > 0]
    assert len(drained) == 1 and len(added) == 1
    assert added[0] == drained[0] > 10.0                          # placed the moment the drained one left
    assert _most_ranks_at_once(result.replica_spans, {"prefill": 1, "decode": 1}) == 3
    # while the decode replica drains, the prefill replica asked for is starting, not placed
    during = [obs for obs in policy.seen if 10.0 < obs.now < drained[0]]
    assert during
    assert all((obs.roles["prefill"].starting, obs.roles["prefill"].running) == (1, 1) for obs in during)
    assert all(len(r.token_times) == 2000 for r in result.requests)


def test_an_ask_the_next_decision_takes_back_is_cancelled_not_placed_by_a_drain_in_that_decision():
    """Budget 4: 2 prefill + 2 decode, then a third decode replica is asked for (no
    room: it waits), then the next decision wants 1 + 2. The idle prefill replica
    it drains leaves at once; its device must not go to the decode ask that the
    same decision takes back (which then drained a live decode replica)."""
    lengths, arrivals = steady(0.5, 30.0, 100, 2000)                # decoders busy throughout
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=4, interval_s=10.0, startup_s=5.0)
    policy = ScriptedPolicy(settings, [(0.0, {"prefill": 2, "decode": 2}), (10.0, {"prefill": 2, "decode": 3}),
                                       (20.0, {"prefill": 1, "decode": 2})])
    spec = ClusterSpec("disaggregated", prefill=SPEC, decode=SPEC, prefill_replicas=2, decode_replicas=2,
                       kv_bytes_per_token=1000)
    result = simulate(spec, lengths, arrivals, autoscaler=SimAutoscaler(policy))
    decode = [(start, stop) for role, start, stop in result.replica_spans if role == "decode"]
    assert decode == [(0.0, result.duration)] * 2                   # none added, none drained
    assert sum(role == "prefill" and stop < result.duration for role, _, stop in result.replica_spans) == 1


def test_the_same_seed_and_load_give_the_same_timeline():
    lengths, arrivals = steady(3.0, 60.0, 1500, 50)
    a = run(1, 1, lengths, arrivals)
    b = run(1, 1, lengths, arrivals)
    assert a.timeline == b.timeline and a.replica_seconds == b.replica_seconds


def test_pdserve_simulate_autoscale(tmp_path, capsys):
    import json

    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(MODEL.to_json()))
    args = ["simulate", "--config", "configs/tiny-cpu.yaml", "--profile", str(profile), "--num-prompts", "300",
            "--request-rate", "7.4", "--random-input-len", "1000", "--random-output-len", "8", "--seed", "1",
            "--save-result", "--result-dir", str(tmp_path), "--result-file", "r.json"]
    assert main(args + ["--autoscale"]) == 2                      # the file has no SLOs
    assert "--autoscale needs the SLOs" in capsys.readouterr().err
    # the file's own budget (the 2 ranks it starts with) leaves nothing to move: refused, as `pdserve serve` does
    assert main(args + ["--autoscale", "--slo", "ttft:400", "tpot:50"]) == 2
    assert "autoscaling could never change a replica count" in capsys.readouterr().err
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(Path("configs/tiny-cpu.yaml").read_text() + "\nautoscaling: {budget: 3}\n")
    args[2] = str(deploy)
    assert main(args + ["--autoscale", "--slo", "ttft:400", "tpot:50"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    timeline = result["autoscaler_timeline"]
    # 1k-token prompts (the context is 1,024) at 7.4 req/s: one prefill replica holds ~6.5 req/s
    # within 80% of a 400 ms TTFT,
    # so the first decision (at 10 s) asks for a second one; outputs of 8 tokens need one decode replica
    assert timeline[0]["time_s"] == 10.0 and timeline[0]["targets"] == {"prefill": 2, "decode": 1}
    assert result["replica_seconds"]["prefill"] > result["replica_seconds"]["decode"]
    # admission control (the TTFT SLO) refuses what one prefill replica cannot serve in time,
    # mostly until the second one serves; every other request completes
    refused = sorted(r["send_offset_s"] for r in result["requests"] if r["status"] == 429)
    assert result["completed"] + len(refused) == 300 and sum(result["refusals"].values()) == len(refused)
    two = next(e["time_s"] for e in timeline if e["running"]["prefill"] == 2)
    before, after = sum(t < two for t in refused) / two, sum(t >= two for t in refused) / (result["duration"] - two)
    assert before > 5 * after


def test_pdserve_simulate_runs_what_the_file_deploys(tmp_path, capsys):
    """A file with autoscaling enabled autoscales (as pdserve serve --config would)
    without --autoscale; a profile measured at another TP degree than a pool's,
    or a tokenizer that cannot load, is refused with a message, not a traceback."""
    import json

    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**MODEL.to_json(), "meta": {"tp": 1}}))
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(Path("configs/tiny-cpu.yaml").read_text()
                      + "\nautoscaling: {enabled: true, budget: 3}\nslo: {ttft_ms: 400, tpot_ms: 50}\n")
    args = ["simulate", "--config", str(deploy), "--profile", str(profile), "--num-prompts", "100",
            "--request-rate", "7.4", "--random-input-len", "1000", "--random-output-len", "8", "--seed", "1",
            "--save-result", "--result-dir", str(tmp_path), "--result-file", "r.json"]
    assert main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["autoscaler_timeline"]
    capsys.readouterr()
    tp2 = tmp_path / "tp2.yaml"
    tp2.write_text(Path("configs/tiny-cpu-tp2.yaml").read_text())
    assert main(["simulate", "--config", str(tp2), *args[3:]]) == 2
    assert "the profile was measured at TP 1, and the deployment's pools decode (TP 2)" in capsys.readouterr().err
    assert main([*args, "--tokenizer", str(tmp_path / "nowhere")]) == 2
    assert "error: cannot load a tokenizer from" in capsys.readouterr().err


def test_on_a_lending_machine_the_policy_counts_the_cores_a_decode_replica_borrows():
    """2 cores, 2 prefill + 1 decode (budget 3), an output-heavy load one decode
    replica on its own core cannot hold within the TPOT budget but can on two:
    the simulated replica borrows the idle prefill cores, the policy sees it in
    the steps and keeps the split; told nothing of lending, it re-splits."""
    from cluster.autoscaler.lending import ScaledStepModel
    lender = ReplicaSpec(MODEL, num_kv_blocks=100_000, in_core_ledger=True)
    borrower = ReplicaSpec(MODEL, num_kv_blocks=100_000, in_core_ledger=True,
                           wide_model=ScaledStepModel(MODEL, 0.55))
    spec = ClusterSpec("disaggregated", prefill=lender, decode=borrower, prefill_replicas=2, decode_replicas=1,
                       kv_bytes_per_token=1000, shared_cores=2, lend_idle_cores=True)
    lengths, arrivals = steady(3.5, 60.0, 200, 256)
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, budget=3, interval_s=10.0, startup_s=5.0,
                                 downscale_cooldown_s=0.0, lend_idle_cores=True)

    def targets(shared_cores):
        policy = GoodputPolicy(settings, {"prefill": MODEL, "decode": MODEL}, shared_cores=shared_cores)
        result = simulate(spec, lengths, arrivals, autoscaler=SimAutoscaler(policy))
        return {tuple(sorted(e["targets"].items())) for e in result.timeline}, policy

    seen, policy = targets(2)
    assert seen == {(("decode", 1), ("prefill", 2))}
    assert policy.lent_speedup.num_observed > 100
    assert 0.5 < policy.lent_speedup.factor(1, 2) < 0.65      # what the simulated borrowed steps took
    seen, _ = targets(None)
    assert (("decode", 2), ("prefill", 1)) in seen
