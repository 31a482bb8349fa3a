"""The engine steps the live worker replicas of a running `pdserve serve` ran
since the last call, as JSON on stdout (each replica keeps its last 512):

    python bench/worker_steps.py ROLE [ROLE ...]    # colocated | prefill | decode
    -> {"prefill": [[prefill_tokens, prefill_attention, decode_seqs, decode_context, seconds, threads], ...], ...}

(threads: the torch threads the step ran with, its own plus any borrowed from idle engines.)

It joins the newest local Ray cluster as a driver of its own, so a benchmark
that starts one cluster after another gets the right one each time (Serve
caches its controller per driver process).
"""

from __future__ import annotations

import json
import sys

# The Serve deployment of each worker role (cluster/app_builder.py).
WORKER_DEPLOYMENTS = {"colocated": "ColocatedServer", "prefill": "PrefillServer", "decode": "DecodeServer"}


def main(roles: list[str]) -> int:
    import ray
    from ray import serve

    from cluster.cli.serve_command import APP_NAME
    unknown = [r for r in roles if r not in WORKER_DEPLOYMENTS]
    if not roles or unknown:
        print(f"usage: worker_steps.py ROLE [ROLE ...] with roles from {sorted(WORKER_DEPLOYMENTS)}",
              file=sys.stderr)
        return 2
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    steps = {}
    for role in roles:
        replies = serve.get_deployment_handle(WORKER_DEPLOYMENTS[role], app_name=APP_NAME) \
            .broadcast("step_samples").results(timeout_s=60)
        steps[role] = [[s.num_prefill_tokens, s.prefill_attention, s.num_decode_seqs, s.decode_context,
                        s.duration_s, s.threads] for reply in replies for _, s in reply["steps"]]
    print(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
