"""dtype names as they appear in configs and on the command line."""

from types import MappingProxyType

import torch

_DTYPES = MappingProxyType({
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
})


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; a clear error otherwise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16; got {name!r}") from None


def dtype_size(name: str | torch.dtype) -> int:
    """Bytes per element."""
    return parse_dtype(name).itemsize
