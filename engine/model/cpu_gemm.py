"""Linear layers on CPU: three paths, the fastest for each batch size measured at load.

- **plain**: `F.linear` on the [out, in] weight. From a few rows up MKL re-packs
  the whole weight on every call.
- **packed**: oneDNN with the weight in its blocked layout, made once at load;
  serves any number of rows, and prefill chunks take it.
- **panels**: pdserve's own kernel for a few rows (engine/kernels/cpu_kernels.py,
  `panel_linear`): the weight packed in column panels, each weight vector
  loaded once for a tile of up to 16 rows, the panels handed out to the
  threads dynamically, so a thread that loses its core to another process
  does not hold the others at the end of the layer.

Which is fastest for a few rows depends on the processor, so it is measured at
load (`choose_row_paths`) for 1, 2, 4, 8, 16, 32 and 64 rows; a batch takes the path
measured at the smallest of those counts at or above its size, and larger
batches take the packed one. Measured:
- a 2-core Xeon (AVX-512), `bench` preset, in-model, before the panels: packed
  from 16 rows (a 16-sequence decode step 28.4 ms packed against 34.3 ms
  plain; at 8 rows level; at 3-4 rows plain ~10% faster). With the panels:
  plain at 1 row, panels at 2-64; the 32 decoder-layer linears took 5.8 ms
  against oneDNN's 6.4 at 16 rows and 12.5 against 12.9 at 64 (296 rows:
  40-50 against 36-46 ms, so larger batches stay on oneDNN); in the engine,
  16 sequences of 256 output tokens +15%, and beside a busy loop taking
  0.1-0.2 cores +8-11% (bench/cpu_contention.py);
- a 2-core AMD EPYC (MKL takes its generic kernels there): packed from 1 row;
  decode steps of 1 / 2 / 4 / 8 sequences took 8.4 / 9.3 / 10.5 / 13.0 ms
  packed against 10.8 / 18.1 / 21.9 / 19.8 ms plain.
A layer keeps the plain weight, the oneDNN copy and, where some batch size
takes them, the panels: up to three times the memory of the linear weights
(`EngineConfig.cpu_weight_prepack=False` keeps only the plain one).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels

log = logging.getLogger(__name__)

PLAIN, PACKED, PANELS = "plain", "packed", "panels"
# the row counts the load-time measurement compares; larger batches take the packed path
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64)
# oneDNN picks its blocked layout for a typical row count; any count works
_PACK_FOR_ROWS = 64
# weights the measurement streams per pass: more than a last-level cache holds,
# so they come from memory as they do in a forward pass
_MEASURE_BYTES = 256 << 20
_MEASURE_REPEATS = 3
# measured paths per (layer shapes, dtype, threads, panels): engines of one model in one process
# take the same paths, so their outputs agree bit for bit (a prefill and a decode engine side by side)
_paths_measured: dict[tuple, dict[int, str]] = {}


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build can pack weights of `dtype` on `device` for oneDNN."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def panels_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the panel kernel runs here: float32 on CPU, its C++ extension built."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    return cpu_kernels.available()


class PackedLinearMixin:
    """For modules with a 2-D `weight` [out, in]: `linear(x, bias)` takes, for a
    batch of r rows, `row_paths[r]` (r < len(row_paths)), else the packed path
    where `packed_weight` is set, else the plain one. `pack_linear_weights`
    fills `packed_weight` (oneDNN), `panel_weight` (pack_panels) and
    `row_paths`. On CUDA, `skinny` (set by `use_skinny_gemm`) takes batches of
    up to `skinny_max_rows` rows."""

    packed_weight: torch.Tensor | None = None
    panel_weight: torch.Tensor | None = None      # [ceil(out / W), in, W]
    row_paths: tuple[str, ...] = ()
    skinny = None                     # (x, weight) -> x @ weight.T, e.g. engine/kernels/gemv.py
    skinny_max_rows: int = 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        rows = x.shape[0]
        if self.skinny is not None and rows <= self.skinny_max_rows:
            y = self.skinny(x, self.weight)
            return y if bias is None else y.add_(bias)
        path = self.row_paths[rows] if rows < len(self.row_paths) else PACKED
        if path == PACKED and self.packed_weight is None:
            path = PLAIN
        return linear_on_path(self, x, path, bias)


def linear_on_path(module: PackedLinearMixin, x: torch.Tensor, path: str,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ module's weight^T (+ bias) -> [T, out] through `path`, whose
    weight copy the module must hold."""
    if path == PANELS:
        y = cpu_kernels.panel_linear(x, module.panel_weight, module.weight.shape[0])
        return y if bias is None else y.add_(bias)
    if path == PACKED:
        return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, bias, "none", [], "")
    return F.linear(x, module.weight, bias)


