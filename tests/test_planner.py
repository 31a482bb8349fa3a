"""The goodput planner: candidates within the GPU budget only, none that does
not fit memory, the better configuration found on a case with a known answer,
a refined rate that converges to the exact M/D/1 answer where a short run
overstates it, and `pdserve plan --slo` writing a deployment file that
validates."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

from cluster.perf_model import LinearStepModel
from cluster.planner.search import (
    Candidate,
    RateEstimate,
    Workload,
    candidates,
    max_rate,
    roofline_spec_builder,
    search,
    sustained_max_rate,
)
from cluster.simulator import ClusterSpec
from cluster.simulator.cluster_sim import ReplicaSpec

search_module = importlib.import_module("cluster.planner.search")   # the package's `search` is the function

REPO = Path(__file__).resolve().parents[1]


def test_candidates_stay_within_the_gpu_budget():
    cands = candidates(8, [1, 2, 4, 8])
    assert cands and all(c.gpus <= 8 for c in cands)
    assert Candidate("disaggregated", 1, 4, 1, 4) in cands and Candidate("colocated", 0, 0, 2, 4) in cands
    assert not any(c.mode == "disaggregated" and c.prefill_tp == 8 for c in cands)   # leaves no decode GPU


def test_planner_never_returns_what_does_not_fit_memory():
    from engine.model.model_config import ModelConfig
    model = ModelConfig.from_pretrained("configs/models/llama-3-70b")
    build = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192)
    result = search(num_gpus=4, tps=[1, 2, 4], workload=Workload(512, 32, num_requests=60),
                    slos_s={"ttft": 2.0, "tpot": 0.1}, build_spec=build, max_requests=240)
    # 70B bf16 (131 GiB) cannot sit on one 80 GiB GPU: every TP-1 candidate is skipped, with the reason
    assert all(1 not in (e.candidate.prefill_tp, e.candidate.decode_tp) for e in result.evaluated)
    assert any("TP 1" in why for _, why in result.skipped)
    assert result.evaluated and all(e.candidate.gpus <= 4 for e in result.evaluated)


def md1_rate_for_wait(wait_s: float, service_s: float, quantile: float) -> float:
    """The Poisson arrival rate at which an M/D/1 queue's waiting time is within
    `wait_s` with probability `quantile` (Erlang's closed form, bisected)."""
    def wait_cdf(lam: float) -> float:
        return (1 - lam * service_s) * sum(
            (lam * (k * service_s - wait_s)) ** k / math.factorial(k) * math.exp(-lam * (k * service_s - wait_s))
            for k in range(int(wait_s / service_s) + 1))
    low, high = 0.0, 1 / service_s
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if wait_cdf(mid) >= quantile else (low, mid)
    return low


def fixed_time_replica(step_s: float = 0.1) -> ClusterSpec:
    """One replica serving one request at a time, each exactly one step of `step_s`."""
    model = LinearStepModel((step_s, 0.0, 0.0, 0.0, 0.0))
    return ClusterSpec("colocated", decode=ReplicaSpec(model, 1000, 16, 1, 2048), decode_replicas=1)


def test_max_rate_finds_the_capacity_of_a_fixed_time_replica():
    # one replica, one request at a time, every request exactly one 0.1 s step. With a TTFT
    # SLO of 0.3 s, 90% of requests may wait at most 0.2 s: M/D/1 puts that at 5.87 req/s.
    # 300 requests of one seed land within 15% of it (a short run's figure moves with the seed)
    exact = md1_rate_for_wait(0.2, 0.1, 0.9)
    assert exact == pytest.approx(5.87, abs=0.01)
    for seed in range(3):
        rate, att = max_rate(fixed_time_replica(), Workload(10, 1, num_requests=300, seed=seed), {"ttft": 0.3})
        assert rate == pytest.approx(exact, rel=0.15) and att >= 0.9


def test_a_configuration_slower_than_the_first_probe_is_rated_not_dropped():
    # 40 s a request, one at a time, TTFT SLO 80 s: 90% of waits within 40 s is ~0.0147 req/s
    # (M/D/1), under the 0.05 req/s the search first tries; before, it was rated 0 and the
    # planner said no configuration meets the SLOs
    exact = md1_rate_for_wait(40.0, 40.0, 0.9)
    rate, att = max_rate(fixed_time_replica(40.0), Workload(10, 1, num_requests=300), {"ttft": 80.0})
    assert rate == pytest.approx(exact, rel=0.2) and att >= 0.9
    # one that misses the SLO even alone is still 0 (and found so in two runs, not a descent)
    assert max_rate(fixed_time_replica(40.0), Workload(10, 1, num_requests=50), {"ttft": 30.0}) == (0.0, 0.0)


def test_a_short_run_overstates_the_rate_and_refinement_converges_to_the_md1_answer():
    # a 0.1 s server with a TTFT SLO of 1 s (the step included): 90% of waits within
    # 0.9 s, which M/D/1 gives at ~8.8 req/s; it can never sustain more than 10
    spec, workload, slos = fixed_time_replica(), Workload(10, 1, num_requests=100), {"ttft": 1.0}
    exact = md1_rate_for_wait(0.9, 0.1, 0.9)
    assert 8.5 < exact < 9.0
    short, _ = max_rate(spec, workload, slos)
    assert short > 10.0          # 100 requests end before the queue shows it is unstable

    estimates = sustained_max_rate(spec, workload, slos, tolerance=0.03, max_requests=8000)
    assert [e.num_requests for e in estimates] == [100 * 2 ** i for i in range(len(estimates))]
    assert estimates[0].rate == pytest.approx(short)
    assert estimates[-1].rate == pytest.approx(exact, rel=0.03) and estimates[-1].num_requests < 8000
    last3 = [e.rate for e in estimates[-3:]]
    assert len(estimates) >= 3 and max(last3) - min(last3) <= 0.03 * max(last3)
    assert all(e.attainment >= 0.9 for e in estimates)


def test_refinement_stops_at_max_requests():
    estimates = sustained_max_rate(fixed_time_replica(), Workload(10, 1, num_requests=100), {"ttft": 1.0},
                                   max_requests=400)
    assert [e.num_requests for e in estimates] == [100, 200, 400]


def fixed_time_replica_cluster(c: Candidate) -> ClusterSpec:
    """The candidate's replicas, each a `fixed_time_replica`."""
    replica = fixed_time_replica().decode
    if c.mode == "colocated":
        return ClusterSpec("colocated", decode=replica, decode_replicas=c.decode_replicas)
    return ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=c.prefill_replicas,
                       decode_replicas=c.decode_replicas)


