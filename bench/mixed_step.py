"""What a prompt chunk costs beside running decodes, in one engine step.

Colocated (and under conditional disaggregation), a new prompt is prefilled in
the same step as the sequences already decoding. Its time to first token is
then that step's time, not the prompt's alone; this measures how much the
decodes add. Offline engine, `bench` preset (fp32), greedy: the median time of
a step holding one prompt of --prompt-len tokens and nothing else; of N
decode-only steps; and of steps holding the prompt beside the N decodes.
`× separate` is the mixed step over (prompt alone + decode-only): under 1.0
the two share the step's fixed costs (weights read once per step).

    python bench/mixed_step.py [--threads 2] [--prompt-len 280] [--decodes 1,9,20] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.tiny_model import ensure_preset_model  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=280)
    ap.add_argument("--decodes", default="1,9,20", help="decoding sequences beside the prompt, comma-separated")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=str(ensure_preset_model("bench")), dtype="float32", max_num_seqs=64,
                                    max_model_len=2048, async_scheduling=False))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(args.prompt_len)]

    def step_ms(prefill_tokens: int, decodes: int) -> float:
        t = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t) * 1e3
        shape = engine.last_step
        assert (shape.num_prefill_tokens, shape.num_decode_seqs) == (prefill_tokens, decodes), shape
        return ms

    def prompt_alone() -> float:
        times = []
        for i in range(args.repeats):
            engine.add_request(f"alone-{i}-{rng.random()}", prompt(), ONE_TOKEN)
            times.append(step_ms(args.prompt_len, 0))
            engine.run_to_completion()
        return statistics.median(times)

    prompt_alone()                                 # warm-up: the first steps build kernels for their shapes
    alone = prompt_alone()
    print(f"{args.threads} threads, prompt of {args.prompt_len} tokens alone: {alone:.1f} ms")
    rows = []
    for n in (int(x) for x in args.decodes.split(",")):
        running = [engine.add_request(f"decode-{n}-{i}", prompt(), SamplingParams(
            max_tokens=10_000, temperature=0.0, ignore_eos=True)) for i in range(n)]
        while engine.step() is not None and engine.last_step.num_prefill_tokens:   # their prompts first
            pass
        decode_only = statistics.median(step_ms(0, n) for _ in range(2 * args.repeats))
        mixed = []
        for i in range(args.repeats):
            engine.add_request(f"mixed-{n}-{i}", prompt(), ONE_TOKEN)
            mixed.append(step_ms(args.prompt_len, n))
            step_ms(0, n)
        row = {"decodes": n, "decode_only_ms": decode_only, "mixed_ms": statistics.median(mixed),
               "separate_ms": alone + decode_only}
        row["x_separate"] = row["mixed_ms"] / row["separate_ms"]
        row["x_prompt_alone"] = row["mixed_ms"] / alone
        rows.append(row)
        print(f"  beside {n:3d} decodes: mixed step {row['mixed_ms']:6.1f} ms  decode-only {decode_only:5.1f} ms  "
              f"x separate {row['x_separate']:.2f}  x prompt alone {row['x_prompt_alone']:.2f}", flush=True)
        for rid in running:
            engine.abort_request(rid)
        engine.step()
    engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "prompt_alone_ms": alone, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
