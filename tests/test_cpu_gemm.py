"""CPU linear layers: the plain, oneDNN-packed and panel paths (engine/model/cpu_gemm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams
from engine.model.cpu_gemm import (
    CANDIDATE_ROWS,
    PACKED,
    PANELS,
    PLAIN,
    PackedLinearMixin,
    fastest_paths,
    pack_linear_weights,
    packing_supported,
    paths_by_rows,
)
from engine.model.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.parallel import SINGLE_PROCESS
from tests.conftest import cpp_toolchain_present

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")),
                                reason="this torch build cannot pack weights for oneDNN")
needs_panels = pytest.mark.skipif(not cpp_toolchain_present(), reason="no C++ compiler or ninja here")

# 1 row plain, 2-4 panels, 8 and up packed
MIXED = {1: PLAIN, 2: PANELS, 4: PANELS, 8: PACKED, 16: PACKED}


def _ops_run(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_panels
@pytest.mark.parametrize("rows, path", [(1, PLAIN), (2, PANELS), (3, PANELS), (4, PANELS), (5, PACKED),
                                        (16, PACKED), (300, PACKED)])
def test_each_batch_size_takes_its_path_and_every_path_equals_f_linear(rows, path):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 200, bias=True, tp=SINGLE_PROCESS)   # 200: not a multiple of a panel
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer, MIXED) == 1
    ops = _ops_run(lambda: layer(x))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert ("mkldnn::_linear_pointwise" in ops) == (path == PACKED)
    assert ("aten::linear" in ops) == (path == PLAIN)


@needs_panels
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("out_features, in_features", [(8, 3), (33, 17), (512, 1408)])
def test_the_panel_kernel_equals_f_linear_for_any_shape(rows, out_features, in_features):
    from engine.kernels.cpu_kernels import pack_panels, panel_linear
    torch.manual_seed(rows + out_features)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    panels = pack_panels(weight)
    assert panels.shape[0] * panels.shape[2] >= out_features > (panels.shape[0] - 1) * panels.shape[2]
    # float32 sums of in_features products in another order than oneDNN's: their difference grows as
    # sqrt(in_features) (up to 3.4e-4 at 1,408 over 400 draws on an AVX-512 EPYC; 1e-4 failed there)
    atol = max(1e-4, 3e-5 * in_features ** 0.5)
    torch.testing.assert_close(panel_linear(x, panels, out_features), F.linear(x, weight), rtol=1e-5, atol=atol)
    strided = torch.randn(in_features, rows).t()                   # a non-contiguous input
    torch.testing.assert_close(panel_linear(strided, panels, out_features), F.linear(strided, weight),
                               rtol=1e-5, atol=atol)


@pytest.mark.parametrize("paths, expected", [
    ({1: PLAIN, 4: PANELS, 16: PACKED}, [PLAIN, PLAIN, PANELS, PANELS, PANELS] + [PACKED] * 12),
    ({2: PACKED, 8: PLAIN}, [PACKED, PACKED, PACKED, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN]),
])
def test_a_batch_takes_the_path_of_the_smallest_candidate_at_or_above_its_size(paths, expected):
    assert list(paths_by_rows(paths)) == expected


@pytest.mark.parametrize("seconds, expected", [
    ({1: {PLAIN: 1.0, PACKED: 0.8, PANELS: 0.5}}, {1: PANELS}),
    ({1: {PLAIN: 1.0, PACKED: 1.2}, 2: {PLAIN: 2.0, PACKED: 1.0}}, {1: PLAIN, 2: PACKED}),
    ({4: {PLAIN: 3.0, PACKED: 3.0, PANELS: 3.0}}, {4: PACKED}),     # a tie goes to packed, then panels
    ({4: {PLAIN: 3.0, PACKED: 3.5, PANELS: 3.0}}, {4: PANELS}),
])
def test_each_count_takes_its_fastest_path(seconds, expected):
    assert fastest_paths(seconds) == expected


def test_packing_measures_a_path_per_candidate_and_sets_the_same_on_every_layer():
    torch.manual_seed(2)
    layers = torch.nn.Sequential(ColumnParallelLinear(64, 128, bias=False, tp=SINGLE_PROCESS),
                                 RowParallelLinear(128, 64, bias=False, tp=SINGLE_PROCESS))
    for layer in layers:
        layer.weight.data.normal_()
    assert pack_linear_weights(layers) == 2
    assert len(layers[0].row_paths) == CANDIDATE_ROWS[-1] + 1
    assert set(layers[0].row_paths) <= {PLAIN, PACKED, PANELS}
    assert layers[1].row_paths == layers[0].row_paths
    # a panel copy that no batch size takes is not kept
    assert (layers[0].panel_weight is not None) == (PANELS in layers[0].row_paths)


def test_without_panels_no_panel_copy_is_made_and_none_is_chosen():
    layer = ColumnParallelLinear(64, 128, bias=False, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    pack_linear_weights(layer, panels=False)
    assert layer.panel_weight is None and PANELS not in layer.row_paths


@pytest.mark.parametrize("path", [PACKED, PANELS])
def test_row_parallel_adds_its_bias_once(path):
    if path == PANELS and not cpp_toolchain_present():
        pytest.skip("no C++ compiler or ninja here")
    torch.manual_seed(1)
    layer = RowParallelLinear(64, 32, bias=True, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(12, 64)
    pack_linear_weights(layer, {rows: path for rows in CANDIDATE_ROWS})
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("paths", [None, {rows: PANELS for rows in CANDIDATE_ROWS}])
def test_the_engine_packs_every_linear_and_the_lm_head_and_generates_the_same_tokens(model_dirs, monkeypatch, paths):
    # more sequences than the largest candidate: decode steps take every path on the way down
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3, 8 + i][: 3 + i % 4] for i in range(CANDIDATE_ROWS[-1] + 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if paths is not None:
        if not cpp_toolchain_present():
            pytest.skip("no C++ compiler or ninja here")
        import engine.model_worker
        monkeypatch.setattr(engine.model_worker, "pack_linear_weights",
                            lambda model: pack_linear_weights(model, paths))
    outputs = {}
    for prepack in (True, False):
        llm = LLM(str(model_dirs["tiny"]), max_model_len=256, dtype="float32", cpu_weight_prepack=prepack)
        modules = [m for m in llm.engine.worker.model.modules() if isinstance(m, PackedLinearMixin)]
        num_layers = llm.engine.worker.model_config.num_layers
        assert len(modules) == 4 * num_layers + 1          # qkv, o, gate_up, down per layer; the LM head
        assert all((m.packed_weight is not None) == prepack for m in modules)
        if paths is not None:
            assert all((m.panel_weight is not None) == prepack for m in modules)
        outputs[prepack] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]


@needs_panels
def test_the_panel_kernel_built_without_avx512_equals_f_linear():
    """The 8-wide build that CPUs without AVX-512 get, built here too where the native one is 16 wide."""
    from torch.utils.cpp_extension import load_inline

    from engine.kernels import cpu_kernels
    if cpu_kernels.panel_width() != 16:
        pytest.skip("the native build is the 8-wide one: the other tests run it")
    narrow = load_inline(name=cpu_kernels.extension_name() + "_no_avx512", cpp_sources=cpu_kernels._SOURCE,
                         functions=["panel_width", "panel_linear"], extra_cflags=cpu_kernels.CFLAGS + ["-mno-avx512f"],
                         extra_ldflags=["-fopenmp"], verbose=False)
    assert narrow.panel_width() == 8
    torch.manual_seed(3)
    for out_features, in_features in [(8, 3), (33, 17), (512, 96)]:
        weight = torch.randn(out_features, in_features)
        panels = cpu_kernels.pack_panels(weight, width=8)
        for rows in (1, 8, 9, 20, 61):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(narrow.panel_linear(x, panels, out_features), F.linear(x, weight),
                                       rtol=1e-5, atol=1e-4)


def test_layers_of_the_same_shapes_are_measured_once_per_process_and_take_the_same_paths(monkeypatch):
    """Two engines of one model in one process (a prefill and a decode engine) must not pick
    different kernels by the noise of two measurements: their outputs would differ in low bits."""
    import engine.model.cpu_gemm as cpu_gemm
    calls = []
    answers = iter([{rows: PLAIN for rows in CANDIDATE_ROWS}, {rows: PACKED for rows in CANDIDATE_ROWS}])

    def measured(modules, *, with_panels):
        calls.append(len(modules))
        return next(answers)

    monkeypatch.setattr(cpu_gemm, "choose_row_paths", measured)
    monkeypatch.setattr(cpu_gemm, "_paths_measured", {})
    first, second = (ColumnParallelLinear(48, 80, bias=False, tp=SINGLE_PROCESS) for _ in range(2))
    pack_linear_weights(first, panels=False)
    pack_linear_weights(second, panels=False)
    assert calls == [1]
    assert first.row_paths == second.row_paths == paths_by_rows({rows: PLAIN for rows in CANDIDATE_ROWS})
    other_shape = ColumnParallelLinear(48, 96, bias=False, tp=SINGLE_PROCESS)
    pack_linear_weights(other_shape, panels=False)                   # another model: measured again
    assert calls == [1, 1] and set(other_shape.row_paths) == {PACKED}
