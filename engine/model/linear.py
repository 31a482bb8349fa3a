"""Tensor-parallel linear layers, each with a `weight_loader` that slices the
full checkpoint tensor down to this rank's part.

Column-parallel layers split the output features (no communication in forward);
row-parallel layers split the input features and all-reduce the partial sums in
forward, where the communication is visible.

Weight loaders take the checkpoint tensor as a lazy handle (`loader.LazyTensor`)
and read only this rank's slice of it with `narrow`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.cpu_gemm import PackedLinearMixin
from engine.model.parallel import TensorParallel


class _ParallelLinear(PackedLinearMixin, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T with W's output rows split across ranks; y stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        start, length = tp.shard(out_features, "output features")
        super().__init__(in_features, length, bias, tp)
        self.shard_start = start
        self.full_shape = (out_features, in_features)    # the checkpoint's weight, all ranks' rows

    def weight_loader(self, param, loaded, shard_id=None):
        _check_full(loaded, self.full_shape[:param.dim()])
        _copy_checked(param.data, loaded.narrow(0, self.shard_start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features / tp]
        return self.linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one
    matmul (gate and up). Checkpoint tensors arrive one by one with `shard_id`
    = their index; each rank keeps its slice of each, concatenated."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool, tp: TensorParallel):
        self.part_sizes = [tp.shard(n, "output features")[1] for n in out_features]
        _ParallelLinear.__init__(self, in_features, sum(self.part_sizes), bias, tp)
        self.full_parts = [(n, in_features) for n in out_features]

    def weight_loader(self, param, loaded, shard_id=None):
        _check_full(loaded, self.full_parts[shard_id][:param.dim()])
        size = self.part_sizes[shard_id]
        offset = sum(self.part_sizes[:shard_id])
        src = loaded.narrow(0, self.tp.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused. Query heads are split across ranks; KV
    heads are split too, or, when there are fewer KV heads than ranks, each KV
    head is replicated on `tp.size / num_kv_heads` consecutive ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TensorParallel):
        _, self.num_local_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            _, self.num_local_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_local_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp.size}) must be a multiple of "
                                 f"num_key_value_heads ({num_kv_heads}) when it is larger")
            self.num_local_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.head_dim = head_dim
        q_size = self.num_local_heads * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        _ParallelLinear.__init__(self, hidden_size, q_size + 2 * kv_size, bias, tp)
        kv_full = (num_kv_heads * head_dim, hidden_size)
        self.full_parts = {"q": (num_heads * head_dim, hidden_size), "k": kv_full, "v": kv_full}

    def weight_loader(self, param, loaded, shard_id=None):
        _check_full(loaded, self.full_parts[shard_id][:param.dim()])
        q_size, kv_size, _ = self.split_sizes
        if shard_id == "q":
            dst, src_start = param.data.narrow(0, 0, q_size), self.tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst, src_start = param.data.narrow(0, offset, kv_size), self.kv_head_start * self.head_dim
        _copy_checked(dst, loaded.narrow(0, src_start, dst.shape[0]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden] -> q [T, local_heads*D], k and v [T, local_kv_heads*D]
        return self.linear(x, self.bias).split(self.split_sizes, dim=-1)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W's input columns split across ranks; each rank computes a
    partial sum and the all-reduce below adds them. The bias is added once,
    after the reduction (on one rank, inside the matmul, as transformers adds it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        start, length = tp.shard(in_features, "input features")
        super().__init__(length, out_features, bias, tp)
        self.shard_start = start
        self.full_shape = (out_features, in_features)

    def weight_loader(self, param, loaded, shard_id=None):
        _check_full(loaded, self.full_shape[:param.dim()])
        if param.dim() == 2:
            _copy_checked(param.data, loaded.narrow(1, self.shard_start, param.shape[1]))
        else:  # the bias is added once, after the reduction: every rank keeps all of it
            _copy_checked(param.data, loaded.materialize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / tp] -> [num_tokens, out_features]
        if self.tp.size == 1:      # the bias in the matmul, as transformers adds it (one rounding, not two)
            return self.linear(x, self.bias)
        out = self.linear(x)
        out = self.tp.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


def _check_full(loaded, expected: tuple[int, ...]) -> None:
    """The checkpoint's whole tensor (before any rank takes its slice) has the
    shape config.json implies: a slice of a larger or smaller tensor would load
    without complaint, or fail on one rank only, naming the slice."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)} "
                         "(does config.json describe this checkpoint?)")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
