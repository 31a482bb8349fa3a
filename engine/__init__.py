"""pdserve's model runtime, shared by prefill and decode workers (no Ray here).

Public names are imported lazily so that `import engine.model` (e.g. in a
memory planner) does not load the tokenizer stack.
"""

from importlib import import_module
from types import MappingProxyType

_EXPORTS = MappingProxyType({
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.engine_config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "OutputKind": "engine.outputs",
    "InvalidRequestError": "engine.errors",
})

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
