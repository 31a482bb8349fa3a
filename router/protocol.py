"""The OpenAI request bodies pdserve accepts: /v1/completions and /v1/chat/completions.

Contracts:
- Parsing (pydantic, run by FastAPI) checks shapes and types; numbers are strict
  (`"max_tokens": "10"` or `true` is refused, not coerced). Unknown fields are
  ignored, and named in the log (the first time each is seen), as vLLM does.
- `check_supported()` raises engine.InvalidRequestError (param set) for an OpenAI
  feature pdserve does not implement (best_of > 1, suffix, response_format,
  tools, ...), saying what to send instead.
- `to_sampling_params(default_max_tokens)` builds the engine's SamplingParams
  (vLLM's extra sampling fields included); out-of-range values raise
  InvalidRequestError naming the request field. Neither method touches the tokenizer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.chat_template import (
    TEMPLATE_ARGUMENTS,
    TEXT_PARTS,
    TemplateTraits,
    is_text_part,
    part_text,
    template_messages,
)
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

# Strict: a JSON int is a valid float, but a string or a bool is not.
StrictNumber = Annotated[float, Field(strict=True)]
# >= 0 here; the engine's bound, 2 (vLLM's and OpenAI's), applies after with its own message
Temperature = Annotated[float, Field(strict=True, ge=0)]


def _whole_number(value: Any) -> Any:
    """A float with no fraction (16.0, as some clients write every number) as the int it is;
    anything else as given (a string, a bool, 16.5 stay refused)."""
    return int(value) if type(value) is float and value.is_integer() else value


# a count or a seed: within 64 bits (a max_tokens of thousands of digits made the context check's
# own message fail: a 500); 16.0 is 16, as vLLM takes it
Int64 = Annotated[int, BeforeValidator(_whole_number), Field(strict=True, ge=-(2**63), le=2**63 - 1)]


def _shape_error(message: str) -> PydanticCustomError:
    # A custom error type keeps the message free of pydantic's "Value error, " prefix.
    return PydanticCustomError("invalid_shape", message)


def _is_token_ids(value: object) -> bool:
    """A list of ints (bools are not token ids). One pass in C, not a Python loop per
    item: a body of millions of ids must not hold the router's event loop for seconds."""
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _whole_list(value: object, fits: Callable[[list], bool], what: str) -> object:
    """`value` unchanged, or one error for the whole list when `fits` refuses it:
    pydantic's own checks would give one error per bad item, and a body of millions
    of them held the router's loop for seconds and gigabytes of error records."""
    if isinstance(value, list) and not fits(value):
        raise _shape_error(f"must be {what}")
    return value


def _string_chars(value: object) -> int:
    """Characters in every string within `value` (nested lists and dicts, keys too).
    Walked with a stack, not recursion: JSON nested hundreds of levels deep parses,
    and must not overflow Python's stack here."""
    chars, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return chars


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False       # OpenAI's and vLLM's (0.32) default
    continuous_usage_stats: StrictBool | None = False   # vLLM's: with include_usage, usage on every chunk


_UNSUPPORTED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                           "logits_processors",
                           "use_beam_search", "cache_salt", "structural_tag",
                           # vLLM's that change the output (scores of given tokens, an early stop): not ignored
                           "logprob_token_ids", "repetition_detection")


_ignored_fields_logged: set[tuple[str, str]] = set()     # (request model, field)
_MAX_IGNORED_FIELDS_LOGGED = 256      # then no more: clients inventing names must not grow the set for ever
_MAX_LOGGED_NAME_CHARS = 64


def _log_ignored_fields(model: type[BaseModel], data: object) -> None:
    """Names, once per request model and field name, a request field this server does not know and so ignores."""
    room = _MAX_IGNORED_FIELDS_LOGGED - len(_ignored_fields_logged)
    if not isinstance(data, dict) or room <= 0:
        return
    # names as the log shows them: cut short and quoted (a client's key may be megabytes, or hold newlines)
    new = sorted({repr(str(k)[:_MAX_LOGGED_NAME_CHARS]) for k in data if k not in model.model_fields}
                 - {f for m, f in _ignored_fields_logged if m == model.__name__})[:room]
    if new:
        _ignored_fields_logged.update((model.__name__, k) for k in new)
        log.warning("%s: ignoring request field(s) this server does not know: %s (logged once each)",
                    model.__name__, ", ".join(new))


