"""CPU per generated token of building a request's outputs, by how long the output already is.

    python bench/output_cost.py [--tokens 16000] [--logprobs 0,1] [--rounds 3] [--json FILE]

Feeds one request's sampled tokens (random ids of the built-in tiny model's
vocabulary, 100-token prompt, EOS ignored) through what the serving path runs
per token, with no model in the way:
- engine side, on the engine thread: detokenize and check stops
  (RequestTextState.append), make the step's output (make_output) and the
  worker's TokenDelta from it;
- router side: add the delta to the request's output (the serving backend's
  accumulator), which the HTTP layer then sends as an SSE chunk.
The engine side runs with CUMULATIVE outputs (everything so far in every
output: what the engine made for every consumer before DELTA existed) and with
DELTA outputs (what the workers ask for), in the same run, alternating within
each round. Prints microseconds per token over output positions [0, 1k),
[1k, 4k), [4k, tokens) (median over the rounds) and cumulative / delta.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from cluster.serving.messages import TokenDelta
from engine.output_processor import RequestTextState
from engine.outputs import OutputKind
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.serving_backend import _Accumulator

PROMPT_LEN = 100


def spans(tokens: int) -> list[tuple[int, int]]:
    edges = sorted({0, *(e for e in (1_000, 4_000) if e < tokens), tokens})
    return list(zip(edges, edges[1:]))


def one_request(tokenizer, kind: OutputKind, tokens: int, logprobs: bool, seed: int) -> dict[str, list[float]]:
    """Seconds per token of each side, per span of output positions."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
    ids = [rng.randrange(256, vocab) for _ in range(tokens)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=1 if logprobs else None)
    seq = Sequence("r", list(prompt), len(prompt), params)
    state = RequestTextState(seq, tokenizer, 10**9, kind)
    accumulator = _Accumulator("r", prompt)
    engine_s, router_s = [0.0] * tokens, [0.0] * tokens
    for i, token_id in enumerate(ids):
        t0 = time.perf_counter()
        state.append(token_id, TokenLogprobs(token_id, -1.0, 1, [(token_id, -1.0)]) if logprobs else None)
        delta = TokenDelta.from_output(state.make_output(i == tokens - 1))
        t1 = time.perf_counter()
        accumulator.add(delta)
        router_s[i], engine_s[i] = time.perf_counter() - t1, t1 - t0
    per_span = {}
    for side, times in (("engine", engine_s), ("router", router_s)):
        per_span[side] = [sum(times[a:b]) / (b - a) for a, b in spans(tokens)]
    return per_span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_000, help="output tokens of the request")
    parser.add_argument("--logprobs", default="0,1", help="comma-separated: without (0) and with (1) logprobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        parser.error("--tokens must be at least 2 and --rounds at least 1")
    tokenizer = load_tokenizer(ensure_default_model())
    results = []
    for logprobs in (bool(int(x)) for x in args.logprobs.split(",")):
        runs: dict[OutputKind, list[dict[str, list[float]]]] = {OutputKind.CUMULATIVE: [], OutputKind.DELTA: []}
        for r in range(args.rounds):
            for kind in runs:
                runs[kind].append(one_request(tokenizer, kind, args.tokens, logprobs, seed=r))
        print(f"\nlogprobs: {'1' if logprobs else 'none'}; {args.tokens} output tokens, median of {args.rounds}")
        print(f"{'output positions':>18} | {'engine cumulative':>17} | {'engine delta':>12} | ratio | "
              f"{'router':>8}  (us per token)")
        for j, (a, b) in enumerate(spans(args.tokens)):
            row = {"logprobs": logprobs, "from": a, "to": b}
            for kind in runs:
                for side in ("engine", "router"):
                    row[f"{side}_{kind.value}_us"] = 1e6 * statistics.median(run[side][j] for run in runs[kind])
            row["engine_ratio"] = row["engine_cumulative_us"] / row["engine_delta_us"]
            results.append(row)
            print(f"{f'[{a}, {b})':>18} | {row['engine_cumulative_us']:17.1f} | {row['engine_delta_us']:12.1f} | "
                  f"{row['engine_ratio']:5.2f} | {row['router_delta_us']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
