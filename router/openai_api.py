"""The OpenAI-compatible HTTP API, written against a GenerationBackend.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and
/v1/models/{model}), GET /health, GET /metrics, and vLLM's POST /tokenize,
POST /detokenize and GET /version.

One generation request:
  parse (router/protocol.py) -> model name -> supported features -> tokenize once
  -> prompt ids in the vocabulary and the context window -> SamplingParams
  -> backend.generate(...) once per choice (n) -> one JSON body, or a stream of
  SSE chunks.

Contracts:
- The backend iterator is closed (`aclose`) when the request ends for any reason;
  a client that disconnects (before or during the stream) therefore aborts the
  request on the workers. Closing is shielded from cancellation.
- Streaming awaits the first output before sending headers, so an error the
  backend raises up front is a normal HTTP error; a later one is sent as an SSE
  `data: {"error": {...}}` event. A stream always ends with `data: [DONE]`.
- Per request that reached the backend, metrics get one `observe_request`, with
  the workers' phase durations from `backend.phase_timings(request_id)` when it has them.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from engine.bad_words import bad_word_sequences
from engine.chat_template import template_traits, tokenizer_template
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError
from router.admission import AdmissionControl, Admitted, Overloaded
from router.backend import BackendUnavailableError, GenerationBackend
from router.choices import Choices, Generation, params_of_choice
from router.cors import CorsSettings, OpenAICorsMiddleware
from router.errors import (
    OpenAIError,
    SpacedLog,
    error_response,
    from_exception,
    install_error_handlers,
)
from router.health import SharedHealthCheck
from router.http_guard import HttpGuard
from router.metrics import ServingMetrics
from router.protocol import (
    MAX_REQUEST_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from router.responses import (
    DONE_EVENT,
    ChatResponses,
    ChoiceCursor,
    CompletionResponses,
    Echo,
    ResponseBuilder,
    TokenTexts,
    sse_event,
    usage,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# nginx's "client closed request"; nobody reads it, but logs show what happened.
_CLIENT_CLOSED = 499
# /v1/completions without max_tokens generates this many, as OpenAI's and vLLM's do
COMPLETION_DEFAULT_MAX_TOKENS = 16
# longer text is tokenized on a worker thread (~1 ms of tokenizing on the event loop at most)
_INLINE_TOKENIZE_CHARS = 16_384
# text is refused untokenized past this many times the characters the context's tokens could spell
_TEXT_MARGIN = 4
# a template that raises refuses the request (400); the operator sees whether it refuses them all
_TEMPLATE_FAILURE_LOG = SpacedLog(log, every_s=60.0, level=logging.INFO)


def _is_client_retry(headers) -> bool:
    """Whether the request is a client's retry of one it sent before: the OpenAI SDKs
    (Python, Node) number their tries in X-Stainless-Retry-Count, 0 for the first."""
    count = headers.get("x-stainless-retry-count", "")
    return count.isascii() and count.isdigit() and int(count) > 0


def _installed_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:    # run from a source tree that is not installed
        return "unknown"


_VERSION = _installed_version()


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (None: only the model's context limits it).
    Past a limit the request gets a 400 naming the field and the limit."""
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_body_bytes: int | None = 16 << 20
    max_stop_token_ids: int = 256
    max_n: int = 16
    max_logit_bias: int = 1024          # entries; every step of the batch pays for them
    max_allowed_token_ids: int = 1024
    max_prompts: int = 256               # in one /v1/completions batch
    # logprob entries (a token's and its alternatives') a response may carry in all: each alone within its
    # limit, prompts x n x tokens x (alternatives + 1) multiply into what the router builds in memory
    max_logprob_entries: int = 1 << 22
    # characters of one stop string: the engine searches a window as long as the longest on every
    # step, and a stream holds back that much text while it could still be a stop string's start
    max_stop_chars: int = 1024


