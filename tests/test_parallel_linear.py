"""Tensor-parallel linear layers against torch's own F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.linear import RowParallelLinear
from engine.model.parallel import TensorParallel


def test_a_one_rank_row_parallel_bias_is_added_in_the_matmul_as_transformers_adds_it():
    # bf16: the bias added after the matmul's output was rounded rounds twice (o_proj / down_proj with a bias)
    torch.manual_seed(0)
    layer = RowParallelLinear(256, 64, bias=True, tp=TensorParallel()).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_(std=50.0)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
