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

With `echo`, a response starts with the prompt (completions: its text, and
with logprobs the prompt's tokens lead the logprobs object, the first without
a logprob, as in OpenAI's legacy API) or the last message where that is the
assistant's (chat, vLLM's). `prompt_logprobs` (vLLM's) are listed as vLLM
lists them: per prompt token, None for the first, else token id -> logprob,
rank and decoded text, for the prompt's token and the best alternatives.

Token strings in logprobs are each token's text after a fixed one-token context
(decoded alone, a SentencePiece tokenizer drops a word's leading space, and the
strings would not spell the completion nor `text_offset` point into it). A
token that holds part of a character (decoded alone it shows U+FFFD) shows ""
while the character is still incomplete, and the token that completes it the
text the tokens since the last complete character make, as vLLM's incremental
detokenizer emits it: the sampled tokens' strings spell the text, and
alternatives that complete different characters stay apart. Each choice
keeps its place (`ChoiceCursor`: its text offset, its last tokens and those of
a character not yet complete) across a stream's chunks.
`bytes` is the string's UTF-8, but for a token that holds part of a character
the bytes its vocabulary entry stands for, so that a client can join them into
the character (OpenAI's purpose for it). `text_offset` is the running sum of
the strings' lengths (vLLM's): past a special token the completion skips, it
no longer points exactly into the text. Logprobs are floored at -9999 because
JSON has no -inf.
"""

from __future__ import annotations

import json
import math
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs

DONE_EVENT = "data: [DONE]\n\n"
# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_LOGPROB_FLOOR = -9999.0
# Tokens of settled text a token's text is decoded after (a SentencePiece word keeps its space).
_CONTEXT_TOKENS = 4
# Tokens held as "" while their text ends in an incomplete character; past this many their text
# goes out as it decodes, U+FFFD included (bytes that never form a character), as the detokenizer's.
_MAX_PENDING = 8


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
        self._bytes: dict[int, list[int]] = {}
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self.anchor = anchor[-1:]          # a first token's context token, [] where "a" has none
        self._anchor_text = self.decode(self.anchor)

    def decode(self, ids: list[int]) -> str:
        # without the clean-up of tokenization spaces, as the streamed text (engine/detokenizer.py)
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            after = self.decode(self.anchor + [token_id])
            text = after[len(self._anchor_text):] if after.startswith(self._anchor_text) else \
                self.decode([token_id])
            self._texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's bytes (chat logprobs' `bytes`, from which a client rebuilds a character split
        across tokens): its text's UTF-8, but for a token that holds part of a character (its text
        shows U+FFFD) the bytes its vocabulary entry stands for: a SentencePiece byte-fallback
        piece `<0xNN>`, or a byte-level BPE piece (each character one byte)."""
        found = self._bytes.get(token_id)
        if found is None:
            text = self(token_id)
            found = list(text.encode("utf-8"))
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):
                    found = [int(byte[1], 16)]
                elif isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
                    found = [_BYTE_OF_CHAR[c] for c in piece]
            self._bytes[token_id] = found
        return found


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the alphabet byte-level BPE vocabularies (GPT-2's, Llama 3's, Qwen's)
    are written in: printable bytes stand for themselves, the others for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass(slots=True)
class ChoiceCursor:
    """Where one choice's logprobs stand: the completion-text offset after its tokens so far,
    its last tokens whose text is out, and the tokens after them that hold part of a character
    not yet complete (their strings were "")."""
    text_offset: int = 0
    context: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    def _text_of(self, token_id: int, texts: TokenTexts) -> tuple[str, bool]:
        """(the text `token_id` adds here, whether that text is out: False while it ends in an
        incomplete character, its text "")."""
        if not self.pending:
            own = texts(token_id)
            if "\ufffd" not in own:
                return own, True
        context = self.context or texts.anchor
        before = texts.decode(context)
        whole = texts.decode(context + self.pending + [token_id])
        if whole.endswith("\ufffd") and len(self.pending) + 1 < _MAX_PENDING:
            return "", False
        return whole[len(os.path.commonprefix([before, whole])):], True

    def label(self, token_id: int, texts: TokenTexts) -> str:
        """The string of `token_id` were it next (an alternative's); the cursor stays."""
        return self._text_of(token_id, texts)[0]

    def take(self, token_id: int, texts: TokenTexts) -> str:
        """The string of `token_id`, next in the sequence; moves past it."""
        text, out = self._text_of(token_id, texts)
        if out:
            self.context = [*self.context, *self.pending, token_id][-_CONTEXT_TOKENS:]
            self.pending = []
        else:
            self.pending.append(token_id)
        self.text_offset += len(text)
        return text


@dataclass(frozen=True, slots=True)
class Echo:
    """What every choice's text starts with."""
    text: str
    prompt_token_ids: list[int]      # completions: the prompt's, whose logprobs lead a choice's


def token_id_label(token_id: int) -> str:
    """A token named by its id, as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token_id}"


class ResponseBuilder(ABC):
    """What the two endpoints' bodies differ in."""

    object: str              # of a whole response
    chunk_object: str        # of a stream chunk

    def __init__(self, token_text: TokenTexts, prompt_token_ids: list[int] | None = None,
                 echo: Echo | None = None, tokens_as_ids: bool = False):
        """`prompt_token_ids`: set when the request asked for token ids (return_token_ids).
        `tokens_as_ids` (vLLM's return_tokens_as_token_ids): logprobs name each token
        `token_id:ID` instead of by its text."""
        self.token_text = token_text
        self.prompt_token_ids = prompt_token_ids
        self.echo = echo
        self.tokens_as_ids = tokens_as_ids

    def token_label(self, token_id: int, cursor: ChoiceCursor) -> str:
        """How logprobs name `token_id` were it next after `cursor` (an alternative's; the cursor stays)."""
        return token_id_label(token_id) if self.tokens_as_ids else cursor.label(token_id, self.token_text)

    def take_token(self, token_id: int, cursor: ChoiceCursor) -> str:
        """How logprobs name `token_id`, next after `cursor`; moves the cursor past it."""
        if not self.tokens_as_ids:
            return cursor.take(token_id, self.token_text)
        label = token_id_label(token_id)
        cursor.text_offset += len(label)
        return label

    def content(self, text: str, out: RequestOutput, cursor: ChoiceCursor,
                opening: bool) -> tuple[str, dict | None]:
        """A choice's text and its logprobs object (None: not asked for), for `out`
        whose new text is `text`; `cursor`, the choice's place, moves past its tokens.
        `opening`: the choice's first entry (a whole response's, a stream's first
        chunk of it), which the echo leads."""
        logprobs = None
        if out.logprobs is not None:
            logprobs = self.logprobs(out.logprobs, cursor)
        if opening and self.echo is not None:
            text = self.echo.text + text
        return text, logprobs

    def prompt_logprobs(self, prompt_token_ids: list[int],
                        entries: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: one per prompt token, None where it has none."""
        cursor = ChoiceCursor()     # through the prompt: a token's text after those before it

        def listed(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": _finite(logprob), "rank": rank, "decoded_token": cursor.label(token_id, self.token_text)}

        out: list[dict[str, Any] | None] = []
        for prompt_token, entry in zip(prompt_token_ids, entries):
            scored = None
            if entry is not None:
                scored = {str(entry.token_id): listed(entry.token_id, entry.logprob, entry.rank)}
                for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                    scored.setdefault(str(token_id), listed(token_id, logprob, rank))
            out.append(scored)
            cursor.take(prompt_token, self.token_text)
        return out

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
    def logprobs(self, entries: list[TokenLogprobs], cursor: ChoiceCursor) -> dict:
        """The logprobs object for `entries`, which follow `cursor`; moves it past them."""


class CompletionResponses(ResponseBuilder):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: TokenTexts, prompt_token_ids: list[int] | None = None,
                 echo: Echo | None = None, tokens_as_ids: bool = False):
        super().__init__(token_text, prompt_token_ids, echo, tokens_as_ids)
        self._prompt_ids_sent: set[int] = set()     # the choices whose entry carried them already

    def choice(self, index: int, text: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        scored = {} if out.prompt_logprobs is None else \
            {"prompt_logprobs": self.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs)}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, **self._token_ids(index, out.token_ids), **scored}

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

    def logprobs(self, entries: list[TokenLogprobs | None], cursor: ChoiceCursor,
                 token_ids: list[int] | None = None) -> dict:
        """`token_ids`: the entries' tokens, needed where an entry is None (the
        echoed prompt's first token, which has no logprob)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for i, entry in enumerate(entries):
            token_id = entry.token_id if entry is not None else token_ids[i]
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                # the sampled token's own logprob under its text, then the best first: tokens whose texts
                # coincide (first bytes of characters, all "") keep the better one, not the last one
                alternatives = {self.token_label(token_id, cursor): _finite(entry.logprob)}
                for t, lp in entry.top:
                    alternatives.setdefault(self.token_label(t, cursor), _finite(lp))
                token_logprobs.append(_finite(entry.logprob))
                top.append(alternatives)
            offsets.append(cursor.text_offset)
            tokens.append(self.take_token(token_id, cursor))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def content(self, text: str, out: RequestOutput, cursor: ChoiceCursor,
                opening: bool) -> tuple[str, dict | None]:
        echo = self.echo if opening else None
        if echo is None or out.logprobs is None:
            return super().content(text, out, cursor, opening)
        if out.prompt_logprobs is None:
            raise RuntimeError("an echo with logprobs needs the prompt's logprobs on the choice's first output")
        entries = [*out.prompt_logprobs, *out.logprobs]
        logprobs = self.logprobs(entries, cursor, [*echo.prompt_token_ids, *out.token_ids])
        return echo.text + text, logprobs


class ChatResponses(ResponseBuilder):
    """`role`: the reply's (the assistant's, or with add_generation_prompt false the last
    message's, whose continuation it is: vLLM's)."""
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: TokenTexts, prompt_token_ids: list[int] | None = None,
                 echo: Echo | None = None, tokens_as_ids: bool = False, role: str = "assistant"):
        super().__init__(token_text, prompt_token_ids, echo, tokens_as_ids)
        self.role = role

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                 "finish_reason": None, "stop_reason": None} for i in range(n)]

    def response_fields(self) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids is not None else {}

    def choice(self, index: int, text: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": self.role, "content": text},
                "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, **self._output_ids(out.token_ids)}

    def chunk_choice(self, index: int, delta: str, logprobs: dict | None, out: RequestOutput) -> dict[str, Any]:
        # (an empty last delta too, as vLLM's: clients that join delta.content need a string)
        return {"index": index, "delta": {"content": delta}, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                **self._output_ids(out.delta_token_ids)}

    def _entry(self, token_id: int, logprob: float, text: str) -> dict[str, Any]:
        raw = list(text.encode("utf-8")) if self.tokens_as_ids else self.token_text.token_bytes(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def logprobs(self, entries: list[TokenLogprobs], cursor: ChoiceCursor) -> dict:
        content = []
        for e in entries:
            top = [self._entry(t, lp, self.token_label(t, cursor)) for t, lp in e.top]
            token = self.take_token(e.token_id, cursor)
            content.append({**self._entry(e.token_id, e.logprob, token), "top_logprobs": top})
        return {"content": content}
