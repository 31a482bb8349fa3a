"""Incremental detokenization for streaming output.

Decoding the whole output after every token costs O(length) per step; this decodes
only a short window of recent tokens (the prefix_offset / read_offset scheme used by
vLLM and TGI). ``read_offset`` marks the token boundary up to which text has been
emitted exactly; the tokens between ``prefix_offset`` and ``read_offset`` are kept
as context so that decoders whose output depends on the preceding token (e.g.
SentencePiece dropping the leading space of the first token) see it.

For byte-level BPE tokenizers (all of ``engine.tiny_model``'s, GPT-2/Llama-3/Qwen
style) decoding concatenates token bytes and decodes them as lossy UTF-8, and the
window is only ever cut where the decoder is between characters, so after
``flush()`` the emitted text equals ``tokenizer.decode(output_ids)`` exactly (without
the clean-up of tokenization spaces, which no window is given).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens used as initial decoding context (vLLM uses the same number).
_CONTEXT_TOKENS = 5
# Once this many tokens past read_offset are undecided, settle all but the last
# _LOOKBACK_TOKENS. A character is at most 4 bytes, so the bytes after a boundary
# that far back have almost always decided it; _settle_undecided checks that they did.
_MAX_UNDECIDED_TOKENS = 8
_LOOKBACK_TOKENS = 4
# Drop ids before the window once this many have accumulated, bounding memory.
_COMPACT_AFTER = 64


def _window_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) for windows of a few tokens: the Rust
    `tokenizers.Tokenizer` behind a transformers fast tokenizer where there is one
    (it skips the Python wrapper, most of the cost of decoding a window), else the
    tokenizer's own decode. Never with the clean-up of tokenization spaces (" ." ->
    "."; set by some Hub configs, Llama 3's among them): applied window by window,
    it shortens a window against its prefix and the stream loses characters
    (" '" then "social" came out as "ocial"). vLLM's detokenizers never apply it
    either."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    if hasattr(tokenizer, "clean_up_tokenization_spaces"):       # a transformers tokenizer
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


# tokenizer -> (its special ids, its vocabulary's size): read once per tokenizer, not per request
# (a Llama-3 tokenizer's 256 added tokens take ~80 us to list)
_DROPPED_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ids_decoded_as_nothing(tokenizer: Any, skip_special_tokens: bool) -> tuple[frozenset[int], int | None]:
    """(ids, vocabulary size): what the full decode drops before decoding, where a
    transformers tokenizer says: with skip_special_tokens its special tokens, and
    any id at or past the vocabulary's size (no token: the model's padded rows).
    Empty and None where the tokenizer does not say."""
    try:
        special, size = _DROPPED_IDS[tokenizer]
    except (KeyError, TypeError):      # (TypeError: a tokenizer no weak reference can name, read each time)
        added = getattr(tokenizer, "added_tokens_decoder", None)
        special = frozenset(i for i, token in added.items() if getattr(token, "special", False)) \
            if isinstance(added, dict) else frozenset()
        try:
            size = len(tokenizer)
        except TypeError:
            size = None
        try:
            _DROPPED_IDS[tokenizer] = special, size
        except TypeError:
            pass
    return (special if skip_special_tokens else frozenset()), size


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    ``tokenizer`` only needs ``decode(ids, skip_special_tokens=...)`` (a
    transformers tokenizer or a ``tokenizers.Tokenizer``). Contracts:

    - ``add_token`` returns the text that became final with this token, possibly "";
      a delta never ends in a U+FFFD that later tokens could still turn into a
      character (an incomplete UTF-8 sequence is held back until resolved);
    - ``text`` is the concatenation of all deltas and contains output text only;
      with byte-level and SentencePiece-style tokenizers it reads as the output
      does after the prompt, ``decode(prompt + output)`` past ``decode(prompt)``
      (a word starting it keeps its leading space), unless the prompt ends inside
      a character;
    - ``flush()`` emits whatever is held back, decoded as the full decode would;
      afterwards ``text == tokenizer.decode(output_ids, skip_special_tokens=...,
      clean_up_tokenization_spaces=False)`` for byte-level tokenizers. No tokens
      may be added after ``flush()``.

    Cost per token is two decodes of a window of a few tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._window_decode = _window_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # dropped before they reach the window, as the full decode drops them: a long run of them
        # after an unfinished character kept every later token decoding the whole run
        self._dropped_ids, self._vocab_size = _ids_decoded_as_nothing(tokenizer, skip_special_tokens)
        self._ids: list[int] = self._context(prompt_token_ids)
        # ids[prefix_offset:read_offset] is context; text up to read_offset is emitted.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # len(decode(ids[prefix_offset:read_offset])); None until needed.
        self._prefix_len: int | None = None
        # Characters past read_offset already emitted (settled text that precedes an
        # unresolved tail inside the same window).
        self._emitted_past_read = 0
        self._pieces: list[str] = []
        self._text = ""
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    def add_token(self, token_id: int) -> str:
        """Append one generated token and return the newly final text (may be "")."""
        if self._flushed:
            raise RuntimeError("add_token() after flush()")
        token_id = int(token_id)
        if token_id in self._dropped_ids or (self._vocab_size is not None and token_id >= self._vocab_size):
            return ""
        self._ids.append(token_id)
        window = self._decode(self._ids[self._prefix_offset :])
        prefix_len = self._window_prefix_len()
        emitted_end = prefix_len + self._emitted_past_read

        if window.endswith(_REPLACEMENT):
            # Text before the trailing U+FFFD run ends in a real character, so the
            # decoder is between characters there and that text is final.
            delta = self._slice(window, emitted_end, len(window.rstrip(_REPLACEMENT)))
            self._emitted_past_read += len(delta)
            if len(self._ids) - self._read_offset > _MAX_UNDECIDED_TOKENS:
                delta += self._settle_undecided(window)
            return self._emit(delta)

        delta = self._slice(window, emitted_end, len(window))
        if len(window) > prefix_len:
            # The window ends between characters: everything is emitted, and the
            # tokens just read become the context for the next window.
            self._advance(len(self._ids))
        elif len(self._ids) - self._read_offset > _MAX_UNDECIDED_TOKENS:
            # Many tokens that add no text (skipped special tokens, say): drop them from
            # the window, keeping the context. Made the context themselves, they would
            # hide the text before them from the next token (SentencePiece would then
            # drop its leading space, as at the start of a text).
            del self._ids[self._read_offset:]
        else:
            # Nothing new yet (e.g. a skipped special token): keep the context.
            self._emitted_past_read += len(delta)
        return self._emit(delta)

    def flush(self) -> str:
        """Emit any held-back text, as the full decode renders it; idempotent."""
        if self._flushed:
            return ""
        self._flushed = True
        window = self._decode(self._ids[self._prefix_offset :])
        emitted_end = self._window_prefix_len() + self._emitted_past_read
        return self._emit(self._slice(window, emitted_end, len(window)))

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        return self._window_decode(ids, self._skip_special_tokens)

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last few tokens that decode to text (ids the decode drops, e.g. a
        chat template's closing special tokens, count for nothing), as the first output
        token's context: a SentencePiece decoder drops the leading space of a token that
        starts the text. Its decode must end in a character. Where the context starts inside
        one, SentencePiece's byte fallback turns the whole run of byte tokens after it into
        U+FFFD: tokens are dropped from the left until the decode ends in a character. Where
        that leaves none (the prompt ends inside a character, or in a U+FFFD of its own), the
        context is what comes before that last character: its bytes glued to the output's
        first bytes would make a character the output's own decode never has."""
        context: list[int] = []
        for token in reversed(prompt_token_ids):
            token = int(token)
            if token not in self._dropped_ids and (self._vocab_size is None or token < self._vocab_size):
                context.insert(0, token)
                if len(context) == _CONTEXT_TOKENS:
                    break
        from_the_left = context[:]
        while from_the_left and self._decode(from_the_left).endswith(_REPLACEMENT):
            del from_the_left[0]
        if from_the_left:
            return from_the_left
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        return context

    def _window_prefix_len(self) -> int:
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        return self._prefix_len

    @staticmethod
    def _slice(window: str, start: int, end: int) -> str:
        return window[start:end] if end > start else ""

    def _advance(self, new_read_offset: int) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = new_read_offset
        self._prefix_len = None
        self._emitted_past_read = 0
        if self._prefix_offset >= _COMPACT_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _settle_undecided(self, window: str) -> str:
        """Move read_offset up to a boundary a few tokens back, if that is safe.

        Without this, output that keeps ending in invalid bytes would grow the
        window without bound. Splitting at token boundary ``cut`` is safe once the
        bytes after it have already decided the character in flight there
        (completed it or proved it invalid): exactly when decoding the two sides
        separately reproduces the joint decode and the right side is non-empty.
        Returns the text that becomes final, which may end in a U+FFFD that the
        full decode has too.
        """
        cut = len(self._ids) - _LOOKBACK_TOKENS
        head = self._decode(self._ids[self._prefix_offset : cut])
        tail = self._decode(self._ids[cut:])
        if not tail or head + tail != window:
            return ""
        emitted_end = self._window_prefix_len() + self._emitted_past_read
        delta = self._slice(window, emitted_end, len(head))
        already_past_cut = max(0, emitted_end - len(head))
        self._advance(cut)
        self._emitted_past_read = already_past_cut
        return delta

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta
