"""Incremental detokenization: streamed deltas add up to the full decode, never early."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import make_tiny_model

REPLACEMENT = "\ufffd"
PIECES = ["日本語", "😀", "👍🏽", "café", " naïve", "a", " the", "\n", "Σ", "€", "🇯🇵", " 42", "<|pad|>"]


def _gpt2_byte_chars() -> dict[int, str]:
    """The byte -> printable character table byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="session", params=["tiny", "tiny-qwen2"])
def tokenizer(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(f"detok-{request.param}"), request.param)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="session")
def byte_ids(tokenizer) -> list[int]:
    """byte value -> id of the single-byte token."""
    table = _gpt2_byte_chars()
    ids = [tokenizer.convert_tokens_to_ids(table[b]) for b in range(256)]
    assert len(set(ids)) == 256
    return ids


def _special_ids(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]


def _stream(tokenizer, prompt, output, skip):
    """Feed ``output`` token by token; check the no-early/no-late property at every step."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    emitted = ""
    for k, token in enumerate(output, 1):
        delta = detok.add_token(token)
        emitted += delta
        assert detok.text == emitted
        truth = tokenizer.decode(output[:k], skip_special_tokens=skip)
        # Never ahead of the decode so far; with later steps' checks this rules out
        # emitting a U+FFFD that a later token turns into a character...
        assert truth.startswith(emitted), (output[:k], emitted, truth)
        # ...and never behind it except for an unresolved trailing U+FFFD run.
        assert emitted.startswith(truth.rstrip(REPLACEMENT)), (output[:k], emitted, truth)
    emitted += detok.flush()
    assert detok.text == emitted
    return emitted


def _split_into_bytes(tokenizer, byte_ids, ids, split_mask):
    """Replace chosen tokens by their single-byte tokens (splitting multi-byte characters)."""
    table = {c: b for b, c in _gpt2_byte_chars().items()}
    out = []
    for token, split in zip(ids, split_mask):
        piece = tokenizer.convert_ids_to_tokens(token)
        if split and token not in _special_ids(tokenizer):
            out.extend(byte_ids[table[c]] for c in piece)
        else:
            out.append(token)
    return out


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_over_whole_vocab(tokenizer, data, skip):
    vocab = st.integers(0, len(tokenizer) - 1)
    prompt = data.draw(st.lists(vocab, max_size=8))
    output = data.draw(st.lists(vocab, max_size=40))
    assert _stream(tokenizer, prompt, output, skip) == tokenizer.decode(output, skip_special_tokens=skip)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_multibyte_text_split_across_tokens(tokenizer, byte_ids, data, skip):
    pieces = data.draw(st.lists(st.sampled_from(PIECES), max_size=10))
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    output = _split_into_bytes(tokenizer, byte_ids, ids, data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))))
    # Special tokens anywhere, including between the bytes of one character.
    for _ in range(data.draw(st.integers(0, 3))):
        output.insert(data.draw(st.integers(0, len(output))), data.draw(st.sampled_from(_special_ids(tokenizer))))
    prompt = tokenizer.encode(data.draw(st.sampled_from(["", "Hello", "日本", "x 😀"])))
    assert _stream(tokenizer, prompt, output, skip) == tokenizer.decode(output, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_high_bytes_only(tokenizer, byte_ids, data):
    """Mostly continuation and lead bytes: long runs of unresolved or invalid UTF-8."""
    output = data.draw(st.lists(st.sampled_from(byte_ids[0x80:] + byte_ids[0x41:0x43]), max_size=60))
    assert _stream(tokenizer, [], output, True) == tokenizer.decode(output, skip_special_tokens=True)


def test_emoji_split_into_bytes_is_held_until_complete(tokenizer, byte_ids):
    output = [byte_ids[b] for b in "😀".encode()] + tokenizer.encode(" ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    deltas = [detok.add_token(t) for t in output]
    assert deltas[:4] == ["", "", "", "😀"]
    assert "".join(deltas[4:]) + detok.flush() == " ok"
    assert detok.text == "😀 ok"


def test_flush_emits_incomplete_tail_as_full_decode_does(tokenizer, byte_ids):
    output = tokenizer.encode("ab", add_special_tokens=False) + [byte_ids[0xE6], byte_ids[0x97]]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.add_token(t) for t in output) == "ab"
    tail = detok.flush()
    assert tail == tokenizer.decode(output, skip_special_tokens=True)[2:]
    assert tail.startswith(REPLACEMENT)
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match=r"add_token\(\) after flush\(\)"):
        detok.add_token(byte_ids[0xA5])


def test_text_excludes_prompt_even_when_prompt_ends_mid_character(tokenizer, byte_ids):
    # The prompt ends with the first two bytes of 日 (E6 97 A5); output starts with A5.
    prompt = tokenizer.encode("Hello", add_special_tokens=False) + [byte_ids[0xE6], byte_ids[0x97]]
    output = [byte_ids[0xA5]] + tokenizer.encode(" world", add_special_tokens=False)
    expected = tokenizer.decode(output, skip_special_tokens=True)
    assert expected.startswith(REPLACEMENT)  # output decoded alone never sees the prompt's bytes
    assert _stream(tokenizer, prompt, output, True) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer, skip):
    prompt = tokenizer.encode("Q:")
    output = tokenizer.encode(" yes", add_special_tokens=False) + [tokenizer.eos_token_id]
    text = _stream(tokenizer, prompt, output, skip)
    assert text == (" yes" if skip else " yes<|end_of_text|>")


def test_leading_space_of_first_output_token_is_kept(tokenizer):
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode(" world, again", add_special_tokens=False)
    assert _stream(tokenizer, prompt, output, True) == " world, again"


def test_accepts_a_bare_tokenizers_tokenizer(tokenizer):
    output = tokenizer.encode("naïve café 日本語", add_special_tokens=False)
    backend = tokenizer.backend_tokenizer
    detok = IncrementalDetokenizer(backend, [])
    text = "".join(detok.add_token(t) for t in output) + detok.flush()
    assert text == "naïve café 日本語"


def test_skipped_special_tokens_do_not_hide_an_unfinished_character(tokenizer, byte_ids):
    """A long undecided tail of skipped specials must not be mistaken for a character boundary."""
    eos = tokenizer.eos_token_id
    output = [byte_ids[0x80]] * 10 + [byte_ids[0xE6]] + [eos] * 10 + [byte_ids[0x97], byte_ids[0xA5]]
    text = _stream(tokenizer, [], output, True)
    assert text == tokenizer.decode(output, skip_special_tokens=True)
    assert text.endswith("日")


class _RecordingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.longest = 0
        self.calls = 0

    def __len__(self):
        return len(self.tokenizer)

    def decode(self, ids, skip_special_tokens):
        self.longest = max(self.longest, len(ids))
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["text", "skipped-specials", "specials-inside-a-character",
                                  "ids-past-the-vocabulary", "invalid-bytes"])
def test_work_per_token_is_bounded(tokenizer, byte_ids, kind):
    if kind == "text":
        output = tokenizer.encode("The quick brown fox, café 日本語 😀. " * 40, add_special_tokens=False)
    elif kind == "skipped-specials":
        # Tokens that add no text at all.
        output = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.pad_token_id] * 400 + [byte_ids[0x41]]
    elif kind == "specials-inside-a-character":
        # (every token after the first byte had decoded the whole run: the window ends in U+FFFD)
        output = [byte_ids[0xE6]] + [tokenizer.eos_token_id] * 400 + [byte_ids[0x97], byte_ids[0xA5]]
    elif kind == "ids-past-the-vocabulary":
        # a model's padded rows: ids no token has, which the full decode drops too
        output = [byte_ids[0xE6]] + [len(tokenizer) + 7] * 400 + [byte_ids[0x97], byte_ids[0xA5]]
    else:
        # Lone continuation bytes: the decoded tail ends in U+FFFD after every token.
        output = [byte_ids[0x80 + (i * 37) % 0x40] for i in range(600)]
    recorder = _RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recorder, tokenizer.encode("prompt text here"))
    streamed = "".join(detok.add_token(t) for t in output) + detok.flush()
    assert streamed == tokenizer.decode(output, skip_special_tokens=True)
    assert len(output) > 300
    assert recorder.longest <= 24
    assert recorder.calls <= 3 * len(output) + 4


def _sentencepiece_style_tokenizer():
    """A Llama-2 / Mistral style tokenizer, trained here: "▁" for spaces, byte
    fallback, and a decoder that strips the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    corpus = ["the quick brown fox jumps over the lazy dog, embers and bread"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"]))
    # byte fallback spells a character outside the vocabulary in tokens <0x00>..<0xFF>, one per UTF-8 byte
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    first_byte_id = len(vocab)
    vocab.update({f"<0x{b:02X}>": first_byte_id + b for b in range(256)})
    backend = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("num_skipped", [1, 8, 9, 30])
def test_a_run_of_skipped_special_tokens_keeps_the_next_words_space(num_skipped):
    # with EOS ignored, a model may emit many EOS in a row: they add no text, and the word after
    # them keeps its leading space, whatever their number (SentencePiece drops it only at the start)
    tok = _sentencepiece_style_tokenizer()
    ids = tok.encode("quick", add_special_tokens=False) + [tok.eos_token_id] * num_skipped + \
        tok.encode("brown", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("the", add_special_tokens=False), skip_special_tokens=True)
    text = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert text == " quick brown"
    assert tok.decode(ids, skip_special_tokens=True) == "quick brown"


@pytest.mark.parametrize("prompt_text", ["the dog", "the dog 🎉", "the dog 🎉🎉", "the 日本語", "🎉🎉🎉"])
def test_the_first_word_after_a_prompt_ending_in_byte_fallback_characters_keeps_its_space(prompt_text):
    # the prompt's last tokens may start inside a character (a run of byte tokens that decodes to U+FFFD
    # as a whole): the output still reads as what it adds after the prompt, decode(prompt + output) past
    # decode(prompt)
    tok = _sentencepiece_style_tokenizer()
    prompt = tok.encode(prompt_text)
    output = tok.encode("quick brown", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    text = "".join(detok.add_token(t) for t in output) + detok.flush()
    before = tok.decode(prompt, skip_special_tokens=True)
    assert before.endswith(prompt_text)
    assert text == tok.decode(prompt + output, skip_special_tokens=True)[len(before):] == " quick brown"


@pytest.mark.parametrize("prompt_text, closing_specials", [("the", 5), ("the", 7), ("the \ufffd", 0),
                                                            ("the dog \ufffd", 1)])
def test_a_prompt_ending_in_skipped_specials_or_a_replacement_character_keeps_the_first_words_space(
        prompt_text, closing_specials):
    # a chat template's closing special tokens decode to nothing (5 of them were the whole context, and
    # the first word lost its space); a U+FFFD the prompt holds as text is a whole character, not one
    # the output's bytes finish (the context was dropped for it)
    tok = _sentencepiece_style_tokenizer()
    prompt = tok.encode(prompt_text, add_special_tokens=False) + [tok.eos_token_id] * closing_specials
    output = tok.encode("quick brown", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    text = "".join(detok.add_token(t) for t in output) + detok.flush()
    before = tok.decode(prompt, skip_special_tokens=True)
    assert text == tok.decode(prompt + output, skip_special_tokens=True)[len(before):] == " quick brown"


class _CleaningTokenizer:
    """A transformers-style tokenizer whose decode cleans up tokenization spaces
    (" ." -> ".", " '" -> "'", ...) unless told not to, as Hub configs with
    clean_up_tokenization_spaces=true make older transformers do; no Rust backend."""

    clean_up_tokenization_spaces = True

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        text = self._inner.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        if clean_up_tokenization_spaces is False:
            return text
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" '", "'"), (" n't", "n't")):
            text = text.replace(before, after)
        return text


def test_streamed_text_is_never_cleaned_up_window_by_window(tokenizer):
    # cleaned a window at a time, " '" then "social" came out as "ocial" and a lone " ." vanished
    cleaning = _CleaningTokenizer(tokenizer)
    ids = tokenizer.encode("the word 'social' ends here . ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(cleaning, tokenizer.encode("Say", add_special_tokens=False))
    streamed = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert streamed.endswith("the word 'social' ends here . ok")
