"""Tensor-parallel context and its collectives, passed to layers explicitly.

A `TensorParallel` value says which rank of how many this process is and holds
the process group its collectives use. The group is built directly on a TCP
store (see engine/tp_group.py), never through torch.distributed's global group,
so several engines can live in one process and a worker's TP group never
collides with the groups that carry KV transfers. With `size == 1` every
collective is a no-op: the single-process engine runs the same code.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True, frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None            # a torch.distributed Backend (ProcessGroupGloo / ProcessGroupNCCL)
    comm_device: str = "cpu"     # where collective buffers live (cuda for NCCL)
    store: Any = None            # the TCP store the group was built on; kept alive with it
    control: Any = None          # a gloo group over the same ranks for pickled objects (engine/tp_group.py)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal slice of `total` items."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        length = total // self.size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `x` across ranks in place (sum, or min); returns it."""
        if op not in ("sum", "min"):
            raise ValueError(f"all_reduce op must be 'sum' or 'min', got {op!r}")
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM
            self.group.allreduce([x], opts).wait()
        return x

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dimension in
        rank order; the other ranks get None (they only send)."""
        parts = self.gather_to_first(x)
        return None if parts is None else torch.cat(parts, dim=-1)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets [x of rank 0, x of rank 1, ...] (same shapes on every
        rank); the other ranks get None."""
        if self.size == 1:
            return [x]
        return self._gather(self.group, x.contiguous().to(self.comm_device))

    def _gather(self, group: Any, x: torch.Tensor) -> list[torch.Tensor] | None:
        """`gather_to_first` over `group` (the tensor group or the control group)."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_first else []
        group.gather(outputs, [x], opts).wait()
        return outputs[0] if self.is_first else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj` (pickled, over the control group); every rank returns it."""
        if self.size == 1:
            return obj
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.is_first:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast([length], opts).wait()
        if not self.is_first:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.control.broadcast([payload], opts).wait()
        return obj if self.is_first else pickle.loads(payload.numpy().tobytes())

    def gather_objects_to_first(self, obj: Any) -> list[Any] | None:
        """Rank 0 gets every rank's `obj` (pickled, over the control group) in rank
        order; others get None."""
        if self.size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                   dtype=torch.uint8)
        # gather needs equal shapes: pad to the longest payload (unpickling stops at
        # the pickle's own end, so the padding needs no length alongside)
        longest = torch.tensor([payload.numel()], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.control.allreduce([longest], opts).wait()
        padded = torch.zeros(int(longest.item()), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        parts = self._gather(self.control, padded)
        if parts is None:
            return None
        return [pickle.loads(p.numpy().tobytes()) for p in parts]


SINGLE_PROCESS = TensorParallel()
