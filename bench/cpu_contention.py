"""What another process's CPU costs the engine on a small CPU machine, measured in one run.

    python bench/cpu_contention.py [--loads 0,0.05,0.1,0.2] [--burst-us 100]
                                   [--where process|thread] [--num-prompts 128]
                                   [--rounds 2] [--model DIR] [--json FILE]

The engine runs a closed loop like the served load of bench/serving_overhead.py
(16 requests in flight, each replaced the moment it finishes; ~280-token
prompts, 64 output tokens, greedy, EOS ignored; torch on every core), once per
background load. A background load of L cores is a busy loop of --burst-us
microseconds every burst_us / L microseconds (a serving tier's work comes in
such short bursts: a message, a chunk, a request), in a process of its own or,
with --where thread, in a thread of the engine's process.

Prints, per load, output tokens/s (median over the rounds), the loss against no
load in the same round, and the amplification: the loss as a share of the
machine's CPU divided by the load's share (1.0: the engine loses exactly the
CPU taken from it). With torch's OpenMP regions over all cores, a thread that
loses its core holds the others at the region's barrier, so the engine loses
more than what was taken: that is what bounds a served engine below its offline
speed on a machine whose serving tier shares its cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import threading
import time

from bench.loadtest.datasets import random_dataset

CONCURRENCY = 16
INPUT_LEN, OUTPUT_LEN = 280, 64


def burn(burst_s: float, period_s: float, stop: threading.Event | None = None) -> None:
    """Busy for `burst_s` once every `period_s`, until `stop` is set (or for ever)."""
    deadline = time.perf_counter()
    while stop is None or not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            pass
        deadline += period_s
        wait = deadline - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        else:
            deadline = time.perf_counter()


class BackgroundLoad:
    """`cores` of CPU in bursts of `burst_s`, in a process or a thread, while in a `with` block."""

    def __init__(self, cores: float, burst_s: float, where: str):
        self.cores, self.burst_s, self.where = cores, burst_s, where
        self._process: multiprocessing.Process | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "BackgroundLoad":
        if self.cores <= 0:
            return self
        period = self.burst_s / self.cores
        if self.where == "thread":
            self._thread = threading.Thread(target=burn, args=(self.burst_s, period, self._stop), daemon=True)
            self._thread.start()
        else:
            self._process = multiprocessing.get_context("spawn").Process(
                target=burn, args=(self.burst_s, period), daemon=True)
            self._process.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._process is not None:
            self._process.terminate()
            self._process.join()


def closed_loop(engine, prompts: list[list[int]], params) -> float:
    """Output tokens/s of `engine` keeping CONCURRENCY of `prompts` in flight."""
    pending = iter(prompts)
    for prompt in [next(pending) for _ in range(CONCURRENCY)]:
        engine.add_request(None, prompt, params)
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.token_ids)
                prompt = next(pending, None)
                if prompt is not None:
                    engine.add_request(None, prompt, params)
    return tokens / (time.perf_counter() - start)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", default="0,0.05,0.1,0.2", help="background loads in cores (default 0,0.05,0.1,0.2)")
    p.add_argument("--burst-us", type=float, default=100.0, help="length of one burst of the load (default 100)")
    p.add_argument("--where", choices=("process", "thread"), default="process")
    p.add_argument("--num-prompts", type=int, default=128, help="requests per measurement (default 128)")
    p.add_argument("--rounds", type=int, default=2, help="every load measured this many times, in turn")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the cached 'bench' preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args()
    args.load_list = [float(x) for x in args.loads.split(",")]
    if 0.0 not in args.load_list:
        args.load_list.insert(0, 0.0)
    if any(x < 0 for x in args.load_list) or args.num_prompts < CONCURRENCY:
        p.error(f"loads must be >= 0 and --num-prompts at least {CONCURRENCY}")
    return args


def main() -> int:
    args = parse_args()
    import torch

    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import ensure_preset_model

    model_dir = args.model or str(ensure_preset_model("bench"))
    cores = os.cpu_count() or 1
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu", cpu_threads=cores))
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)

    def prompts(seed: int) -> list[list[int]]:
        requests = random_dataset(engine.tokenizer, num_prompts=args.num_prompts, input_len=INPUT_LEN,
                                  output_len=OUTPUT_LEN, seed=seed)
        return [list(engine.tokenizer.encode(r.prompt)) for r in requests]

    closed_loop(engine, prompts(args.seed + 999)[:CONCURRENCY], params)   # warm-up
    print(f"{model_dir}; {cores} cores, torch on {torch.get_num_threads()} threads; closed loop of "
          f"{CONCURRENCY}, {args.num_prompts} requests of ~{INPUT_LEN} prompt / {OUTPUT_LEN} output tokens; "
          f"load in {args.burst_us:g} us bursts, in a {args.where}", flush=True)
    runs: dict[float, list[float]] = {load: [] for load in args.load_list}
    for r in range(args.rounds):
        # a round's prompts are its own: the prefix cache never carries one run into the next
        for i, load in enumerate(args.load_list):
            with BackgroundLoad(load, args.burst_us * 1e-6, args.where):
                tps = closed_loop(engine, prompts(args.seed + 1000 * r + i), params)
            runs[load].append(tps)
            print(f"  round {r + 1}: load {load:.3f} cores: {tps:.1f} tok/s", flush=True)

    print(f"\n{'load (cores)':>12} {'tok/s':>8} {'loss':>7} {'amplification':>13}")
    rows = []
    for load in args.load_list:
        losses = [1 - tps / base for tps, base in zip(runs[load], runs[0.0])]
        loss = statistics.median(losses)
        amplification = loss / (load / cores) if load > 0 else None
        rows.append({"load_cores": load, "tok_s": runs[load], "loss": losses, "median_loss": loss,
                     "amplification": amplification})
        amp = f"{amplification:.1f}x" if amplification is not None else "-"
        print(f"{load:12.3f} {statistics.median(runs[load]):8.1f} {100 * loss:6.1f}% {amp:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "cores": cores,
                       "burst_us": args.burst_us, "where": args.where, "num_prompts": args.num_prompts,
                       "rounds": args.rounds, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
