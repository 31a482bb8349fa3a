"""Scoring tokens on a CPU (engine.sampler.score_tokens: prompt logprobs, and the
logprobs of sampled tokens): cache-sized blocks against one pass over all rows.

    python bench/score_tokens.py [--rows 256] [--vocab 8192,32000,128256] [--top 0,1,5] [--threads 2]

For each vocabulary size and number of alternatives, the best of --repeats runs
of score_tokens on random float32 logits [rows, vocab], and of the same ops in
one pass over all rows (log_softmax, an int64 rank sum, topk: how it was done
before), and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampler import score_tokens  # noqa: E402


def one_pass(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> None:
    """The baseline: every op over all rows at once."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = token_ids.unsqueeze(1)
    logprobs.gather(1, chosen).squeeze(1).tolist()
    ((logits > logits.gather(1, chosen)).sum(dim=-1) + 1).tolist()
    if top_n:
        best = logprobs.topk(top_n, dim=-1)
        best.values.tolist(), best.indices.tolist()


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", default="8192,32000,128256")
    p.add_argument("--top", default="0,1,5")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows, {args.threads} torch threads, best of {args.repeats}")
    print("| vocabulary | alternatives | one pass | blocks | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        logits = torch.randn(args.rows, vocab)
        tokens = torch.randint(0, vocab, (args.rows,))
        for top in (int(t) for t in args.top.split(",")):
            base = best_ms(lambda: one_pass(logits, tokens, top), args.repeats)
            new = best_ms(lambda: score_tokens(logits, tokens, top), args.repeats)
            print(f"| {vocab:,} | {top} | {base:.1f} ms | {new:.1f} ms | {base / new:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
