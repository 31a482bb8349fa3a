"""Token strings in logprobs spell the completion: each token's text after other
text, also with tokenizers that drop a lone word's leading space (SentencePiece's
Metaspace), so `text_offset` points into the returned text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.sampler import TokenLogprobs
from engine.tiny_model import ensure_default_model
from engine.tokenizer import load_tokenizer
from router.responses import ChatResponses, ChoiceCursor, CompletionResponses, TokenTexts


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
    cursor = ChoiceCursor()
    logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids), cursor)
    assert logprobs["tokens"] == [" hello", " world", " foo"]
    assert [completion[o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == \
        logprobs["tokens"]
    assert cursor.text_offset == len(completion)
    chat = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(ids), ChoiceCursor())
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == completion


def test_byte_level_tokens_are_their_own_text():
    tokenizer = load_tokenizer(ensure_default_model())
    ids = tokenizer.encode("hello world foo", add_special_tokens=False)
    logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids), ChoiceCursor())
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
    # before: each token's bytes were its string's, U+FFFD's own UTF-8, 3 per token
    tokenizer = load_tokenizer(ensure_default_model())
    character, ids = _split_character_ids(tokenizer)
    assert tokenizer.decode(ids) == character
    chat = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(ids), ChoiceCursor())
    assert [entry["token"] for entry in chat["content"]] == ["", "", character]
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == character
    whole = tokenizer.encode("hello world", add_special_tokens=False)
    chat = ChatResponses(TokenTexts(tokenizer)).logprobs(entries(whole), ChoiceCursor())
    assert bytes(b for entry in chat["content"] for b in entry["bytes"]).decode() == "hello world"


def test_tokens_of_a_split_character_spell_the_text_and_its_alternatives_stay_apart():
    # before: each byte token read U+FFFD, so the strings did not spell "a 中" (3 U+FFFD), text_offset ran
    # 2 characters past the text for each such character, and every alternative completing another
    # character fell onto the same U+FFFD key of top_logprobs
    tokenizer = load_tokenizer(ensure_default_model())
    from tests.test_detokenizer import _gpt2_byte_chars
    character, split = _split_character_ids(tokenizer)
    ids = tokenizer.encode("a ", add_special_tokens=False) + split
    other = tokenizer.convert_tokens_to_ids(_gpt2_byte_chars()["丮".encode()[-1]])   # 丮: 中's first two bytes
    completion = "a " + character
    assert tokenizer.decode(ids) == completion
    scored = [*entries(ids[:-1]), TokenLogprobs(ids[-1], -0.5, 1, [(ids[-1], -0.5), (other, -1.5)])]
    cursor = ChoiceCursor()
    logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs(scored, cursor)
    assert "".join(logprobs["tokens"]) == completion
    assert logprobs["tokens"][-3:] == ["", "", character]
    assert [completion[o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == \
        logprobs["tokens"]
    assert cursor.text_offset == len(completion)
    assert logprobs["top_logprobs"][-1] == {character: -0.5, "丮": -1.5}
    chat = ChatResponses(TokenTexts(tokenizer)).logprobs(scored, ChoiceCursor())
    assert [t["token"] for t in chat["content"][-1]["top_logprobs"]] == [character, "丮"]


TEXTS = ["です", "これはです", "こんにちは世界", "a 中 b", "héllo wörld 🙂👍🏽", "日本語のテキスト、です。"]


@pytest.fixture(scope="module")
def wide_vocabulary_tokenizer():
    """The `bench` preset's tokenizer (8,192 tokens): it has tokens that end one character and
    start the next, and tokens that hold a character's last bytes and then a whole character."""
    from engine.tiny_model import _train_tokenizer
    return _train_tokenizer(8192, 2048, "llama")


