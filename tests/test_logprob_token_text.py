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
