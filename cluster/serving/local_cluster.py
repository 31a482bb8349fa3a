"""The one-node Ray cluster `pdserve serve` starts when it joins none.

On a small CPU machine the engine shares its cores with everything else, and
every CPU-millisecond another process takes costs the engine about two: torch
runs a step as OpenMP regions over all cores, and while one of its threads is
preempted the others wait for it at the region's barrier. So the local cluster
runs lean by default:
- no Ray dashboard (its head process and module workers poll all the time);
  `pdserve serve --ray-dashboard` starts it;
- Serve's controller loop every SERVE_CONTROL_LOOP_INTERVAL_S instead of every
  0.1 s (it reconciles replicas and runs autoscaling policies; pdserve's own
  autoscaler decides every several seconds, and replica start-up takes longer);
  an interval set in the environment (RAY_SERVE_CONTROL_LOOP_INTERVAL_S) wins;
- worker processes at normal priority (cluster/serving/process_priority.py);
- calls between deployments (router -> workers, and their streams of step
  batches) over Serve's gRPC transport instead of Ray actor calls
  (RAY_SERVE_USE_GRPC_BY_DEFAULT, part of Serve's throughput-optimized mode):
  served colocated at 16 concurrent went from 0.73-0.78x to 0.80-0.85x the
  offline engine on 2 cores (bench/MEASUREMENTS.md); set in the environment,
  the operator's choice wins.
A cluster pdserve joins (`--address`) is left as its operator started it.
"""

from __future__ import annotations

import os

from cluster.serving.process_priority import LOCAL_CLUSTER_ENV

SERVE_CONTROL_LOOP_INTERVAL_S = 0.5
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
GRPC_CALLS_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"


def local_cluster_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment the local cluster's processes start with (over os.environ):
    normal priority, the controller's interval and gRPC calls between deployments
    unless already set, then `extra`."""
    env = dict(LOCAL_CLUSTER_ENV)
    for name, value in ((CONTROL_LOOP_ENV, str(SERVE_CONTROL_LOOP_INTERVAL_S)), (GRPC_CALLS_ENV, "1")):
        if name not in os.environ:
            env[name] = value
    return {**env, **extra}


def start_local_cluster(num_cpus: int, env: dict[str, str], *, dashboard: bool = False) -> None:
    """Starts a one-node Ray cluster declaring `num_cpus` CPUs whose processes see
    local_cluster_env(env); with the Ray dashboard only if `dashboard`."""
    import ray

    os.environ.update(local_cluster_env(env))   # read by the raylet this starts and its workers
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard)
