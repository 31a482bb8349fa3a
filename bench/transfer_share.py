"""What share of a request's latency the KV hand-off costs, served for real.

Starts a local Ray cluster, serves the tiny model disaggregated (1 prefill + 1
decode) and then colocated (the baseline), sends the same requests to each over
HTTP one at a time, and reads the router's own phase histograms from /metrics:

    python bench/transfer_share.py [--requests 24] [--prompt-tokens 128 512] [--max-tokens 32]

Prints per mode: mean TTFT, mean end-to-end latency, and for disaggregated the
mean queue / prefill / KV-transfer time, bytes per hand-off and the transfer's
share of end-to-end latency (the first token is streamed before the hand-off);
then disaggregated / colocated ratios.
Figures are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import urllib.request
from pathlib import Path

from bench.serve_app import deploy

PHASES = {
    "ttft": "pdserve_time_to_first_token_seconds",
    "e2e": "pdserve_e2e_request_latency_seconds",
    "queue": "pdserve_request_queue_time_seconds",
    "prefill": "pdserve_request_prefill_time_seconds",
    "transfer": "pdserve_kv_transfer_time_seconds",
    "transfer_bytes": "pdserve_kv_transfer_bytes",
}


def histogram_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """phase -> (sum, count) of its histogram."""
    sums, counts = {}, {}
    for line in metrics_text.splitlines():
        for key, name in PHASES.items():
            if line.startswith(name + "_sum"):
                sums[key] = float(line.split()[-1])
            elif line.startswith(name + "_count"):
                counts[key] = float(line.split()[-1])
    return {k: (sums[k], counts.get(k, 0.0)) for k in sums}


def means_between(before: dict, after: dict) -> dict[str, float]:
    """Mean of each phase over the observations made between two scrapes."""
    out = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            out[key] = (total - total0) / (count - count0)
    return out


def run_mode(mode: str, prompts: list[list[int]], max_tokens: int, port: int) -> dict[str, float]:
    from ray import serve

    # every prompt through a prefill worker: this measures the hand-off
    base = deploy(mode, {"mode": mode, "model": {"dtype": "float32", "max_model_len": 1024},
                         "disaggregation": {"policy": "always"}}, port)

    def scrape() -> dict[str, tuple[float, float]]:
        return histogram_totals(urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode())

    warmup, *measured = prompts   # the warm-up also connects the KV pair: not counted
    before = None
    for prompt in [warmup, *measured]:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        before = before or scrape()
    after = scrape()
    serve.delete(mode)
    return means_between(before, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer_share.json"))
    args = parser.parse_args()

    import ray
    from ray import serve

    from engine.tp_group import free_port

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(*args.prompt_tokens))]
               for _ in range(args.requests + 1)]
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        results = {mode: run_mode(mode, prompts, args.max_tokens, port) for mode in ("disaggregated", "colocated")}
    finally:
        serve.shutdown()
        ray.shutdown()

    d, c = results["disaggregated"], results["colocated"]
    print(f"{args.requests} requests, one at a time, prompts of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
          f"tokens, {args.max_tokens} output tokens, tiny model fp32 on CPU")
    print(f"{'':16}{'disaggregated':>16}{'colocated':>12}{'ratio':>8}")
    for key in ("ttft", "e2e"):
        print(f"{key + ' (ms)':16}{d[key] * 1e3:16.1f}{c[key] * 1e3:12.1f}{d[key] / c[key]:8.2f}")
    for key in ("queue", "prefill", "transfer"):
        print(f"{key + ' (ms)':16}{d[key] * 1e3:16.1f}")
    print(f"{'KV per request':16}{d['transfer_bytes'] / 2**20:13.2f} MiB")
    # the first token is streamed from the prefill worker: the hand-off runs after it, inside e2e only
    share = {"of_e2e": d["transfer"] / d["e2e"]}
    print(f"KV transfer share: {share['of_e2e']:.1%} of end-to-end latency (TTFT does not wait for it)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "means_s": results, "transfer_share": share},
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
