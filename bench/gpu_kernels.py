"""Kernel-level timings on a CUDA GPU, at Llama-3-8B shapes (32 heads, 8 KV heads,
head_dim 128, bf16), against the memory floor measured in the same run:

- paged decode attention (in place, split contexts) vs the torch backend's
  gather + SDPA, at batch x context; achieved KV bandwidth over the copy rate;
- paged prefill attention after a cached prefix vs SDPA on contiguous K/V;
- the fused small ops (RMSNorm+residual, SiLU-and-mul, rotary) vs torch.

    python3 bench/gpu_kernels.py [--out bench/results/gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def copy_bandwidth(torch, triton) -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16).repeat(2)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def decode_rows(torch, triton, bandwidth: float) -> list[dict]:
    from engine.kernels.paged_attention import decode_splits, paged_decode_attention
    from engine.model.attention import _decode_attention
    from engine.model.attention_metadata import DecodeGroup
    rows = []
    device = torch.device("cuda")
    for batch in (1, 8, 32, 64, 128):
        for context in (512, 2048):
            blocks_per_seq = context // BLOCK
            num_blocks = batch * blocks_per_seq
            cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
            tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
            splits = decode_splits(batch, KV_HEADS, context, device)
            out = torch.empty_like(q)
            triton_ms = triton.testing.do_bench(
                lambda: paged_decode_attention(q, cache, tables, lens, 0.088, splits, out=out),
                warmup=20, rep=100, return_mode="median")
            group = DecodeGroup(0, tables.long(), None)
            torch_ms = triton.testing.do_bench(lambda: _decode_attention(q, cache, group, 0.088),
                                               warmup=10, rep=50, return_mode="median")
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
            floor_ms = kv_bytes / bandwidth * 1e3
            rows.append({"batch": batch, "context": context, "splits": splits, "triton_ms": triton_ms,
                         "torch_gather_ms": torch_ms, "floor_ms": floor_ms,
                         "bandwidth_share": floor_ms / triton_ms})
    return rows


def prefill_rows(torch, triton) -> list[dict]:
    import torch.nn.functional as F

    from engine.kernels.paged_attention import paged_prefill_attention
    device = torch.device("cuda")
    rows = []
    for prefix, chunk in ((0, 2048), (2048, 512), (1536, 2048)):
        total = prefix + chunk
        blocks = total // BLOCK
        cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        table = torch.arange(blocks, device=device, dtype=torch.int32)[None]
        q = torch.randn(chunk, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        lens = torch.tensor([total], dtype=torch.int32, device=device)
        triton_ms = triton.testing.do_bench(
            lambda: paged_prefill_attention(q, cache, table, starts, lens, chunk, 0.088),
            warmup=10, rep=100, return_mode="median")
        k = cache[0].reshape(total, KV_HEADS, HEAD_DIM).repeat_interleave(4, 1).transpose(0, 1)
        v = cache[1].reshape(total, KV_HEADS, HEAD_DIM).repeat_interleave(4, 1).transpose(0, 1)
        mask = torch.arange(total, device=device)[None, :] <= torch.arange(prefix, total, device=device)[:, None]
        qt = q.transpose(0, 1)
        if prefix == 0:
            sdpa = lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True)  # noqa: E731
        else:
            sdpa = lambda: F.scaled_dot_product_attention(qt, k, v, attn_mask=mask)  # noqa: E731
        sdpa_ms = triton.testing.do_bench(sdpa, warmup=10, rep=100, return_mode="median")
        # the same on 4-D contiguous [1, heads, L, D] tensors (what the flash backends want)
        q4, k4, v4 = (t.unsqueeze(0).contiguous() for t in (qt, k, v))
        if prefix == 0:
            sdpa4 = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)  # noqa: E731
        else:
            sdpa4 = lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)  # noqa: E731
        sdpa4_ms = triton.testing.do_bench(sdpa4, warmup=10, rep=100, return_mode="median")
        flops = 4 * HEADS * HEAD_DIM * chunk * (prefix + chunk / 2)
        rows.append({"prefix": prefix, "chunk": chunk, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
                     "sdpa_4d_ms": sdpa4_ms, "triton_tflops": flops / triton_ms * 1e-9,
                     "sdpa_tflops": flops / sdpa_ms * 1e-9, "sdpa_4d_tflops": flops / sdpa4_ms * 1e-9})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/gpu_kernels.json")
    args = parser.parse_args()
    import torch
    import triton

    from engine.kernels.fused_ops import benchmark_fused_ops
    bandwidth = copy_bandwidth(torch, triton)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
              "decode": decode_rows(torch, triton, bandwidth), "prefill": prefill_rows(torch, triton),
              "fused_ops": benchmark_fused_ops(torch.device("cuda"), torch.bfloat16)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}: copy {bandwidth / 1e9:.0f} GB/s (read + write)")
    print("| batch | context | splits | paged (ms) | gather+SDPA (ms) | KV floor (ms) | floor/paged |")
    print("|---|---|---|---|---|---|---|")
    for r in result["decode"]:
        print(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['triton_ms']:.3f} | "
              f"{r['torch_gather_ms']:.3f} | {r['floor_ms']:.3f} | {r['bandwidth_share']:.0%} |")
    print("| prefix | chunk | paged (ms) | SDPA 3-D views (ms) | SDPA 4-D contiguous (ms) | paged TFLOP/s | "
          "SDPA 4-D TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in result["prefill"]:
        print(f"| {r['prefix']} | {r['chunk']} | {r['triton_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['sdpa_4d_ms']:.3f} | "
              f"{r['triton_tflops']:.0f} | {r['sdpa_4d_tflops']:.0f} |")
    print("| op | tokens | torch (ms) | fused (ms) | speedup |")
    print("|---|---|---|---|---|")
    for r in result["fused_ops"]:
        print(f"| {r['op']} | {r['num_tokens']} | {r['torch_ms']:.4f} | {r['triton_ms']:.4f} | {r['speedup']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
