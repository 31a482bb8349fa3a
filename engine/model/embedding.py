"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous slice of the vocabulary rows. The embedding looks
up the ids it owns, zeroes the rest and all-reduces; the LM head computes logits
for its slice and gathers them once, onto rank 0 (the rank that samples), for
the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu_gemm import PackedLinearMixin
from engine.model.parallel import TensorParallel


def _vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    # Pad so every rank gets the same number of rows; padded rows are never real ids.
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.rows_per_rank = _vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected ({self.vocab_size}, {param.shape[1]})")
        rows = min(self.rows_per_rank, self.vocab_size - self.vocab_start)
        if rows > 0:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedLinearMixin, VocabParallelEmbedding):
    """Shares the embedding's sharding; may share its weight (tied embeddings)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [num_sampled, hidden] -> logits [num_sampled, vocab_size] on rank 0, None elsewhere
        logits = self.linear(hidden)
        logits = self.tp.gather_last_dim_to_first(logits)   # only the sampling rank needs them
        return None if logits is None else logits[:, : self.vocab_size]
