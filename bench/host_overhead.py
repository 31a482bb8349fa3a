"""Host work per decode step, by part, at B running sequences.

Every engine step pays, besides the model's forward, the scheduler's
bookkeeping and the output processing of each sampled token (appending it,
EOS / stop checks, incremental detokenization, the RequestOutput). With
tensor parallelism (no async scheduling) all of it sits between two device
steps, so per sequence it must stay a small share of a decode step. This runs
the `tiny` preset on one thread (so the forward is cheap and the host parts
show), B sequences decoding sampled tokens, and times each part with wrappers
around the engine's own methods:

    schedule   Scheduler.schedule + after_step
    runner     ModelRunner.launch (prepare, forward, sample: includes the model)
    outputs    the rest of LLMEngine.step (reading samples back, output processing)

    python bench/host_overhead.py [--seqs 64,256] [--steps 40] [--output-kind delta|cumulative] [--json F]
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
from engine.outputs import OutputKind  # noqa: E402
from engine.tiny_model import ensure_preset_model  # noqa: E402


def _timed(obj, name: str, bucket: list[float]) -> None:
    """Wraps obj.name so that each call's wall time is added to bucket[0]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            bucket[0] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def measure(num_seqs: int, steps: int, output_kind: OutputKind) -> dict:
    engine = LLMEngine(EngineConfig(model=str(ensure_preset_model("tiny")), dtype="float32", max_num_seqs=num_seqs,
                                    max_model_len=1024, async_scheduling=False,
                                    num_kv_blocks=num_seqs * (16 + steps + 40) // 16 + 64))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=100_000, temperature=0.8, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(10, vocab) for _ in range(16)], params, output_kind=output_kind)
    engine.step()
    while engine.last_step.num_prefill_tokens:   # the prompts first
        engine.step()
    for _ in range(5):
        engine.step()
    schedule, runner = [0.0], [0.0]
    _timed(engine.scheduler, "schedule", schedule)
    _timed(engine.scheduler, "after_step", schedule)
    _timed(engine.runner, "launch", runner)
    totals = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t)
        assert engine.last_step.num_decode_seqs == num_seqs, engine.last_step
    engine.shutdown()
    step = statistics.mean(totals)
    parts = {"schedule": schedule[0] / steps, "runner": runner[0] / steps}
    parts["outputs"] = step - parts["schedule"] - parts["runner"]
    return {"seqs": num_seqs, "step_ms": step * 1e3, **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
            "host_us_per_seq": (parts["schedule"] + parts["outputs"]) / num_seqs * 1e6,
            "host_share": (parts["schedule"] + parts["outputs"]) / step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--output-kind", choices=["delta", "cumulative"], default="delta",
                    help="delta: what the served workers ask for; cumulative: LLM.generate's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kind = OutputKind.DELTA if args.output_kind == "delta" else OutputKind.CUMULATIVE
    rows = []
    for n in (int(x) for x in args.seqs.split(",")):
        row = measure(n, args.steps, kind)
        rows.append(row)
        print(f"{n:4d} sequences: step {row['step_ms']:6.2f} ms = schedule {row['schedule_ms']:5.2f} + runner "
              f"{row['runner_ms']:6.2f} + outputs {row['outputs_ms']:5.2f} ms; host outside the runner "
              f"{row['host_us_per_seq']:.1f} us a sequence, {row['host_share']:.0%} of the step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
