"""Host time to build one engine step's inputs, against the device step it feeds.

`ModelRunner.prepare` runs on the host before every step: token ids, positions,
the slot of each new token's K/V, and the block tables the attention kernels
read. Its cost is paid again every step, so at large batches and long contexts
it must stay a small share of the device step, which is what this measures:
prepare() on synthetic steps (decode-only batches of B sequences at a context
length, and one long prompt chunk), for the paged GPU kernels' inputs
(`--backend triton`) or the CPU engine's (`cpp`), against the roofline time of
the same step for Llama-3-70B in bf16 on 8 x H100-SXM (TP 8), the design
target: `share` = prepare / (prepare + device step), the part of a step the
device would idle if nothing overlapped them.

    python bench/step_inputs.py [--backend triton|cpp] [--repeats 20] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.perf_model.roofline import RooflineStepModel  # noqa: E402
from cluster.perf_model.step_shape import StepShape  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledStep  # noqa: E402
from engine.sequence import Sequence, SequenceStatus  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3-70b"
BLOCK_SIZE = 16
DECODE_CASES = [(16, 1024), (64, 1024), (256, 1024), (64, 8192), (256, 8192), (256, 32768)]   # (batch, context)
PREFILL_CASES = [8192, 32768]        # one chunk of this many prompt tokens, nothing cached


def _runner(backend: str) -> ModelRunner:
    worker = SimpleNamespace(kv_cache=SimpleNamespace(spec=SimpleNamespace(block_size=BLOCK_SIZE)),
                             attention_backend=backend, decode_splits=lambda batch, length: 1)
    return ModelRunner(worker, Sampler())


def _sequences(manager: BlockManager, batch: int, context: int, computed: int) -> list[Sequence]:
    """`batch` sequences of `context` tokens each, `computed` of them already in the cache."""
    seqs = []
    for i in range(batch):
        seq = Sequence(f"r{i}", [(7 * i + t) % 32000 for t in range(context)], min(context, 16),
                       SamplingParams(max_tokens=16), status=SequenceStatus.RUNNING, num_computed_tokens=computed)
        if not manager.allocate(seq.block_table, context):
            raise RuntimeError("the synthetic cache is too small")
        seqs.append(seq)
    return seqs


def _time_prepare(runner: ModelRunner, step: ScheduledStep, repeats: int) -> float:
    """Median seconds of runner.prepare(step) over `repeats` calls (after one warm-up)."""
    runner.prepare(step)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.prepare(step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("triton", "cpp"), default="triton",
                    help="whose inputs to build: the GPU's paged kernels or the CPU engine's")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    runner = _runner(args.backend)
    roofline = RooflineStepModel.for_model(ModelConfig.from_pretrained(str(MODEL_DIR)), gpu="H100-SXM", tp=8)
    rows = []
    print(f"prepare() for the {args.backend} backend, block size {BLOCK_SIZE}; device step: Llama-3-70B bf16 "
          f"on 8 x H100-SXM (TP 8), roofline\n")
    print("| step | prepare | device step | prepare share |")
    print("|---|---:|---:|---:|")
    cases = [("decode", b, c) for b, c in DECODE_CASES] + [("prefill", 1, n) for n in PREFILL_CASES]
    for kind, batch, context in cases:
        manager = BlockManager(batch * (-(-context // BLOCK_SIZE)) + 1, BLOCK_SIZE, enable_prefix_caching=False)
        if kind == "decode":
            seqs = _sequences(manager, batch, context, context - 1)
            step = ScheduledStep(seqs, [1] * batch, num_decode_seqs=batch)
            shape = StepShape.build([], [context] * batch)
            label = f"decode, {batch} x {context} tokens of context"
        else:
            seqs = _sequences(manager, 1, context, 0)
            step = ScheduledStep(seqs, [context])
            shape = StepShape.build([(0, context)], [])
            label = f"prefill, one chunk of {context} tokens"
        host_s = _time_prepare(runner, step, args.repeats)
        device_s = roofline.step_time(shape)
        share = host_s / (host_s + device_s)
        rows.append({"step": kind, "batch": batch, "context": context, "prepare_ms": host_s * 1e3,
                     "device_step_ms": device_s * 1e3, "share": share})
        print(f"| {label} | {host_s * 1e3:.2f} ms | {device_s * 1e3:.1f} ms | {share:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "block_size": BLOCK_SIZE,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
