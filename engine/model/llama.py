"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3), tensor-parallel ready.

The model runs on a flat batch of tokens from many sequences at once:
input_ids [T], positions [T] and an AttentionMetadata telling each token where
its K/V go and what it attends to. It returns hidden states [T, hidden]; logits
are computed only for the rows that are sampled (`compute_logits`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import paged_attention
from engine.model.attention_metadata import AttentionMetadata
from engine.model.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.model.model_config import ModelConfig
from engine.model.parallel import TensorParallel
from engine.model.rotary import RotaryEmbedding


def use_fused_ops(model: nn.Module, kernels: ModuleType) -> None:
    """Switches the model's norms, MLPs and rotary embedding to fused kernels:
    `kernels` is a module with rms_norm, fused_add_rms_norm, silu_and_mul and
    apply_rotary (engine/kernels/fused_ops.py, Triton, on CUDA;
    engine/kernels/cpu_kernels.py, C++, on CPU). Same results, fewer passes over
    memory and far fewer ops per layer."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, LlamaMLP, RotaryEmbedding)):
            module.fused = kernels


class RMSNorm(nn.Module):
    fused: ModuleType | None = None    # set by use_fused_ops

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, hidden]. Without `residual`: norm(x). With it: (norm(x + residual),
        x + residual), the sum being the residual stream the next layer adds to."""
        if self.fused is not None:
            if residual is None:
                return self.fused.rms_norm(x, self.weight, self.eps)
            return self.fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]. Normalise in float32, as transformers does,
        # then scale in the model dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        config.o_bias, tp)
        self.num_local_heads = self.qkv_proj.num_local_heads
        self.num_local_kv_heads = self.qkv_proj.num_local_kv_heads
        self.scale = config.head_dim ** -0.5
        self.rotary = rotary
        if config.qk_norm:     # Qwen3: one weight per head_dim, the same on every rank
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj(x)
        if self.q_norm is not None:
            # each head's query and key normalised over head_dim: rows [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(-1, self.num_local_heads, self.head_dim)
        k = k.view(-1, self.num_local_kv_heads, self.head_dim)
        v = v.view(-1, self.num_local_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)       # [T, local_heads, D]
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    fused: ModuleType | None = None    # set by use_fused_ops

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        n = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [n, n], config.mlp_bias, tp)
        self.down_proj = RowParallelLinear(n, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; gate/up: [T, intermediate / tp]
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, rotary)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; x: [T, hidden], the previous layer's MLP output (the
        embeddings for the first layer, with residual None); residual: [T, hidden],
        the stream x is added to. Returns (this layer's MLP output, its residual
        stream); kv_cache: this layer's [2, blocks, bs, kv_heads, D]."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary = RotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter name fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp: TensorParallel, max_positions: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [num_sampled, hidden] -> [num_sampled, vocab_size] float32 on rank 0; None elsewhere
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()
