"""What the HTTP layer needs from the serving side: one generation stream per
request. The OpenAI API (router/openai_api.py) is written against this
interface only; the Ray router implements it by sending the request through a
prefill worker and a decode worker (or one colocated worker), and tests can
drive the API with an in-process engine or a scripted fake.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from router.timings import PhaseTimings


@dataclass(frozen=True, slots=True)
class ModelInfo:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    # the checkpoint's generation_config.json sampling settings, for what a request leaves unset
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    chat_template: str | None = None      # the deployment's own, in place of the tokenizer's (its text)
    aliases: tuple[str, ...] = ()         # other names requests may give for the model


class BackendUnavailableError(RuntimeError):
    """The request could not be served for a reason that is not the caller's
    fault (a worker died, a KV transfer failed): HTTP 503. `replica_id`: the
    replica that failed, where known (a retry or migration avoids it). The
    message is for the log (it may quote Ray's errors, which name actors, nodes
    and processes); the client is told `reason`, or only that the model is
    unavailable."""

    def __init__(self, message: str = "", replica_id: str = "", reason: str = ""):
        super().__init__(message)
        self.replica_id = replica_id
        self.reason = reason

    @classmethod
    def public(cls, message: str) -> BackendUnavailableError:
        """One whose message (the router's own words) the client is told as it is."""
        return cls(message, reason=message)

    def __reduce__(self):
        return BackendUnavailableError, (str(self), self.replica_id, self.reason)


class GenerationBackend(ABC):
    """Contract:
    - `generate` yields delta RequestOutputs (engine.outputs.OutputKind.DELTA:
      text, token_ids and logprobs are what is new since the previous one;
      num_output_tokens counts every token so far); the last one has
      `finished=True`. An output may carry no new text (text held back).
    - Closing the iterator early (client went away) aborts the request on
      every worker and frees its KV blocks.
    - Raises engine.InvalidRequestError for a request the model cannot take
      (HTTP 400) and BackendUnavailableError for a serving failure (503).
    """

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def check_health(self) -> None:
        """Raises BackendUnavailableError when the workers cannot serve."""

    def phase_timings(self, request_id: str) -> PhaseTimings | None:
        """The phase durations the workers measured for an ended request (queue,
        prefill, KV transfer), or None when not tracked. Called once per request,
        after its iterator was closed; the backend may forget them afterwards."""
        return None