@pytest.mark.parametrize("text", TEXTS)
def test_the_token_strings_of_multibyte_text_spell_it_with_any_vocabulary(text, wide_vocabulary_tokenizer):
    # before: with this vocabulary "です" gave ["", "�す"] and "こんにちは世界" "�は世界", as only tokens
    # ending in U+FFFD were corrected, from at most 4 tokens back
    for tokenizer in (load_tokenizer(ensure_default_model()), wide_vocabulary_tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        cursor = ChoiceCursor()
        logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids), cursor)
        assert "".join(logprobs["tokens"]) == text
        assert [text[o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"])] == \
            logprobs["tokens"]
        assert cursor.text_offset == len(text)
        prompt = CompletionResponses(TokenTexts(tokenizer)).prompt_logprobs(ids, [None, *entries(ids[1:])])
        decoded = [entry[str(t)]["decoded_token"] for entry, t in zip(prompt[1:], ids[1:])]
        first = CompletionResponses(TokenTexts(tokenizer)).logprobs(entries(ids[:1]), ChoiceCursor())["tokens"]
        assert "".join(first + decoded) == text


def test_bytes_that_never_form_a_character_go_out_after_a_bound():
    # a run of continuation bytes holds "" for at most 8 tokens, then shows what it decodes to
    tokenizer = load_tokenizer(ensure_default_model())
    from tests.test_detokenizer import _gpt2_byte_chars
    continuation = tokenizer.convert_tokens_to_ids(_gpt2_byte_chars()[0x80])     # no lead byte before it
    cursor, texts = ChoiceCursor(), TokenTexts(tokenizer)
    strings = [cursor.take(t, texts) for t in [continuation] * 10]
    assert strings[:7] == [""] * 7 and strings[7] == "\ufffd" * 8
    assert "".join(strings) == tokenizer.decode([continuation] * 8)


def test_a_stream_keeps_each_choices_place_across_chunks():
    # the character's bytes arrive in three chunks: the cursor carries its first bytes to the last
    tokenizer = load_tokenizer(ensure_default_model())
    character, ids = _split_character_ids(tokenizer)
    fmt, cursor = CompletionResponses(TokenTexts(tokenizer)), ChoiceCursor()
    chunks = [fmt.logprobs(entries([t]), cursor) for t in ids]
    assert [c["tokens"] for c in chunks] == [[""], [""], [character]]
    assert [c["text_offset"] for c in chunks] == [[0], [0], [0]]
    assert cursor.text_offset == 1
    # a character never completed keeps "" (vLLM's): its bytes count nowhere in the offsets
    lone = fmt.logprobs(entries(ids[:1]), ChoiceCursor())
    assert lone["tokens"] == [""]


def test_prompt_logprobs_name_a_split_character_by_the_prompt_tokens_before_it():
    tokenizer = load_tokenizer(ensure_default_model())
    character, ids = _split_character_ids(tokenizer)
    prompt = tokenizer.encode("a", add_special_tokens=False) + ids
    scored = [None, *entries(ids)]
    listed = CompletionResponses(TokenTexts(tokenizer)).prompt_logprobs(prompt, scored)
    assert [entry[str(t)]["decoded_token"] for entry, t in zip(listed[1:], ids)] == ["", "", character]


def test_top_logprobs_of_tokens_with_the_same_text_keep_the_better_and_the_sampled_ones():
    # two byte tokens that start characters both read "": the dict, keyed by text, kept the last (worst)
    # value, and the sampled token's own logprob then disagreed with token_logprobs
    tokenizer = load_tokenizer(ensure_default_model())
    _, (first, second, third) = _split_character_ids(tokenizer)
    entry = TokenLogprobs(first, -0.1, 1, [(first, -0.1), (second, -2.0), (third, -3.0)])
    logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs([entry], ChoiceCursor())
    assert logprobs["token_logprobs"] == [-0.1]
    assert logprobs["top_logprobs"] == [{"": -0.1}]
    entry = TokenLogprobs(third, -3.0, 3, [(first, -0.1), (second, -2.0)])    # sampled outside the best two
    logprobs = CompletionResponses(TokenTexts(tokenizer)).logprobs([entry], ChoiceCursor())
    assert logprobs["top_logprobs"] == [{"": -3.0}]