def test_search_refines_the_leaders_of_each_mode_and_ranks_on_refined_rates():
    def build(c: Candidate):
        return fixed_time_replica_cluster(c), ""
    # 3 GPUs: one colocated candidate (3 x TP1), three disaggregated ones
    result = search(num_gpus=3, tps=[1], workload=Workload(10, 1, num_requests=100), slos_s={"ttft": 1.0},
                    build_spec=build, refine_top=1, max_requests=1600)
    for mode in ("colocated", "disaggregated"):
        best = result.best(mode)
        assert best.refined and best.num_requests > 100
        assert best.max_rate == best.refined[-1].rate
        assert best.refined[0] == RateEstimate(100, best.refined[0].rate, best.refined[0].attainment)
    screened = [e for e in result.evaluated if not e.refined]
    assert screened and all(e.num_requests is None for e in screened)

    in_workers = search(num_gpus=3, tps=[1], workload=Workload(10, 1, num_requests=100), slos_s={"ttft": 1.0},
                        build_spec=build, refine_top=1, max_requests=1600, jobs=2)
    assert [(e.candidate, e.max_rate, e.refined, e.settled) for e in in_workers.evaluated] == \
        [(e.candidate, e.max_rate, e.refined, e.settled) for e in result.evaluated]

    unrefined = search(num_gpus=3, tps=[1], workload=Workload(10, 1, num_requests=100), slos_s={"ttft": 1.0},
                       build_spec=build, refine_top=0)
    assert not any(e.refined for e in unrefined.evaluated)


