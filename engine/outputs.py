"""What the engine reports per request per step."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch

from engine.sampler import TokenLogprobs


class OutputKind(enum.Enum):
    """What a request's outputs carry; the consumer picks it (vLLM's RequestOutputKind).
    A streaming server wants DELTA: CUMULATIVE copies everything generated so far
    into every output, O(length) per token."""
    CUMULATIVE = "cumulative"   # every output: text, token_ids and logprobs so far, and the deltas
    DELTA = "delta"             # every output: only what is new (text == delta_text, token_ids == delta_token_ids)
    FINAL_ONLY = "final_only"   # one output, the request's last from this engine, cumulative


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str                         # generated text so far (a matched stop string excluded); DELTA: the new text
    token_ids: list[int]              # generated token ids so far; DELTA: the new ones
    delta_text: str = ""              # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None        # one per token in token_ids, when asked for
    # one per prompt token (the first None), when asked for: DELTA outputs carry them once, in the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0        # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # monotonic times, this process's clock
    first_token_time: float | None = None
    finished_time: float | None = None
    # tokens generated so far, whatever the kind (left out: len(token_ids), a cumulative output's count)
    num_output_tokens: int = None   # type: ignore[assignment]
    prompt: str | None = None         # the text prompt, where LLM.generate was given one

    def __post_init__(self) -> None:
        if self.num_output_tokens is None:
            self.num_output_tokens = len(self.token_ids)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' logprobs (vLLM's), where logprobs were asked for; None else."""
        return None if self.logprobs is None else float(sum(lp.logprob for lp in self.logprobs))


def aborted_output(request_id: str) -> RequestOutput:
    """The last output of a request a worker aborted, for whoever waits on its outputs."""
    return RequestOutput(request_id=request_id, prompt_token_ids=[], text="", token_ids=[], finished=True,
                         finish_reason="abort")


def joined(deltas: list[RequestOutput]) -> RequestOutput:
    """The cumulative output of a request whose DELTA outputs are `deltas`, in
    order (the last one's status): what its last CUMULATIVE output would be."""
    token_ids = [t for out in deltas for t in out.delta_token_ids]
    logprobs = None
    if any(out.logprobs is not None for out in deltas):
        logprobs = [entry for out in deltas for entry in (out.logprobs or [])]
    prompt_logprobs = next((out.prompt_logprobs for out in deltas if out.prompt_logprobs is not None), None)
    return dataclasses.replace(deltas[-1], text="".join(out.delta_text for out in deltas), token_ids=token_ids,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs)


@dataclass(frozen=True, slots=True)
class ResumedOutput:
    """What a request already generated, and streamed, on a worker that then
    failed. An engine given it continues the request right after it, as if it
    had generated those tokens itself: stop strings may span it, penalties,
    max_tokens and min_tokens count it, and a seeded generator is advanced
    past it. The request's outputs carry only what follows."""
    token_ids: list[int]
    num_sent_chars: int        # characters of its text the client already has
    logprobs: list[TokenLogprobs] | None = None   # one per token, when the request asks for them
    # a seeded request's generator already advanced past the tokens (None: the engine advances it,
    # one vocabulary-sized draw per token on its own thread)
    generator_state: torch.Tensor | None = None
