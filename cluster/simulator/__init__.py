"""A discrete-event simulator of a pdserve deployment (no Ray, no model).

Requests arrive as `pdserve loadtest` would send them; a router sends each to a
prefill, decode or colocated replica as the deployment's mode and
disaggregation policy say; each replica runs the engine's scheduling
(continuous batching, chunked prefill, KV block accounting, preemption by
recompute) with step times from a performance model (cluster/perf_model);
a prefill→decode hand-off costs a latency plus the KV bytes over the link.
The result has `pdserve loadtest`'s JSON keys, so a simulated and a measured
run compare line by line.
"""

from cluster.simulator.cluster_sim import ClusterSpec, SimulationResult, simulate

__all__ = ["ClusterSpec", "SimulationResult", "simulate"]
