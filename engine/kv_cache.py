"""The paged KV cache tensors and how many blocks fit in a memory budget.

One tensor per model: [num_layers, 2, num_blocks, block_size, local_kv_heads, head_dim]
(index 0 of dim 1 is K, 1 is V). Layer i's view, kv[i], is what attention reads
and writes. The layout is fixed and public because blocks are shipped between
workers: a block of one layer for a head range is kv[layer, :, block, :, h0:h1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int        # heads held by this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def num_blocks_for(self, budget_bytes: int) -> int:
        return int(budget_bytes // self.bytes_per_block)


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str):
        self.spec = spec
        self.num_blocks = num_blocks
        # zeros, not empty: padded decode slots read block 0 and are masked, but
        # uninitialised memory could hold NaN/inf, which a 0 weight does not cancel
        self.tensor = torch.zeros(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads,
                                  spec.head_dim, dtype=spec.dtype, device=device)

    def layer_views(self) -> list[torch.Tensor]:
        """Per layer: [2, num_blocks, block_size, kv_heads, head_dim]."""
        return list(self.tensor.unbind(0))

    def read_blocks(self, block_ids: list[int], heads: range | None = None) -> torch.Tensor:
        """Copy of the blocks, for local KV heads `heads` (default all):
        [num_layers, 2, len(block_ids), block_size, len(heads), head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        data = self.tensor.index_select(2, idx)
        return data if heads is None else data[..., heads.start:heads.stop, :].contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, heads: range | None = None) -> None:
        """Inverse of read_blocks: writes `data` into the blocks' local heads `heads`."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        data = data.to(self.tensor.device, self.tensor.dtype)
        if heads is None or (heads.start == 0 and heads.stop == self.spec.num_kv_heads):
            self.tensor.index_copy_(2, idx, data)
        else:
            self.tensor[..., heads.start:heads.stop, :].index_copy_(2, idx, data)


def gpu_kv_budget_bytes(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes left for KV on a CUDA device after the weights already loaded:
    total * utilization minus what this process (and others) already use."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * gpu_memory_utilization) - used)