_SURROGATE = re.compile("[\ud800-\udfff]")
# messages in one chat: far past what any context holds (each renders to several tokens)
MAX_MESSAGES = 16384
MAX_REQUEST_ID_CHARS = 256      # a client's id for its request (the body's request_id, or X-Request-Id)


def _valid_text(value: object) -> object:
    """A string (or each string of a list) without lone UTF-16 surrogates, which
    JSON can carry but no UTF-8 tokenizer or response can."""
    for text in value if isinstance(value, list) else [value]:
        found = _SURROGATE.search(text) if isinstance(text, str) else None
        if found:
            raise _shape_error(f"has a lone UTF-16 surrogate (U+{ord(found.group()):04X}) at character "
                               f"{found.start()}, which is not text; send the character it belongs to")
    return value


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None           # None = the served model
    max_tokens: Int64 | None = None      # None: completions 16, chat the rest of the context window
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name; wins over max_tokens
    temperature: Temperature | None = None
    top_p: StrictNumber | None = None
    top_k: Int64 | None = None
    min_p: StrictNumber | None = None
    repetition_penalty: StrictNumber | None = None
    presence_penalty: StrictNumber | None = None
    frequency_penalty: StrictNumber | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: Int64 | None = None
    skip_special_tokens: StrictBool | None = None
    n: Int64 | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None     # token id (a string in JSON) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None   # vLLM's: only these may be sampled
    include_stop_str_in_output: StrictBool | None = None   # vLLM's: the stop string that ended it, kept
    user: StrictStr | None = None            # accepted and ignored
    # vLLM's: the response's id (`{prefix}-{request_id}`), which every chunk of a stream repeats
    request_id: Annotated[str, Field(strict=True, max_length=MAX_REQUEST_ID_CHARS)] | None = None
    return_token_ids: StrictBool | None = None   # vLLM's: the prompt's and the output's token ids too
    priority: Int64 | None = None            # vLLM's priority scheduling: only 0 (there is none)
    # vLLM's; either value decodes the same: the fast (Rust) tokenizers' decoders, and transformers 5's
    # SentencePiece ones, never put spaces between special tokens
    spaces_between_special_tokens: StrictBool | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    # vLLM's extensions that would change the output: refused (check_supported), not ignored
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    bad_words: list[StrictStr] | None = None     # vLLM's: words the output may not contain
    logits_processors: Any = None
    prompt_logprobs: Int64 | None = None    # vLLM's: each prompt token's logprob and this many alternatives
    use_beam_search: Any = None
    truncate_prompt_tokens: Int64 | None = None   # vLLM's: keep this many prompt tokens (-1: as many as fit)
    truncation_side: Literal["left", "right"] | None = None   # left (default): keep the last ones
    return_tokens_as_token_ids: StrictBool | None = None   # vLLM's: logprobs name tokens `token_id:ID`
    cache_salt: Any = None
    structural_tag: Any = None
    logprob_token_ids: Any = None          # vLLM's: refused (_UNSUPPORTED_EXTENSIONS)
    repetition_detection: Any = None       # vLLM's: refused (_UNSUPPORTED_EXTENSIONS)

    @model_validator(mode="before")
    @classmethod
    def _note_ignored_fields(cls, data: object) -> object:
        _log_ignored_fields(cls, data)
        return data

    @field_validator("model", "user", "stop", "request_id", "bad_words")
    @classmethod
    def _shared_text(cls, value: object) -> object:
        return _valid_text(value)

    @field_validator("stop_token_ids", "allowed_token_ids", mode="before")
    @classmethod
    def _token_id_list(cls, value: object) -> object:
        return _whole_list(value, _is_token_ids, "a list of token ids (integers)")

    @field_validator("bad_words", mode="before")
    @classmethod
    def _word_list(cls, value: object) -> object:
        return _whole_list(value, lambda words: all(isinstance(w, str) for w in words), "a list of strings")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: object) -> object:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise _shape_error("must be a string or a list of strings")

    def text_length(self) -> int:
        """Characters of prompt text the request carries (0 for token ids)."""
        raise NotImplementedError

    @property
    def choices(self) -> int:
        """How many choices to generate (n)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM's continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The request field that set max_tokens (named in errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top alternatives to return, None = no logprobs."""
        return None

    def _prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: alternatives per prompt token, None = the prompt is not scored."""
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """The response is the prompt alone (completions' echo with max_tokens 0)."""
        return False

    @property
    def requested_logprobs(self) -> int | None:
        """How many alternatives per token the request asks for (None: no logprobs)."""
        return self._logprobs()

    @property
    def logprobs_param(self) -> str:
        return self._api_name("logprobs")

    def check_supported(self) -> None:
        """Raise InvalidRequestError for a feature pdserve does not implement."""
        if self.n is not None and self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}.", param="n")
        if self.response_format is not None and not (
                isinstance(self.response_format, dict) and self.response_format.get("type") == "text"):
            raise InvalidRequestError("response_format (JSON mode, structured output) is not "
                                      "supported; remove it.", param="response_format")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} (tool calling) is not supported; remove it.",
                                          param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise InvalidRequestError(f"{name} is not supported (no tool calling); remove it.",
                                          param=name)
        for name in _UNSUPPORTED_EXTENSIONS:
            value = getattr(self, name)
            if value is not None and value is not False:    # 0 too: set at all, it asks for the feature
                raise InvalidRequestError(f"{name} is not supported by this server; remove it.", param=name)
        # ({} sets nothing: taken without a stream, as vLLM takes it)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true.",
                                      param="stream_options")
        if self.priority:
            raise InvalidRequestError(f"priority must be 0 (got {self.priority}): this server schedules "
                                      "requests first come, first served. Remove it.", param="priority")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be at least 1 (or -1: as many as the context "
                                      f"holds with one token for the output), got {self.truncate_prompt_tokens}.",
                                      param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs} (-1, the "
                                      "whole vocabulary, is not supported).", param="prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not available when stream is true; send the request "
                                      "without stream, or remove prompt_logprobs.", param="prompt_logprobs")

    def to_sampling_params(self, default_max_tokens: int,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams; `default_max_tokens` stands in for an unset
        max_tokens, `defaults` (the model's generation_config.json settings) for
        other unset fields."""
        max_tokens = self.requested_max_tokens
        if self.echo_only:
            max_tokens = 1        # the prompt's logprobs come with the first token, which is not returned
        kwargs: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "logprobs": self._logprobs(),
            "prompt_logprobs": self._prompt_logprobs(),
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "min_tokens", "skip_special_tokens", "logit_bias", "allowed_token_ids",
                     "include_stop_str_in_output", "bad_words"):
            value = getattr(self, name)
            if value is None:   # unset: the model's recommendation, else the engine's default
                value = (defaults or {}).get(name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), param=self._param_for(exc.field, kwargs)) from None

    def _param_for(self, field: str, fields: dict[str, Any]) -> str | None:
        """The request field that set the sampling field `field` (None: none of `fields` did)."""
        if field not in fields:
            return None
        return self.max_tokens_param if field == "max_tokens" else self._api_name(field)

    def _api_name(self, sampling_field: str) -> str:
        return sampling_field


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is normalised to one str or one list of token ids,
    or, for a batch (OpenAI's and vLLM's list of prompts), a list of two or more of
    those; `prompts()` splits a batch into one request per prompt."""

    prompt: str | list[StrictInt] | list[str | list[StrictInt]]
    logprobs: Int64 | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: Int64 | None = None
    add_special_tokens: StrictBool = True    # vLLM: prepend BOS etc. to a text prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: object) -> object:
        shape = _shape_error("must be a string, a list of token ids, or a list of those (a batch)")
        if isinstance(value, list) and value and not isinstance(value[0], int):
            # A list of prompts: text prompts or token-id prompts.
            if not all(isinstance(p, str) or _is_token_ids(p) for p in value):
                raise shape
            if len(value) == 1:
                value = value[0]
            elif not all(value):
                raise _shape_error(f"prompt {value.index(next(p for p in value if not p))} of the batch is "
                                   "empty; send at least one character or token id in each")
            else:
                return value
        elif not (isinstance(value, str) or _is_token_ids(value)):
            raise shape
        if not value:
            raise _shape_error("empty prompt; send at least one character or token id")
        return value

    @property
    def is_batch(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    def prompts(self) -> list["CompletionRequest"]:
        """One request per prompt of a batch (in order); [self] for one prompt."""
        if not self.is_batch:
            return [self]
        return [self.model_copy(update={"prompt": prompt}) for prompt in self.prompt]

    @field_validator("prompt", "suffix")
    @classmethod
    def _prompt_text(cls, value: object) -> object:
        if isinstance(value, str) or (isinstance(value, list) and value and not isinstance(value[0], int)):
            return _valid_text(value)       # one text, or each text of a batch
        return value                        # token ids: checked by their type

    def text_length(self) -> int:
        """Characters of text prompt (a batch's together)."""
        if self.is_batch:
            return sum(len(p) for p in self.prompt if isinstance(p, str))
        return len(self.prompt) if isinstance(self.prompt, str) else 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < 1:
            raise InvalidRequestError(f"best_of must be 1, got {self.best_of}.", param="best_of")
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequestError(f"best_of > 1 is not supported (got best_of={self.best_of}); "
                                      "send one request per candidate.", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix (insertion) is not supported; remove it.",
                                      param="suffix")

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs: the echoed prompt's tokens are scored as the output's are (vLLM's rule)
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.requested_max_tokens == 0


class ChatMessage(BaseModel):
    """One chat turn. List-of-parts content (text parts; an assistant's refusal parts as
    their text) is joined into one string, its parts kept for templates that loop over
    them (chat_messages)."""

    model_config = ConfigDict(extra="ignore")

    # developer: OpenAI's newer name for system; tool / function: refused with a word on tool calling
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | None = None
    content_parts: list[str] | None = None   # the parts' texts, where content came as a list (set here, never sent)
    name: StrictStr | None = None            # passed to the chat template, which may show it
    reasoning: StrictStr | None = None       # an assistant turn's reasoning, passed to the template (vLLM's)
    tool_calls: Any = None                   # refused when set (no tool calling)
    function_call: Any = None

    @model_validator(mode="before")
    @classmethod
    def _keep_parts(cls, data: object) -> object:
        if isinstance(data, dict):
            content = data.get("content")
            parts = [part_text(p) for p in content] if isinstance(content, list) else None
            data = {**data, "content_parts": parts if parts is None or all(isinstance(t, str) for t in parts)
                    else None}      # (a malformed part is refused by the content's own check)
        return data

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, value: object) -> object:
        # (tool and function pass here to be refused as tool calling; the message names the roles served)
        if value not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise _shape_error(f"must be 'system', 'developer', 'user' or 'assistant' (got {value!r:.80})")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: object) -> object:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise _shape_error("must be a string or a list of text parts")
        texts = []
        for part in value:
            if not is_text_part(part):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _shape_error(f"only text content parts are supported (got {kind!r}); "
                                   "send {\"type\": \"text\", \"text\": ...}")
            if not isinstance(part_text(part), str):
                raise _shape_error(f"a {part['type']} content part needs a string \"{TEXT_PARTS[part['type']]}\" "
                                   "field")
            texts.append(part_text(part))
        # Templates written for plain-string content get the parts joined, as vLLM does.
        return "\n".join(texts)

    @field_validator("content", "name", "reasoning")
    @classmethod
    def _message_text(cls, value: object) -> object:
        return _valid_text(value)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # Only an assistant turn may omit content (OpenAI allows it next to tool calls).
        if self.content is None and self.role != "assistant":
            raise _shape_error(f"content is required in a {self.role} message")
        return self


class _ChatPrompt(BaseModel):
    """A conversation and how the model's chat template renders it into the prompt
    (the chat endpoint's and /tokenize's)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False   # vLLM: the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM: extra variables for the template
    # vLLM's: passed to the template, which with enable_thinking (set from it, unless chat_template_kwargs
    # sets it) turns a reasoning model's thinking on or off
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    add_special_tokens: StrictBool = False   # vLLM: BOS etc. on top of what the template adds
    # what vLLM passes to the template and this server does not render: refused (check_rendering), so that
    # /tokenize does not count a prompt without them that the chat endpoint would refuse
    tools: Any = None
    tool_choice: Any = None
    documents: Any = None                    # vLLM's documents for the chat template (RAG)
    chat_template: Any = None                # a template of its own

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough_messages(cls, value: object) -> object:
        # before each message is checked: one error for a list past any context, not one per message
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise _shape_error(f"has {len(value)} messages; this server takes at most {MAX_MESSAGES}")
        return _whole_list(value, lambda items: all(isinstance(m, dict) for m in items),
                           "a list of message objects")

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise _shape_error("no messages; send at least one")
        return value

    @property
    def reply_role(self) -> str:
        """The reply's role: the assistant's, or with add_generation_prompt false the last
        message's, which the reply continues (vLLM's)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def text_length(self) -> int:
        """The messages' text and every string the template may render besides
        (names, chat_template_kwargs: a template can print any of them)."""
        return sum(len(m.content or "") + len(m.name or "") + len(m.reasoning or "") for m in self.messages) + \
            _string_chars(self.chat_template_kwargs)

    def check_rendering(self) -> None:
        """Raise InvalidRequestError for settings the template cannot render."""
        if self.tools:
            raise InvalidRequestError("tools (tool calling) is not supported; remove it.", param="tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported (no tool calling); remove it.",
                                      param="tool_choice")
        if self.documents:
            raise InvalidRequestError("documents is not supported: this server does not pass documents to the "
                                      "chat template. Put them in the messages, or remove documents.",
                                      param="documents")
        if self.chat_template is not None:
            raise InvalidRequestError("chat_template is not supported: this server renders every conversation "
                                      "with the model's own template. Remove it.", param="chat_template")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: "
                                      "set add_generation_prompt to false.", param="continue_final_message")
        clashes = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if clashes:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clashes)}: use the request "
                                      "fields for these.", param="chat_template_kwargs")
        for i, message in enumerate(self.messages):
            if message.role in ("tool", "function"):
                raise InvalidRequestError(f"messages[{i}] is a {message.role} message (a tool's result); tool "
                                          "calling is not supported, so a conversation with tool calls cannot be "
                                          "continued. Remove it, or send its text as a user message.",
                                          param=f"messages[{i}].role")
            for name in ("tool_calls", "function_call"):
                if getattr(message, name):
                    raise InvalidRequestError(f"messages[{i}] carries {name}; tool calling is not supported, so "
                                              "a conversation with tool calls cannot be continued. Remove them.",
                                              param=f"messages[{i}].{name}")

    def chat_messages(self, traits: TemplateTraits = TemplateTraits()) -> list[dict[str, Any]]:
        """Messages as a chat template of `traits` takes them (engine.chat_template's
        template_messages: vLLM's rendering), with `name` where the message has one and
        an assistant's `reasoning`."""
        return template_messages([
            {"role": m.role,
             "content": m.content if m.content_parts is None else [{"type": "text", "text": t}
                                                                   for t in m.content_parts],
             **({"name": m.name} if m.name is not None else {}),
             **({"reasoning": m.reasoning} if m.reasoning is not None and m.role == "assistant" else {})}
            for m in self.messages], traits, continue_final=self.continue_final_message)

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables: chat_template_kwargs, and reasoning_effort where
        given, with enable_thinking from it (off for "none") unless chat_template_kwargs sets it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs


