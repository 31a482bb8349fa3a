"""Offline API.

    from engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint", dtype="float32")
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

All prompts are scheduled together (continuous batching). A prompt is a string,
a list of token ids, or {"prompt_token_ids": [...]}. `LLM(..., tensor_parallel_size=N)`
shards the model over N local rank processes; `shutdown()` (or leaving a
`with LLM(...)` block, or exiting) stops them.

Streams and generate() calls may interleave on one LLM (two streams read in
turns, a generate() while a stream is open): whichever call steps the engine
keeps the other open streams' outputs for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import OutputKind, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


# vLLM LLM(...) arguments that change nothing here at these values (a script ported from vLLM passes them)
_VLLM_NO_OPS = {"trust_remote_code": (False, True), "revision": (None,), "tokenizer_revision": (None,),
                "quantization": (None,), "tokenizer_mode": ("auto",), "disable_log_stats": (False, True),
                "swap_space": None, "cpu_offload_gb": (0, 0.0), "disable_custom_all_reduce": (False, True)}


class LLM:
    def __init__(self, model: str | None = None, *, chat_template: str | None = None, **engine_options: Any):
        """`model`: a checkpoint directory (default: the built-in tiny model);
        `chat_template`: a Jinja template, or its file, in place of the tokenizer's;
        `engine_options`: EngineConfig's fields. vLLM's arguments that change nothing
        here (trust_remote_code: the architectures are pdserve's own code; revision
        None; quantization None; ...) are taken and dropped; others raise ValueError."""
        if model is None:
            from engine.tiny_model import ensure_default_model
            model = str(ensure_default_model())
        engine_options = _engine_options(engine_options)
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_options))
        self.tokenizer = self.engine.tokenizer
        if chat_template is not None:
            from engine.chat_template import read_chat_template
            self.tokenizer.chat_template = read_chat_template(chat_template)
        self._streams: dict[str, deque[RequestOutput]] = {}   # open streams' outputs not yet yielded
        from engine.model.model_config import generation_sampling_defaults
        self._recommended = generation_sampling_defaults(self.engine.config.model)   # read once

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's LLM.get_tokenizer)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling parameters uses, as vLLM's LLM does: the checkpoint's
        generation_config.json recommendations (temperature, top_p, ..., max_new_tokens as
        max_tokens) over SamplingParams' defaults."""
        return SamplingParams(**self._recommended)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Any = True, *, lora_request: Any = None, priority: Any = None
                 ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order (a text prompt's output
        carries it as `prompt`). Every request is validated before any runs, so a bad
        one raises without running the rest. `use_tqdm`: vLLM's, taken (no progress
        bar is shown); `lora_request` and `priority` only at vLLM's defaults."""
        _check_vllm_defaults(lora_request=lora_request, priority=priority)
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            if isinstance(sampling_params, Mapping):    # (iterating it would give its keys)
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, not a "
                                f"{type(sampling_params).__name__}: pass SamplingParams(**the_dict)")
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, params in zip(prompt_list, params_list):
                # only the finished outputs are wanted: no output per step
                ids.append(self.engine.add_request(None, _prompt_value(prompt), params,
                                                   output_kind=OutputKind.FINAL_ONLY))
            mine = set(ids)      # only this call's: other requests in the engine finish on their own
            while len(finished) < len(ids):
                finished.update((o.request_id, o) for o in self._step() if o.finished and o.request_id in mine)
        except BaseException:
            for request_id in ids:  # all or nothing: none of this call's prompts stays queued
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        outputs = [finished[i] for i in ids]
        for output, prompt in zip(outputs, prompt_list):
            value = _prompt_value(prompt)
            output.prompt = value if isinstance(value, str) else None
        return outputs

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Any = True, *, lora_request: Any = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or
        a list of them, rendered with the model's chat template (or `chat_template`, a
        template or its file) as the server renders them (text parts, developer
        messages: engine.chat_template.template_messages) and generated as generate()
        does; one finished output per conversation. The explicit arguments win over
        the same keys in `chat_template_kwargs`, which may not set apply_chat_template's
        other arguments (chat_template, tools, ...: the call's own). ValueError when
        there is no chat template, the template refuses a conversation, or content is
        not text."""
        from engine.chat_template import (
            TEMPLATE_ARGUMENTS,
            read_chat_template,
            template_messages,
            template_traits,
            tokenizer_template,
        )
        _check_vllm_defaults(lora_request=lora_request, tools=tools)
        explicit = {"add_generation_prompt", "continue_final_message"}
        if clashes := sorted(set(chat_template_kwargs or {}) & (TEMPLATE_ARGUMENTS - explicit)):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clashes)}: pass chat_template as "
                             "chat()'s own argument (tools and documents are not supported)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message exclude each other: the reply "
                             "either starts a new assistant message or continues the last one")
        template = read_chat_template(chat_template) if chat_template is not None else \
            tokenizer_template(self.tokenizer)
        if template is None:
            raise ValueError("this model's tokenizer has no chat template: give generate() the prompt text, "
                             "or chat() a chat_template")
        single = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        kwargs = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                  "continue_final_message": continue_final_message, "tokenize": True}
        if chat_template is not None:
            kwargs["chat_template"] = template
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                turns = template_messages(list(conversation), template_traits(template),
                                          continue_final=continue_final_message)
            except ValueError as exc:
                raise ValueError(f"conversation {i}: {exc}") from None
            try:
                rendered = self.tokenizer.apply_chat_template(turns, **kwargs)
            except Exception as exc:  # noqa: BLE001 - templates refuse conversations by raising anything
                raise ValueError(f"the chat template cannot render conversation {i}: {exc}") from None
            if isinstance(rendered, Mapping):     # transformers 5: a BatchEncoding
                rendered = rendered["input_ids"]
            prompts.append([int(t) for t in rendered])
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel rank processes, if it has any."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               output_kind: OutputKind = OutputKind.CUMULATIVE) -> Iterator[RequestOutput]:
        """Yields an output per generated chunk of one prompt; the last is finished.
        `output_kind=OutputKind.DELTA`: each output holds only what is new, at a
        cost per token that does not grow with the output. Abandoning the
        iterator aborts the request."""
        if not isinstance(output_kind, OutputKind):    # (a string was taken for CUMULATIVE: `is` comparisons)
            raise ValueError(f"output_kind must be an OutputKind ({', '.join(k.name for k in OutputKind)}), "
                             f"got {output_kind!r}")
        (prompt,) = _as_prompt_list([prompt])
        request_id = self.engine.add_request(None, _prompt_value(prompt),
                                             sampling_params or self.get_default_sampling_params(),
                                             output_kind=output_kind)
        outputs = self._streams[request_id] = deque()
        finished = False
        try:
            while not finished:
                if not outputs:
                    self._step()
                    continue
                out = outputs.popleft()
                finished = out.finished
                yield out
        finally:
            del self._streams[request_id]
            if not finished:
                self.engine.abort_request(request_id)

    def _step(self) -> list[RequestOutput]:
        """One engine step: the open streams' outputs are kept for them, the rest
        returned. Raises RuntimeError when nothing can run (the requests left wait
        for blocks that held or reserved ones keep)."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has no unfinished request: this call's requests were aborted "
                               "on the engine directly")
        others = []
        for out in self.engine.step():
            stream = self._streams.get(out.request_id)
            if stream is None:
                others.append(out)
            else:
                stream.append(out)
        self.engine.raise_if_blocked()
        return others


