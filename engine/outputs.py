"""What the engine reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str                         # all generated text so far (a matched stop string excluded)
    token_ids: list[int]              # all generated token ids so far
    delta_text: str = ""              # text new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None        # one per generated token, when asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0        # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # monotonic times, this process's clock
    first_token_time: float | None = None
    finished_time: float | None = None


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