def build_openai_app(backend: GenerationBackend, tokenizer: Any, metrics: ServingMetrics, *,
                     request_id_prefix: str = "cmpl", limits: RequestLimits = RequestLimits(),
                     api_key_sha256: str | None = None, protect_metrics: bool = True,
                     admission: AdmissionControl | None = None, cors: CorsSettings | None = None) -> FastAPI:
    """An app serving `backend`'s model. Request ids are `{prefix}-{hex}` for completions
    and `chat{prefix}-{hex}` for chat (so "cmpl-..." and "chatcmpl-...", as OpenAI).
    With `api_key_sha256`, requests must carry the key (router/http_guard.py). With
    `cors`, pages of its origins may call the API from a browser."""
    server = _Server(backend, tokenizer, metrics, request_id_prefix, limits, admission)
    if admission is not None:
        metrics.watch_admission(admission)
    app = FastAPI(title="pdserve", summary="OpenAI-compatible API")
    install_error_handlers(app, on_error=metrics.observe_error)
    app.add_middleware(HttpGuard, api_key_sha256=api_key_sha256, protect_metrics=protect_metrics,
                       max_body_bytes=limits.max_body_bytes, on_error=metrics.observe_error)
    if cors is not None:
        # added last, so outermost: preflights are answered before the key check (browsers send no key
        # with them), and the guard's 401 and 413 carry the headers a page needs to read them
        app.add_middleware(OpenAICorsMiddleware, **cors.middleware_options())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.generate(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.generate(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        server.check_model(model)
        card = next((card for card in server.models()["data"] if card["id"] == model), None)
        if card is None:    # an empty name (a trailing slash) passes check_model as the served model
            raise OpenAIError(404, f"No model is named `{model}`; this server serves "
                              f"`{server.info.served_model_name}`.", param="model", code="model_not_found")
        return card

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        # a conversation when it has messages, else a prompt (one shape's errors, not both's)
        shape = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            parsed = shape.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        return await server.tokenize(parsed)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return server.detokenize(body)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": _VERSION}

    check_health = SharedHealthCheck(backend.check_health)

    @app.api_route("/health", methods=["GET", "HEAD"])     # (load balancers' probes send HEAD too)
    async def health() -> Response:
        if (reason := await check_health()) is not None:
            # Answered here rather than raised: a failing probe is not a request error.
            return error_response(503, f"The server cannot serve requests: {reason}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    return app


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token's text can have (a token's string form, bytes
    spelled one character each, is never shorter than its text), at least 1."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(token) for token in vocab), default=1))


@dataclass(frozen=True)
class _PlannedPrompt:
    """One prompt of a request, tokenized and checked: its token ids, its output bound,
    each of its choices' sampling parameters, and the builder of its choices' entries."""
    ids: list[int]
    max_tokens_asked: int | None    # the output bound asked for; None where it is only the context's room
    choice_params: list[SamplingParams]
    fmt: ResponseBuilder


class _ClientDisconnected(Exception):
    """The client went away before the response started."""


class _Server:
    """Per-app state and the request path shared by both generation endpoints."""

    def __init__(self, backend: GenerationBackend, tokenizer: Any, metrics: ServingMetrics,
                 request_id_prefix: str, limits: RequestLimits, admission: AdmissionControl | None):
        self.limits = limits
        self.admission = admission
        self.backend = backend
        self.metrics = metrics
        self.info = backend.model_info()
        if self.info.chat_template is not None:    # the deployment's, on this app's own copy
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = self.info.chat_template
        self.tokenizer = tokenizer
        self.prefix = request_id_prefix
        self.created = int(time.time())
        self.max_token_chars = _longest_token_chars(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        self.added_special_ids = list(tokenizer.encode("", add_special_tokens=True))   # e.g. [BOS]
        if getattr(tokenizer, "chat_template", None) is None:
            log.warning("the model's tokenizer has no chat template: /v1/chat/completions answers 400; "
                        "/v1/completions serves prompts as text")

    def models(self) -> dict[str, Any]:
        """A card per name the model is served under (vLLM's), the main name first."""
        root = self.info.served_model_name
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": root,
             "parent": None, "max_model_len": self.info.max_model_len, "permission": []}
            for name in (root, *self.info.aliases)]}

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is one the model is served under (None or "": the served model, as vLLM's)."""
        if name and name != self.info.served_model_name and name not in self.info.aliases:
            shown = name if len(name) <= 80 else name[:80] + "..."
            raise OpenAIError(404, f"The model `{shown}` does not exist; this server serves "
                              f"`{self.info.served_model_name}`.", param="model", code="model_not_found")

    async def tokenize(self, body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the prompt's token ids as the generation endpoints would run them."""
        self.check_model(body.model)
        chat = isinstance(body, TokenizeChatRequest)
        if chat:
            body.check_rendering()
        ids = await self._tokenize(body, "messages" if chat else "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token ids (special tokens included)."""
        self.check_model(body.model)
        if len(body.tokens) > self.info.max_model_len:
            raise InvalidRequestError(f"tokens has {len(body.tokens)} ids, more than the model's context of "
                                      f"{self.info.max_model_len}.", param="tokens")
        vocab = self.info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens contains {bad}, outside the model's vocabulary [0, {vocab}).",
                                      param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def generate(self, body: CompletionRequest | ChatCompletionRequest,
                       request: Request) -> Response:
        arrival = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        self.check_model(body.model)
        body.check_supported()
        self._check_request_limits(body)
        # a client's retry of a 429 was counted as demand when it was first offered (AdmissionControl.takes_retry:
        # one without a refusal to retry counts again); with admission control off, nothing is refused and the
        # header is taken at its word
        offered = not (_is_client_retry(request.headers) and (self.admission is None or self.admission.takes_retry()))
        arrived = self._check_before_tokenizing(offered)
        try:
            batch = [body] if chat else body.prompts()
            prompts = [await self._planned(one, chat, i if len(batch) > 1 else None) for i, one in enumerate(batch)]
            await self._check_bad_words(prompts[0].choice_params[0])     # the request's, for every prompt
            self._bound_logprob_entries(prompts, body)
        except BaseException:    # a 400 (or a client gone while tokenizing): no demand on the workers
            if arrived is not None:
                self.admission.withdraw(arrived)
            raise

        request_id = f"{'chat' if chat else ''}{self.prefix}-{uuid.uuid4().hex}"
        n = body.choices
        tickets = self._admit(prompts, n, arrived, offered)
        # choice p * n + j: prompt p's choice j (OpenAI's and vLLM's index for a batch)
        plan_of = [(plan, j, tickets[p][j]) for p, plan in enumerate(prompts) for j in range(n)]
        choices = Choices([Generation(self.backend, self.metrics, self.admission,
                                      request_id if len(plan_of) == 1 else f"{request_id}-{i}", plan.ids,
                                      plan.choice_params[j], arrival, ticket, shares_prompt=j > 0, offered=offered,
                                      max_tokens_asked=plan.max_tokens_asked, output_returned=not body.echo_only)
                           for i, (plan, j, ticket) in enumerate(plan_of)],
                          prompt_tokens=sum(len(plan.ids) for plan in prompts))
        fmts = [plan.fmt for plan, _, _ in plan_of]
        # the client's own id for it (vLLM's request_id field, else the X-Request-Id header, which Ray Serve
        # sets when the client did not: the response's header) names the response; the cluster keeps a
        # unique one, as two clients may send the same
        client_id = body.request_id or _usable_request_id(request.headers.get("x-request-id"))
        response_id = f"{'chat' if chat else ''}{self.prefix}-{client_id}" if client_id else request_id
        # system_fingerprint: the server's build, as OpenAI's and vLLM's responses carry theirs
        header = {"id": response_id, "object": fmts[0].chunk_object if body.stream else fmts[0].object,
                  "created": int(time.time()), "model": self.info.served_model_name,
                  "system_fingerprint": f"pdserve-{_VERSION}"}
        try:
            if body.stream:
                first = await _unless_disconnected(request, choices.next())
                if first is None:    # before any header: an HTTP error like a non-streamed request's
                    raise BackendUnavailableError.public("the generation stream ended before its first output")
                return _EventStream(self._events(choices, first, fmts, header, body.include_usage,
                                                 body.continuous_usage, body.echo_only),
                                    on_close=lambda: choices.close("abort"), media_type="text/event-stream")
            finals = await _unless_disconnected(request, choices.run_to_end())
        except _ClientDisconnected:
            await choices.close("abort")
            return Response(status_code=_CLIENT_CLOSED)
        except asyncio.CancelledError:    # Serve cancels the handler of a client that left
            await choices.close("abort")
            raise
        except BaseException:
            await choices.close(None)
            raise
        await choices.close(None)      # each ran to its end: closed with its own finish reason
        for first in range(0, len(finals), n):    # each prompt scored once (_planned): all its choices carry it
            if finals[first].prompt_logprobs is not None:
                finals[first + 1:first + n] = [dataclasses.replace(f, prompt_logprobs=finals[first].prompt_logprobs)
                                               for f in finals[first + 1:first + n]]
        if body.echo_only:
            finals = [_prompt_only(final) for final in finals]
        entries = []
        for i, (final, fmt) in enumerate(zip(finals, fmts)):
            text, logprobs = fmt.content(final.text, final, ChoiceCursor(), opening=True)
            entries.append(fmt.choice(i, text, logprobs, final))
        scored = {}
        if chat and finals[0].prompt_logprobs is not None:     # chat's are the response's (vLLM's)
            scored = {"prompt_logprobs": fmts[0].prompt_logprobs(prompts[0].ids, finals[0].prompt_logprobs)}
        return JSONResponse({**header, "choices": entries, "usage": usage(choices.prompt_tokens, *finals),
                             **fmts[0].response_fields(), **scored})

    async def _planned(self, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                       batch_index: int | None = None) -> _PlannedPrompt:
        """One prompt of the request (`body` holds one; `batch_index`: its place in a
        batch, which a 400 names), tokenized and checked (400s)."""
        try:
            prompt_ids, params, cut = await self._prompt_and_params(body, chat)
        except InvalidRequestError as exc:
            if batch_index is None:
                raise
            raise InvalidRequestError(f"prompt {batch_index} of the batch: {exc}", exc.param) from None
        choice_params = [params_of_choice(params, i) for i in range(body.choices)]
        if not body.stream and params.prompt_logprobs is not None:
            # the first choice scores the prompt for all; the others read it from the prefix cache
            choice_params[1:] = [dataclasses.replace(p, prompt_logprobs=None) for p in choice_params[1:]]
        token_ids = prompt_ids if body.return_token_ids else None
        echo = self._echo(body, prompt_ids, cut)
        as_ids = bool(body.return_tokens_as_token_ids)
        fmt = ChatResponses(self.token_texts, token_ids, echo, as_ids, body.reply_role) if chat else \
            CompletionResponses(self.token_texts, token_ids, echo, as_ids)
        # a chat request without max_tokens may run to the end of the context: no output length asked
        # for (as the autoscaler's arrivals, it would stand for outputs of thousands of tokens)
        asked = params.max_tokens if params.max_tokens < self.info.max_model_len - len(prompt_ids) else None
        return _PlannedPrompt(prompt_ids, asked, choice_params, fmt)

    def _echo(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
              cut: bool) -> Echo | None:
        """What `echo` puts before each choice's text: the prompt (its own text, the text of its
        token ids, or when it was `cut` the text of the tokens kept), or in a chat the last message
        when it has the reply's role (vLLM's: the assistant's; with add_generation_prompt false,
        whichever it is)."""
        if not body.echo:
            return None
        if isinstance(body, ChatCompletionRequest):
            last = body.messages[-1]
            return Echo(last.content or "", prompt_ids) if last.role == body.reply_role else None
        # decoded without the clean-up of tokenization spaces (" ." kept), as the streamed text and token strings
        if not isinstance(body.prompt, str):      # token ids, cut or not: the text of every id, special ones too
            return Echo(self.tokenizer.decode(prompt_ids, clean_up_tokenization_spaces=False), prompt_ids)
        if cut:         # text: the special tokens the tokenizer added are not the client's text
            return Echo(self.tokenizer.decode(prompt_ids, skip_special_tokens=True,
                                              clean_up_tokenization_spaces=False), prompt_ids)
        return Echo(body.prompt, prompt_ids)

    async def _prompt_and_params(self, body: CompletionRequest | ChatCompletionRequest,
                                 chat: bool) -> tuple[list[int], SamplingParams, bool]:
        """The prompt's token ids and the sampling parameters, each checked (400s; the
        bad_words apart: _check_bad_words), and whether the prompt was cut
        (truncate_prompt_tokens)."""
        prompt_param = "messages" if chat else "prompt"
        keep = self._tokens_to_keep(body)
        tokenized = await self._tokenize(body, prompt_param, keep)
        prompt_ids = self._truncated(body, tokenized, keep)
        self._check_prompt(prompt_ids, prompt_param)
        # chat: the rest of the context, or the checkpoint's max_new_tokens if less (vLLM's); completions:
        # 16 as OpenAI's and vLLM's (or min_tokens, if more)
        default_max = self.info.max_model_len - len(prompt_ids)
        if not chat:
            default_max = min(default_max, max(COMPLETION_DEFAULT_MAX_TOKENS, body.min_tokens or 0))
        elif "max_tokens" in self.info.sampling_defaults:
            default_max = min(default_max, max(int(self.info.sampling_defaults["max_tokens"]), body.min_tokens or 0))
        if self.limits.max_tokens is not None:
            default_max = min(default_max, self.limits.max_tokens)
        params = body.to_sampling_params(default_max, self.info.sampling_defaults)
        params = self._fit_to_context(len(prompt_ids), params, body.max_tokens_param, prompt_param)
        text_cut = keep is not None and isinstance(body, CompletionRequest) and \
            self._text_to_tokenize(body, keep) is not None
        return prompt_ids, params, text_cut or len(prompt_ids) < len(tokenized)

    async def _check_bad_words(self, params: SamplingParams) -> None:
        """The workers' bad_words check, as a 400 here (its min_tokens part needs the EOS ids: the
        engine's); long words tokenize off the loop, as long prompts do."""
        if sum(map(len, params.bad_words or ())) <= _INLINE_TOKENIZE_CHARS:
            bad_word_sequences(self.tokenizer, params, self.info.vocab_size)
        else:
            await anyio.to_thread.run_sync(bad_word_sequences, self.tokenizer, params, self.info.vocab_size)

    def _tokens_to_keep(self, body: CompletionRequest | ChatCompletionRequest) -> int | None:
        """vLLM's `truncate_prompt_tokens` resolved (None: no truncation); -1: as many as fit
        beside the requested output (unset: a completion's default 16 tokens, a chat's one)
        and max_prompt_tokens."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return None
        limit = self.info.max_model_len
        if keep >= limit:
            raise InvalidRequestError(f"truncate_prompt_tokens is {keep}, but this model's context is {limit} "
                                      f"tokens and the completion needs one at least; send at most {limit - 1}, "
                                      "or -1.", param="truncate_prompt_tokens")
        if keep == -1:
            wanted = body.requested_max_tokens
            if wanted is None:      # completions' default output (16), else one token at least
                wanted = max(COMPLETION_DEFAULT_MAX_TOKENS, body.min_tokens or 0) \
                    if isinstance(body, CompletionRequest) else 1
            keep = max(1, limit - max(1, wanted))
            if self.limits.max_prompt_tokens is not None:
                keep = min(keep, self.limits.max_prompt_tokens)
        return keep

    def _truncated(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                   keep: int | None) -> list[int]:
        """The prompt cut to `keep` tokens (`_tokens_to_keep`; None: not cut) from
        `body.truncation_side` (left, the default: the last tokens stay). The special tokens
        the tokenizer added around a text prompt (BOS) stay where they are, as when vLLM's
        tokenizer truncates, unless `keep` leaves no room beside them."""
        if keep is None or len(prompt_ids) <= keep:
            return prompt_ids
        head, tail = self._added_special_tokens(body, prompt_ids)
        if head + tail >= keep:
            head = tail = 0
        own = prompt_ids[head:len(prompt_ids) - tail]
        room = keep - head - tail
        kept = own[:room] if body.truncation_side == "right" else own[-room:]
        return prompt_ids[:head] + kept + prompt_ids[len(prompt_ids) - tail:]

    def _added_special_tokens(self, body: CompletionRequest | ChatCompletionRequest,
                              prompt_ids: list[int]) -> tuple[int, int]:
        """How many of `prompt_ids`' first and last tokens the tokenizer added to a text
        completion prompt ((0, 0) for token ids, a chat, or add_special_tokens false)."""
        if not (isinstance(body, CompletionRequest) and isinstance(body.prompt, str) and body.add_special_tokens):
            return 0, 0
        added = self.added_special_ids
        head = 0
        while head < min(len(added), len(prompt_ids)) and prompt_ids[head] == added[head]:
            head += 1
        tail = len(added) - head
        if tail and prompt_ids[-tail:] != added[head:]:
            tail = 0
        return head, tail

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuses, before tokenizing, text of `chars` characters that cannot fit the
        context, or this server's `max_prompt_tokens`, whatever its tokens: far more than
        those tokens could spell."""
        limit = self.info.max_model_len
        cap = self.limits.max_prompt_tokens
        # a margin for normalizers and templates that drop characters before tokens are counted
        if cap is not None and cap < limit and chars > _TEXT_MARGIN * cap * self.max_token_chars:
            raise InvalidRequestError(
                f"Your {param} has {chars} characters, far more than the {cap} tokens this server accepts "
                f"can hold. Please reduce the length of the {param}.", param=param)
        if chars > _TEXT_MARGIN * limit * self.max_token_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your {param} has "
                f"{chars} characters, far more than {limit} tokens can hold. Please reduce the length of "
                f"the {param}.", param=param)

    def _check_message_count(self, count: int, param: str) -> None:
        """Refuses, before rendering, more messages than the context could hold if
        each took no more than a token of the template's (a body of hundreds of
        thousands of empty messages would otherwise be rendered and tokenized)."""
        limit = self.info.max_model_len
        if count > _TEXT_MARGIN * limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your {param} has {count} "
                f"messages, far more than {limit} tokens can hold. Please send fewer messages.", param=param)

    def _text_to_tokenize(self, body: CompletionRequest, keep: int) -> int | None:
        """How many characters of a completion's text prompt, to be cut to `keep` tokens, are worth
        tokenizing: as many as could spell the tokens kept (None: all of it)."""
        most = _TEXT_MARGIN * keep * self.max_token_chars
        return most if isinstance(body.prompt, str) and body.text_length() > most else None

    async def _tokenize(self, body: CompletionRequest | ChatCompletionRequest | TokenizeChatRequest |
                        TokenizeCompletionRequest, param: str, keep: int | None = None) -> list[int]:
        """The prompt's token ids (a 400 naming `param` for text that cannot fit the
        context, unless it is a completion's prompt to be cut to `keep` tokens); a long
        text is tokenized off the event loop, which every stream of this router shares."""
        text_chars = body.text_length()
        num_messages = len(getattr(body, "messages", ()))
        if keep is None or not isinstance(body, CompletionRequest):  # a chat's messages are rendered whole
            self._check_text_length(text_chars, param)
            self._check_message_count(num_messages, param)
        elif (most := self._text_to_tokenize(body, keep)) is not None:
            kept = body.prompt[:most] if body.truncation_side == "right" else body.prompt[-most:]
            body = body.model_copy(update={"prompt": kept})
            text_chars = most
        if isinstance(body, CompletionRequest) and not isinstance(body.prompt, str):
            return list(body.prompt)
        # many short messages cost a template little text each but still its rendering: counted as
        # a long token's text apiece towards rendering them off the loop
        render_chars = text_chars + self.max_token_chars * num_messages
        if render_chars <= _INLINE_TOKENIZE_CHARS:
            return self._tokenize_text(body)
        return await anyio.to_thread.run_sync(self._tokenize_text, body)

    def _tokenize_text(self, body: CompletionRequest | ChatCompletionRequest | TokenizeChatRequest |
                       TokenizeCompletionRequest) -> list[int]:
        if isinstance(body, CompletionRequest | TokenizeCompletionRequest):
            try:
                return list(self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            except (TypeError, ValueError) as exc:   # e.g. text the tokenizer cannot take
                raise InvalidRequestError(f"The prompt cannot be tokenized: {exc}", param="prompt") from None
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("This model's tokenizer has no chat template, so it cannot run a "
                                      "conversation: send the prompt text to /v1/completions instead.")
        try:
            rendered = self.tokenizer.apply_chat_template(
                body.chat_messages(template_traits(tokenizer_template(self.tokenizer))),
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, tokenize=not body.add_special_tokens,
                **body.template_kwargs())
        except Exception as exc:  # noqa: BLE001 - templates refuse messages by raising anything
            _TEMPLATE_FAILURE_LOG.log("the chat template refused a request's messages (answered 400): %s: %s",
                                      type(exc).__name__, exc)
            raise InvalidRequestError(f"The chat template cannot render these messages: {exc}",
                                      param="messages") from None
        if body.add_special_tokens:      # the rendered text, with the tokenizer's own special tokens added
            try:
                return list(self.tokenizer.encode(rendered, add_special_tokens=True))
            except (TypeError, ValueError) as exc:   # e.g. a chat_template_kwargs string that is not text
                raise InvalidRequestError(f"The rendered chat cannot be tokenized: {exc}",
                                          param="chat_template_kwargs") from None
        # transformers 5 returns a BatchEncoding (a Mapping); older versions a list.
        if isinstance(rendered, Mapping):
            rendered = rendered["input_ids"]
        return [int(t) for t in rendered]

    def _check_before_tokenizing(self, offered: bool = True) -> float | None:
        """Admission control's checks that need no prompt length (router/admission.py):
        the arrival's time, to withdraw it should the request turn out invalid (None:
        not counted as an arrival, as `offered` False says of a client's retry)."""
        if self.admission is None:
            return None
        with self._counting_refusals([(None, None)], offered):
            return self.admission.check_before_tokenizing(counted=offered)

    def _admit(self, prompts: list[_PlannedPrompt], choices: int, arrived: float | None,
               offered: bool = True) -> list[list[Admitted | None]]:
        """Admission control's checks with the prompts' lengths and output bounds: each
        prompt once, each of its choices as a sequence of its own (a ticket each, with
        admission control on). All or none are admitted. arrived: _check_before_tokenizing's;
        offered: whether a refusal counts as demand (not for a client's retry)."""
        if self.admission is None:
            return [[None] * choices for _ in prompts]
        per_prompt = [(len(plan.ids), plan.max_tokens_asked) for plan in prompts]
        # each choice is a sequence to decode; the prompt is prefilled once (the others read it cached)
        demands = [(tokens if j == 0 else 0, max_tokens) for tokens, max_tokens in per_prompt for j in range(choices)]
        with self._counting_refusals(demands, offered):
            return self.admission.admit_prompts(per_prompt, choices, arrived)

    @contextmanager
    def _counting_refusals(self, demands: list[tuple[int | None, int | None]],
                           offered: bool = True) -> Iterator[None]:
        """Counts a refusal by its reason, and the refused request's `demands` (prompt
        tokens, max_tokens: one per sequence it asked for) as arrivals all the same,
        as admitted ones count; a client's retry (`offered` False) only in the refusals'
        metric, as demand was counted when it was first offered."""
        try:
            yield
        except Overloaded as exc:
            self.metrics.observe_rejection(exc.reason, offered)
            if offered:
                for num_prompt_tokens, max_tokens in demands:
                    self.metrics.observe_arrival(num_prompt_tokens, max_tokens)
            raise

    def _check_request_limits(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The server's per-request limits that need no tokenizing."""
        lim = self.limits
        requested = body.requested_max_tokens
        if lim.max_tokens is not None and requested is not None and requested > lim.max_tokens:
            raise InvalidRequestError(f"{body.max_tokens_param} is {requested}; this server allows at most "
                                      f"{lim.max_tokens}.", param=body.max_tokens_param)
        if isinstance(body, CompletionRequest) and body.is_batch and len(body.prompt) > lim.max_prompts:
            raise InvalidRequestError(f"prompt is a batch of {len(body.prompt)} prompts; this server takes at most "
                                      f"{lim.max_prompts} in one request.", param="prompt")
        if body.choices > lim.max_n:
            raise InvalidRequestError(f"n is {body.choices}; this server generates at most {lim.max_n} choices "
                                      "per request.", param="n")
        for param, logprobs in ((body.logprobs_param, body.requested_logprobs),
                                ("prompt_logprobs", body.prompt_logprobs)):
            if logprobs is not None and logprobs > lim.max_logprobs:
                raise InvalidRequestError(f"{param} is {logprobs}; this server returns at most "
                                          f"{lim.max_logprobs} alternatives per token.", param=param)
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > lim.max_stop_sequences:
            raise InvalidRequestError(f"stop has {len(stops)} sequences; this server allows at most "
                                      f"{lim.max_stop_sequences}.", param="stop")
        longest = max((len(stop) for stop in stops if isinstance(stop, str)), default=0)
        if longest > lim.max_stop_chars:
            raise InvalidRequestError(f"stop has a sequence of {longest} characters; this server allows at most "
                                      f"{lim.max_stop_chars} characters per stop sequence.", param="stop")
        for name, ids, most in (("stop_token_ids", body.stop_token_ids, lim.max_stop_token_ids),
                                ("logit_bias", body.logit_bias, lim.max_logit_bias),
                                ("allowed_token_ids", body.allowed_token_ids, lim.max_allowed_token_ids)):
            if ids is not None and len(ids) > most:
                raise InvalidRequestError(f"{name} has {len(ids)} ids; this server allows at most {most}.",
                                          param=name)
        self._check_bad_words_size(body.bad_words or [])

    def _bound_logprob_entries(self, prompts: list[_PlannedPrompt],
                               body: CompletionRequest | ChatCompletionRequest) -> None:
        """Refuses a request whose response could carry more logprob entries than the limit: for
        each prompt, its output's (max_tokens of each of n choices; not for a stream, whose chunks
        go out as they come) and its prompt's (prompt_logprobs, or echo with logprobs), counted
        for each choice, which repeats them. A chat that asks for no output bound (vLLM and OpenAI
        serve it: its bound is the context's room, which on a long-context model alone would pass
        the limit) is served with its choices' max_tokens lowered, in place, to what the limit
        leaves: it ends there with finish_reason length."""
        entries, unbounded = 0, []
        for plan in prompts:
            params = plan.choice_params[0]
            if params.logprobs is not None and not body.stream:
                if body.requested_max_tokens is None and plan.max_tokens_asked is None:
                    unbounded.append(plan)
                else:
                    entries += body.choices * params.max_tokens * (params.logprobs + 1)     # the cap sent
            if params.prompt_logprobs is not None:
                entries += body.choices * len(plan.ids) * (params.prompt_logprobs + 1)
        most = self.limits.max_logprob_entries
        per_token = body.choices * len(unbounded) * ((prompts[0].choice_params[0].logprobs or 0) + 1)
        if entries > most or (unbounded and (most - entries) // per_token < 1):
            raise InvalidRequestError(
                f"the response could carry {entries:,} logprob entries (prompts x n x tokens x (logprobs + 1)), "
                f"more than this server's {most:,}: ask for fewer alternatives, choices, prompts or max_tokens, "
                "or stream the response.",
                param=body.logprobs_param if prompts[0].choice_params[0].logprobs is not None else "prompt_logprobs")
        for plan in unbounded:
            cap = (most - entries) // per_token
            if plan.choice_params[0].max_tokens > cap:
                plan.choice_params[:] = [dataclasses.replace(p, max_tokens=cap) for p in plan.choice_params]

    def _check_bad_words_size(self, words: list[str]) -> None:
        """Refuses, before tokenizing them, bad_words longer than any output could spell, one by one
        and together (each word is tokenized on the router and on every worker; SamplingParams
        bounds how many there are)."""
        longest = _TEXT_MARGIN * self.info.max_model_len * self.max_token_chars
        for word in words:
            if len(word) > longest:
                raise InvalidRequestError(f"a bad_words entry has {len(word)} characters, more than an output "
                                          f"of this model's {self.info.max_model_len}-token context could "
                                          "contain; shorten it.", param="bad_words")
        if (total := sum(map(len, words))) > longest:
            raise InvalidRequestError(f"bad_words hold {total} characters together; this server takes at most "
                                      f"{longest} (about {_TEXT_MARGIN} times what an output of this model's "
                                      f"{self.info.max_model_len}-token context spells); send fewer or shorter "
                                      "words.", param="bad_words")

    def _check_prompt(self, ids: list[int], param: str) -> None:
        if self.limits.max_prompt_tokens is not None and len(ids) > self.limits.max_prompt_tokens:
            raise InvalidRequestError(f"The {param} has {len(ids)} tokens; this server accepts at most "
                                      f"{self.limits.max_prompt_tokens}.", param=param)
        vocab, limit = self.info.vocab_size, self.info.max_model_len
        if len(ids) >= limit:    # first: bounds the scan below
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your {param} "
                f"has {len(ids)} tokens, which leaves no room for the completion. Please reduce "
                f"the length of the {param}.", param=param)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(f"The prompt contains token id {bad}, outside the model's "
                                      f"vocabulary [0, {vocab}).", param=param)

    def _fit_to_context(self, num_prompt: int, params: SamplingParams, max_tokens_param: str,
                        prompt_param: str) -> SamplingParams:
        """`params` checked against the vocabulary and the context, as vLLM (0.32) does: a
        max_tokens past the model's context is refused; one the prompt leaves less room
        for is cut to the room left (the output then ends with finish_reason "length"),
        unless min_tokens needs more. The prompt leaves room (_check_prompt)."""
        try:
            params.validate_against_vocab(self.info.vocab_size)
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), param=exc.field) from None
        limit, room = self.info.max_model_len, self.info.max_model_len - num_prompt
        if params.max_tokens > limit:
            raise InvalidRequestError(
                f"{max_tokens_param}={params.max_tokens} cannot be greater than this model's maximum context "
                f"length of {limit} tokens. Please request fewer output tokens.", param=max_tokens_param)
        if params.min_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested at least "
                f"{num_prompt + params.min_tokens} tokens ({num_prompt} in the {prompt_param}, min_tokens "
                f"{params.min_tokens} in the completion). Please reduce the length of the {prompt_param} or "
                "min_tokens.", param="min_tokens")
        return dataclasses.replace(params, max_tokens=room) if params.max_tokens > room else params

    async def _events(self, choices: Choices, first: tuple[int, RequestOutput], fmts: list[ResponseBuilder],
                      header: dict[str, Any], include_usage: bool,
                      continuous_usage: bool = False, prompt_only: bool = False) -> AsyncIterator[str]:
        """SSE events of one stream (its choices' chunks in the order they come, choice i's
        built by fmts[i]); closes `choices` however the stream ends. `prompt_only`: the
        choices' outputs are left out (an echo alone)."""
        prompt_tokens = choices.prompt_tokens
        latest: list[RequestOutput | None] = [None] * choices.n      # each choice's latest output

        def chunk_usage(index: int) -> dict[str, Any]:
            # OpenAI sends "usage": null on every chunk but the last when usage is asked for;
            # vLLM's continuous_usage_stats, the usage so far of the chunk's choice (its own prompt's)
            if not include_usage:
                return {}
            own_prompt = choices.generations[index].timings.prompt_tokens
            return {"usage": usage(own_prompt, latest[index]) if continuous_usage else None}
        with_ids = fmts[0].prompt_token_ids is not None     # a chunk per output with token ids, even without text
        reason: str | None = "abort"   # kept if the client leaves mid-stream
        try:
            for i, choice in enumerate(fmts[0].opening_choices(choices.n)):
                yield sse_event({**header, "choices": [choice], **chunk_usage(i), **fmts[0].response_fields()})
            item, cursors = first, [ChoiceCursor() for _ in range(choices.n)]
            opened = [fmt.echo is None for fmt in fmts]      # an echo goes out in each choice's first chunk
            while item is not None:
                index, out = item
                if prompt_only:
                    out = _prompt_only(out)
                latest[index] = out
                # Skip outputs with nothing to say (text held back mid-character, no logprobs, no ids asked for).
                if out.delta_text or out.finished or out.logprobs or (with_ids and out.delta_token_ids) or \
                        not opened[index]:
                    fmt = fmts[index]
                    text, logprobs = fmt.content(out.delta_text, out, cursors[index], opening=not opened[index])
                    opened[index] = True
                    choice = fmt.chunk_choice(index, text, logprobs, out)
                    yield sse_event({**header, "choices": [choice], **chunk_usage(index)})
                if choices.all_finished:
                    break
                item = await choices.next()
            if item is None:
                raise BackendUnavailableError.public("the generation stream ended before the request finished")
            if include_usage:
                yield sse_event({**header, "choices": [], "usage": usage(prompt_tokens, *latest)})
        except Exception as exc:  # noqa: BLE001 - headers are out: report it in the stream
            reason = None
            error = from_exception(exc)
            self.metrics.observe_error(error.status)
            yield sse_event(error.body())
        finally:
            # Starlette cancels this generator's task on disconnect; the cleanup must still run.
            with anyio.CancelScope(shield=True):
                await choices.close(reason)
        yield DONE_EVENT


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` without what the request generated (an echo alone: its one token ran only to score the prompt),
    finished, if it is, on its length of 0 tokens (OpenAI's), not on what ended the discarded token."""
    finish = {"finish_reason": "length", "stop_reason": None} if out.finished else {}
    return dataclasses.replace(out, text="", token_ids=[], delta_text="", delta_token_ids=[],
                               logprobs=None if out.logprobs is None else [], num_output_tokens=0, **finish)


def _usable_request_id(header: str | None) -> str | None:
    """The X-Request-Id header as a response id, if it is one a client could mean (at most the body
    field's 256 characters, printable ASCII): every chunk of a stream repeats it."""
    if header is None or len(header) > MAX_REQUEST_ID_CHARS or not (header.isascii() and header.isprintable()):
        return None
    return header


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise _ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the work unwind before the caller closes the stream (closing a generator that
            # is still inside anext() fails), even if this coroutine is cancelled meanwhile: both
            # the watcher and Serve see a client leave, and Serve cancels the handler.
            cancelled_again = False
            while not task.done():
                try:
                    await asyncio.wait({task})
                except asyncio.CancelledError:
                    cancelled_again = True
            if cancelled_again:
                raise asyncio.CancelledError
    if task.cancelled():
        raise _ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body was already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A streaming response that always watches for a client disconnect and always
    closes its body iterator (Starlette only watches below ASGI spec 2.4 and leaves
    the iterator to the garbage collector), then awaits `on_close`: an iterator that
    never started (the response's first send failed) does not run its own clean-up."""

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the server reports a vanished client this way (ASGI 2.4)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()