_PROMPT_FORMS = "a str, a list of int token ids, or {'prompt': str} / {'prompt_token_ids': [int, ...]}"


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list, one per request; ValueError naming the first one (and
    its index) that has none of the prompt forms."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]     # (a dict's ids checked below, as in a list)
    # (a numpy array or a tensor: not taken for a list of prompts; bytes are not token ids)
    elif not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be one prompt or a list of them, each {_PROMPT_FORMS}; "
                         f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(_is_token_id(t) for t in prompts):
        return [prompts]  # a single token-id prompt
    for i, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
                                       and ids is None):
            continue
        if not (isinstance(ids, list | tuple) and all(_is_token_id(t) for t in ids)):
            raise ValueError(f"prompt {i} must be {_PROMPT_FORMS}; got {type(prompt).__name__}"
                             + (f" holding {type(ids).__name__}" if isinstance(prompt, dict) else ""))
    return prompts


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig's fields of LLM(...)'s keyword arguments: vLLM's no-op ones dropped
    (kv_cache_memory_bytes as kv_cache_memory_gib); ValueError for any other."""
    import dataclasses
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kept = {}
    for name, value in options.items():
        if name in fields:
            kept[name] = value
        elif name == "kv_cache_memory_bytes" and "kv_cache_memory_gib" not in options:
            kept["kv_cache_memory_gib"] = value / (1 << 30)
        elif name in _VLLM_NO_OPS and (_VLLM_NO_OPS[name] is None or value in _VLLM_NO_OPS[name]):
            continue
        elif name in _VLLM_NO_OPS:
            raise ValueError(f"LLM({name}={value!r}) is not supported here (vLLM's argument; this engine takes "
                             f"{' or '.join(map(repr, _VLLM_NO_OPS[name]))}, which change nothing)")
        else:
            raise ValueError(f"LLM() got an unknown argument {name!r}; it takes model, chat_template and the "
                             f"engine's settings: {', '.join(sorted(fields - {'model'}))}")
    return kept


def _check_vllm_defaults(**arguments: Any) -> None:
    """vLLM's call arguments this engine has no use for, taken only at their defaults (None)."""
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name} is not supported here (no LoRA adapters, priorities or tool calling); "
                             f"leave it None")


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    return prompt
