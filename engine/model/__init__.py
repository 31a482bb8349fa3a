"""Model runtime: Llama-family layers, tensor-parallel linear layers, loading."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import torch

from engine.model.llama import LlamaForCausalLM
from engine.model.loader import CheckpointError, load_weights
from engine.model.model_config import ModelConfig, ModelConfigError
from engine.model.parallel import SINGLE_PROCESS, TensorParallel

__all__ = ["build_model", "load_model", "ModelConfig", "ModelConfigError", "CheckpointError", "TensorParallel"]

# Every supported architecture is a Llama variant distinguished by ModelConfig flags.
_MODEL_CLASSES = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
})


def build_model(config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    """The model with uninitialised weights, on `device` in `dtype` ("meta" builds shapes only)."""
    cls = _MODEL_CLASSES[config.architecture]
    with torch.device(device):
        model = cls(config, tp, max_positions)
    # rotary tables stay float32; weights take the serving dtype
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


def load_model(model_dir: str | Path, config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    model = build_model(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    load_weights(model, model_dir)
    return model
