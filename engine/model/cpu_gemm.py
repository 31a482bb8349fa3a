"""Linear layers on CPU through oneDNN, with each weight packed once at load.

`F.linear` on CPU hands MKL the plain [out, in] weight on every call, and from
a few rows up MKL re-packs the whole weight each time. oneDNN's blocked layout
is made once and serves any number of rows. Which path is faster for a few
rows depends on the processor, so it is measured at load
(`choose_packed_min_rows`):
- a 2-core Xeon, `bench` preset, in-model: packed from 16 rows (a 16-sequence
  decode step 28.4 ms packed against 34.3 ms plain; at 8 rows level; at 3-4
  rows plain ~10% faster);
- a 2-core AMD EPYC (MKL takes its generic kernels there): packed from 1 row;
  decode steps of 1 / 2 / 4 / 8 sequences took 8.4 / 9.3 / 10.5 / 13.0 ms
  packed against 10.8 / 18.1 / 21.9 / 19.8 ms plain.
A layer keeps both weights: packing doubles the memory of the linear weights
(`EngineConfig.cpu_weight_prepack=False` turns it off).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

# the row counts the load-time measurement compares; from the last one up the packed path is taken
CANDIDATE_ROWS = (1, 2, 4, 8, 16)
# oneDNN picks its blocked layout for a typical row count; any count works
_PACK_FOR_ROWS = 64
# weights the measurement streams per pass: more than a last-level cache holds,
# so they come from memory as they do in a forward pass
_MEASURE_BYTES = 256 << 20
_MEASURE_REPEATS = 3


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
    for batches of `packed_min_rows` rows or more. On CUDA, `skinny` (set by
    `use_skinny_gemm`) takes batches of up to `skinny_max_rows` rows."""

    packed_weight: torch.Tensor | None = None
    packed_min_rows: int = CANDIDATE_ROWS[-1]
    skinny = None                     # (x, weight) -> x @ weight.T, e.g. engine/kernels/gemv.py
    skinny_max_rows: int = 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.skinny is not None and x.shape[0] <= self.skinny_max_rows:
            y = self.skinny(x, self.weight)
            return y if bias is None else y.add_(bias)
        if self.packed_weight is not None and x.shape[0] >= self.packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def use_skinny_gemm(model: nn.Module, skinny, max_rows: int) -> None:
    """Routes every linear layer's batches of up to `max_rows` rows to `skinny`."""
    for module in model.modules():
        if isinstance(module, PackedLinearMixin):
            module.skinny = skinny
            module.skinny_max_rows = max_rows


def pack_linear_weights(model: nn.Module, min_rows: int | None = None) -> int:
    """Packs the weight of every PackedLinearMixin module of `model` (CPU, after
    loading; the weights must not change afterwards) and sets the row count from
    which they take the packed path: `min_rows`, or measured here
    (`choose_packed_min_rows`) when None. Returns how many it packed."""
    modules = [m for m in model.modules() if isinstance(m, PackedLinearMixin)]
    for module in modules:
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PACK_FOR_ROWS)
    if min_rows is None:
        min_rows = choose_packed_min_rows(modules)
    for module in modules:
        module.packed_min_rows = min_rows
    return len(modules)


def choose_packed_min_rows(modules: list[PackedLinearMixin]) -> int:
    """The smallest of CANDIDATE_ROWS from which the packed path was at least as
    fast as the plain one at that and every larger candidate (the last
    candidate if none), timed on this thread (its torch threads are the
    forward's) over the first modules' weights, _MEASURE_BYTES of them in
    order, as a forward pass streams them; each figure is the best of
    _MEASURE_REPEATS passes, the two paths alternating. About 0.4 s for the
    `bench` preset here."""
    sample, nbytes = [], 0
    for module in modules:
        sample.append(module)
        nbytes += module.weight.numel() * module.weight.element_size()
        if nbytes >= _MEASURE_BYTES:
            break
    if not sample:
        return CANDIDATE_ROWS[-1]
    dtype = sample[0].weight.dtype
    inputs = {(rows, m.weight.shape[1]): torch.randn(rows, m.weight.shape[1], dtype=dtype)
              for rows in CANDIDATE_ROWS for m in sample}

    def one_pass(rows: int, packed: bool) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for m in sample:
                x = inputs[rows, m.weight.shape[1]]
                if packed:
                    torch.ops.mkldnn._linear_pointwise(x, m.packed_weight, None, "none", [], "")
                else:
                    F.linear(x, m.weight)
        return time.perf_counter() - start

    best = {(rows, packed): float("inf") for rows in CANDIDATE_ROWS for packed in (False, True)}
    for _ in range(_MEASURE_REPEATS):
        for rows in CANDIDATE_ROWS:
            for packed in (False, True):
                best[rows, packed] = min(best[rows, packed], one_pass(rows, packed))
    return min_rows_from_timings({rows: (best[rows, False], best[rows, True]) for rows in CANDIDATE_ROWS})


def min_rows_from_timings(seconds: dict[int, tuple[float, float]]) -> int:
    """seconds: candidate row count -> (plain, packed) time. The smallest count
    from which packed is no slower at that and every larger count; the largest
    count when packed is slower just below it."""
    counts = sorted(seconds)
    min_rows = counts[-1]
    for rows in reversed(counts[:-1]):
        plain, packed = seconds[rows]
        if packed > plain:
            break
        min_rows = rows
    return min_rows