def test_a_candidate_that_refinement_leaves_on_top_is_refined_too(monkeypatch):
    # screening ranks A over B; refining A drops it under B's screened rate, so B is
    # refined as well, and the mode's best is a refined figure
    from types import SimpleNamespace
    a, b = Candidate("colocated", 0, 0, 2, 1), Candidate("colocated", 0, 0, 1, 2)
    never = Candidate("colocated", 0, 0, 1, 1)
    specs = {c: SimpleNamespace(name=c, decode=SimpleNamespace(num_kv_blocks=1), prefill=None) for c in (a, b, never)}
    screened = {a: 10.0, b: 9.0, never: 0.0}    # req/s on the GPUs each uses; `never` meets the SLOs at no rate
    refined_to = {a: 4.0, b: 8.0}

    def fake_max_rate(spec, workload, slos_s, target=0.9, iterations=7, near=None):
        return screened[spec.name], 0.95

    def fake_sustained(spec, workload, slos_s, target=0.9, *, tolerance, max_requests, first):
        return [first, RateEstimate(2 * first.num_requests, refined_to[spec.name], 0.95)]

    monkeypatch.setattr(search_module, "max_rate", fake_max_rate)
    monkeypatch.setattr(search_module, "sustained_max_rate", fake_sustained)
    monkeypatch.setattr(search_module, "candidates", lambda num_gpus, tps: [a, b, never])
    result = search(num_gpus=2, tps=[1, 2], workload=Workload(10, 1, num_requests=100), slos_s={"ttft": 1.0},
                    build_spec=lambda c: (specs[c], ""), refine_top=1)
    assert {e.candidate: e.max_rate for e in result.evaluated} == {a: 4.0, b: 8.0, never: 0.0}
    assert {e.candidate: e.num_requests for e in result.evaluated} == {a: 200, b: 200, never: None}
    assert result.best("colocated").candidate == b
    # however many leaders are refined, one that meets the SLOs at no rate is not
    result = search(num_gpus=2, tps=[1, 2], workload=Workload(10, 1, num_requests=100), slos_s={"ttft": 1.0},
                    build_spec=lambda c: (specs[c], ""), refine_top=3)
    assert {e.candidate: e.num_requests for e in result.evaluated} == {a: 200, b: 200, never: None}


def test_a_faster_decode_pool_wins(tmp_path):
    # the same cluster with twice the decode replicas sustains a higher rate on a decode-bound workload
    model = LinearStepModel((2e-3, 1e-5, 0.0, 1e-3, 0.0))
    replica = ReplicaSpec(model, 100_000, 16, 8, 2048)

    def build(c: Candidate):
        if c.mode == "colocated":
            return None, "colocated not considered here"
        return ClusterSpec("disaggregated", prefill=replica, decode=replica, prefill_replicas=c.prefill_replicas,
                           decode_replicas=c.decode_replicas), ""
    result = search(num_gpus=3, tps=[1], workload=Workload(64, 64, num_requests=120),
                    slos_s={"ttft": 1.0, "tpot": 0.05}, build_spec=build, max_requests=480)
    best = result.best("disaggregated")
    assert (best.candidate.prefill_replicas, best.candidate.decode_replicas) == (1, 2)


def test_pdserve_plan_slo_writes_a_valid_deployment(tmp_path, capsys, monkeypatch):
    from cluster.cli.main import main
    from cluster.config import load_config
    import importlib
    search = importlib.import_module("cluster.planner.search")
    out = tmp_path / "plans" / "best.yaml"      # its folder made, as profile --output's is
    monkeypatch.chdir(REPO)
    simulated = []
    builder = search.roofline_spec_builder

    def recording_builder(*args, **kw):
        simulated.append(kw.get("admission"))
        return builder(*args, **kw)
    monkeypatch.setattr(search, "roofline_spec_builder", recording_builder)
    code = main(["plan", "--model", "configs/models/llama-3-8b", "--slo", "ttft:1000", "tpot:50", "--gpus", "2",
                 "--num-prompts", "60", "--max-prompts", "240", "--random-input-len", "512",
                 "--random-output-len", "32", "--write-config", str(out)])
    assert code == 0
    config = load_config(out)
    # the candidates ran behind the admission control the written file deploys (its refusals are misses)
    assert simulated == [config.admission.settings(config.slo)] and simulated[0].ttft_slo_s == 1.0
    used = sum(p.replicas * p.tensor_parallel_size for p in config.pools().values())
    assert config.device == "cuda" and used <= 2
    assert (config.slo.ttft_ms, config.slo.tpot_ms) == (1000, 50)     # the SLOs it was chosen for
    # the directory itself, wherever the file is read from (serve deploy builds in a Ray worker)
    assert config.model.path == str(REPO / "configs" / "models" / "llama-3-8b")
    out_text = capsys.readouterr().out
    assert "best colocated" in out_text and "| 60: " in out_text and " -> 120: " in out_text


