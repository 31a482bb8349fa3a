"""What tensor parallelism costs and buys on this machine, measured in one run.

    python bench/tp_scaling.py [--model DIR] [--num-prompts 32] [--tp 1,2]

For each TP degree: the same greedy workload through LLM.generate (output
tokens/s), the mean time of a pure decode step, and how much of each step
rank 0 spends inside all-reduce (two per layer: after attention and after the
MLP; the time includes waiting for the slowest rank). On CPU the ranks are
local processes over gloo, so this shows the cost of TP here, not a speed-up:
two ranks on two cores split the same FLOPs and add the collectives.

With a CUDA device, it also runs TP 1 on the GPU and reports the decode step
time at batch 1 against the planner's bandwidth floor (weights + KV read once
per step / HBM bandwidth).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.model.parallel import TensorParallel


class AllReduceTimer:
    """Wraps TensorParallel.all_reduce in this process (rank 0) to time it."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._original = TensorParallel.all_reduce

    def __enter__(self):
        timer = self

        def timed(tp, x, op="sum"):
            start = time.perf_counter()
            out = timer._original(tp, x, op)
            timer.seconds += time.perf_counter() - start
            timer.calls += 1
            return out

        TensorParallel.all_reduce = timed
        return self

    def __exit__(self, *exc):
        TensorParallel.all_reduce = self._original


def workload(vocab: int, n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]
    return prompts


def measure(model_dir: str, tp: int, prompts, max_tokens: int, device: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device=device, tensor_parallel_size=tp, max_model_len=1024) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))           # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        total = time.perf_counter() - start
        # pure decode steps: all prompts prefilled, then time steps one by one
        engine = llm.engine
        for p in prompts:
            engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        with AllReduceTimer() as timer:
            steps, start = 0, time.perf_counter()
            for _ in range(20):
                engine.step()
                steps += 1
            decode_s = (time.perf_counter() - start) / steps
        engine.run_to_completion()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tp": tp, "output_tokens": tokens, "seconds": total, "tokens_per_s": tokens / total,
            "decode_step_ms": decode_s * 1e3, "decode_batch": len(prompts),
            "all_reduce_ms_per_step": timer.seconds / steps * 1e3 if tp > 1 else 0.0,
            "all_reduces_per_step": timer.calls / steps if tp > 1 else 0}


def gpu_floor(model_dir: str) -> dict | None:
    if not torch.cuda.is_available():
        return None
    from engine.memory_planner import GPU_TYPES, plan
    from engine.model import ModelConfig
    name = torch.cuda.get_device_name()
    gpu = next((g for key, g in GPU_TYPES.items() if key.split("-")[0] in name), None)
    if gpu is None:
        return {"device": name, "note": "unknown GPU type: no bandwidth figure to compare with"}
    mc = ModelConfig.from_pretrained(model_dir)
    with LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=1024) as llm:
        engine = llm.engine
        engine.add_request(None, list(range(3, 259)), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            engine.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) / 50 * 1e3
    p = plan(mc, tp=1, gpu_memory_gib=gpu.memory_gib, dtype="bfloat16", max_model_len=300, gpu_type=gpu.name)
    floor = p.decode_floor_ms_batch1
    return {"device": name, "decode_step_ms_batch1": step_ms, "floor_ms": floor, "fraction_of_floor": floor / step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the 'bench' preset)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.model is None:
        from engine.tiny_model import ensure_preset_model
        model_dir = str(ensure_preset_model("bench"))
    else:
        model_dir = args.model
    prompts = workload(8000, args.num_prompts, seed=0)
    threads = torch.get_num_threads()
    results = []
    for tp in [int(x) for x in args.tp.split(",")]:
        r = measure(model_dir, tp, prompts, args.max_tokens, "cpu")
        torch.set_num_threads(threads)  # TP lowers rank 0's threads to cores / tp
        results.append(r)
        print(f"TP {tp}: {r['tokens_per_s']:7.1f} output tok/s ({r['seconds']:.2f} s), decode step "
              f"{r['decode_step_ms']:.1f} ms at batch {r['decode_batch']}, all-reduce "
              f"{r['all_reduce_ms_per_step']:.1f} ms/step over {r['all_reduces_per_step']:.0f} calls")
    base = results[0]
    for r in results[1:]:
        print(f"TP {r['tp']} / TP {base['tp']}: throughput {r['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
              f"all-reduce share of the decode step {r['all_reduce_ms_per_step'] / r['decode_step_ms']:.0%}")
    gpu = gpu_floor(model_dir)
    if gpu:
        print(f"GPU {gpu}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": results, "gpu": gpu}, indent=2))


if __name__ == "__main__":
    main()
