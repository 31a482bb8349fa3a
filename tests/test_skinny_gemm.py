"""The skinny-matmul Triton kernel (engine/kernels/gemv.py) against float64
matmuls, and its routing inside a model's linear layers. Without a GPU it runs
under Triton's CPU interpreter (switched on before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.kernels import interpreter_compat  # noqa: E402,F401
from engine.kernels.gemv import MAX_ROWS, skinny_linear  # noqa: E402
from engine.model.cpu_gemm import use_skinny_gemm  # noqa: E402
from engine.model.linear import ColumnParallelLinear  # noqa: E402
from engine.model.parallel import SINGLE_PROCESS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("rows, n, k, config", [
    (1, 64, 256, (4, 64, 1, 4, 2)),        # even tiles, several K steps
    (1, 37, 100, (8, 64, 1, 4, 2)),        # ragged N and K: masked loads and stores
    (3, 48, 256, (4, 32, 4, 4, 2)),        # split K: fp32 atomics, then the cast
    (5, 40, 96, (16, 32, 2, 4, 2)),        # split K with ragged K
    (16, 24, 64, None),                    # the default tiles, the largest row count
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_matches_float64(rows, n, k, config, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    y = skinny_linear(x, w, config)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert _rel_err(y, x, w) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_a_strided_input_is_accepted_and_too_many_rows_are_refused():
    x = torch.randn(2, 64, device=DEVICE)[:, ::2]            # stride 2 along K
    w = torch.randn(16, 32, device=DEVICE)
    assert _rel_err(skinny_linear(x, w), x, w) < 1e-5
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 32, device=DEVICE), w)


def test_linear_layers_route_only_batches_up_to_the_row_limit():
    layer = ColumnParallelLinear(32, 24, bias=True, tp=SINGLE_PROCESS).to(DEVICE)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    calls = []

    def recording(x, w):
        calls.append(x.shape[0])
        return skinny_linear(x, w)

    use_skinny_gemm(layer, recording, max_rows=1)
    for rows in (1, 2):
        x = torch.randn(rows, 32, device=DEVICE)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert calls == [1]


def test_tile_table_follows_the_gpu_name(monkeypatch):
    from engine.kernels import gemv
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3", 2: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device.index])
    gemv.tile_configs.cache_clear()
    try:
        h200, h100, a100 = (gemv.tile_configs(torch.device("cuda", i)) for i in range(3))
    finally:
        gemv.tile_configs.cache_clear()
    assert h200 is gemv.CONFIGS_BY_GPU["H200"] and h100 is gemv.CONFIGS_BY_GPU["H100"]
    assert a100 is gemv.CONFIGS_BY_GPU["H100"]            # no table of its own: the H100's
    assert h200[(4096, 14336, 1)] != h100[(4096, 14336, 1)]
    assert gemv.tile_configs(torch.device("cpu")) is gemv.CONFIGS_BY_GPU["H100"]
