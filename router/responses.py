"""How engine outputs become OpenAI response bodies and SSE stream chunks.

One `ResponseBuilder` per request, by endpoint: `CompletionResponses`
(/v1/completions, "text_completion") and `ChatResponses` (/v1/chat/completions,
"chat.completion" and "chat.completion.chunk"). They build the `choices` entries
(one per choice index, `n` of them) and the logprobs objects; the envelope (id,
created, model, usage) is the caller's.

Given the prompt's token ids (vLLM's `return_token_ids`), the bodies carry them
as vLLM's do: chat in the response's (a stream's first chunk's)
`prompt_token_ids`, completions in each choice's (a stream's first content
chunk of each choice); and every choice its output's `token_ids` (a chunk: the
new ones).

Token strings in logprobs are each token's text after a fixed one-token context
(decoded alone, a SentencePiece tokenizer drops a word's leading space, and the
strings would not spell the completion nor `text_offset` point into it);
`bytes` is that string's UTF-8 (a token that ends mid-character shows U+FFFD,
as in vLLM). `text_offset` is the running sum of the strings' lengths (vLLM's):
past a special token the completion skips, or a character split across tokens,
it no longer points exactly into the text. Logprobs are floored at -9999
because JSON has no -inf.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import Any

from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs

DONE_EVENT = "data: [DONE]\n\n"
# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_LOGPROB_FLOOR = -9999.0


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt: int, *outs: RequestOutput | None) -> dict[str, int]:
    """The prompt counted once, the completion tokens of every choice (`outs`, None: none yet)."""
    completion = sum(out.num_output_tokens for out in outs if out is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finite(logprob: float) -> float:
    if math.isnan(logprob) or logprob < _LOGPROB_FLOOR:
        return _LOGPROB_FLOOR
    return logprob


class TokenTexts:
    """Each token's text after other text, decoded once per token (shared by a
    server's requests)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:]                     # a context token, [] where "a" has none
        self._anchor_text = tokenizer.decode(self._anchor)

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            after = self.tokenizer.decode(self._anchor + [token_id])
            text = after[len(self._anchor_text):] if after.startswith(self._anchor_text) else \
                self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text


class ResponseBuilder(ABC):
    """What the two endpoints' bodies differ in."""

    object: str              # of a whole response
    chunk_object: str        # of a stream chunk

    def __init__(self, token_text: TokenTexts, prompt_token_ids: list[int] | None = None):
        """`prompt_token_ids`: set when the request asked for token ids (return_token_ids)."""
        self.token_text = token_text
        self.prompt_token_ids = prompt_token_ids

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any text, for choices 0..n-1."""
        return []

    def response_fields(self) -> dict[str, Any]:
        """Fields beside `choices` in a whole response and in a stream's first chunk."""
        return {}

    def _output_ids(self, token_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": token_ids} if self.prompt_token_ids is not None else {}

    @abstractmethod
    def choice(self, index: int, text: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        """Choice `index`'s entry of `choices` in a whole response."""

    @abstractmethod
    def chunk_choice(self, index: int, delta: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        """The one entry of `choices` in a stream chunk carrying choice `index`'s `delta`."""

    @abstractmethod
    def logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> tuple[dict, int]:
        """(the logprobs object for `entries`, the completion-text offset after them)."""


class CompletionResponses(ResponseBuilder):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenTexts, prompt_token_ids: list[int] | None = None):
        super().__init__(token_text, prompt_token_ids)
        self._prompt_ids_sent: set[int] = set()     # the choices whose entry carried them already

    def choice(self, index: int, text: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, **self._token_ids(index, out.token_ids)}

    def chunk_choice(self, index: int, delta: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, **self._token_ids(index, out.delta_token_ids)}

    def _token_ids(self, index: int, output_ids: list[int]) -> dict[str, Any]:
        """The prompt's ids in each choice's first entry that carries ids, the output's in each."""
        if self.prompt_token_ids is None:
            return {}
        prompt = None if index in self._prompt_ids_sent else self.prompt_token_ids
        self._prompt_ids_sent.add(index)
        return {"prompt_token_ids": prompt, "token_ids": output_ids}

    def logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> tuple[dict, int]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            text = self.token_text(entry.token_id)
            alternatives = {self.token_text(t): _finite(lp) for t, lp in entry.top}
            alternatives.setdefault(text, _finite(entry.logprob))  # the sampled one is always listed
            tokens.append(text)
            token_logprobs.append(_finite(entry.logprob))
            top.append(alternatives)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}, text_offset


class ChatResponses(ResponseBuilder):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None, "stop_reason": None} for i in range(n)]

    def response_fields(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids is not None else {}

    def choice(self, index: int, text: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, **self._output_ids(out.token_ids)}

    def chunk_choice(self, index: int, delta: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                **self._output_ids(out.delta_token_ids)}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> tuple[dict, int]:
        content = [{**self._entry(e.token_id, e.logprob),
                    "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content}, text_offset
