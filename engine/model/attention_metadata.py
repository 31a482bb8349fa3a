"""Where each token of a step's flat batch writes its K/V and what it attends to.

A step's batch is one flat list of tokens: first one token for each decoding
sequence, then the chunks of the sequences that are prefilling. The runner
builds this value once per step; every attention layer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's chunk of prompt tokens in this step."""
    token_start: int              # index of the chunk's first token in the flat batch
    num_tokens: int               # tokens in this chunk
    context_len: int              # tokens of the sequence attended to, this chunk included
    block_table: torch.Tensor     # [blocks covering context_len] int64 block ids

    @property
    def has_cached_prefix(self) -> bool:
        return self.context_len > self.num_tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [num_tokens] int64: cache slot each token's K/V goes to
    num_decode_tokens: int                  # the first num_decode_tokens tokens decode, one per sequence
    decode_block_tables: torch.Tensor | None   # [num_decodes, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None   # [num_decodes] int64
    decode_key_mask: torch.Tensor | None       # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
