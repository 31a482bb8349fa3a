"""Which GPUs a worker replica's TP gang runs on.

A replica of TP degree N reserves N bundles of {"GPU": 1} in one STRICT_PACK
placement group (one node). The replica actor holds bundle 0's GPU; ranks
1..N-1 are processes the replica starts itself, so they must be told the GPUs
of bundles 1..N-1. `claim_gang_gpus` finds them (a zero-CPU probe task per
bundle reports the GPU Ray assigned to that bundle) and sets
CUDA_VISIBLE_DEVICES to the gang's GPUs in rank order, before CUDA starts in
this process: rank r then uses cuda:r.
"""

from __future__ import annotations

import asyncio
import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PROBE_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0, num_gpus=1)
def _gpu_of_bundle() -> str:
    return str(ray.get_gpu_ids()[0])


async def claim_gang_gpus(tp_size: int) -> list[str]:
    """Makes this replica's N bundle GPUs visible to it and its rank processes;
    returns them in rank order. Call before anything touches CUDA."""
    own = [str(i) for i in ray.get_gpu_ids()]
    if tp_size == 1:
        if own:      # (Ray sets it too, but not under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: then cuda:0)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(own)
        return own
    pg = ray.util.get_current_placement_group()
    if pg is None or len(own) != 1:
        raise RuntimeError(f"a TP {tp_size} replica needs a placement group of {tp_size} one-GPU bundles "
                           f"and one GPU of its own (it has {own or 'none'})")
    probes = [_gpu_of_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=k)).remote() for k in range(1, tp_size)]
    try:
        gpus = own + list(await asyncio.wait_for(asyncio.gather(*probes), PROBE_TIMEOUT_S))
    except asyncio.TimeoutError:      # (not the builtin TimeoutError before Python 3.11)
        for probe in probes:
            ray.cancel(probe, force=True)
        raise RuntimeError(f"the GPUs of this TP {tp_size} replica's bundles 1..{tp_size - 1} (placement group "
                           f"{pg.id.hex()}) were not found within {PROBE_TIMEOUT_S:g} s: the probes there were "
                           "not scheduled; check that the gang's nodes are alive and not out of CPU") from None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return gpus
