"""Memory planner arithmetic, checked against numbers worked out by hand, and
the `pdserve plan` command's output and exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from cluster.cli.plan_command import MODELS_DIR, add_plan_parser
from engine.memory_planner import GPU_TYPES, Plan, format_plan, plan, resolve_gpu_type
from engine.model.model_config import ModelConfig

PARAMS_8B = 8_030_261_248
PARAMS_70B = 70_553_706_496


@pytest.fixture(scope="module")
def llama8b() -> ModelConfig:
    return ModelConfig.from_pretrained(MODELS_DIR / "llama-3-8b")


@pytest.fixture(scope="module")
def llama70b() -> ModelConfig:
    return ModelConfig.from_pretrained(MODELS_DIR / "llama-3-70b")


def small(**overrides) -> ModelConfig:
    """vocab 1002 (not divisible by 4: padded), 4 query heads, 2 KV heads (replicated at tp 4)."""
    fields = dict(architecture="LlamaForCausalLM", vocab_size=1002, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float16")
    return ModelConfig(**{**fields, **overrides})


# ---- the shipped configs -------------------------------------------------------------------------

def test_shipped_configs_have_the_llama3_shapes(llama8b, llama70b):
    assert (llama8b.num_layers, llama8b.hidden_size, llama8b.num_heads, llama8b.num_kv_heads,
            llama8b.intermediate_size, llama8b.head_dim) == (32, 4096, 32, 8, 14336, 128)
    assert (llama70b.num_layers, llama70b.hidden_size, llama70b.num_heads, llama70b.num_kv_heads,
            llama70b.intermediate_size, llama70b.head_dim) == (80, 8192, 64, 8, 28672, 128)
    for m in (llama8b, llama70b):
        assert (m.vocab_size, m.max_position_embeddings, m.rope_theta, m.torch_dtype, m.tie_word_embeddings) \
            == (128256, 8192, 500000.0, "bfloat16", False)


# ---- parameters and weights ----------------------------------------------------------------------

def test_parameter_counts_match_the_published_models(llama8b, llama70b):
    assert plan(llama8b, tp=1, gpu_memory_gib=80).parameters == PARAMS_8B
    assert plan(llama70b, tp=1, gpu_memory_gib=80).parameters == PARAMS_70B


def test_small_model_parameters_by_hand():
    # embed + lm_head 2*1002*64 = 128,256; per layer q 4096 + k 2048 + v 2048 + o 4096
    # + gate/up 16,384 + down 8192 + 2 norms 128 = 36,992, x2 layers; final norm 64
    assert plan(small(), tp=1, gpu_memory_gib=1).parameters == 202_304
    # tied: the lm_head is the embedding, counted once
    assert plan(small(tie_word_embeddings=True), tp=1, gpu_memory_gib=1).parameters == 202_304 - 64_128
    # biases per layer: qkv (4+2+2)*16 = 128, o 64, gate/up 2*128 + down 64 = 320
    biased = small(qkv_bias=True, o_bias=True, mlp_bias=True)
    assert plan(biased, tp=1, gpu_memory_gib=1).parameters == 202_304 + 2 * (128 + 64 + 320)


def test_small_model_per_rank_shards_by_hand():
    # tp 4: 251 vocab rows (padded), 1 query head, 1 KV head (each of the 2 held by 2 ranks),
    # intermediate 32. embed + lm_head 2*251*64 = 32,128; per layer q 1024 + k 1024 + v 1024
    # + o 1024 + gate/up 4096 + down 2048 + norms 128 = 10,368, x2; final norm 64 -> 52,928 elements
    p = plan(small(), tp=4, gpu_memory_gib=1)
    assert p.dtype == "float16"
    assert p.weight_bytes_per_rank == 52_928 * 2
    # replicated biases: o and down (64 each) on every rank; qkv (1+1+1)*16 and gate/up 2*32 sharded
    biased = plan(small(qkv_bias=True, o_bias=True, mlp_bias=True), tp=4, gpu_memory_gib=1)
    assert biased.weight_bytes_per_rank == (52_928 + 2 * (48 + 64 + 64 + 64)) * 2
    # the sum over ranks is the whole model plus every extra copy:
    # 3 more copies of the norms (2*2*64 + 64 = 320), 2 padded vocab rows in embed and lm_head,
    # and each K/V projection (2048 per layer) held twice over
    extra = 3 * 320 + 2 * 2 * 64 + 2 * 2 * 2048
    assert p.weight_bytes_per_rank * 4 == p.weight_bytes_total + extra * 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_per_rank_weights_sum_to_total_plus_replicated(llama8b, llama70b, tp):
    for model, params in ((llama8b, PARAMS_8B), (llama70b, PARAMS_70B)):
        p = plan(model, tp=tp, gpu_memory_gib=1000)
        assert p.weight_bytes_total == params * 2
        assert p.weight_bytes_per_rank * tp >= p.weight_bytes_total
        h = model.hidden_size
        replicated = (2 * model.num_layers + 1) * h      # norms only: Llama has no o/down bias
        # 128256 rows split evenly over every tp here; past 8 ranks each of the 8 KV heads is
        # held by tp/8 ranks, so the K and V projections are stored tp/8 times
        kv_copies = max(1, tp // model.num_kv_heads) - 1
        kv_extra = kv_copies * model.num_layers * 2 * h * model.num_kv_heads * model.head_dim
        assert p.weight_bytes_per_rank * tp == p.weight_bytes_total + ((tp - 1) * replicated + kv_extra) * 2


def test_llama70b_tp8_weights_per_rank(llama70b):
    p = plan(llama70b, tp=8, gpu_memory_gib=80)
    assert p.weight_bytes_per_rank == pytest.approx(17.6e9, rel=0.01)
    # (70,553,706,496 params + 7 extra copies of 161 norms of 8192) * 2 bytes / 8
    assert p.weight_bytes_per_rank == (PARAMS_70B + 7 * 161 * 8192) * 2 // 8 == 17_640_734_720


def test_dtype_resolution():
    assert plan(small(torch_dtype="float32"), tp=1, gpu_memory_gib=1).dtype == "bfloat16"   # auto on GPU
    fp32 = plan(small(), tp=1, gpu_memory_gib=1, dtype="float32")
    assert (fp32.dtype, fp32.weight_bytes_total) == ("float32", 202_304 * 4)
    assert plan(small(), tp=1, gpu_memory_gib=1, dtype="bf16").dtype == "bfloat16"
    assert plan(small(), tp=1, gpu_memory_gib=1, dtype="fp16").dtype == "float16"
    with pytest.raises(ValueError, match="--dtype"):
        plan(small(), tp=1, gpu_memory_gib=1, dtype="int8")


# ---- KV cache ------------------------------------------------------------------------------------

def test_kv_bytes_per_token(llama8b, llama70b):
    assert plan(llama70b, tp=1, gpu_memory_gib=80).kv_bytes_per_token == 327_680     # 2*80*8*128*2
    assert plan(llama8b, tp=1, gpu_memory_gib=80).kv_bytes_per_token == 131_072      # 2*32*8*128*2
    p = plan(llama70b, tp=8, gpu_memory_gib=80)
    assert (p.kv_bytes_per_token, p.kv_bytes_per_token_per_rank) == (327_680, 40_960)
    # 16 ranks, 8 KV heads: each rank still holds one whole head
    assert plan(llama70b, tp=16, gpu_memory_gib=80).kv_bytes_per_token_per_rank == 40_960
    assert plan(llama70b, tp=1, gpu_memory_gib=80, dtype="float32").kv_bytes_per_token == 655_360


def test_small_model_capacity_by_hand():
    p = plan(small(), tp=4, gpu_memory_gib=1.0, gpu_memory_utilization=0.5, overhead_gib=0.25)
    assert p.kv_bytes_per_token == 256                   # 2 * 2 layers * 2 heads * 16 * 2 bytes
    assert p.kv_bytes_per_token_per_rank == 128          # one (replicated) KV head per rank
    # 0.25 GiB = 268,435,456 - 105,856 weight bytes = 268,329,600
    assert p.kv_budget_bytes_per_rank == 268_329_600
    # / 128 = 2,096,325 tokens, rounded down to blocks of 16
    assert p.kv_tokens_capacity == 2_096_320
    assert p.max_model_len == 256                        # default: max_position_embeddings
    assert p.max_concurrent_sequences == 8188            # 131,020 blocks / 16 per sequence
    assert p.fits and p.problems == [] and p.suggestions == []


def test_sequences_occupy_whole_blocks():
    # 250 tokens take 16 blocks, as 256 would: 2,096,320 // 250 = 8385 would overcount
    p = plan(small(), tp=4, gpu_memory_gib=1.0, gpu_memory_utilization=0.5, overhead_gib=0.25,
             max_model_len=250)
    assert p.max_concurrent_sequences == 8188


def test_llama70b_tp8_on_h100(llama70b):
    p = plan(llama70b, tp=8, gpu_memory_gib=80)
    # 71 GiB = 76,235,669,504 - 17,640,734,720 = 58,594,934,784 / 40,960 = 1,430,540 -> 1,430,528
    assert p.kv_tokens_capacity == 1_430_528
    assert p.max_concurrent_sequences == 174             # 89,408 blocks / 512 per 8192-token sequence
    assert p.fits


def test_a_replica_that_hands_kv_off_leaves_its_staging_buffers_free(llama70b):
    colocated = plan(llama70b, tp=2, gpu_memory_gib=80)
    decode = plan(llama70b, tp=2, gpu_memory_gib=80, kv_transfer_staging_gib=1.0)
    assert colocated.kv_budget_bytes_per_rank - decode.kv_budget_bytes_per_rank == 1 << 30
    # 4.3 GiB: 4,669,530,112 B / 163,840 B a token = 28,500 -> 1,757 blocks of 16
    assert (colocated.kv_tokens_capacity, decode.kv_tokens_capacity) == (34_656, 28_112)
    assert decode.kv_transfer_staging_gib == 1.0 and colocated.kv_transfer_staging_gib == 0.0
    # the buffers count where the weights are what does not fit, and in what would fit
    tight = plan(llama70b, tp=2, gpu_memory_gib=80, kv_transfer_staging_gib=5.0, max_model_len=8192)
    assert not tight.fits and "1 GiB overhead − 5 GiB hand-off buffers" in format_plan(tight)
    with pytest.raises(ValueError, match="--kv-transfer-staging-mib must be >= 0, got -512"):
        plan(llama70b, tp=2, gpu_memory_gib=80, kv_transfer_staging_gib=-0.5)


# ---- decode floor --------------------------------------------------------------------------------

def test_decode_floor(llama70b):
    p = plan(llama70b, tp=1, gpu_memory_gib=80)
    assert p.decode_floor_ms_weights_only == pytest.approx(141_107_412_992 / 3.35e12 * 1e3)
    assert p.decode_floor_ms_weights_only == pytest.approx(42.1, abs=0.05)
    assert plan(llama70b, tp=1, gpu_memory_gib=141, gpu_type="h200").decode_floor_ms_weights_only \
        == pytest.approx(141_107_412_992 / 4.8e12 * 1e3)
    tp8 = plan(llama70b, tp=8, gpu_memory_gib=80)
    assert tp8.decode_floor_ms_batch1 == pytest.approx((17_640_734_720 + 40_960 * 8192) / 3.35e12 * 1e3)


# ---- not fitting ---------------------------------------------------------------------------------

def test_llama70b_tp1_does_not_fit_and_tp2_is_the_smallest_that_does(llama70b):
    p = plan(llama70b, tp=1, gpu_memory_gib=80)
    assert not p.fits
    assert p.kv_tokens_capacity == 0
    assert p.problems == ["weights need 131.4 GiB per rank but only 80 GiB × 0.9 − 1 GiB overhead = "
                          "71.0 GiB is available: short by 60.4 GiB"]
    # 65.7 GiB of weights per rank at tp 2 leaves 5,680,644,096 bytes: 34,671 tokens of
    # 163,840 bytes -> 34,656 in whole blocks, four 8192-token sequences
    assert p.suggestions[0] == ("--tp 2: 65.7 GiB weights per rank, KV cache for 34,656 tokens "
                                "(4 sequences of 8,192)")
    assert plan(llama70b, tp=2, gpu_memory_gib=80).kv_tokens_capacity == 34_656
    # the weights are the problem, so a shorter context cannot help
    assert not any(s.startswith("--max-model-len") for s in p.suggestions)


def test_kv_shortfall_suggests_each_flag(llama8b):
    p = plan(llama8b, tp=1, gpu_memory_gib=18)
    # 15.2 GiB - 16,060,522,496 weight bytes leaves 260,353,228: 1986 tokens -> 1984 in whole blocks
    assert p.kv_tokens_capacity == 1984 and not p.fits
    assert p.problems[0].startswith("the KV cache holds 1,984 tokens, fewer than one max_model_len=8,192 sequence")
    assert "short by 0.8 GiB" in p.problems[0]          # 1.0 GiB needed, 0.24 GiB left
    flags = [s.split(":")[0] for s in p.suggestions]
    # weights + 1 GiB overhead + 1 GiB of KV = 18,208,006,144 bytes = 0.942 of 18 GiB
    assert flags == ["--tp 2", "--max-model-len 1792", "--gpu-memory-utilization 0.95"]
    for flag in flags:
        name, value = flag.split()
        key = {"--tp": "tp", "--max-model-len": "max_model_len",
               "--gpu-memory-utilization": "gpu_memory_utilization"}[name]
        assert plan(llama8b, **{"tp": 1, "gpu_memory_gib": 18, key: type(getattr(p, key))(value)}).fits


def test_float32_suggests_bfloat16(llama8b):
    # 29.9 GiB of float32 weights; 27.8 GiB available; bfloat16 halves them
    p = plan(llama8b, tp=1, gpu_memory_gib=32, dtype="float32")
    assert not p.fits
    assert [s.split(":")[0] for s in p.suggestions] == ["--tp 2", "--dtype bfloat16"]
    # 13.4 GiB available: bfloat16 alone (15.0 GiB) is not enough, bfloat16 at tp 2 is
    p = plan(llama8b, tp=1, gpu_memory_gib=16, dtype="float32")
    assert [s.split(":")[0] for s in p.suggestions] == ["--tp 4", "--dtype bfloat16 --tp 2"]


def test_invalid_arguments_name_the_flag(llama70b):
    with pytest.raises(ValueError, match=r"--tp 3.*valid --tp values: 1, 2, 4, 8, 16"):
        plan(llama70b, tp=3, gpu_memory_gib=80)
    with pytest.raises(ValueError, match="--tp 8"):
        plan(small(), tp=8, gpu_memory_gib=80)                # 4 query heads
    with pytest.raises(ValueError, match="--tp 2"):
        plan(small(num_heads=6, num_kv_heads=3), tp=2, gpu_memory_gib=80)   # 3 KV heads, 2 ranks
    with pytest.raises(ValueError, match="--max-model-len"):
        plan(llama70b, tp=8, gpu_memory_gib=80, max_model_len=8193)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        plan(llama70b, tp=8, gpu_memory_gib=80, gpu_memory_utilization=1.5)


def test_gpu_types():
    assert resolve_gpu_type("h100") == GPU_TYPES["H100-SXM"] == resolve_gpu_type("H100-sxm")
    assert (resolve_gpu_type("H200").hbm_bytes_per_s, resolve_gpu_type("h200").memory_gib) == (4.8e12, 141.0)
    assert (resolve_gpu_type("A100").name, resolve_gpu_type("a100").hbm_bytes_per_s) == ("A100-80GB", 2.0e12)
    with pytest.raises(ValueError, match="--gpu-type"):
        resolve_gpu_type("v100")
    with pytest.raises(TypeError):
        GPU_TYPES["B200"] = GPU_TYPES["H200"]                  # type: ignore[index]


def test_format_plan(llama70b):
    text = format_plan(plan(llama70b, tp=8, gpu_memory_gib=80))
    for fragment in ("70.55 B parameters", "17,640,734,720 B", "1,430,528 tokens", "174 at max_model_len",
                     "all-reduce time not included", "fits: yes"):
        assert fragment in text
    text = format_plan(plan(llama70b, tp=1, gpu_memory_gib=80))
    assert "fits: no" in text and "problem: weights need 131.4 GiB" in text and "would fit: --tp 2" in text


# ---- the command ---------------------------------------------------------------------------------

def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_command_fits_exits_0(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama-3-70b", "--tp", "8")
    assert code == 0 and "fits: yes" in out and "1,430,528 tokens" in out   # 80 GiB: the H100's


def test_command_does_not_fit_exits_1(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama-3-70b", "--tp", "1")
    assert code == 1 and "short by 60.4 GiB" in out and "would fit: --tp 2" in out


def test_command_role_leaves_the_staging_buffers_free(capsys):
    code, out, _ = run_plan(capsys, "--model", "llama-3-70b", "--tp", "2", "--role", "decode")
    assert code == 0 and "− 1 GiB hand-off buffers" in out and "28,112 tokens" in out
    code, out, _ = run_plan(capsys, "--model", "llama-3-70b", "--tp", "2", "--role", "prefill",
                            "--kv-transfer-staging-mib", "512")
    assert code == 0 and "− 0.5 GiB hand-off buffers" in out
    code, out, _ = run_plan(capsys, "--model", "llama-3-70b", "--tp", "2", "--kv-transfer-staging-mib", "512")
    assert code == 0 and "hand-off" not in out and "34,656 tokens" in out      # colocated: nothing handed off


def test_command_json(capsys):
    code, out, _ = run_plan(capsys, "--model", str(MODELS_DIR / "llama-3-70b"), "--tp", "1",
                            "--gpu-type", "h200", "--json")
    data = json.loads(out)
    assert set(data) == {f.name for f in dataclasses.fields(Plan)}
    assert code == 1
    # 141 GiB default memory: 141 * 0.9 - 1 = 125.9 GiB < 131.4 GiB of weights
    assert (data["gpu_type"], data["gpu_memory_gib"], data["fits"]) == ("H200", 141.0, False)
    assert (data["parameters"], data["kv_bytes_per_token"]) == (PARAMS_70B, 327_680)
    assert data["problems"][0].endswith("short by 5.5 GiB") and data["suggestions"][0].startswith("--tp 2")


@pytest.mark.parametrize("argv, flag", [
    (("--model", "llama-3-8b", "--tp", "3"), "--tp"),
    (("--model", "llama-3-8b", "--tp", "1", "--gpu-type", "v100"), "--gpu-type"),
    (("--model", "llama-3-8b", "--tp", "1", "--dtype", "int8"), "--dtype"),
    (("--model", "llama-3-8b", "--tp", "1", "--max-model-len", "100000"), "--max-model-len"),
    (("--model", "llama-3-8b", "--tp", "1", "--gpu-memory-utilization", "0"), "--gpu-memory-utilization"),
    (("--model", "llama-3-8b", "--tp", "1", "--kv-transfer-staging-mib", "-1"), "--kv-transfer-staging-mib"),
])
def test_command_bad_arguments_exit_2(capsys, argv, flag):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and flag in err and out == ""


def test_command_missing_config_exits_2(capsys, tmp_path: Path):
    code, _, err = run_plan(capsys, "--model", str(tmp_path), "--tp", "1")
    assert code == 2 and "--model" in err and "no config.json" in err and "llama-3-70b" in err
