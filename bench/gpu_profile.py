"""Where a decode step's GPU time goes: torch.profiler over graph-replayed decode
steps of the Llama-3-8B-shaped random checkpoint (bench/gpu_engine.py writes
it), per kernel, grouped into matmuls, attention, fused small ops and the rest.

    python3 bench/gpu_profile.py [--model-dir /tmp/llama3-8b-random] [--out bench/results/gpu_profile.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = (("attention", ("_decode_kernel", "_merge_splits", "_prefill_kernel", "flash")),
          ("kv write", ("_write_kv",)),
          ("norms / rotary / silu", ("rms_norm", "rotary", "silu", "_add_")),
          ("matmul", ("gemm", "gemv", "sm90", "cutlass", "nvjet", "splitk", "splitK")),
          ("sampling", ("argmax", "reduce", "max_")))


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in lowered for k in keys):
            return group
    return "other"


def profile_point(engine, batch: int, context: int, steps: int = 8) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams
    rng = random.Random(batch * 7919 + context)
    ids = [engine.add_request(None, [rng.randrange(128000) for _ in range(context)],
                              SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
           for _ in range(batch)]
    started_ids: set[str] = set()
    while len(started_ids) < len(ids):           # every prompt prefilled: its first token is out
        started_ids.update(out.request_id for out in engine.step())
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / steps * 1e3
    for i in ids:
        engine.abort_request(i)
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if us and event.key and not event.key.startswith(("cudaGraph", "Memcpy", "Memset")):
            kernels[event.key] = kernels.get(event.key, 0.0) + us / steps / 1e3
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"batch": batch, "context": context, "step_wall_ms": wall_ms,
            "gpu_kernel_ms": sum(kernels.values()), "groups_ms": groups,
            "top_kernels_ms": [[name[:90], ms] for name, ms in top]}


def host_profile(engine, batch: int, context: int, steps: int = 20) -> str:
    """cProfile of `steps` decode steps: where the host's time goes (a wait for
    the GPU shows up in the call that reads the sampled tokens)."""
    import cProfile
    import io
    import pstats

    from engine import SamplingParams
    rng = random.Random(batch * 31 + context)
    ids = [engine.add_request(None, [rng.randrange(128000) for _ in range(context)],
                              SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
           for _ in range(batch)]
    started_ids: set[str] = set()
    while len(started_ids) < len(ids):
        started_ids.update(out.request_id for out in engine.step())
    engine.step()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    wall_ms = (time.perf_counter() - started) / steps * 1e3
    for i in ids:
        engine.abort_request(i)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    return f"B={batch} C={context}: {wall_ms:.2f} ms/step under cProfile\n" + text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/tmp/llama3-8b-random")
    parser.add_argument("--out", default="bench/results/gpu_profile.json")
    args = parser.parse_args()
    from bench.gpu_engine import write_random_llama
    from engine import EngineConfig, LLMEngine
    write_random_llama(args.model_dir, "llama3-8b")
    engine = LLMEngine(EngineConfig(model=args.model_dir, dtype="bfloat16", max_model_len=8192, max_num_seqs=64,
                                    num_kv_blocks=64 * 2200 // 16, max_num_batched_tokens=8192))
    points = [profile_point(engine, b, c) for b, c in ((1, 512), (64, 2048))]
    host = [host_profile(engine, b, c) for b, c in ((64, 2048), (1, 512))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"kernels": points, "host": host}, indent=2) + "\n")
    for text in host:
        print(text)
    for p in points:
        print(f"B={p['batch']} C={p['context']}: step {p['step_wall_ms']:.2f} ms wall, "
              f"{p['gpu_kernel_ms']:.2f} ms of kernels")
        for group, ms in sorted(p["groups_ms"].items(), key=lambda kv: -kv[1]):
            print(f"    {group:24s} {ms:7.3f} ms")
        for name, ms in p["top_kernels_ms"]:
            print(f"      {ms:7.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
