"""Linear layers through oneDNN with pre-packed weights (engine/model/cpu_gemm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams
from engine.model.cpu_gemm import (
    CANDIDATE_ROWS,
    PackedLinearMixin,
    min_rows_from_timings,
    pack_linear_weights,
    packing_supported,
)
from engine.model.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.parallel import SINGLE_PROCESS

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32, torch.device("cpu")),
                                reason="this torch build cannot pack weights for oneDNN")


def _ops_run(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


MIN_ROWS = 8


@pytest.mark.parametrize("rows", [1, MIN_ROWS - 1, MIN_ROWS, 300])
def test_packed_linear_equals_f_linear_and_takes_the_packed_path_from_the_threshold(rows):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 200, bias=True, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer, min_rows=MIN_ROWS) == 1
    ops = _ops_run(lambda: layer(x))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert ("mkldnn::_linear_pointwise" in ops) == (rows >= MIN_ROWS)


@pytest.mark.parametrize("timings, expected", [
    # rows: (plain s, packed s)
    ({1: (1.0, 0.8), 2: (2.0, 1.0), 4: (3.0, 2.0), 16: (5.0, 4.0)}, 1),    # packed wins everywhere
    ({1: (1.0, 1.2), 2: (2.0, 1.0), 4: (3.0, 2.0), 16: (5.0, 4.0)}, 2),    # plain wins at one row (a gemv)
    ({1: (1.0, 0.8), 2: (2.0, 2.5), 4: (3.0, 2.0), 16: (5.0, 4.0)}, 4),    # a loss at 2 rows: not from 1
    ({1: (1.0, 1.2), 2: (2.0, 2.5), 4: (3.0, 3.5), 16: (5.0, 6.0)}, 16),   # never wins: the largest count
    ({1: (1.0, 1.0), 2: (2.0, 2.0), 4: (3.0, 3.0), 16: (5.0, 5.0)}, 1),    # a tie counts as no slower
])
def test_packed_min_rows_is_the_smallest_count_from_which_packed_is_never_slower(timings, expected):
    assert min_rows_from_timings(timings) == expected


def test_packing_measures_a_threshold_among_the_candidates_and_sets_it_on_every_layer():
    torch.manual_seed(2)
    layers = torch.nn.Sequential(ColumnParallelLinear(64, 128, bias=False, tp=SINGLE_PROCESS),
                                 RowParallelLinear(128, 64, bias=False, tp=SINGLE_PROCESS))
    for layer in layers:
        layer.weight.data.normal_()
    assert pack_linear_weights(layers) == 2
    assert layers[0].packed_min_rows in CANDIDATE_ROWS
    assert layers[1].packed_min_rows == layers[0].packed_min_rows


def test_row_parallel_adds_its_bias_once_on_the_packed_path():
    torch.manual_seed(1)
    layer = RowParallelLinear(64, 32, bias=True, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(MIN_ROWS + 4, 64)
    pack_linear_weights(layer, min_rows=MIN_ROWS)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


def test_the_engine_packs_every_linear_and_the_lm_head_and_generates_the_same_tokens(model_dirs):
    # more sequences than the largest threshold: decode steps take the packed path whatever was measured
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3, 8 + i][: 3 + i % 4] for i in range(CANDIDATE_ROWS[-1] + 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for prepack in (True, False):
        llm = LLM(str(model_dirs["tiny"]), max_model_len=256, dtype="float32", cpu_weight_prepack=prepack)
        modules = [m for m in llm.engine.worker.model.modules() if isinstance(m, PackedLinearMixin)]
        num_layers = llm.engine.worker.model_config.num_layers
        assert len(modules) == 4 * num_layers + 1          # qkv, o, gate_up, down per layer; the LM head
        assert all((m.packed_weight is not None) == prepack for m in modules)
        outputs[prepack] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
