"""vLLM's `bad_words`: words the output may not contain, as token sequences.

A word is banned as the tokens it encodes to at the start of a text and, where
that differs, after a space (mid-text), as vLLM encodes it. At every step, each
sequence whose first tokens the output ends with has its last token banned; a
one-token word is banned at every step. Only the output counts (the prompt may
contain the words)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import InvalidRequestError

MAX_BAD_WORD_SEQUENCES = 128     # token sequences after tokenizing (vLLM's VLLM_MAX_NUM_BAD_WORDS)


def tokenize_bad_words(tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """Each word's token sequences: as encoded alone, and after a space where that is
    another word token of the same length (vLLM's rule). InvalidRequestError for a
    word that encodes to nothing or to a token outside the model's vocabulary, or
    past MAX_BAD_WORD_SEQUENCES sequences."""
    sequences: list[list[int]] = []
    for word in dict.fromkeys(words):
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise InvalidRequestError(f"bad_words entry {word!r} encodes to no token; remove it",
                                              "bad_words")
                continue
            if prefix and (ids[0] == sequences[-1][0] or len(ids) != len(sequences[-1])):
                continue
            if any(not 0 <= t < vocab_size for t in ids):
                raise InvalidRequestError(f"bad_words entry {word!r} encodes to token ids {ids}, outside the "
                                          f"model's vocabulary [0, {vocab_size}); remove it", "bad_words")
            sequences.append(ids)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise InvalidRequestError(f"bad_words encode to {len(sequences)} token sequences, more than the "
                                  f"{MAX_BAD_WORD_SEQUENCES} this server takes; send fewer words", "bad_words")
    return sequences


def bad_word_sequences(tokenizer, params, vocab_size: int, ending_ids: Iterable[int] = ()) -> list[list[int]]:
    """`params.bad_words` as token sequences (tokenize_bad_words), checked against
    `params.allowed_token_ids`: InvalidRequestError when the words ban every allowed
    token, as nothing could then be sampled; with `params.min_tokens`, also when
    they ban every allowed token but those of `ending_ids` (EOS and stop_token_ids),
    which min_tokens bans for the first tokens."""
    if not params.bad_words:
        return []
    sequences = tokenize_bad_words(tokenizer, params.bad_words, vocab_size)
    always_banned = {ids[0] for ids in sequences if len(ids) == 1}
    if params.allowed_token_ids is None:
        return sequences
    allowed = set(params.allowed_token_ids)
    if allowed <= always_banned:
        raise InvalidRequestError(f"bad_words ban every token allowed_token_ids allows "
                                  f"({sorted(allowed)}), so nothing could be sampled: "
                                  "allow other tokens, or drop those words", "bad_words")
    if params.min_tokens and allowed <= always_banned | set(ending_ids):
        raise InvalidRequestError(f"bad_words ban every token allowed_token_ids allows ({sorted(allowed)}) but "
                                  f"those that end the output, which min_tokens={params.min_tokens} forbids until "
                                  "then, so nothing could be sampled: allow other tokens, or drop those words or "
                                  "min_tokens", "bad_words")
    return sequences


def banned_next(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word after `output_token_ids`."""
    banned = []
    for ids in sequences:
        prefix = len(ids) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or output_token_ids[-prefix:] == ids[:prefix]:
            banned.append(ids[-1])
    return banned
