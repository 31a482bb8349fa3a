"""Decode matmuls at Llama-3-8B shapes on one GPU: cuBLAS against the skinny Triton
kernel (engine/kernels/gemv.py), as achieved weight-read bandwidth against the
copy and read ceilings measured in the same run.

    python3 bench/gpu_gemv.py [--rows 1,2,4,8,16] [--budget-s 300] [--out bench/results/gpu_gemv.json]

1. ceilings: a 2 GiB device-to-device copy (read + written bytes / time) and a
   4 GiB read (a sum in fp32);
2. per shape (qkv, o, gate_up, down, lm_head) and row count: cuBLAS (F.linear)
   and every tile configuration of the Triton kernel that fits its registers;
   weights rotate over enough copies (>= 400 MB) that none is read from L2;
3. a whole decode step's matmuls (32 layers of separate weights + lm_head) captured
   in one CUDA graph, cuBLAS against the best configurations of step 2: the time
   a decode step spends in matmuls, launch gaps included.

Prints the best configuration per (N, K, rows) as a table for gemv.py's CONFIGS_BY_GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name -> (N, K) of W [N, K], Llama-3-8B
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYERS = 32


def candidate_configs(block_m: int, n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """Tile configurations whose registers fit, the likeliest first (a run that
    runs out of budget has tried those)."""
    found = []
    for bn, bk, split, warps, stages in itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (1, 2, 4),
                                                          (4, 8), (2, 3, 4)):
        if block_m * bn * bk > 4096 * warps or bk * 2 > k or bn * bk < 1024:
            continue   # the fp32 product would spill registers / fewer than two K steps / tiny tiles
        if split > 1 and (n > 8192 or k % (bk * split)):
            continue
        found.append((bn, bk, split, warps, stages))
    likeliest = (4, 1024, 1, 4, 4)
    return sorted(found, key=lambda c: sum(a != b for a, b in zip(c, likeliest)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1")
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--out", default="bench/results/gpu_gemv.json")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    import triton

    from engine.kernels.gemv import padded_rows, skinny_linear

    started = time.monotonic()
    dev = torch.device("cuda")
    bench = triton.testing.do_bench
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    src = torch.randn(2**30 // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    out["copy_bytes_per_s"] = copy_bw = 2 * src.numel() * 2 / (ms * 1e-3)
    big = torch.randn(2**31, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: big.sum(dtype=torch.float32), warmup=20, rep=300, return_mode="median")
    out["read_bytes_per_s"] = read_bw = big.numel() * 2 / (ms * 1e-3)
    del src, dst, big
    print(f"{out['device']}: copy {copy_bw / 1e12:.2f} TB/s, read {read_bw / 1e12:.2f} TB/s", flush=True)

    rows_list = [int(r) for r in args.rows.split(",")]
    per_shape: list[dict] = []
    best: dict[tuple[int, int, int], tuple] = {}
    shape_budget = args.budget_s * 0.75 / (len(SHAPES) * len(rows_list))
    for (name, (n, k)), m in itertools.product(SHAPES.items(), rows_list):
        copies = max(1, -(-400_000_000 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().T)
        turn = itertools.cycle(range(copies))
        nbytes = n * k * 2
        t_cublas = bench(lambda: F.linear(x, ws[next(turn)]), warmup=10, rep=50, return_mode="median")
        rec = {"shape": name, "n": n, "k": k, "rows": m, "cublas_ms": t_cublas,
               "cublas_bw": nbytes / (t_cublas * 1e-3), "triton": []}
        shape_start = time.monotonic()
        for cfg in candidate_configs(padded_rows(m), n, k):
            if time.monotonic() - shape_start > shape_budget:
                rec["truncated"] = True
                break
            try:
                y = skinny_linear(x, ws[0], cfg)
                err = ((y.double() - ref).norm() / ref.norm()).item()
                t = bench(lambda: skinny_linear(x, ws[next(turn)], cfg), warmup=5, rep=25, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                rec["triton"].append({"config": cfg, "error": str(exc)[:200]})
                continue
            rec["triton"].append({"config": cfg, "ms": t, "rel_err": err})
        ok = [r for r in rec["triton"] if "ms" in r and r["rel_err"] < 1e-2]
        if ok:
            top = min(ok, key=lambda r: r["ms"])
            rec["best"] = top
            best[(n, k, padded_rows(m))] = tuple(top["config"])
            print(f"{name:8s} M={m:2d}: cuBLAS {t_cublas * 1e3:7.1f} us ({rec['cublas_bw'] / 1e12:.2f} TB/s)  "
                  f"triton {top['ms'] * 1e3:7.1f} us ({nbytes / (top['ms'] * 1e-3) / 1e12:.2f} TB/s) "
                  f"{tuple(top['config'])} of {len(ok)} configs", flush=True)
        per_shape.append(rec)
        del ws
        torch.cuda.empty_cache()
    out["shapes"] = per_shape
    out["best_configs"] = {f"{n},{k},{bm}": list(c) for (n, k, bm), c in best.items()}

    # a decode step's matmuls, one CUDA graph each way
    layers = [{name: torch.randn(*SHAPES[name], device=dev, dtype=torch.bfloat16) * 0.02
               for name in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    lm_head = torch.randn(*SHAPES["lm_head"], device=dev, dtype=torch.bfloat16) * 0.02
    step_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values()) + lm_head.numel() * 2
    chain = []
    for m in rows_list:
        x4 = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        x14 = torch.randn(m, 14336, device=dev, dtype=torch.bfloat16)

        def run(mm):
            for layer in layers:
                mm(x4, layer["qkv"]); mm(x4, layer["o"]); mm(x4, layer["gate_up"]); mm(x14, layer["down"])
            mm(x4, lm_head)

        def triton_mm(x, w):
            return skinny_linear(x, w, best.get((w.shape[0], w.shape[1], padded_rows(x.shape[0]))))

        rec = {"rows": m, "weight_bytes": step_bytes}
        for label, mm in (("cublas", F.linear), ("triton", triton_mm)):
            run(mm)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(mm)
            t = bench(graph.replay, warmup=5, rep=200, return_mode="median")
            rec[f"{label}_ms"] = t
            rec[f"{label}_bw"] = step_bytes / (t * 1e-3)
        chain.append(rec)
        print(f"step matmuls M={m:2d}: cuBLAS {rec['cublas_ms']:.3f} ms ({rec['cublas_bw'] / 1e12:.2f} TB/s), "
              f"triton {rec['triton_ms']:.3f} ms ({rec['triton_bw'] / 1e12:.2f} TB/s); "
              f"floor at copy rate {step_bytes / copy_bw * 1e3:.3f} ms", flush=True)
    out["step_matmuls"] = chain
    out["elapsed_s"] = time.monotonic() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"CONFIGS_BY_GPU[...] for {out['device']} = {{")
    for (n, k, bm), c in sorted(best.items()):
        print(f"    ({n}, {k}, {bm}): {c},")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
