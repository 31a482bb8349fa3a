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
class DecodeGroup:
    """Decode tokens [token_start, token_start + n) of sequences of similar
    length, attended together: their block tables are padded to the group's
    longest, so grouping by length keeps the padding (wasted gathers) small."""
    token_start: int
    block_tables: torch.Tensor    # [n, max_blocks] int64, padded with block 0
    key_mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool; None when nothing is padded


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [num_tokens] int64: cache slot each token's K/V goes to
    decode_groups: list[DecodeGroup]        # decode tokens come first in the batch, one per sequence
    prefills: list[PrefillChunk]