def test_pdserve_plan_says_what_becomes_of_requests_past_the_context(capsys, monkeypatch):
    # the warning said they were refused (400); the router (and the simulator) cut their outputs to the
    # room the prompt leaves, and refuse only prompts that fill the context
    from cluster.cli.main import main
    monkeypatch.chdir(REPO)
    base = ["plan", "--model", "configs/models/llama-3-8b", "--slo", "ttft:1000", "tpot:50", "--gpus", "2",
            "--num-prompts", "20", "--max-prompts", "40", "--jobs", "1", "--random-input-len", "512", "--random-output-len", "32"]
    assert main([*base, "--max-model-len", "580", "--random-range-ratio", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "prompts of up to 563 + outputs of up to 35 tokens" in err and "cut to the room the prompt leaves" in err
    assert "refused" not in err
    main([*base, "--max-model-len", "600", "--random-range-ratio", "0.5"])    # (a third refused: no rate meets)
    assert "prompts of 600 tokens or more are refused (400)" in capsys.readouterr().err


def test_the_goodput_search_sizes_gpus_as_the_flags_say():
    # --gpu-memory-gib 16: Llama-3-8B's 15 GiB of bf16 weights do not fit one such GPU at TP 1 when the
    # flag is honoured, where 80 GiB (the H100 default) leaves room
    from cluster.planner.search import Candidate, roofline_spec_builder
    from engine.model.model_config import ModelConfig
    model = ModelConfig.from_pretrained("configs/models/llama-3-8b")
    tp1 = Candidate("colocated", 0, 0, 1, 1)
    default = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192)
    small = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192, gpu_memory_gib=16)
    spec, _ = default(tp1)
    assert spec is not None and spec.max_model_len == 8192
    spec, why = small(tp1)
    assert spec is None and "TP 1" in why


def test_a_workload_that_never_misses_the_slos_is_reported_as_a_lower_bound():
    # a step of 1 us and SLOs of a minute: no rate breaks them, and the search's last doubling is
    # no measured limit
    from cluster.cli.plan_goodput import format_report
    from cluster.perf_model import LinearStepModel
    from cluster.planner.search import Workload, max_rate, unbounded
    from cluster.simulator import ClusterSpec
    from cluster.simulator.cluster_sim import ReplicaSpec
    spec = ClusterSpec("colocated", decode=ReplicaSpec(LinearStepModel((1e-6, 0, 0, 0, 0)), 100_000))
    rate, attained = max_rate(spec, Workload(8, 2, num_requests=20), {"ttft": 60.0, "tpot": 60.0})
    assert unbounded(rate) and rate == pytest.approx(0.05 * 2 ** 20) and attained == 1.0
    assert not unbounded(9.83)
    candidate = {"config": "colocated 1 x TP1", "gpus_used": 1, "max_rate": rate, "unbounded": True,
                 "goodput_per_gpu": rate, "estimates": [], "num_requests": 20, "settled": True}
    text = format_report({"attainment_target": 0.9, "slos_ms": {"ttft": 60000.0}, "gpus": 1, "gpu_type": "H100-SXM",
                          "step_model": "roofline", "candidates": [candidate], "skipped": [],
                          "best": {"colocated": candidate["config"], "disaggregated": None}})
    assert "| >= 52429 |" in text and "too light to rate" in text


