"""Linear layers through oneDNN with pre-packed weights (engine/model/cpu_gemm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams
from engine.model.cpu_gemm import (
    PACKED_MIN_ROWS,
    PackedLinearMixin,
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


@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 300])
def test_packed_linear_equals_f_linear_and_takes_the_packed_path_from_the_threshold(rows):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 200, bias=True, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer) == 1
    ops = _ops_run(lambda: layer(x))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert ("mkldnn::_linear_pointwise" in ops) == (rows >= PACKED_MIN_ROWS)


def test_row_parallel_adds_its_bias_once_on_the_packed_path():
    torch.manual_seed(1)
    layer = RowParallelLinear(64, 32, bias=True, tp=SINGLE_PROCESS)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(PACKED_MIN_ROWS + 4, 64)
    pack_linear_weights(layer)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


def test_the_engine_packs_every_linear_and_the_lm_head_and_generates_the_same_tokens(model_dirs):
    # more sequences than PACKED_MIN_ROWS: decode steps take the packed path too
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3, 8 + i][: 3 + i % 4] for i in range(PACKED_MIN_ROWS + 2)]
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
