"""Engine throughput against transformers generate(), measured in one run.

    python bench/engine_throughput.py [--model DIR] [--num-prompts 64] [--hf-batch-size 8]

Workload: `--num-prompts` prompts of random token ids with lengths uniform in
[--min-input, --max-input] and output lengths uniform in [--min-output,
--max-output], EOS ignored so every system generates exactly the same number of
tokens. Systems, all greedy, fp32, same checkpoint (default: the ~30M "bench"
preset, built on first use):

- pdserve: every prompt submitted at once to LLM.generate (continuous batching);
- transformers, one prompt at a time (batch 1);
- transformers, padded batches of --hf-batch-size prompts of similar length, each
  batch running to its longest output (only the tokens each prompt asked for count).

Prints output tokens/s for each and pdserve's ratio to each baseline.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch


def build_workload(vocab: int, special: set[int], n: int, in_range, out_range, seed: int):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(*in_range)
        ids = []
        while len(ids) < length:
            t = rng.randrange(vocab)
            if t not in special:
                ids.append(t)
        prompts.append(ids)
        outs.append(rng.randint(*out_range))
    return prompts, outs


def run_pdserve(model_dir: str, prompts, outs) -> float:
    from engine import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == outs
    return elapsed


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_hf_sequential(model, prompts, outs) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, n in zip(prompts, outs):
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            assert out.shape[1] - len(ids) == n
    return time.perf_counter() - start


def run_hf_batched(model, prompts, outs, batch_size: int, pad_id: int) -> float:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            longest = max(len(prompts[i]) for i in idx)
            x = torch.full((len(idx), longest), pad_id, dtype=torch.long)
            mask = torch.zeros_like(x)
            for row, i in enumerate(idx):  # left padding, as decoder-only generation needs
                x[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, longest - len(prompts[i]):] = 1
            n = max(outs[i] for i in idx)
            model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad_id)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build the 'bench' preset)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip-sequential", action="store_true", help="skip the (slow) batch-1 baseline")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.model is None:
        from engine.tiny_model import ensure_preset_model
        model_dir = str(ensure_preset_model("bench"))
    else:
        model_dir = args.model
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, outs = build_workload(len(tok), set(tok.all_special_ids), args.num_prompts,
                                   (args.min_input, args.max_input), (args.min_output, args.max_output), args.seed)
    total_out = sum(outs)
    hf = _hf_model(model_dir)
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model {model_dir} ({n_params / 1e6:.1f}M params), {len(prompts)} prompts, "
          f"input {args.min_input}-{args.max_input} tokens (total {sum(map(len, prompts))}), "
          f"output {args.min_output}-{args.max_output} (total {total_out}), torch threads {torch.get_num_threads()}")

    results = {}
    t = run_pdserve(model_dir, prompts, outs)
    results["pdserve"] = t
    print(f"pdserve (continuous batching)          {t:8.2f} s  {total_out / t:8.1f} output tok/s")
    t = run_hf_batched(hf, prompts, outs, args.hf_batch_size, tok.pad_token_id or 0)
    results[f"transformers_batch{args.hf_batch_size}"] = t
    print(f"transformers generate, batch {args.hf_batch_size:<3}       {t:8.2f} s  {total_out / t:8.1f} output tok/s")
    if not args.skip_sequential:
        t = run_hf_sequential(hf, prompts, outs)
        results["transformers_batch1"] = t
        print(f"transformers generate, batch 1         {t:8.2f} s  {total_out / t:8.1f} output tok/s")
    ours = total_out / results["pdserve"]
    for name, t in results.items():
        if name != "pdserve":
            print(f"ratio pdserve / {name}: {ours / (total_out / t):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model_params": n_params, "num_prompts": len(prompts), "output_tokens": total_out,
            "seconds": results, "output_tokens_per_s": {k: total_out / v for k, v in results.items()},
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        }, indent=2))


if __name__ == "__main__":
    main()
