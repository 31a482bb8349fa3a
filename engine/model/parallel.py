"""Tensor-parallel context and collectives, passed to layers explicitly.

A `TensorParallel` value says which rank of how many this process is and which
torch.distributed group its collectives use. Layers take it as a constructor
argument (no global state); with `size == 1` every collective is a no-op, so the
single-process engine runs the same code as a sharded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True, frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None when size == 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal slice of `total` items."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        length = total // self.size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` across ranks in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = TensorParallel()
