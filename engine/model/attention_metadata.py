"""Where each token of a step's flat batch writes its K/V and what it attends to.

A step's batch is one flat list of tokens: first one token for each decoding
sequence, then the chunks of the sequences that are prefilling. The runner
builds this value once per step; every attention layer reads it. The torch
and cpp backends read `decode_groups` and `prefills`; the Triton backend reads
`paged`.
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
    # [n] int64 keys per sequence: set when the C++ kernel reads the blocks in place (one group
    # for all decodes, engine/kernels/cpu_kernels.py); None for the gather + SDPA path
    seq_lens: torch.Tensor | None = None


# A lone fresh prompt this long or longer takes SDPA's contiguous causal kernel (faster on the
# device: 214-220 against the paged kernel's 171-177 TFLOP/s on an H100). A shorter one takes the
# paged prefill kernel: its step is bound by the host's launches (an 8B prompt of 16 to 1,024
# tokens took 22-37 ms on one H200 machine, with 5 ms of kernels at 16 tokens and 12 at 512), and SDPA adds
# ~8 launches and cuDNN's set-up per layer where the paged kernel is one launch
# (bench/gpu_prefill_paths.py: 1.21-1.28x faster steps from 16 to 512 tokens).
SDPA_FRESH_PREFILL_MIN_TOKENS = 1024


def lone_fresh_prompt_takes_sdpa(num_tokens: int) -> bool:
    """Whether a step of one fresh prompt of `num_tokens` (no decodes, no cached
    prefix) runs SDPA's contiguous kernel rather than the paged prefill kernel."""
    return num_tokens >= SDPA_FRESH_PREFILL_MIN_TOKENS


@dataclass(slots=True)
class PagedBatch:
    """The step's sequences as the paged kernels read them, decodes first.
    Host ints size the kernel grids, so no value is read back from the device."""
    num_decodes: int
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int32, rows padded with block 0
    seq_lens: torch.Tensor            # [num_seqs] int32: keys each sequence attends to, this step's included
    prefill_query_start: torch.Tensor  # [num_prefills + 1] int32: chunk offsets after the decode tokens
    max_prefill_query_len: int
    decode_splits: int                # programs each decode context is split over
    # one long fresh prompt and no decodes: the contiguous causal kernel (SDPA) is the fastest
    single_fresh_prefill: bool = False

    def to(self, device: torch.device) -> "PagedBatch":
        return PagedBatch(self.num_decodes, to_device(self.block_tables, device), to_device(self.seq_lens, device),
                          to_device(self.prefill_query_start, device), self.max_prefill_query_len,
                          self.decode_splits, self.single_fresh_prefill)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [num_tokens] int64: cache slot each token's K/V goes to (< 0: none)
    decode_groups: list[DecodeGroup]        # decode tokens come first in the batch, one per sequence
    prefills: list[PrefillChunk]
    paged: PagedBatch | None = None         # set for the Triton backend

    def to(self, device: torch.device) -> "AttentionMetadata":
        """A copy on `device`; host-to-device copies are asynchronous (pinned)."""
        return AttentionMetadata(
            slot_mapping=to_device(self.slot_mapping, device),
            decode_groups=[DecodeGroup(g.token_start, to_device(g.block_tables, device),
                                       None if g.key_mask is None else to_device(g.key_mask, device),
                                       None if g.seq_lens is None else to_device(g.seq_lens, device))
                           for g in self.decode_groups],
            prefills=[PrefillChunk(c.token_start, c.num_tokens, c.context_len, to_device(c.block_table, device))
                      for c in self.prefills],
            paged=None if self.paged is None else self.paged.to(device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from CPU to CUDA through pinned memory, without blocking the host."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
