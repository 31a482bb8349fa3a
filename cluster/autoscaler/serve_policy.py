"""Ray Serve's application-level autoscaling policy for a pdserve application.

The decision is made in the router (router/autoscale_loop.py), which reports
`target_<role>` through `record_autoscaling_stats`. This function runs in
Serve's controller every control-loop tick (0.1 s), so it only copies those
numbers to the worker deployments: nothing heavy, and it never raises (an
exception here would stop the controller's update of every application).

Wiring (cluster/app_builder.py): every deployment has an `autoscaling_config`
(the workers' min/max, no extra delays; the router pinned to one replica), and
the application names this function as its `autoscaling_policy`.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ROUTER_DEPLOYMENT = "Router"
ROLE_DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer", "colocated": "ColocatedServer"}


def router_targets(contexts: dict) -> tuple[dict, None]:
    """{DeploymentID: AutoscalingContext} -> ({DeploymentID: replicas}, no state).
    Deployments the router has not reported a target for keep theirs."""
    try:
        by_name = {dep.name: dep for dep in contexts}
        router = contexts.get(by_name.get(ROUTER_DEPLOYMENT))
        if router is None:
            return {}, None
        decisions = {}
        for metric, value in _latest_targets(router).items():
            dep = by_name.get(ROLE_DEPLOYMENTS.get(metric.removeprefix("target_"), ""))
            if dep is not None:
                decisions[dep] = int(round(value))
        return decisions, None
    except Exception:  # noqa: BLE001 - see the module docstring
        log.exception("pdserve autoscaling policy failed; replica targets unchanged")
        return {}, None


def _latest_targets(router) -> dict[str, float]:
    """metric -> the value the router reported last. Not Serve's aggregate, a mean
    over its look-back: while the router moves a rank from one role to another
    (prefill 4 -> 3, decode 3 -> 4), both means pass 3.5 and round to 4, past the
    budget, for about a second."""
    latest = {}
    for metric, per_replica in (getattr(router, "raw_metrics", None) or {}).items():
        points = [p for series in per_replica.values() for p in series]
        if points:
            latest[metric] = max(points, key=lambda p: p.timestamp).value
    if latest:
        return latest
    return {metric: max(per_replica.values()) for metric, per_replica in (router.aggregated_metrics or {}).items()
            if per_replica}
