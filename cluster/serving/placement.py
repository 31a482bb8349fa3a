"""Can a deployment's TP gangs ever be placed on a cluster? Decided before
deploying, so that a deployment that cannot be placed is refused with a message
instead of Serve waiting forever.

Each worker replica is a gang: one STRICT_PACK placement group of one bundle per
rank, `{"CPU": cpus_per_rank}` (plus `{"GPU": 1}` on CUDA), so a gang needs all
of its CPUs and GPUs on one node. The check is by total capacity (what the
nodes have, not what is free now):

    resolve_cpus_per_rank(config, node_cpus)   fill in resources.cpus_per_rank
    gang_needs(config)                         what one gang of each role needs
    cluster_resources()                        the live cluster's nodes (after ray.init)
    check_placement(config, cluster)           PlacementError when it can never fit
    local_cluster_cpus(config, machine_cpus)   num_cpus for a local cluster pdserve starts

Only `cluster_resources` imports Ray.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

from cluster.config import DeploymentConfig

log = logging.getLogger(__name__)

_EPS = 1e-9
LOOPBACK = "127.0.0.1"


class PlacementError(ValueError):
    """A deployment whose gangs can never be placed on the cluster; the message
    says what is needed, what the cluster has, and what to change."""


@dataclass(frozen=True)
class GangNeed:
    """What the gangs of one role need: `replicas` gangs of
    `tensor_parallel_size` bundles each, all of one gang on one node."""
    role: str
    replicas: int
    tensor_parallel_size: int
    cpus_per_rank: float
    gpus_per_rank: int

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle."""
        return {"CPU": self.cpus_per_rank, "GPU": self.gpus_per_rank} if self.gpus_per_rank else \
            {"CPU": self.cpus_per_rank}

    @property
    def cpus(self) -> float:
        """CPUs one gang needs on one node."""
        return self.cpus_per_rank * self.tensor_parallel_size

    @property
    def gpus(self) -> int:
        """GPUs one gang needs on one node."""
        return self.gpus_per_rank * self.tensor_parallel_size


class NodeResources(NamedTuple):
    """One node's total CPUs and GPUs."""
    node: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ClusterResources:
    """Per-node totals; `nodes` takes NodeResources or (node, cpus, gpus) tuples."""
    nodes: tuple[NodeResources, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(NodeResources(*n) for n in self.nodes))

    @property
    def total_cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def total_gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    @property
    def largest_node_cpus(self) -> float:
        """The most CPUs any one node has (0 for no nodes)."""
        return max((n.cpus for n in self.nodes), default=0.0)

    def describe(self) -> str:
        nodes = "; ".join(f"node {n.node}: {_cpus(n.cpus)}, {_gpus(n.gpus)}" for n in self.nodes) or "no nodes"
        return f"{nodes}; in all {_cpus(self.total_cpus)}, {_gpus(self.total_gpus)}"


def resolve_cpus_per_rank(config: DeploymentConfig, node_cpus: float) -> DeploymentConfig:
    """A copy of `config` with resources.cpus_per_rank filled in: an explicit
    value is kept; on CUDA 1; on CPU the `node_cpus` cores shared equally among
    all ranks of the deployment, floored, at least 1."""
    if config.resources.cpus_per_rank is not None:
        return config
    if config.device == "cuda":
        cpus = 1.0
    else:
        ranks = sum(p.replicas * p.tensor_parallel_size for p in config.pools().values())
        if config.autoscaling.enabled:
            ranks = max(ranks, config.autoscaling_settings().budget)
        cpus = float(max(1, math.floor(node_cpus / ranks)))
    return config.model_copy(update={"resources": config.resources.model_copy(update={"cpus_per_rank": cpus})})


def gang_needs(config: DeploymentConfig) -> list[GangNeed]:
    """One GangNeed per role the mode runs. Raises ValueError when
    resources.cpus_per_rank is not resolved yet."""
    cpus = config.resources.cpus_per_rank
    if cpus is None:
        raise ValueError("resources.cpus_per_rank is not resolved: call resolve_cpus_per_rank first")
    gpus = 1 if config.device == "cuda" else 0
    return [GangNeed(role, pool.replicas, pool.tensor_parallel_size, cpus, gpus)
            for role, pool in config.pools().items()]


def visible_gpus() -> int:
    """The CUDA GPUs torch sees on this machine."""
    import torch
    return torch.cuda.device_count()