def test_pdserve_plan_slo_rejects_bad_input(capsys):
    from cluster.cli.main import main
    assert main(["plan", "--model", "llama-3-8b", "--slo", "ttft:1000"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--slo", "ttft:1000", "--gpus", "2", "--rate-tolerance", "0"]) == 2
    assert "--rate-tolerance" in capsys.readouterr().err
    for slo in (["latency:5"], ["ttft:inf"], ["ttft:nan"], ["ttft:1000", "ttft:500"]):    # (a second one won)
        for command in (["plan", "--model", "llama-3-8b", "--gpus", "2"], ["simulate"], ["serve"]):
            with pytest.raises(SystemExit) as exit_:
                main([*command, "--slo", *slo])
            assert exit_.value.code == 2 and "--slo" in capsys.readouterr().err, (command, slo)
    for bad, says in ((["--gpus", "100000"], "at most 256 GPUs"),      # (searched for hours, saying nothing)
                      (["--gpus", "2", "--profile", "/nonexistent.json"], "--profile /nonexistent.json: "),
                      (["--random-range-ratio", "-1"], "--random-range-ratio must be in [0, 1)"),
                      (["--random-input-len", "-5"], "must be >= 1"), (["--attainment", "0"], "--attainment"),
                      (["--random-input-len", "7200", "--random-output-len", "1000"], "exceed the 8192-token")):
        assert main(["plan", "--model", "llama-3-8b", "--slo", "ttft:1000", "--gpus", "2", *bad]) == 2
        assert says in capsys.readouterr().err, bad


def test_make_tiny_model_where_it_cannot_write_says_what_to_change(tmp_path, capsys):
    from cluster.cli.main import main
    (tmp_path / "a-file").write_text("")
    assert main(["make-tiny-model", str(tmp_path / "a-file" / "model")]) == 2
    assert "cannot write a checkpoint to" in capsys.readouterr().err     # (was a bare "[Errno 17] File exists")


def test_pdserve_plan_refuses_a_profile_of_another_model_or_a_tp_it_cannot_run(tmp_path, capsys):
    # before: a 2-layer CPU model's profile planned Llama-3-8B at >= 52,429 req/s per GPU; a
    # profile at a TP no candidate has left an empty table and "add GPUs"
    import json

    from cluster.cli.main import main
    from cluster.perf_model import LinearStepModel
    from cluster.perf_model.roofline import RooflineStepModel
    from engine.model.model_config import ModelConfig
    llama_8b = ModelConfig.from_pretrained("configs/models/llama-3-8b")
    tiny_shape = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}
    other = tmp_path / "tiny.json"
    other.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0),
                                                meta={"model_shape": tiny_shape, "tp": 1}).to_json()))
    base = ["plan", "--model", "llama-3-8b", "--slo", "ttft:1000", "tpot:50", "--num-prompts", "20"]
    assert main([*base, "--gpus", "2", "--profile", str(other)]) == 2
    assert "step times are another model's: num_layers 2 (this model: 32)" in capsys.readouterr().err
    tp4 = tmp_path / "tp4.json"
    tp4.write_text(json.dumps(RooflineStepModel.for_model(llama_8b, gpu="H100-SXM", tp=4).to_json()))
    assert main([*base, "--gpus", "2", "--profile", str(tp4)]) == 2
    assert "measured at TP 4, which this model on --gpus 2 cannot run (TP degrees: 1, 2)" in \
        capsys.readouterr().err


