"""Model runtime: Llama-family layers, tensor-parallel linear layers, loading."""

from __future__ import annotations

import threading
from pathlib import Path
from types import MappingProxyType

import torch
from torch.overrides import TorchFunctionMode

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
    "Qwen3ForCausalLM": LlamaForCausalLM,
})


def build_model(config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    """The model with uninitialised weights, on `device` in `dtype` ("meta" builds shapes only).
    The weights are made in `dtype`: made in float32 and cast after, a model would
    need twice its memory while it is built, and a GPU's caching allocator would
    keep the freed half. Only this thread's tensor factories see `dtype` (torch's
    process-wide default dtype is left alone: another engine's thread may be
    making tensors meanwhile)."""
    cls = _MODEL_CLASSES[config.architecture]
    # one build at a time: torch.device's context also records the device in a process-wide variable
    with _BUILD_LOCK, torch.device(device), _FactoryDtype(dtype):
        model = cls(config, tp, max_positions)
    return model.eval()   # (the rotary tables are float32 by construction, whatever the default)


class _FactoryDtype(TorchFunctionMode):
    """Within it, in this thread only (torch's function modes are thread-local), the
    factories the layers make their parameters with (torch.empty, zeros, ones) make
    `dtype` where the call names none."""

    _FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones})

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def load_model(model_dir: str | Path, config: ModelConfig, *, max_positions: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", tp: TensorParallel = SINGLE_PROCESS) -> LlamaForCausalLM:
    model = build_model(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    load_weights(model, model_dir)
    return model
