"""Placement: cpus_per_rank resolved from the node's cores, deployments checked
against a cluster's capacity (each TP gang whole on one node, all gangs packed
together), and `pdserve serve` refusing one that can never be placed instead of
waiting forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import DeploymentConfig, with_overrides
from cluster.serving.placement import (
    ClusterResources,
    PlacementError,
    check_placement,
    gang_needs,
    local_cluster_cpus,
    resolve_cpus_per_rank,
)
from engine.tp_group import free_port

REPO = Path(__file__).resolve().parents[1]


def config(**overrides) -> DeploymentConfig:
    return with_overrides(DeploymentConfig(), overrides)


ONE_2CPU = ClusterResources((("10.0.0.1", 2, 0),))
TWO_4CPU = ClusterResources((("10.0.0.1", 4, 0), ("10.0.0.2", 4, 0)))
GPU_8 = ClusterResources((("10.0.0.1", 64, 8),))
CPU_ONLY_BIG = ClusterResources((("10.0.0.1", 64, 0), ("10.0.0.2", 64, 0)))


# (name, deployment, cluster, None when accepted else the texts the message must contain)
CASES = [
    ("default on 2 cores", config(), ONE_2CPU, None),
    ("colocated on 2 cores", config(mode="colocated"), ONE_2CPU, None),
    ("decode tp 2 on 2 cores", config(**{"decode.tensor_parallel_size": 2}), ONE_2CPU,
     ["needs 3 CPUs in all", "cluster has 2 CPUs", "decode: 1 replica × 2 TP ranks × {CPU: 1}",
      "node 10.0.0.1: 2 CPUs", "--decode-tp", "cpus_per_rank", "add nodes"]),
    ("decode tp 4 on 2 cores", config(**{"decode.tensor_parallel_size": 4}), ONE_2CPU,
     ["a decode gang needs 4 CPUs on one node", "decode: 1 replica × 4 TP ranks", "most any node has: 2 CPUs",
      "lower --decode-tp / decode.tensor_parallel_size", "add a node with at least 4 CPUs"]),
    ("2 nodes of 4: tp 4 + tp 4", config(**{"prefill.tensor_parallel_size": 4, "decode.tensor_parallel_size": 4,
                                            "resources.cpus_per_rank": 1}), TWO_4CPU, None),
    ("2 nodes of 4: 2 x tp 2 prefill + 2 x tp 2 decode",
     config(**{"prefill.replicas": 2, "prefill.tensor_parallel_size": 2, "decode.replicas": 2,
               "decode.tensor_parallel_size": 2, "resources.cpus_per_rank": 1}), TWO_4CPU, None),
    ("gang bigger than any node, smaller than the total",
     config(**{"decode.tensor_parallel_size": 6, "resources.cpus_per_rank": 1}), TWO_4CPU,
     ["a decode gang needs 6 CPUs on one node", "most any node has: 4 CPUs", "in all 8 CPUs",
      "node 10.0.0.1: 4 CPUs", "node 10.0.0.2: 4 CPUs", "--decode-tp"]),
    ("totals fit, gangs do not pack (3 + 3 + 2 on 4 + 4)",
     config(**{"prefill.replicas": 2, "prefill.tensor_parallel_size": 3, "decode.tensor_parallel_size": 2,
               "resources.cpus_per_rank": 1}), TWO_4CPU,
     ["do not pack", "no node has room left for a decode gang (2 CPUs)", "prefill: 2 replicas × 3 TP ranks",
      "in all 8 CPUs", "--prefill-replicas", "add nodes"]),
    ("8-GPU node: tp 4 + tp 4", config(device="cuda", **{"prefill.tensor_parallel_size": 4,
                                                        "decode.tensor_parallel_size": 4}), GPU_8, None),
    ("8-GPU node: tp 4 + tp 8", config(device="cuda", **{"prefill.tensor_parallel_size": 4,
                                                        "decode.tensor_parallel_size": 8}), GPU_8,
     ["needs 12 CPUs, 12 GPUs in all", "64 CPUs, 8 GPUs", "decode: 1 replica × 8 TP ranks × {CPU: 1, GPU: 1}",
      "--device cpu", "add GPUs"]),
    ("8-GPU node: a tp 16 gang", config(device="cuda", **{"decode.tensor_parallel_size": 16}), GPU_8,
     ["a decode gang needs 16 CPUs, 16 GPUs on one node", "8 GPUs", "--device cpu"]),
    ("autoscaled: a budget of 3 ranks on 2 cores", config(**{
        "autoscaling.enabled": True, "autoscaling.budget": 3, "slo.ttft_ms": 1000, "slo.tpot_ms": 100}), ONE_2CPU,
     ["needs 3 CPUs in all", "prefill: 2 replicas", "lower autoscaling.budget (--max-replicas, now 3)"]),
    # first fit in node order put the TP-6 gang on the 8-GPU node, leaving no node for the second
    # TP-4 gang (with the nodes listed the other way round, it fitted)
    ("8 + 6 GPUs: tp 6 prefill + 2 x tp 4 decode, the larger node first",
     config(device="cuda", **{"prefill.tensor_parallel_size": 6, "decode.replicas": 2,
                              "decode.tensor_parallel_size": 4}),
     ClusterResources((("10.0.0.1", 64, 8), ("10.0.0.2", 64, 6))), None),
    ("GPU deployment on a CPU-only cluster", config(device="cuda"), CPU_ONLY_BIG,
     ["device is cuda but the cluster has no GPUs", "prefill: 1 replica × 1 TP rank × {CPU: 1, GPU: 1}",
      "in all 128 CPUs, 0 GPUs", "--device cpu", "ray start --num-gpus"]),
]


@pytest.mark.parametrize("name, deployment, cluster, expected", CASES, ids=[c[0] for c in CASES])
def test_check_placement(name, deployment, cluster, expected):
    resolved = resolve_cpus_per_rank(deployment, cluster.largest_node_cpus)
    if expected is None:
        check_placement(resolved, cluster)
        return
    with pytest.raises(PlacementError) as info:
        check_placement(resolved, cluster)
    for text in expected:
        assert text in str(info.value), (text, str(info.value))


@pytest.mark.parametrize("deployment, node_cpus, cpus", [
    (config(), 2, 1.0),                                           # 1 prefill + 1 decode rank
    (config(mode="colocated"), 2, 2.0),                           # one rank has both cores
    (config(**{"decode.tensor_parallel_size": 2}), 2, 1.0),       # 3 ranks: at least 1 each
    (config(**{"decode.tensor_parallel_size": 2}), 16, 5.0),      # floor(16 / 3)
    (config(**{"resources.cpus_per_rank": 0.5}), 2, 0.5),         # explicit: kept
    (config(**{"resources.cpus_per_rank": 4}), 2, 4.0),
    (config(device="cuda"), 64, 1.0),                             # cuda: 1
])
def test_resolve_cpus_per_rank(deployment, node_cpus, cpus):
    assert deployment.resources.cpus_per_rank in (None, 0.5, 4)
    resolved = resolve_cpus_per_rank(deployment, node_cpus)
    assert resolved.resources.cpus_per_rank == cpus
    assert resolved.model_dump(exclude={"resources"}) == deployment.model_dump(exclude={"resources"})


def test_gang_needs_want_a_resolved_config():
    with pytest.raises(ValueError, match="resolve_cpus_per_rank"):
        gang_needs(DeploymentConfig())
    decode = {n.role: n for n in gang_needs(resolve_cpus_per_rank(
        config(device="cuda", **{"decode.replicas": 2, "decode.tensor_parallel_size": 4}), 64))}["decode"]
    assert (decode.replicas, decode.tensor_parallel_size, decode.bundle, decode.cpus, decode.gpus) == \
        (2, 4, {"CPU": 1.0, "GPU": 1}, 4.0, 4)


def test_local_cluster_cpus_cover_every_gang():
    assert local_cluster_cpus(config(**{"decode.tensor_parallel_size": 2}), 2) == 3
    assert local_cluster_cpus(config(), 2) == 2
    assert local_cluster_cpus(config(mode="colocated"), 2) == 2
    assert local_cluster_cpus(config(), 16) == 16
    # autoscaled: the budget's largest pool, and one gang more for a replica starting beside one that drains
    from cluster.config import load_config
    autoscaled = load_config(REPO / "configs" / "tiny-cpu-autoscale.yaml")
    assert autoscaled.autoscaling_settings().budget == 3
    assert local_cluster_cpus(autoscaled, 2) == 4
    for name in ("tiny-cpu.yaml", "tiny-cpu-tp2.yaml"):   # every shipped CPU config fits a local cluster
        from cluster.config import load_config
        c = load_config(REPO / "configs" / name)
        cpus = local_cluster_cpus(c, 2)
        check_placement(resolve_cpus_per_rank(c, 2), ClusterResources((("local", cpus, 0),)))


@pytest.fixture()
def ray_2cpu():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_pdserve_serve_refuses_a_gang_bigger_than_the_cluster(ray_2cpu, tmp_path):
    timeout_s = 120
    env = {**os.environ, "RAY_ADDRESS": ""}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "serve", "--decode-tp", "4", "--address", ray_2cpu,
         "--port", str(free_port())],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout_s, check=False)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error: cannot place this deployment" in done.stderr, done.stderr[-2000:]
    assert "a decode gang needs 4 CPUs on one node" in done.stderr, done.stderr[-2000:]
    assert "pdserve is serving" not in done.stdout
    print(f"refused in {elapsed:.1f} s")


def test_pdserve_serve_refuses_the_dashboard_flag_on_a_cluster_it_joins(ray_2cpu, tmp_path):
    # the flag starts the dashboard with a cluster pdserve starts; joining one, it was ignored
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "serve", "--ray-dashboard", "--address", ray_2cpu,
         "--port", str(free_port())],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error: --ray-dashboard starts the dashboard with a cluster pdserve starts" in done.stderr


def test_a_cluster_that_adds_nodes_on_demand_can_be_deployed_to_with_the_check_off(monkeypatch, caplog):
    # GPU workers scaled to zero: the check refused, though Ray's autoscaler would start them
    import cluster.serving.placement as placement
    monkeypatch.setattr(placement, "cluster_resources", lambda: CPU_ONLY_BIG)
    with pytest.raises(PlacementError, match="device is cuda but the cluster has no GPUs"):
        placement.placed_config(config(device="cuda"))
    with caplog.at_level("WARNING", logger="cluster.serving.placement"):
        placed = placement.placed_config(config(device="cuda", **{"resources.check_placement": False}))
    assert placed.resources.cpus_per_rank == 1.0
    assert "deploying although the cluster cannot place every gang now" in caplog.text
    assert "device is cuda but the cluster has no GPUs" in caplog.text


def test_on_the_one_node_cluster_pdserve_started_the_kv_path_listens_on_loopback(monkeypatch):
    # else on the node's address, which Ray makes the machine's network address even for a local cluster
    import cluster.serving.placement as placement
    monkeypatch.setattr(placement, "cluster_resources", lambda: CPU_ONLY_BIG)
    assert placement.placed_config(config(), node_cpus=2).kv_transfer.listen_address == "127.0.0.1"
    assert placement.placed_config(config()).kv_transfer.listen_address is None        # a cluster it joined
    named = config(**{"kv_transfer.listen_address": "10.0.0.7"})
    assert placement.placed_config(named, node_cpus=2).kv_transfer.listen_address == "10.0.0.7"
    for bad, says in (("10.0.0.7; rm -rf", "an IP address .* or a host name"), ("[::1]", "without brackets"),
                      ("0.0.0.0", "not 0.0.0.0 or ::")):
        with pytest.raises(ValueError, match=f"listen_address(.|\n)*{says}"):
            config(**{"kv_transfer.listen_address": bad})
    assert config(**{"kv_transfer.listen_address": "::1"}).kv_transfer.listen_address == "::1"


def test_a_one_gpu_replica_sees_its_own_gpu_even_where_ray_leaves_the_variable_unset(monkeypatch):
    # under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES every one-GPU replica on a node used GPU 0
    import asyncio

    import ray

    from cluster.serving import gang_devices
    environ: dict[str, str] = {}       # (this process's own is left as it was: later tests start Ray)
    monkeypatch.setattr(gang_devices.os, "environ", environ)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    assert asyncio.run(gang_devices.claim_gang_gpus(1)) == ["3"]
    assert environ == {"CUDA_VISIBLE_DEVICES": "3"}
    environ.clear()
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])          # a CPU replica: left alone
    assert asyncio.run(gang_devices.claim_gang_gpus(1)) == []
    assert environ == {}
