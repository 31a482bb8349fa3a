"""Rotary position embeddings (RoPE), with the Llama-3, linear and dynamic-NTK
frequency scalings computed exactly as transformers computes them.

cos/sin are precomputed for every position up to `max_positions` and looked up
by position, so a batch of tokens from many sequences at different offsets
needs no per-sequence work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies for the config's rope type.

    "dynamic" (NTK) rescales with the sequence length in transformers; here it is
    fixed at engine start for `max_positions`, which is exactly transformers'
    result whenever max_positions <= max_position_embeddings (no scaling), and
    vLLM's fixed-length choice beyond it.
    """
    dim = config.head_dim
    p = config.rope_params
    base = config.rope_theta
    if config.rope_type == "dynamic" and max_positions > config.max_position_embeddings:
        factor = p["factor"]
        ratio = factor * max_positions / config.max_position_embeddings - (factor - 1)
        base = base * ratio ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, p)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    fused = None       # set by llama.use_fused_ops: a kernel module whose apply_rotary does q and k

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = inverse_frequencies(config, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]          # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                 # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]
        if self.fused is not None:
            return self.fused.apply_rotary(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)      # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
