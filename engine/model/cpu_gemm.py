"""Linear layers on CPU through oneDNN, with each weight packed once at load.

`F.linear` on CPU hands MKL the plain [out, in] weight on every call, and from
a few rows up MKL re-packs the whole weight each time: on a 2-core Xeon, one
decoder layer of the `bench` preset plus its LM head took 3.2 ms at 16 rows
through F.linear and 1.2–1.5 ms with the weight pre-packed, 1.0 against 0.7 ms at
4 rows, and 17 against 14 ms at 280 rows. oneDNN's blocked weight layout is made
once and serves any number of rows. For one or two rows (a lone decode) the
plain weight is faster, so a layer keeps both: packing doubles the memory of
the linear weights (`EngineConfig.cpu_weight_prepack=False` turns it off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# below this many rows the plain weight through F.linear is faster
PACKED_MIN_ROWS = 3
# oneDNN picks its blocked layout for a typical row count; any count works
_PACK_FOR_ROWS = 64


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build can pack weights of `dtype` on `device` for oneDNN."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinearMixin:
    """For modules with a 2-D `weight` [out, in]: `packed_weight` is None until
    `pack_linear_weights` fills it; `linear(x, bias)` then takes the packed path
    for batches of PACKED_MIN_ROWS rows or more."""

    packed_weight: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.packed_weight is not None and x.shape[0] >= PACKED_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Packs the weight of every PackedLinearMixin module of `model` (CPU, after
    loading; the weights must not change afterwards). Returns how many it packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, PackedLinearMixin):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PACK_FOR_ROWS)
            packed += 1
    return packed
