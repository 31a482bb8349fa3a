"""The roofline step model against published Llama-3-70B latencies.

    python bench/roofline_crosscheck.py [--json FILE]

Published figures: vLLM's continuous performance benchmark (Buildkite pipeline
vllm/performance-benchmark), test `latency_llama70B_tp4`: Llama-3-70B in bf16
at TP 4, a fixed batch of 8 prompts of 32 tokens, 128 output tokens each
(`benchmark_latency.py`: one generate() call, timed end to end), mean of its
iterations, on one machine of each GPU kind. The roofline side replays the
same work through `RooflineStepModel` (cluster/perf_model/roofline.py): one
prefill step of the 8 prompts (its first tokens), then 127 decode steps of 8
sequences with their contexts growing by one token a step. The roofline's
efficiencies come from pdserve's own H100 run (8B, CUDA graphs); nothing here
is fitted to these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.perf_model.roofline import RooflineStepModel  # noqa: E402
from cluster.perf_model.step_shape import StepShape  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3-70b"
BATCH, INPUT_LEN, OUTPUT_LEN, TP = 8, 32, 128, 4
# (roofline GPU, the benchmark's GPU label, mean latency in ms, Buildkite build)
PUBLISHED = (
    ("H100-SXM", "8xH100", 2444.47, 9555),
    ("H200", "H200", 2075.08, 9513),
    ("A100-80GB", "A100-SXM4-80GB", 3990.59, 9523),
)


def roofline_latency_s(model, gpu: str) -> tuple[float, float, float]:
    """(whole generate call, its prefill step, its mean decode step), seconds."""
    roofline = RooflineStepModel.for_model(model, gpu=gpu, tp=TP, dtype="bfloat16")
    prefill = roofline.step_time(StepShape.build([(0, INPUT_LEN)] * BATCH, []))
    decodes = [roofline.step_time(StepShape.build([], [INPUT_LEN + i] * BATCH)) for i in range(1, OUTPUT_LEN)]
    return prefill + sum(decodes), prefill, sum(decodes) / len(decodes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    model = ModelConfig.from_pretrained(str(MODEL_DIR))
    rows = []
    print(f"Llama-3-70B bf16, TP {TP}, batch {BATCH}, {INPUT_LEN} in / {OUTPUT_LEN} out, whole-call latency\n")
    print("| GPU | published (vLLM, build) | roofline | roofline / published | roofline prefill step | "
          "roofline decode step |")
    print("|---|---:|---:|---:|---:|---:|")
    for gpu, label, published_ms, build in PUBLISHED:
        total, prefill, decode = roofline_latency_s(model, gpu)
        ratio = total * 1000 / published_ms
        rows.append({"gpu": gpu, "published_label": label, "published_ms": published_ms, "build": build,
                     "roofline_ms": total * 1000, "ratio": ratio, "prefill_step_ms": prefill * 1000,
                     "mean_decode_step_ms": decode * 1000})
        print(f"| {gpu} | {published_ms:.0f} ms ({label}, #{build}) | {total * 1000:.0f} ms | {ratio:.2f} | "
              f"{prefill * 1000:.1f} ms | {decode * 1000:.1f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": BATCH, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                                               "tp": TP, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