class ChatCompletionRequest(_ChatPrompt, _GenerationRequest):
    """POST /v1/chat/completions."""

    logprobs: StrictBool | None = False
    top_logprobs: Int64 | None = None
    echo: StrictBool | None = False          # vLLM's: the reply starts with the last message, if it is the assistant's
    best_of: Any = None                      # > 1: refused

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}.",
                                      param="top_logprobs")
        if self.top_logprobs and not self.logprobs:     # 0 asks for nothing (vLLM takes it too)
            raise InvalidRequestError("top_logprobs requires logprobs=true.", param="top_logprobs")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of > 1 is not supported; send one request per candidate.",
                                      param="best_of")
        self.check_rendering()

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs (vLLM's rule): the prompt is scored as the reply's tokens are
        if self.prompt_logprobs is None and self.echo and self.logprobs and not self.stream:
            return self.top_logprobs or 0          # (a stream does not carry them)
        return self.prompt_logprobs

    def _api_name(self, sampling_field: str) -> str:
        return "top_logprobs" if sampling_field == "logprobs" else sampling_field


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's): its token ids as /v1/completions would take them."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: str) -> str:
        return _valid_text(value)

    def text_length(self) -> int:
        return len(self.prompt)


class TokenizeChatRequest(_ChatPrompt):
    """POST /tokenize with messages (vLLM's): the prompt /v1/chat/completions would run."""

    model: StrictStr | None = None
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): the text of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_id_list(cls, value: object) -> object:
        return _whole_list(value, _is_token_ids, "a list of token ids (integers)")
