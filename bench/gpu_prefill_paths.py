"""A lone fresh prompt's prefill step on a GPU: the paged Triton prefill kernel against
SDPA's contiguous causal kernel, per prompt length, alternated in one run.

    python3 bench/gpu_prefill_paths.py [--model-dir /tmp/llama3-8b-random] [--out FILE]

The engine sends a lone fresh prompt shorter than SDPA_FRESH_PREFILL_MIN_TOKENS
(engine/model/attention_metadata.py) through the paged kernel, longer ones through SDPA; "sdpa"
here sets the threshold to 0 (every lone fresh prompt through SDPA, the engine's
behaviour before the threshold). Each figure is the median of 5 warm steps
(`LLMEngine.step()` of one prompt and its first token, synchronous), after every
length ran twice on both paths. Writes the Llama-3-8B-shaped random checkpoint
of bench/gpu_engine.py if the folder holds none.
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

PROMPT_LENS = (16, 64, 128, 256, 512, 1000, 2048)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/tmp/llama3-8b-random")
    parser.add_argument("--out", default="bench/results/gpu_prefill_paths.json")
    args = parser.parse_args()

    import torch

    import engine.model.attention_metadata as attention_metadata
    from bench.gpu_engine import write_random_llama
    from engine import EngineConfig, LLMEngine, SamplingParams
    write_random_llama(args.model_dir, "llama3-8b")
    engine = LLMEngine(EngineConfig(model=args.model_dir, dtype="bfloat16", max_model_len=8192, max_num_seqs=64,
                                    max_num_batched_tokens=8192, async_scheduling=False))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill_ms(n: int) -> float:
        engine.add_request(None, [rng.randrange(128000) for _ in range(n)], params)
        torch.cuda.synchronize()
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    thresholds = {"paged": attention_metadata.SDPA_FRESH_PREFILL_MIN_TOKENS, "sdpa": 0}
    for threshold in thresholds.values():         # warm both paths at every length
        attention_metadata.SDPA_FRESH_PREFILL_MIN_TOKENS = threshold
        for n in PROMPT_LENS:
            prefill_ms(n)
            prefill_ms(n)
    result = {"device": torch.cuda.get_device_name(), "threshold": thresholds["paged"],
              "ms": {path: {} for path in thresholds}}
    for n in PROMPT_LENS:
        samples: dict[str, list[float]] = {path: [] for path in thresholds}
        for _ in range(5):
            for path, threshold in thresholds.items():
                attention_metadata.SDPA_FRESH_PREFILL_MIN_TOKENS = threshold
                samples[path].append(prefill_ms(n))
        paged, sdpa = (statistics.median(samples[p]) for p in thresholds)
        result["ms"]["paged"][n], result["ms"]["sdpa"][n] = paged, sdpa
        print(f"prefill {n:5d}: paged {paged:7.2f} ms, sdpa {sdpa:7.2f} ms, sdpa/paged {sdpa / paged:.2f}", flush=True)
    engine.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