def test_pdserve_plan_refuses_flags_its_mode_would_ignore(tmp_path, capsys):
    from cluster.cli.main import main
    (tmp_path / "a_file").write_text("")
    slo = ["--slo", "ttft:1000", "tpot:50", "--gpus", "2"]
    for argv, says in (
            (["--tp", "1", "--gpus", "8", "--write-config", str(tmp_path / "x.yaml")],
             "--gpus, --write-config set the goodput search, which runs only with --slo"),
            (["--tp", "1", "--attainment", "0.5"], "--attainment set the goodput search"),
            ([*slo, "--tp", "4", "--role", "decode"], "--tp, --role plan one given replica; with --slo the search"),
            ([*slo, "--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0"),
            ([*slo, "--write-config", str(tmp_path / "a_file" / "x.yaml")], "a_file is a file, not a directory"),
            # refused before the search (a traceback after it, the result lost)
            ([*slo, "--write-config", str(tmp_path)], "it is a directory; name a file"),
            ([*slo, "--max-model-len", "0"], "--max-model-len must be >= 1, got 0")):
        assert main(["plan", "--model", "llama-3-8b", *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
    for flag, value in (("--gpu-memory-gib", "inf"), ("--overhead-gib", "nan")):   # (inf: an OverflowError)
        with pytest.raises(SystemExit) as exited:
            main(["plan", "--model", "llama-3-8b", "--tp", "1", flag, value])
        assert exited.value.code == 2 and f"must be a finite number, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
    assert main(["plan", "--model", "llama-3-8b", "--tp", "1"]) == 0


def test_prefill_and_decode_replicas_leave_the_kv_staging_budget_free():
    # as the engines size their caches (kv_transfer.staging_mib): a disaggregated TP-4 replica of 70B
    # holds 1 GiB per rank less KV than a colocated one, in the planner and in the simulator
    from cluster.config import load_config
    from cluster.planner.search import Candidate, roofline_spec_builder
    from cluster.simulator.from_config import kv_blocks
    from engine.memory_planner import kv_bytes_per_token
    from engine.model.model_config import ModelConfig
    model = ModelConfig.from_pretrained("configs/models/llama-3-70b")
    block_bytes_per_rank = kv_bytes_per_token(model, 4, "bfloat16") * 16
    one_gib_of_blocks = 2**30 / block_bytes_per_rank                   # 819.2
    build = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192)
    colocated, _ = build(Candidate("colocated", 0, 0, 1, 4))
    disaggregated, _ = build(Candidate("disaggregated", 1, 4, 1, 4))
    lost = colocated.decode.num_kv_blocks - disaggregated.decode.num_kv_blocks
    assert lost == pytest.approx(one_gib_of_blocks, abs=1)
    assert disaggregated.prefill.num_kv_blocks == disaggregated.decode.num_kv_blocks
    half, _ = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192,
                                    kv_transfer_staging_gib=0.5)(Candidate("disaggregated", 1, 4, 1, 4))
    assert half.decode.num_kv_blocks - disaggregated.decode.num_kv_blocks == pytest.approx(one_gib_of_blocks / 2,
                                                                                           abs=1)

    def simulated(overrides):
        config = load_config("configs/llama-3-70b-8xh100.yaml", overrides)
        pool = config.colocated if config.mode.value == "colocated" else config.decode
        return kv_blocks(config, pool, model, "bfloat16", 8192)
    assert simulated({}) == disaggregated.decode.num_kv_blocks
    assert simulated({"kv_transfer.staging_mib": 512}) == half.decode.num_kv_blocks
    assert simulated({"mode": "colocated", "colocated.tensor_parallel_size": 4}) == colocated.decode.num_kv_blocks


def test_a_hand_off_between_tensor_parallel_replicas_moves_its_shards_over_a_link_each():
    # each prefill rank sends its KV heads to its decode rank(s) at once: min(TPs) links, not one
    from cluster.perf_model.roofline import GPU_SPECS
    from cluster.planner.search import Candidate, roofline_spec_builder
    from engine.model.model_config import ModelConfig
    model = ModelConfig.from_pretrained("configs/models/llama-3-70b")
    build = roofline_spec_builder(model, gpu="H100-SXM", dtype="bfloat16", max_model_len=8192)
    nvlink, network = GPU_SPECS["H100-SXM"].link_bytes_per_s * 0.7, 50e9 * 0.7
    # a TP-8 replica and a TP-4 one fill more than a node's 8 GPUs: their hand-off crosses the network
    for (ptp, dtp), rate in {(4, 4): 4 * nvlink, (2, 4): 2 * nvlink, (8, 4): 4 * network}.items():
        spec, why = build(Candidate("disaggregated", 1, ptp, 1, dtp))
        assert spec is not None, why
        assert spec.kv_bandwidth_bytes_per_s == pytest.approx(rate), (ptp, dtp)


def test_a_tp_gang_wider_than_a_node_all_reduces_over_the_network():
    # TP 16 spans two 8-GPU nodes: its all-reduces were priced at NVLink's rate, a decode step faster than TP 8's
    from cluster.perf_model.roofline import RooflineStepModel
    from cluster.perf_model.step_shape import StepShape
    from engine.model.model_config import ModelConfig
    model = ModelConfig.from_pretrained("configs/models/llama-3-70b")
    tp8, tp16 = (RooflineStepModel.for_model(model, gpu="H100-SXM", tp=tp) for tp in (8, 16))
    batch = StepShape.build([], [1024] * 64)
    assert tp16.step_time(batch) > tp8.step_time(batch)
    no_latency = tp16.with_efficiencies(allreduce_latency_s=0.0, link=1.0)
    free = tp16.with_efficiencies(allreduce_latency_s=0.0, link=1e9)
    payload = 2 * 15 / 16 * 64 * 8192 * 2          # bytes a rank moves in one all-reduce of 64 rows
    assert no_latency.step_time(batch) - free.step_time(batch) == pytest.approx(
        2 * 80 * payload / 50e9, rel=1e-3)


def _sigint_handler_name(_: int) -> str:
    import signal
    return "ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default"


def test_the_searchs_worker_processes_leave_ctrl_c_to_the_parent():
    # a worker that took it printed a KeyboardInterrupt traceback each, and the parent waited for the queue
    with search_module._pool(2) as pool:
        assert list(pool.map(_sigint_handler_name, range(2))) == ["ignored", "ignored"]
