"""What the router, a prefill worker and a decode worker tell each other about
one request's hand-off (small metadata over Ray calls; the KV itself goes over
the KV transport).

    router ── prefill ──▶ PrefillResult (first token, where the KV is)
    router ── DecodeRequest ──▶ decode worker
           ◀─ ReadyToReceive (receives posted: now tell the prefill worker to send)
           ◀─ KVReceived (the KV is in the decode cache: the prefill side may free it)
           ◀─ RequestOutput ... (tokens, the first one included)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.transport.kv_transport import PeerAddress
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    generator_state: torch.Tensor | None   # seeded sampling continues from here on the decode side
    num_cached_tokens: int                 # prompt tokens served from the prefix cache
    num_blocks: int
    queue_time_s: float
    prefill_time_s: float
    sender_names: list[str]                # one per prefill rank
    num_kv_heads: int
    replica_id: str = ""                   # the prefill replica holding the KV (set by the server)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill: PrefillResult
    transfer_id: str                       # new for every attempt: a retry never meets a stale piece


@dataclass(frozen=True, slots=True)
class ReadyToReceive:
    transfer_id: str
    receivers: list[PeerAddress]           # one per decode rank
    reserve_time_s: float                  # waiting for free KV blocks
    replica_id: str = ""                   # the decode replica (set by the server): avoided on a retry


@dataclass(frozen=True, slots=True)
class KVReceived:
    transfer_time_s: float
    num_bytes: int


class KVTransferFailed(RuntimeError):
    """The KV did not arrive; the request was ended and its blocks freed."""
