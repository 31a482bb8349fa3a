"""Linear layers on CPU through oneDNN, with each weight packed once at load.

`F.linear` on CPU hands MKL the plain [out, in] weight on every call, and from
a few rows up MKL re-packs the whole weight each time. oneDNN's blocked layout
is made once and serves any number of rows. In the `bench` preset's forward
pass on a 2-core Xeon (A/B in one process, medians of 12): a decode step of 16
sequences took 28.4 ms packed against 34.3 ms plain, one 280-token prefill
95.8 against 104.1 ms and two 1024-token prompts 829 against 862 ms; at 8
sequences the two were level, and at 3–4 the plain weight was ~10% faster
(the weights no longer all fit the caches once there are two copies). So a
layer keeps both and packs from PACKED_MIN_ROWS rows up: packing doubles the
memory of the linear weights (`EngineConfig.cpu_weight_prepack=False` turns it
off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# below this many rows the plain weight through F.linear is as fast or faster
PACKED_MIN_ROWS = 16
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
