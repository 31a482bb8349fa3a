"""A request's state inside the engine.

Life cycle in one engine:
    WAITING --scheduled--> RUNNING --EOS/stop/length--> FINISHED (blocks freed)
       ^                      |
       +------preempted-------+   (blocks freed, recomputed from scratch later)
Disaggregated roles add two states:
    prefill side: RUNNING --first token--> HELD (blocks kept until release_kv)
    decode side:  RESERVED (blocks allocated, KV arriving) --kv ready--> RUNNING
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.block_table import BlockTable
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams


# stands for a token the device sampled and the host has not read yet (async scheduling)
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"
    HELD = "held"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()   # the model's main EOS first (ending on it gives no stop_reason)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    block_table: BlockTable = field(default_factory=BlockTable)
    num_hashed_blocks: int = 0            # leading blocks registered for prefix caching
    num_cached_prompt_tokens: int = 0     # prompt tokens served from the prefix cache
    generator: torch.Generator | None = None
    hold_kv: bool = False                 # prefill role: keep blocks after the first token
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None   # end of queueing: the first step it ran in
    first_token_time: float | None = None
    num_preemptions: int = 0
    # trailing PENDING_TOKENs in token_ids: sampled by a launched step, not yet read back
    num_pending_tokens: int = 0
    # params.prompt_logprobs set: entry i scores prompt token i given those before it (entry 0: None);
    # filled chunk by chunk as the prompt runs. None: not asked for, or computed by another engine
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)   # params.bad_words, tokenized
    prompt_block_hashes: list[int] | None = None   # of the prompt's full blocks, once the scheduler needs them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (pending ones excluded)."""
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