def use_skinny_gemm(model: nn.Module, skinny, max_rows: int) -> None:
    """Routes every linear layer's batches of up to `max_rows` rows to `skinny`."""
    for module in model.modules():
        if isinstance(module, PackedLinearMixin):
            module.skinny = skinny
            module.skinny_max_rows = max_rows


def pack_linear_weights(model: nn.Module, paths: dict[int, str] | None = None, *,
                        panels: bool | None = None) -> int:
    """Packs the weight of every PackedLinearMixin module of `model` (CPU, after
    loading; the weights must not change afterwards) for oneDNN, and in panels
    when `panels` (default: where panels_supported), and sets which path each
    batch size takes: `paths` (candidate row count -> path), or when None
    measured (`choose_row_paths`) once per process for these layers' shapes,
    dtype and torch threads. A panel copy no count takes is dropped. Returns
    how many modules it packed."""
    modules = [m for m in model.modules() if isinstance(m, PackedLinearMixin)]
    if not modules:
        return 0
    if panels is None:
        panels = panels_supported(modules[0].weight.dtype, modules[0].weight.device)
    for module in modules:
        weight = module.weight.detach()
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
        if panels:
            module.panel_weight = cpu_kernels.pack_panels(weight)
    if paths is None:
        key = (tuple(tuple(m.weight.shape) for m in modules), modules[0].weight.dtype, torch.get_num_threads(),
               panels)
        if key not in _paths_measured:
            _paths_measured[key] = choose_row_paths(modules, with_panels=panels)
        paths = _paths_measured[key]
        log.info("CPU linears, path by batch rows (larger: %s): %s", PACKED,
                 ", ".join(f"{rows}: {path}" for rows, path in sorted(paths.items())))
    row_paths = paths_by_rows(paths)
    for module in modules:
        module.row_paths = row_paths
        if PANELS not in row_paths:
            module.panel_weight = None
    return len(modules)


def paths_by_rows(paths: dict[int, str]) -> tuple[str, ...]:
    """Candidate row count -> path, to the path of every batch size up to the
    largest candidate (index = rows): that of the smallest candidate at or
    above it."""
    counts = sorted(paths)
    return tuple(paths[next(c for c in counts if c >= max(rows, 1))] for rows in range(counts[-1] + 1))


def choose_row_paths(modules: list[PackedLinearMixin], *, with_panels: bool) -> dict[int, str]:
    """For each of CANDIDATE_ROWS, the fastest path (PANELS only `with_panels`),
    timed on this thread (its torch threads are the forward's) over the first
    modules' weights, _MEASURE_BYTES of them in order, as a forward pass
    streams them; each figure is the best of _MEASURE_REPEATS passes, the paths
    taking turns. About 0.6 s for the `bench` preset here."""
    sample, nbytes = [], 0
    for module in modules:
        sample.append(module)
        nbytes += module.weight.numel() * module.weight.element_size()
        if nbytes >= _MEASURE_BYTES:
            break
    dtype = sample[0].weight.dtype
    inputs = {(rows, m.weight.shape[1]): torch.randn(rows, m.weight.shape[1], dtype=dtype)
              for rows in CANDIDATE_ROWS for m in sample}
    candidates = (PLAIN, PACKED, PANELS) if with_panels else (PLAIN, PACKED)

    def one_pass(rows: int, path: str) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for m in sample:
                linear_on_path(m, inputs[rows, m.weight.shape[1]], path)
        return time.perf_counter() - start

    best = {(rows, path): float("inf") for rows in CANDIDATE_ROWS for path in candidates}
    for _ in range(_MEASURE_REPEATS):
        for rows in CANDIDATE_ROWS:
            for path in candidates:
                best[rows, path] = min(best[rows, path], one_pass(rows, path))
    return fastest_paths({rows: {path: best[rows, path] for path in candidates} for rows in CANDIDATE_ROWS})


def fastest_paths(seconds: dict[int, dict[str, float]]) -> dict[int, str]:
    """seconds: row count -> path -> time. The fastest path at each count; a tie
    goes to the packed path, then the panels (the plain one re-packs per call)."""
    preference = {PACKED: 0, PANELS: 1, PLAIN: 2}
    return {rows: min(times, key=lambda path: (times[path], preference[path])) for rows, times in seconds.items()}
