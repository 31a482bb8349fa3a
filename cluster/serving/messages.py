"""What the router and the workers tell each other (small metadata over Ray
calls; the KV itself goes over the KV transport). Each message is filled in by
the side that sends it.

    router ── prefill(...) ──▶ prefill replica ──▶ PrefillResult (the first token, where the KV is)
    router ── generate(DecodeRequest) ──▶ decode replica
                 decode replica ── send_kv ──▶ prefill replica (by replica id); KV over the transport
                 decode replica ── release ──▶ prefill replica, once the KV is in
           ◀── Admitted (the request is in the decode batch)
    router ◀── stream_outputs(subscriber): one list of TokenDelta per engine step, for
               every request of this router on that replica
    (a request prefilled on the decode replica itself: DecodeRequest.prefill is None)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import RequestOutput, ResumedOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class FirstTokenTimes:
    """Durations a worker measured up to a request's first token."""
    queue_s: float      # arrival at the worker → first scheduled
    prefill_s: float    # first scheduled → first token sampled


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one request produced since its previous delta (never cumulative)."""
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None     # one per token in token_ids, when asked for
    finished: bool = False
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0               # prompt tokens served from a prefix cache
    first_token_times: FirstTokenTimes | None = None   # on the delta that carries the first token
    # one per prompt token (the first None), on the request's first delta, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def from_output(cls, out: RequestOutput) -> "TokenDelta":
        """The new part of an engine output (of any kind): its new tokens, with
        their logprobs (the output's logprobs are one per token in token_ids, so
        the new tokens' are the last ones). First-token times go with the delta
        that carries the request's first token; a decode engine's outputs after
        a hand-off count the first token, which the prefill side already sent,
        among the generated ones, so none of them does."""
        times = None
        if out.first_token_time is not None and out.delta_token_ids and \
                out.num_output_tokens == len(out.delta_token_ids):
            scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else out.arrival_time
            times = FirstTokenTimes(queue_s=scheduled - out.arrival_time, prefill_s=out.first_token_time - scheduled)
        logprobs = None if out.logprobs is None else out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
        return cls(request_id=out.request_id, token_ids=list(out.delta_token_ids), text=out.delta_text,
                   logprobs=logprobs,
                   finished=out.finished, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                   num_cached_tokens=out.num_cached_tokens, first_token_times=times,
                   prompt_logprobs=out.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first: TokenDelta                      # the first token: streamed to the client at once
    generator_state: torch.Tensor | None   # seeded sampling continues from here on the decode side
    num_blocks: int
    sender_names: list[str]                # one per prefill rank
    num_kv_heads: int
    replica_id: str                        # the prefill replica holding the KV
    lease_s: float = 60.0                  # the hold ends this long after the last renew (or the prefill)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    subscriber: str                        # the router stream that receives this request's deltas
    prefill: PrefillResult | None = None   # None: the decode replica prefills the prompt itself
    transfer_id: str = ""                  # new for every attempt: a retry never meets a stale piece
    resume: ResumedOutput | None = None    # a migrated request: the output it already streamed


@dataclass(frozen=True, slots=True)
class Admitted:
    """A decode replica took the request into its batch."""
    replica_id: str
    reserve_time_s: float = 0.0            # waiting for free KV blocks
    transfer_time_s: float | None = None   # receives posted → KV in the cache (None: prefilled here)
    transfer_bytes: int | None = None


class KVTransferFailed(RuntimeError):
    """The KV did not arrive; the request was ended on the decode side and its
    blocks freed (the prefill side still holds its copy). `replica_id`: the
    decode replica it failed on (a retry avoids it)."""

    def __init__(self, message: str, replica_id: str = ""):
        super().__init__(message)
        self.replica_id = replica_id

    def __reduce__(self):   # keeps replica_id across Ray's pickling
        return type(self), (str(self), self.replica_id)


class ReplicaGoneError(RuntimeError):
    """The replica a call was addressed to (target_replica) is no longer running.
    Raised by the request router (cluster/serving/replica_routing.py), which Serve
    ships to every replica by value: defined here, so that it is one class
    everywhere (a class defined there is a new one in each process, which no
    `except ReplicaGoneError` elsewhere would catch)."""


class KVHolderLost(KVTransferFailed):
    """The prefill replica that held the request's KV no longer has it (it is
    gone, or the hold's lease ran out): no decode replica can take it any more,
    so the router prefills the request again instead of retrying the hand-off."""