def cluster_resources() -> ClusterResources:
    """The alive nodes of the Ray cluster this process is connected to, with
    their total CPUs and GPUs. Call after ray.init."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    addresses = [n.get("NodeManagerAddress", "?") for n in alive]
    nodes = []
    for node, address in zip(alive, addresses):
        name = address if addresses.count(address) == 1 else f"{address} ({node.get('NodeID', '?')[:8]})"
        totals = node.get("Resources", {})
        nodes.append(NodeResources(name, float(totals.get("CPU", 0.0)), float(totals.get("GPU", 0.0))))
    return ClusterResources(tuple(nodes))


def check_placement(config: DeploymentConfig, cluster: ClusterResources) -> None:
    """Returns when every gang of `config` (cpus_per_rank resolved) fits on
    `cluster` at once by total capacity: each gang whole on one node, all gangs
    together by best-fit-decreasing over the nodes. Raises PlacementError
    otherwise. An autoscaled deployment must fit at every size it can reach."""
    if config.autoscaling.enabled:
        budget = config.autoscaling_settings().budget
        for sized in reachable_sizes(config):
            try:
                check_placement(sized, cluster)
            except PlacementError as exc:
                raise PlacementError(
                    f"{exc}\n  (autoscaled: the sizes above are the most of one role the autoscaler may reach; "
                    f"to keep every size within the cluster, lower autoscaling.budget (--max-replicas, now "
                    f"{budget}) or autoscaling.max_replicas)") from None
        return
    needs = gang_needs(config)
    if config.device == "cuda" and cluster.total_gpus < 1 - _EPS:
        raise PlacementError(_message(
            "device is cuda but the cluster has no GPUs", needs, cluster,
            "run on CPU with --device cpu (device: cpu in the deployment file), or join a cluster with GPUs "
            "(ray start --num-gpus N on nodes that have them)"))
    for need in needs:
        if any(_fits(n.cpus, n.gpus, need) for n in cluster.nodes):
            continue
        most_gpus = max((n.gpus for n in cluster.nodes), default=0.0)
        raise PlacementError(_message(
            f"a {need.role} gang needs {_gang(need)} on one node, and no node has that "
            f"(the most any node has: {_amount(cluster.largest_node_cpus, most_gpus if need.gpus else 0)})",
            needs, cluster, _advice(
                [need], cpu_short=cluster.largest_node_cpus < need.cpus - _EPS,
                gpu_short=most_gpus < need.gpus - _EPS, add=f"add a node with at least {_gang(need)}")))
    unplaced = _best_fit_decreasing(needs, cluster)
    if unplaced is not None:
        total_cpus = sum(n.replicas * n.cpus for n in needs)
        total_gpus = sum(n.replicas * n.gpus for n in needs)
        cpu_short = total_cpus > cluster.total_cpus + _EPS
        gpu_short = total_gpus > cluster.total_gpus + _EPS
        if cpu_short or gpu_short:
            why = (f"the deployment needs {_amount(total_cpus, total_gpus)} in all, and the cluster has "
                   f"{_amount(cluster.total_cpus, cluster.total_gpus if total_gpus else 0)}")
        else:
            why = (f"the gangs do not pack onto the nodes: with the others placed, no node has room left for "
                   f"a {unplaced.role} gang ({_gang(unplaced)})")
            cpu_short, gpu_short = True, unplaced.gpus > 0
        add = "add nodes" if not gpu_short else \
            "add GPUs (nodes started with ray start --num-gpus N)" if not cpu_short else "add nodes with GPUs"
        raise PlacementError(_message(why, needs, cluster, _advice(needs, cpu_short=cpu_short, gpu_short=gpu_short,
                                                                   add=add, replicas=True)))


def local_cluster_cpus(config: DeploymentConfig, machine_cpus: int) -> int:
    """num_cpus for a one-node Ray cluster pdserve starts itself on a machine of
    `machine_cpus` cores: at least the cores, and enough that every gang fits
    (ranks then share cores); with autoscaling, one gang more, for a replica
    that starts while the one it replaces still drains (its streams finish
    first, for up to minutes). `config` is resolved against `machine_cpus`
    first if its cpus_per_rank is null."""
    config = resolve_cpus_per_rank(config, machine_cpus)
    steady = max(sum(n.replicas * n.cpus for n in gang_needs(c)) for c in reachable_sizes(config))
    moving = max(n.cpus for n in gang_needs(config)) if config.autoscaling.enabled else 0.0
    return max(machine_cpus, math.ceil(steady + moving - _EPS))


def reachable_sizes(config: DeploymentConfig) -> list[DeploymentConfig]:
    """The pool sizes that need the most of each role: `config` itself, or with
    autoscaling, for each role the budget's most of it next to the others' least."""
    if not config.autoscaling.enabled:
        return [config]
    s = config.autoscaling_settings()
    sizes = []
    for role in s.roles:
        others = sum(s.min_for(r) * s.tp(r) for r in s.roles if r != role)
        counts = {r: s.min_for(r) for r in s.roles}
        counts[role] = min(s.max_for(role), (s.budget - others) // s.tp(role))
        pools = {r: getattr(config, r).model_copy(update={"replicas": n}) for r, n in counts.items()}
        sizes.append(config.model_copy(update={**pools, "autoscaling": config.autoscaling.model_copy(
            update={"enabled": False})}))
    return sizes


def _fits(cpus: float, gpus: float, need: GangNeed) -> bool:
    return cpus >= need.cpus - _EPS and gpus >= need.gpus - _EPS


def _best_fit_decreasing(needs: list[GangNeed], cluster: ClusterResources) -> GangNeed | None:
    """Places every gang, largest first, on the node it leaves the least room on
    (first fit in node order refused a TP-6 gang and two TP-4 ones on nodes of 8
    and 6 GPUs, listed in that order); the first gang that finds no node, or None
    when all fit."""
    free = [[n.cpus, n.gpus] for n in cluster.nodes]
    gangs = sorted((n for n in needs for _ in range(n.replicas)), key=lambda n: (n.gpus, n.cpus), reverse=True)
    for gang in gangs:
        rooms = [room for room in free if _fits(room[0], room[1], gang)]
        if not rooms:
            return gang
        room = min(rooms, key=lambda r: (r[1] - gang.gpus, r[0] - gang.cpus))
        room[0] -= gang.cpus
        room[1] -= gang.gpus
    return None


def _message(problem: str, needs: list[GangNeed], cluster: ClusterResources, change: str) -> str:
    needed = "; ".join(
        f"{n.role}: {n.replicas} replica{'s' if n.replicas != 1 else ''} × {n.tensor_parallel_size} TP "
        f"rank{'s' if n.tensor_parallel_size != 1 else ''} × {_bundle(n.bundle)} ({_gang(n)} per gang, on one node)"
        for n in needs)
    return (f"cannot place this deployment: {problem}.\n"
            f"  needs: {needed}\n"
            f"  cluster: {cluster.describe()}\n"
            f"  to change: {change}")


def _advice(needs: list[GangNeed], *, cpu_short: bool, gpu_short: bool, add: str, replicas: bool = False) -> str:
    """What to change, as one sentence; `replicas`: fewer replicas would help."""
    steps = [f"lower --{n.role}-tp / {n.role}.tensor_parallel_size" for n in needs if n.tensor_parallel_size > 1]
    if replicas:
        fewer = [f"--{n.role}-replicas / {n.role}.replicas" for n in needs if n.replicas > 1]
        if fewer:
            steps.append("run fewer replicas (" + ", ".join(fewer) + ")")
    if cpu_short:
        steps.append(f"lower resources.cpus_per_rank (now {_num(needs[0].cpus_per_rank)})")
    if gpu_short:
        steps.append("run on CPU with --device cpu")
    steps.append(add)
    return ", ".join(steps[:-1]) + ", or " + steps[-1] if len(steps) > 1 else steps[0]


def _gang(need: GangNeed) -> str:
    return _amount(need.cpus, need.gpus)


def _amount(cpus: float, gpus: float) -> str:
    return f"{_cpus(cpus)}, {_gpus(gpus)}" if gpus else _cpus(cpus)


def _bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in bundle.items()) + "}"


def _cpus(x: float) -> str:
    return f"{_num(x)} CPU{'' if x == 1 else 's'}"


def _gpus(x: float) -> str:
    return f"{_num(x)} GPU{'' if x == 1 else 's'}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def check_local_machine(config: DeploymentConfig, machine_cpus: int, local_cpus: int, machine_gpus: int) -> None:
    """Before starting a one-node cluster of `local_cpus` CPUs (local_cluster_cpus') on this
    machine: raises PlacementError when `config` could never be placed on it (a CUDA
    deployment on a machine with fewer GPUs than a gang needs; its CPUs are sized to fit),
    unless resources.check_placement is false. Its ranks' CPUs are resolved against the
    machine's, as placed_config resolves them once the cluster runs."""
    if not config.resources.check_placement:
        return
    node = NodeResources("this machine", float(local_cpus), float(machine_gpus))
    check_placement(resolve_cpus_per_rank(config, machine_cpus), ClusterResources((node,)))


def placed_config(config: DeploymentConfig, node_cpus: float | None = None) -> DeploymentConfig:
    """`config` with cpus_per_rank resolved against `node_cpus` (default: the
    connected cluster's largest node) and checked against the connected Ray
    cluster; raises PlacementError when it can never be placed there, unless
    resources.check_placement is false (a cluster that adds nodes on demand).
    With `node_cpus` (the one-node cluster pdserve started), the KV path listens
    on loopback unless the config names an address."""
    if node_cpus is not None and config.kv_transfer.listen_address is None:
        config = config.model_copy(update={"kv_transfer": config.kv_transfer.model_copy(
            update={"listen_address": LOOPBACK})})
    cluster = cluster_resources()
    config = resolve_cpus_per_rank(config, node_cpus if node_cpus is not None else cluster.largest_node_cpus)
    try:
        check_placement(config, cluster)
    except PlacementError as exc:
        if config.resources.check_placement:
            raise
        log.warning("deploying although the cluster cannot place every gang now (resources.check_placement "
                    "is false; Serve waits until nodes come):\n%s", exc)
    return config

