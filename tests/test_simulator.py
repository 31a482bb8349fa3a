"""The cluster simulator on cases whose answers are known by hand: queueing on
one replica with fixed step times, preemption exactly when the KV pool runs
out, a hand-off costing exactly its modelled time, conditional routing, and
determinism; and `pdserve simulate` writing loadtest's JSON keys."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from cluster.perf_model import LinearStepModel
from cluster.simulator import ClusterSpec, simulate
from cluster.simulator.cluster_sim import ReplicaSpec

T = 0.01
FIXED = LinearStepModel((T, 0.0, 0.0, 0.0, 0.0))      # every step takes T, whatever it holds


def _colocated(num_blocks=1000, block_size=16, max_num_seqs=256, replicas=1) -> ClusterSpec:
    return ClusterSpec("colocated", decode=ReplicaSpec(FIXED, num_blocks, block_size, max_num_seqs, 2048),
                       decode_replicas=replicas)


def _times(result, i):
    return result.requests[i].token_times


def test_one_request_at_a_time_queues_exactly():
    result = simulate(_colocated(max_num_seqs=1), [(10, 3)] * 3, [0.0, 0.0, 0.0])
    assert [_times(result, i) for i in range(3)] == [
        pytest.approx([T, 2 * T, 3 * T]), pytest.approx([4 * T, 5 * T, 6 * T]), pytest.approx([7 * T, 8 * T, 9 * T])]
    assert result.duration == pytest.approx(9 * T)


def test_arrival_during_a_step_waits_for_it():
    # one-step requests: the second arrives mid-step and starts when it ends; the third finds it idle
    result = simulate(_colocated(), [(5, 1)] * 3, [0.0, 0.5 * T, 5 * T])
    ttfts = [r.token_times[0] - r.send_time for r in result.requests]
    assert ttfts == pytest.approx([T, 1.5 * T, T])


def test_batching_serves_concurrent_requests_in_the_same_steps():
    result = simulate(_colocated(), [(5, 4)] * 8, [0.0] * 8)
    assert all(r.token_times == pytest.approx([T, 2 * T, 3 * T, 4 * T]) for r in result.requests)
    assert result.num_steps == 4


def test_preemption_happens_when_the_pool_runs_out_and_the_victim_recomputes():
    # 4 blocks of 4 tokens; two 6-token prompts take 2 blocks each. The 9th token of the
    # older sequence needs a third block in step 4: the newer one is preempted then,
    # readmitted once the older one finishes (step 5 frees its blocks) and recomputes
    # its 9 tokens in step 6.
    spec = _colocated(num_blocks=4, block_size=4, max_num_seqs=2)
    result = simulate(spec, [(6, 5), (6, 5)], [0.0, 0.0])
    assert result.num_preemptions == 1
    assert _times(result, 0) == pytest.approx([T, 2 * T, 3 * T, 4 * T, 5 * T])
    assert _times(result, 1) == pytest.approx([T, 2 * T, 3 * T, 6 * T, 7 * T])


def test_the_hand_off_adds_exactly_its_modelled_time():
    replica = ReplicaSpec(FIXED, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       kv_bytes_per_token=1000.0, kv_bandwidth_bytes_per_s=1e6, kv_latency_s=0.01)
    result = simulate(spec, [(100, 3)], [0.0])
    transfer = 0.01 + 100 * 1000.0 / 1e6
    assert _times(result, 0) == pytest.approx([T, T + transfer + T, T + transfer + 2 * T])
    assert result.num_local_prefills == 0


def test_hand_offs_between_one_pair_move_one_after_another():
    # four prompts prefilled in one step: the pair's link moves their 100 KB each in turn, each with its
    # latency (the transport sends a pair's transfers in order, each acknowledged before the next); each
    # took the whole link before
    replica = ReplicaSpec(FIXED, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       kv_bytes_per_token=1000.0, kv_bandwidth_bytes_per_s=1e6, kv_latency_s=0.01)
    result = simulate(spec, [(100, 2)] * 4, [0.0] * 4)
    transfer = 100 * 1000.0 / 1e6
    # the first is in at T + 0.01 + 0.1 and decoded in the next step; each of the others 0.11 s later,
    # the decode replica's steps of T fitting between them
    ends = [T + (i + 1) * (0.01 + transfer) for i in range(4)]
    assert sorted(_times(result, i)[1] for i in range(4)) == pytest.approx([e + T for e in ends])


def test_a_prefill_pool_emptied_between_the_routers_looks_sends_prompts_to_the_decode_replicas():
    """With autoscaling.min_replicas.prefill 0, the last prefill replica can retire
    between two stats refreshes: the router has not seen the pool empty yet, and a
    prompt arriving then is prefilled on a decode replica (it raised ValueError)."""
    from cluster.simulator.cluster_sim import _Simulation
    replica = ReplicaSpec(FIXED, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       policy="always")
    sim = _Simulation(spec, None, float("inf"))
    sim.at(0.1, sim.prefill_pool.clear)            # after the refresh at 0, before the one at 1 s
    result = sim.run([(100, 3)], [0.2])
    assert result.num_local_prefills == 1 and _times(result, 0) == pytest.approx([0.2 + T, 0.2 + 2 * T, 0.2 + 3 * T])


def test_conditional_policy_prefills_short_prompts_on_the_decode_worker():
    replica = ReplicaSpec(FIXED, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       policy="conditional", local_prefill_max_tokens=50, kv_latency_s=0.5)
    result = simulate(spec, [(20, 2), (200, 2)], [0.0, 1.0])
    assert [r.prefilled_locally for r in result.requests] == [True, False]
    assert _times(result, 0) == pytest.approx([T, 2 * T])              # no hand-off
    assert _times(result, 1) == pytest.approx([1 + T, 1 + T + 0.5 + T])


def test_conditional_routing_is_the_live_routers_own_decision():
    # 1 ms a prompt token on either side, hand-offs of 2 s. At t=1 six 400-token prompts arrive
    # together: the live policy sends two to the prefill replica (0 and 0.4 s of prompts ahead,
    # within the 0.5 s it waits), then prices the rest at the decode replica's prompts sent and
    # not yet answered + its own (0.4, 0.8, 1.2, 1.6 s) against the prefill pool's wait + its own
    # + the hand-off (0.8 + 0.4 + 2 s): all four local. (The simulator's own pricing, without the
    # hand-off, had sent the fifth to the prefill replica.)
    per_token = LinearStepModel((0.0, 1e-3, 0.0, 0.0, 0.0))
    replica = ReplicaSpec(per_token, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       policy="conditional", local_prefill_max_tokens=16, kv_latency_s=2.0)
    result = simulate(spec, [(400, 2)] * 7, [0.0] + [1.0] * 6)
    assert [r.prefilled_locally for r in result.requests] == [False] * 3 + [True] * 4


def test_max_concurrency_holds_requests_back():
    result = simulate(_colocated(), [(5, 2)] * 4, [0.0] * 4, max_concurrency=2)
    sends = sorted(r.send_time for r in result.requests)
    assert sends == pytest.approx([0.0, 0.0, 2 * T, 2 * T])


def test_same_seed_same_result_and_ten_thousand_requests_run(tmp_path):
    from bench.loadtest.arrivals import arrival_offsets
    model = LinearStepModel((1e-3, 1e-5, 1e-9, 5e-5, 1e-7))
    replica = ReplicaSpec(model, 4000, max_num_seqs=64)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=2,
                       kv_bytes_per_token=1e4, kv_latency_s=0.005)
    lengths = [(100 + (i * 37) % 400, 20 + (i * 11) % 50) for i in range(10_000)]
    first = simulate(spec, lengths, arrival_offsets(len(lengths), 40.0, 1.0, seed=3))
    second = simulate(spec, lengths, arrival_offsets(len(lengths), 40.0, 1.0, seed=3))
    assert [r.token_times for r in first.requests] == [r.token_times for r in second.requests]
    assert all(r.end_time is not None for r in first.requests)
    other = simulate(spec, lengths, arrival_offsets(len(lengths), 40.0, 1.0, seed=4))
    assert [r.token_times for r in other.requests] != [r.token_times for r in first.requests]


def test_shared_cores_are_shared_by_the_steps_running_and_the_streams():
    # one 2-thread replica on 2 cores, 0.5 core of serving per request streaming: the prefill
    # step (nothing streams yet) takes T, the decode steps after it (2 + 0.5) / 2 x T
    spec = ClusterSpec("colocated", decode=ReplicaSpec(FIXED, 1000, threads=2), shared_cores=2.0,
                       serving_cores_per_stream=0.5)
    result = simulate(spec, [(5, 3)], [0.0])
    assert _times(result, 0) == pytest.approx([T, 2.25 * T, 3.5 * T])
    assert result.mean_stretch == {"colocated": pytest.approx((1 + 1.25 + 1.25) / 3)}
    # two 1-thread replicas on 1 core: the second request goes to the idle replica at 0.1 T; from
    # then on both steps run at half speed, so the first ends at 0.1 + 2 x 0.9 = 1.9 T, and the
    # second, with 0.1 T of work left then, alone at full speed at 2.0 T
    spec = ClusterSpec("colocated", decode=ReplicaSpec(FIXED, 1000), decode_replicas=2, shared_cores=1.0)
    result = simulate(spec, [(5, 1), (5, 1)], [0.0, 0.1 * T])
    assert [r.token_times[0] for r in result.requests] == pytest.approx([1.9 * T, 2.0 * T])
    assert result.mean_stretch == {"colocated": pytest.approx((1.9 + 1.9) / 2)}
    # many steps ending and starting while others run: none ever runs faster than alone
    model = LinearStepModel((T, 1e-4, 0.0, 1e-4, 0.0))
    replica = ReplicaSpec(model, 1000)
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       shared_cores=2.0, serving_cores_per_stream=0.2)
    result = simulate(spec, [(50, 20)] * 30, [i * 3 * T for i in range(30)])
    assert min(result.mean_stretch.values()) > 1.0
    # a device per replica (the default): the model's time
    result = simulate(_colocated(replicas=2), [(5, 1), (5, 1)], [0.0, 0.1 * T])
    assert [r.token_times[0] for r in result.requests] == pytest.approx([T, 1.1 * T])


def test_idle_cores_are_lent_to_decode_steps_and_kept_for_the_step():
    # 1 prefill + 1 decode, 1 thread each on 2 cores; with both cores a step takes T / 2
    replica = ReplicaSpec(FIXED, 1000, in_core_ledger=True, wide_model=LinearStepModel((T / 2, 0, 0, 0, 0)))
    spec = ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=1, decode_replicas=1,
                       shared_cores=2.0, lend_idle_cores=True)
    # the prefill replica never borrows (its step takes T though the decode replica is idle); the
    # decode steps after the hand-off borrow its core
    result = simulate(spec, [(100, 3)], [0.0])
    assert _times(result, 0) == pytest.approx([T, 1.5 * T, 2 * T])
    # a second prompt reaches the prefill replica at 1.25 T, mid-way through the decode replica's
    # borrowed step: 3 threads on 2 cores, both at 2/3 speed. The decode step's last 0.25 T of work
    # takes 0.375 T (ends 1.625 T); its next step finds the lender busy: T on its own core. The
    # prefill step's 0.75 T left at 1.625 T runs at full speed: its first token at 2.375 T
    result = simulate(spec, [(100, 3), (100, 3)], [0.0, 1.25 * T])
    assert _times(result, 0) == pytest.approx([T, 1.625 * T, 2.625 * T])
    assert _times(result, 1)[0] == pytest.approx(2.375 * T)
    # 1 prefill + 2 decode on 2 cores: two decode replicas at work leave no core to borrow
    two = dataclasses.replace(spec, decode_replicas=2)
    result = simulate(two, [(100, 3), (100, 3)], [0.0, 0.0])
    assert [r.token_times[1] - r.token_times[0] for r in result.requests] == pytest.approx([T, T])
    # lending off: the decode replica keeps its own core
    result = simulate(dataclasses.replace(spec, lend_idle_cores=False), [(100, 3)], [0.0])
    assert _times(result, 0) == pytest.approx([T, 2 * T, 3 * T])
    # a replica outside the ledger (a TP gang) neither lends nor borrows
    outside = dataclasses.replace(replica, in_core_ledger=False)
    result = simulate(dataclasses.replace(spec, prefill=outside), [(100, 3)], [0.0])
    assert _times(result, 0) == pytest.approx([T, 2 * T, 3 * T])


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="needs at least one prefill replica"):
        ClusterSpec("disaggregated", decode=ReplicaSpec(FIXED, 10))
    with pytest.raises(ValueError, match="mode must be"):
        ClusterSpec("split", decode=ReplicaSpec(FIXED, 10))
    with pytest.raises(ValueError, match="shared_cores must be > 0"):
        ClusterSpec("colocated", decode=ReplicaSpec(FIXED, 10), shared_cores=0.0)
    with pytest.raises(ValueError, match="lend_idle_cores needs shared_cores"):
        ClusterSpec("colocated", decode=ReplicaSpec(FIXED, 10), lend_idle_cores=True)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        simulate(_colocated(), [(0, 3)], [0.0])


def test_past_max_model_len_the_router_answers_400_or_cuts_the_output_and_the_rest_is_served():
    # as the live router: a prompt that leaves no room, or an output past the context, is refused
    # (400): a request that cannot fit must not sit in a replica for ever, nor hold up the requests
    # behind it; an output the prompt leaves less room for is cut to the room left
    spec = dataclasses.replace(_colocated(num_blocks=8, block_size=16), max_model_len=64)
    result = simulate(spec, [(100, 3), (8, 2), (8, 65), (60, 10)], [0.0, 0.0, 0.0, 0.0])
    records = sorted(result.records(), key=lambda r: r.index)
    assert [(r.status, r.succeeded) for r in records] == [(400, False), (200, True), (400, False), (200, True)]
    assert "maximum context length is 64 tokens" in records[0].error and "100 tokens in the prompt" in records[0].error
    assert "65 in the completion" in records[2].error
    assert len(_times(result, 1)) == 2 and len(_times(result, 3)) == 4      # 60 + 4 = the context


def test_a_hand_off_leaves_room_for_the_head_of_the_waiting_queue():
    # as the engine's Scheduler.reserve: 6 blocks free, a waiting sequence needs 5, a hand-off 2
    from cluster.simulator.replica import SimReplica, SimSequence
    replica = SimReplica("decode-0", FIXED, num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    replica.add(SimSequence(0, prompt_len=20, output_len=4))
    assert not replica.try_admit_prefilled(SimSequence(1, prompt_len=8, output_len=4))
    replica.waiting.clear()
    assert replica.try_admit_prefilled(SimSequence(1, prompt_len=8, output_len=4))
    # and a batch slot: at max_num_seqs 2 with one reserved, the waiting head keeps the other
    replica = SimReplica("decode-0", FIXED, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    assert replica.try_admit_prefilled(SimSequence(1, prompt_len=8, output_len=4))
    replica.add(SimSequence(0, prompt_len=4, output_len=4))
    assert not replica.try_admit_prefilled(SimSequence(2, prompt_len=8, output_len=4))
    # nor while a preempted sequence waits, whatever room is free (it would be kept behind the hand-offs)
    replica = SimReplica("decode-0", FIXED, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    replica.add(SimSequence(3, prompt_len=4, output_len=4))
    preempted = SimSequence(0, prompt_len=4, output_len=8, generated=3)
    replica.add(preempted)
    preempted.preempted = True                                                # (as _preempt marks it)
    assert not replica.try_admit_prefilled(SimSequence(1, prompt_len=8, output_len=4))
    replica.waiting.pop()
    assert replica.try_admit_prefilled(SimSequence(1, prompt_len=8, output_len=4))


def test_no_more_sequences_run_than_a_step_has_tokens_in_the_engine_and_the_simulator():
    from engine import EngineConfig
    assert EngineConfig(model="unused", max_num_seqs=256, max_num_batched_tokens=64).max_running_seqs == 64
    assert EngineConfig(model="unused", max_num_seqs=16, max_num_batched_tokens=512).max_running_seqs == 16
    spec = ReplicaSpec(FIXED, num_kv_blocks=64, max_num_seqs=256, max_num_batched_tokens=64)
    assert spec.max_num_seqs == 64 and dataclasses.replace(spec, block_size=8).max_num_seqs == 64


def test_prompts_arriving_together_are_spread_over_the_colocated_replicas():
    # the router charges a replica the prompts it just sent it: two 1,000-token prompts at once go
    # one to each replica (both had gone to replica 0, whose free blocks were not yet taken)
    per_token = LinearStepModel((0.0, 1e-3, 0.0, 0.0, 0.0))
    spec = ClusterSpec("colocated", decode=ReplicaSpec(per_token, 1000), decode_replicas=2)
    result = simulate(spec, [(1000, 1)] * 2, [0.0, 0.0])
    assert [r.token_times[0] for r in result.requests] == pytest.approx([1.0, 1.0])


def test_a_running_prompt_chunk_leaves_a_token_for_each_decode_after_it():
    # as the engine's scheduler: a long prompt prefilled in chunks ahead of a decoding sequence
    # in the running list does not take the whole step's budget from it
    from cluster.simulator.replica import SimReplica, SimSequence
    replica = SimReplica("decode-0", FIXED, num_blocks=1000, block_size=16, max_num_seqs=8,
                         max_num_batched_tokens=64)
    replica.on_token = lambda seq, now: None
    long_prompt = SimSequence(0, prompt_len=1000, output_len=4)
    replica.add(long_prompt)
    _, work = replica.schedule()                       # its first chunk: the whole budget
    replica.finish_step(work, 0.0)
    decoding = SimSequence(1, prompt_len=8, output_len=4, generated=1)
    assert replica.try_admit_prefilled(decoding)
    replica.commit_prefilled(decoding)                  # a hand-off, behind the running prompt
    shape, work = replica.schedule()
    assert [(seq.index, n) for seq, n in work] == [(0, 63), (1, 1)]


def test_the_queued_prompt_tokens_are_kept_as_sequences_come_and_go():
    # kept as a running count (the router reads it on every arrival): it must equal the sum
    import random

    from cluster.simulator.replica import SimReplica, SimSequence
    rng = random.Random(0)
    replica = SimReplica("colocated-0", FIXED, num_blocks=24, block_size=4, max_num_seqs=6,
                         max_num_batched_tokens=24)
    replica.on_token = lambda seq, now: None
    for i in range(200):
        if rng.random() < 0.5:
            replica.add(SimSequence(i, prompt_len=rng.randint(1, 30), output_len=rng.randint(1, 40)))
        _, work = replica.schedule()
        replica.finish_step(work, float(i))
        brute = sum(q.num_tokens - q.computed for q in replica.waiting) + \
            sum(q.num_tokens - q.computed for q in replica.running if q.computed < q.prompt_len)
        assert replica.queued_prefill_tokens == brute, i
    assert replica.num_preemptions > 0 and replica.waiting   # both paths were taken


def test_with_chunked_prefill_off_a_prompt_runs_whole_as_the_engine_runs_it():
    # two 600-token prompts, a budget of 1,024, a step costing T + 10 us a token: the engine runs the
    # first alone (600 tokens), then the second; chunked, the first step also takes 424 of the second's
    per_token = LinearStepModel((T, 1e-5, 0.0, 0.0, 0.0))
    whole = ReplicaSpec(per_token, 1000, 16, 256, 1024, enable_chunked_prefill=False)
    result = simulate(ClusterSpec("colocated", decode=whole), [(600, 1), (600, 1)], [0.0, 0.0])
    assert [_times(result, i) for i in range(2)] == [pytest.approx([T + 0.006]), pytest.approx([2 * T + 0.012])]
    chunked = simulate(ClusterSpec("colocated", decode=dataclasses.replace(whole, enable_chunked_prefill=True)),
                       [(600, 1), (600, 1)], [0.0, 0.0])
    assert _times(chunked, 0) == pytest.approx([T + 0.01024])


def test_a_run_cut_at_max_duration_reads_as_loadtest_reports_one():
    result = simulate(_colocated(max_num_seqs=1), [(10, 50)] * 3, [0.0] * 3, max_duration=0.6)
    assert result.interrupted == "--max-duration 0.6 s reached" and result.duration == 0.6
    cut = [r for r in result.records() if not r.succeeded]
    assert len(cut) == 2 and all(r.unfinished and r.end_time == 0.6 for r in cut)
    assert all(r.error == "unfinished when the run stopped (--max-duration 0.6 s reached)" for r in cut)


def test_a_run_that_ended_before_max_duration_is_not_cut_and_a_400_is_an_end():
    # the autoscaler ticks every interval while requests are unfinished: a request answered 400
    # had kept them coming (to --max-duration, or for ever without one), and the ticks left past
    # --max-duration had read as a cut run
    from cluster.autoscaler.policy import AutoscaleSettings, GoodputPolicy
    from cluster.simulator.autoscaling import SimAutoscaler
    spec = dataclasses.replace(_colocated(), max_model_len=64)
    settings = AutoscaleSettings(ttft_slo_s=1.0, tpot_slo_s=0.05, mode="colocated", budget=2,
                                 interval_s=10.0, startup_s=5.0)
    for lengths, max_duration in (([(8, 3)], 5.0), ([(8, 3), (100, 3)], 600.0)):
        result = simulate(spec, lengths, [0.0] * len(lengths), max_duration=max_duration,
                          autoscaler=SimAutoscaler(GoodputPolicy(settings, {"colocated": FIXED})))
        assert result.interrupted is None, lengths
        assert result.duration == pytest.approx(3 * T)
        # the tick at 10 s (past a 5 s --max-duration: none), after which nothing was left to do
        assert len(result.timeline) == (1 if max_duration > 10 else 0)


def test_profiles_that_would_run_the_clock_backwards_or_are_malformed_are_refused(tmp_path):
    from cluster.perf_model import load_step_model
    negative = LinearStepModel((1e-3, -1e-5, 0.0, 0.0, 0.0)).to_json()
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        load_step_model(negative)
    with pytest.raises(ValueError, match="not a JSON object"):
        load_step_model(tmp_path.joinpath("p.json").write_text("[1, 2]") and tmp_path / "p.json")
    with pytest.raises(ValueError, match="malformed for a linear model"):
        load_step_model({**LinearStepModel((1e-3, 0, 0, 0, 0)).to_json(), "fit_error": {"worst": 1}})
    from cluster.perf_model.roofline import RooflineStepModel
    from engine.model.model_config import ModelConfig
    from engine.tiny_model import ensure_preset_model
    roofline = RooflineStepModel.for_model(ModelConfig.from_pretrained(ensure_preset_model("tiny")),
                                           gpu="H100-SXM", tp=1, dtype="bfloat16").to_json()
    with pytest.raises(ValueError, match="efficiencies.mfu"):
        load_step_model({**roofline, "efficiencies": {**roofline["efficiencies"], "mfu": -0.5}})
    with pytest.raises(ValueError, match="malformed for a roofline model"):
        load_step_model({**roofline, "cost": {"tp": 1}})
    # a NaN cost ran the simulation on NaN step times; a TP of a list was a TypeError in plan and simulate
    with pytest.raises(ValueError, match=r"cost.matmul_params"):
        load_step_model({**roofline, "cost": {**roofline["cost"], "matmul_params": float("nan")}})
    with pytest.raises(ValueError, match=r"cost.tp"):
        load_step_model({**roofline, "cost": {**roofline["cost"], "tp": 0}})
    with pytest.raises(ValueError, match="meta.tp must be an integer >= 1"):
        load_step_model({**LinearStepModel((1e-3, 0, 0, 0, 0)).to_json(), "meta": {"tp": [1]}})
    with pytest.raises(ValueError, match="KV latency and the request overhead >= 0"):
        dataclasses.replace(_colocated(), kv_latency_s=-0.001)


def test_pdserve_simulate_refuses_a_tp_that_does_not_divide_the_heads(tmp_path, capsys):
    # the engines refuse it (pdserve serve's preflight); simulated, it sized the KV as if it ran
    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0)).to_json()))
    config = tmp_path / "tp3.yaml"
    config.write_text(open("configs/tiny-cpu.yaml").read().replace(
        "decode: {replicas: 1, tensor_parallel_size: 1}", "decode: {replicas: 1, tensor_parallel_size: 3}"))
    assert main(["simulate", "--config", str(config), "--profile", str(profile), "--num-prompts", "5"]) == 2
    assert "the decode engines would not start: num_attention_heads (4) is not divisible by " \
        "tensor_parallel_size (3)" in capsys.readouterr().err


def test_pdserve_simulate_refuses_what_it_would_ignore_or_could_not_start(tmp_path, capsys):
    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0)).to_json()))
    base = ["simulate", "--config", "configs/tiny-cpu.yaml", "--profile", str(profile), "--num-prompts", "5"]
    assert main([*base, "--threads-per-rank", "2"]) == 2
    assert "--threads-per-rank apply to replicas sharing one machine's cores" in capsys.readouterr().err
    assert main([*base, "--dataset-path", "x.json"]) == 2
    assert "--dataset-path apply to --dataset-name sharegpt" in capsys.readouterr().err
    assert main([*base, "--random-range-ratio", "1.5"]) == 2           # before: a traceback
    assert "--random-range-ratio must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert main([*base, "--kv-latency-ms", "-5"]) == 2
    assert "--kv-latency-ms and --request-overhead-ms >= 0" in capsys.readouterr().err
    for bad in (["--request-overhead-ms", "nan"], ["--shared-cores", "inf"], ["--shared-cores", "nan"]):
        assert main([*base, *bad]) == 2, bad               # before: a traceback, or no limit at all
        assert "every number finite" in capsys.readouterr().err
    assert main([*base, "--shared-cores", "2", "--threads-per-rank", "0"]) == 2
    assert "--threads-per-rank must be >= 1, got 0" in capsys.readouterr().err
    assert main([*base, "--result-dir", str(tmp_path)]) == 2          # (ignored without --save-result)
    assert "--result-dir and --result-file name the file --save-result writes" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main([*base, "--save-result", "--result-dir", str(a_file)]) == 2   # before the simulation
    assert f"--result-dir {a_file}: it is a file, not a directory" in capsys.readouterr().err
    for result_file, problem in ((a_file / "x.json", f"{a_file} is a file, not a directory"),
                                 (tmp_path, "it is a directory; name a file")):
        # before: the simulation ran, and then its result was lost to an OSError
        assert main([*base, "--save-result", "--result-file", str(result_file)]) == 2
        err = capsys.readouterr().err
        assert f"--result-file {result_file}: {problem}" in err and "Serving Benchmark Result" not in err
    no_admission = tmp_path / "no-admission.yaml"
    no_admission.write_text(open("configs/tiny-cpu.yaml").read() + "admission: {enabled: false}\n")
    assert main([*base[:2], str(no_admission), *base[3:], "--slo", "ttft:500", "tpot:50"]) == 2   # before: ignored
    assert "--slo sets the SLOs admission control and the autoscaler serve, and both are off" in \
        capsys.readouterr().err
    colocated = tmp_path / "colocated.yaml"
    colocated.write_text(open("configs/tiny-cpu.yaml").read().replace("mode: disaggregated", "mode: colocated"))
    assert main([*base[:2], str(colocated), *base[3:], "--kv-bandwidth-gibps", "5"]) == 2   # before: ignored
    assert "--kv-bandwidth-gibps model the KV hand-off, and" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:                          # loadtest's flags, not simulate's
        main([*base, "--num-warmups", "2"])
    assert exit_.value.code == 2 and "unrecognized arguments: --num-warmups" in capsys.readouterr().err
    on_gpu = tmp_path / "gpu.yaml"
    on_gpu.write_text(open("configs/tiny-cpu.yaml").read().replace("device: cpu", "device: cuda"))
    assert main([*base[:2], str(on_gpu), *base[3:], "--shared-cores", "2"]) == 2
    assert "runs on cuda: drop it" in capsys.readouterr().err
    other = tmp_path / "other-model.json"             # measured on a model of 4 layers, not tiny's 2
    other.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0), meta={"model_shape": {
        "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}}).to_json()))
    assert main([*base[:4], str(other), *base[5:]]) == 2
    assert "step times are another model's: num_layers 4 (this model: 2)" in capsys.readouterr().err
    small = tmp_path / "small.yaml"      # a KV cache of a few blocks: the engine would refuse to start
    small.write_text(open("configs/tiny-cpu.yaml").read().replace("kv_cache_memory_gib: 0.25",
                                                                  "kv_cache_memory_gib: 0.0001"))
    assert main([*base[:2], str(small), *base[3:]]) == 2
    assert "would not start: the KV cache on cpu holds" in capsys.readouterr().err
    whole_prompts = tmp_path / "whole.yaml"    # no chunking and a step budget under the context
    whole_prompts.write_text(open("configs/tiny-cpu.yaml").read().replace(
        "  max_num_batched_tokens: 512", "  enable_chunked_prefill: false\n  max_num_batched_tokens: 256", 1))
    assert main([*base[:2], str(whole_prompts), *base[3:]]) == 2   # before: every request "unfinished (None)"
    assert "would not start: with chunked prefill off, max_num_batched_tokens (256)" in capsys.readouterr().err


def test_pdserve_simulate_tokenizes_with_the_deployments_tokenizer(tmp_path, capsys, model_dirs):
    # a checkpoint without tokenizer files, its tokenizer named by model.tokenizer (as pdserve serve loads it)
    from cluster.cli.main import main
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dirs["tiny"]) / name, bare / name)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0)).to_json()))
    config = tmp_path / "named.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(open("configs/tiny-cpu.yaml")),
                                      "model": {"path": str(bare), "tokenizer": str(model_dirs["tiny"])}}))
    assert main(["simulate", "--config", str(config), "--profile", str(profile), "--num-prompts", "5"]) == 0, \
        capsys.readouterr().err


def test_the_simulated_context_is_the_engines_default_where_the_config_sets_none():
    # the engines take the model's default context (its RoPE scaling, a sliding window), not
    # max_position_embeddings: the simulated router answered 400 where the live one served
    from cluster.config import load_config
    from cluster.simulator.from_config import cluster_spec
    from engine.model import ModelConfig
    from engine.tiny_model import ensure_preset_model
    tiny = ModelConfig.from_pretrained(ensure_preset_model("tiny"))
    config = load_config("configs/tiny-cpu.yaml", {"model": {"max_model_len": None}})
    scaled = dataclasses.replace(tiny, rope_type="linear", rope_params={"factor": 4.0})
    windowed = dataclasses.replace(tiny, sliding_window=256)
    assert cluster_spec(config, FIXED, model_config=tiny).max_model_len == tiny.max_position_embeddings == 1024
    assert cluster_spec(config, FIXED, model_config=scaled).max_model_len == 4096
    assert cluster_spec(config, FIXED, model_config=windowed).max_model_len == 256
    too_long = load_config("configs/tiny-cpu.yaml", {"model": {"max_model_len": 2048}})
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) is larger than the model supports"):
        cluster_spec(too_long, FIXED, model_config=tiny)


def test_a_gpu_deployments_hand_off_is_priced_on_nvlink_as_the_planner_prices_it():
    # the CPU machine's gloo figures (1 GiB/s, 8.4 ms) had been used for GPU deployments too
    from cluster.config import load_config
    from cluster.simulator.from_config import CPU_KV_BANDWIDTH, CPU_KV_LATENCY_S, default_kv_link
    cpu = load_config("configs/tiny-cpu.yaml")
    link = default_kv_link(cpu)
    assert (link.bandwidth_bytes_per_s, link.latency_s) == (CPU_KV_BANDWIDTH, CPU_KV_LATENCY_S)
    gpu = load_config("configs/tiny-cpu.yaml", {"device": "cuda", "resources": {"gpu_type": "h200", "cpus_per_rank": 1},
                                                 "prefill": {"tensor_parallel_size": 2},
                                                 "decode": {"tensor_parallel_size": 4}})
    link = default_kv_link(gpu)
    assert link.bandwidth_bytes_per_s == pytest.approx(450e9 * 0.7 * 2) and link.latency_s == 1e-3


def test_pdserve_simulate_writes_loadtest_keys(tmp_path):
    from cluster.cli.main import main
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 1e-9, 5e-5, 1e-7)).to_json()))
    wide = tmp_path / "wide.json"        # the same engine on both cores: every step half as long
    wide.write_text(json.dumps(LinearStepModel((5e-4, 5e-6, 5e-10, 2.5e-5, 5e-8)).to_json()))
    out = []
    two_cores = ["--shared-cores", "2", "--threads-per-rank", "1"]
    machine = [[], [], ["--shared-cores", "1", "--threads-per-rank", "1", "--serving-cores-per-stream", "0.1"],
               two_cores, [*two_cores, "--lend-profile", str(wide)]]
    for run, flags in enumerate(machine):
        code = main(["simulate", "--config", "configs/tiny-cpu.yaml", "--profile", str(profile), "--num-prompts",
                     "50", "--request-rate", "10", "--goodput", "ttft:100", "tpot:20", "--save-result",
                     "--result-dir", str(tmp_path), "--result-file", f"r{run}.json", *flags])
        assert code == 0
        out.append(json.loads((tmp_path / f"r{run}.json").read_text()))
    result = out[0]
    for key in ("request_goodput", "slo_attainment", "median_ttft_ms", "p90_tpot_ms", "p99_e2el_ms",
                "completed", "total_output_tokens", "ttfts", "itls", "requests"):
        assert key in result, key
    assert result["simulated"] is True and result["completed"] == 50
    assert {k: v for k, v in out[0].items() if k != "date"} == {k: v for k, v in out[1].items() if k != "date"}
    # the 1 prefill + 1 decode ranks sharing one core, with the serving path on it too, step slower
    assert out[2]["mean_tpot_ms"] > 1.1 * result["mean_tpot_ms"]
    # on two cores, a decode replica that borrows the idle prefill replica's core steps faster
    assert out[3]["mean_tpot_ms"] == pytest.approx(result["mean_tpot_ms"])
    assert out[4]["mean_tpot_ms"] < 0.9 * out[3]["mean_tpot_ms"]
