"""Llama-3-70B built on the meta device per rank for TP 1, 2, 4, 8: every
sharded tensor has the shape its rank should hold; no weights are needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model import ModelConfig, TensorParallel, build_model

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3-70b"


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    c = ModelConfig.from_pretrained(CONFIG_DIR)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, c.intermediate_size) == \
        (80, 8192, 64, 8, 128256, 28672)
    return c


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_rank_holds_its_share(config, tp):
    d = config.head_dim
    total_params = 0
    for rank in range(tp):
        model = build_model(config, max_positions=16, dtype=torch.bfloat16, device="meta",
                            tp=TensorParallel(rank=rank, size=tp))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        layer = "model.layers.79."
        assert shapes[layer + "self_attn.qkv_proj.weight"] == ((64 // tp + 2 * 8 // tp) * d, 8192)
        assert shapes[layer + "self_attn.o_proj.weight"] == (8192, 64 // tp * d)
        assert shapes[layer + "mlp.gate_up_proj.weight"] == (2 * 28672 // tp, 8192)
        assert shapes[layer + "mlp.down_proj.weight"] == (8192, 28672 // tp)
        assert shapes[layer + "input_layernorm.weight"] == (8192,)
        assert shapes["model.embed_tokens.weight"] == (128256 // tp, 8192)
        assert shapes["lm_head.weight"] == (128256 // tp, 8192)
        assert len([n for n in shapes if n.endswith("qkv_proj.weight")]) == 80
        attn = model.model.layers[0].self_attn
        assert attn.qkv_proj.kv_head_start == rank * (8 // tp)
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
        total_params += sum(p.numel() for p in model.parameters())
    # memory per rank ~ total / tp: only the norms (2*80+1 vectors of 8192) are replicated
    replicated = (2 * 80 + 1) * 8192
    assert total_params == 70_553_706_496 + (tp - 1) * replicated


def test_tp16_replicates_kv_heads(config):
    """16 ranks, 8 KV heads: each head lives on 2 consecutive ranks."""
    starts = []
    for rank in range(16):
        model = build_model(config, max_positions=16, dtype=torch.bfloat16, device="meta",
                            tp=TensorParallel(rank=rank, size=16))
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.shape == ((4 + 2) * 128, 8192)
        starts.append(qkv.kv_head_start)
    assert starts == [r // 2 for r in range(16)]


def test_uneven_tp_is_refused(config):
    with pytest.raises(ValueError, match=r"num_attention_heads \(64\) is not divisible by tensor_parallel_size \(3\)"):
        build_model(config, max_positions=16, dtype=torch.bfloat16, device="meta", tp=TensorParallel(0, 3))
