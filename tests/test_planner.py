"""The goodput planner: candidates within the GPU budget only, none that does
not fit memory, the better configuration found on a case with a known answer,
and `pdserve plan --slo` writing a deployment file that validates."""

from __future__ import annotations

import pytest

from cluster.perf_model import LinearStepModel
from cluster.planner.search import (
    Candidate,
    Workload,
    candidates,
    max_rate,
    roofline_spec_builder,
    search,
)
from cluster.simulator import ClusterSpec
from cluster.simulator.cluster_sim import ReplicaSpec


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
                    slos_s={"ttft": 2.0, "tpot": 0.1}, build_spec=build)
    # 70B bf16 (131 GiB) cannot sit on one 80 GiB GPU: every TP-1 candidate is skipped, with the reason
    assert all(1 not in (e.candidate.prefill_tp, e.candidate.decode_tp) for e in result.evaluated)
    assert any("TP 1" in why for _, why in result.skipped)
    assert result.evaluated and all(e.candidate.gpus <= 4 for e in result.evaluated)


def test_max_rate_finds_the_capacity_of_a_fixed_time_replica():
    # one replica, one request at a time, every request exactly one 0.1 s step: capacity
    # 10 req/s. With a TTFT SLO of 0.3 s, rates well under 10 pass and rates above fail.
    model = LinearStepModel((0.1, 0.0, 0.0, 0.0, 0.0))
    spec = ClusterSpec("colocated", decode=ReplicaSpec(model, 1000, 16, 1, 2048), decode_replicas=1)
    rate, att = max_rate(spec, Workload(10, 1, num_requests=300), {"ttft": 0.3})
    assert 5.0 < rate < 10.0 and att >= 0.9


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
                    slos_s={"ttft": 1.0, "tpot": 0.05}, build_spec=build)
    best = result.best("disaggregated")
    assert (best.candidate.prefill_replicas, best.candidate.decode_replicas) == (1, 2)


def test_pdserve_plan_slo_writes_a_valid_deployment(tmp_path, capsys):
    from cluster.cli.main import main
    from cluster.config import load_config
    out = tmp_path / "best.yaml"
    code = main(["plan", "--model", "llama-3-8b", "--slo", "ttft:1000", "tpot:50", "--gpus", "2",
                 "--num-prompts", "60", "--random-input-len", "512", "--random-output-len", "32",
                 "--write-config", str(out)])
    assert code == 0
    config = load_config(out)
    used = sum(p.replicas * p.tensor_parallel_size for p in config.pools().values())
    assert config.device == "cuda" and used <= 2
    assert "best colocated" in capsys.readouterr().out


def test_pdserve_plan_slo_rejects_bad_input(capsys):
    from cluster.cli.main import main
    assert main(["plan", "--model", "llama-3-8b", "--slo", "ttft:1000"]) == 2
    assert "--gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3-8b", "--slo", "latency:5", "--gpus", "2"])
