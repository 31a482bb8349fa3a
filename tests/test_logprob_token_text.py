"""Token strings in logprobs spell the completion: each token's text after other
text, also with tokenizers that drop a lone word's leading space (SentencePiece's
Metaspace), so `text_offset` points into the returned text."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.sampler import TokenLogprobs
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.responses import ChatResponses, CompletionResponses, TokenTexts


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁foo": 3, "▁a": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def entries(ids: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, -1.0, 1, [(t, -1.0)]) for t in ids]


def test_metaspace_tokens_keep_their_leading_space_and_offsets_point_into_the_text():
    tokenizer = metaspace_tokenizer()
    ids = [1, 2, 3]
    completion = " " + tokenizer.decode(ids)      # after a prompt: "hello" starts a new word
    logprobs, end = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids), 0)
    assert logprobs["tokens"] == [" hello", " world", " foo"]
    assert [completion[o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == \
        logprobs["tokens"]
    assert end == len(completion)
    chat, _ = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(ids), 0)
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == completion


def test_byte_level_tokens_are_their_own_text():
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode("hello world foo", add_special_tokens=False)
    logprobs, _ = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids), 0)
    assert logprobs["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert "".join(logprobs["tokens"]) == "hello world foo"


class _CleaningTokenizer:
    """Tokens that start with a space before punctuation (" .", " 's", as Llama 3's
    vocabulary has), decoded with the clean-up of tokenization spaces (" ." -> ".")
    unless told not to, as older transformers do for Hub configs that ask for it."""

    PIECES = {0: "a", 1: "end", 2: " .", 3: " 's"}

    def encode(self, text, add_special_tokens=True):
        return [next(i for i, piece in self.PIECES.items() if piece == text)]

    def decode(self, ids, clean_up_tokenization_spaces=None, **kwargs):
        text = "".join(self.PIECES[i] for i in ids)
        return text if clean_up_tokenization_spaces is False else text.replace(" .", ".").replace(" 's", "'s")


def test_token_strings_are_not_cleaned_up_as_the_streamed_text_is_not():
    texts = TokenTexts(_CleaningTokenizer())
    # each token's string is its text in the stream: " ." keeps its space (cleaned up, it lost it)
    assert [texts(t) for t in (1, 3, 2)] == ["end", " 's", " ."]


def _split_character_ids(tokenizer) -> tuple[str, list[int]]:
    """A character of 3 UTF-8 bytes and the tiny vocabulary's single-byte tokens spelling it."""
    from tests.test_detokenizer import _gpt2_byte_chars
    table = _gpt2_byte_chars()
    character = "中"
    return character, [tokenizer.convert_tokens_to_ids(table[b]) for b in character.encode()]


def test_chat_bytes_of_tokens_that_split_a_character_join_into_it():
    # each token's text is U+FFFD; its bytes are the vocabulary's (before: U+FFFD's own UTF-8, 3 per token)
    tokenizer = load_tokenizer(ensure_default_model())
    character, ids = _split_character_ids(tokenizer)
    assert tokenizer.decode(ids) == character
    chat, _ = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(ids), 0)
    assert [entry["token"] for entry in chat["content"]] == ["\ufffd"] * 3
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == character
    whole = tokenizer.encode("hello world", add_special_tokens=False)
    chat, _ = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(whole), 0)
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == "hello world"


def test_top_logprobs_of_tokens_with_the_same_text_keep_the_better_and_the_sampled_ones():
    # two byte tokens both read U+FFFD: the dict, keyed by text, kept the last (worst) value,
    # and the sampled token's own logprob then disagreed with token_logprobs
    tokenizer = load_tokenizer(ensure_default_model())
    _, (first, second, third) = _split_character_ids(tokenizer)
    entry = TokenLogprobs(first, -0.1, 1, [(first, -0.1), (second, -2.0), (third, -3.0)])
    logprobs, _ = CompletionResponses(TokenTexts(tokenizer)).logprobs([entry], 0)
    assert logprobs["token_logprobs"] == [-0.1]
    assert logprobs["top_logprobs"] == [{"\ufffd": -0.1}]
    entry = TokenLogprobs(third, -3.0, 3, [(first, -0.1), (second, -2.0)])    # sampled outside the best two
    logprobs, _ = CompletionResponses(TokenTexts(tokenizer)).logprobs([entry], 0)
    assert logprobs["top_logprobs"] == [{"\ufffd": -3.0}]
