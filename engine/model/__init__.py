"""Model runtime: Llama-family layers, tensor-parallel linear layers, loading."""

from __future__ import annotations

import threading
from pathlib import Path
from types import MappingProxyType

import torch

from engine.model.llama import LlamaForCausalLM
from engine.model.loader import CheckpointError, load_weights
from engine.model.model_config import ModelConfig, ModelConfigError
from engine.model.parallel import SINGLE_PROCESS, TensorParallel

__all__ = ["build_model", "load_model", "ModelConfig", "ModelConfigError", "CheckpointError", "TensorParallel"]

_BUILD_LOCK = threading.Lock()

# Every supported architecture is a Llama variant distinguished by ModelConfig flags.
_MODEL_CLASSES = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
})


def build_model(config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    """The model with uninitialised weights, on `device` in `dtype` ("meta" builds shapes only).
    The weights are made in `dtype` (under torch's default dtype for the build):
    made in float32 and cast after, a model would need twice its memory while
    it is built, and a GPU's caching allocator would keep the freed half."""
    cls = _MODEL_CLASSES[config.architecture]
    with _BUILD_LOCK:   # the default dtype is the process's: one build at a time
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(config, tp, max_positions)
        finally:
            torch.set_default_dtype(previous)
    return model.eval()   # (the rotary tables are float32 by construction, whatever the default)


def load_model(model_dir: str | Path, config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    model = build_model(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    load_weights(model, model_dir)
    return model
