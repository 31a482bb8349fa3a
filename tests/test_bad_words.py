"""vLLM's bad_words: each word's token sequences (alone, and after a space), and
the engine never completing one in the output, whatever the prompt holds."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.bad_words import banned_next, tokenize_bad_words
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParamsError
from tests.test_parity import _prompts


def _contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_the_last_token_of_a_sequence_whose_start_the_output_ends_with_is_banned():
    seqs = [[7], [3, 4, 5], [9, 4]]
    assert banned_next(seqs, []) == [7]                    # only a one-token word fits an empty output
    assert banned_next(seqs, [1, 3, 4]) == [7, 5]
    assert banned_next(seqs, [3, 4, 1]) == [7]
    assert banned_next(seqs, [9]) == [7, 4]


def test_a_word_is_encoded_alone_and_after_a_space(tokenizer):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)
    # vLLM's rule: the spaced form too, where it starts with another token and is as long
    quick, spaced_quick = encode("quick"), encode(" quick")
    assert len(quick) == len(spaced_quick) and quick[0] != spaced_quick[0]     # (this tokenizer's)
    assert tokenize_bad_words(tokenizer, ["quick", "quick"], len(tokenizer)) == [quick, spaced_quick]  # once
    hello, spaced_hello = encode("Hello"), encode(" Hello")
    assert len(hello) != len(spaced_hello)                                       # (this tokenizer's)
    assert tokenize_bad_words(tokenizer, ["Hello"], len(tokenizer)) == [hello]   # not as long: left out
    with pytest.raises(SamplingParamsError, match="bad_words"):
        SamplingParams(bad_words=[" "])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_never_completes_a_bad_word_and_the_prompt_may_hold_it(model_dirs, async_scheduling):
    """With async scheduling too: a step whose rows ban bad words is never left pending on
    the device, or the next step's ban would miss the token it sampled."""
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256,
                                    async_scheduling=async_scheduling))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    chosen = None
    for prompt in _prompts(tok, 12, seed=21, min_len=4, max_len=20):
        engine.add_request("free", prompt, params)
        (free,) = engine.run_to_completion()
        for word in tok.decode(free.token_ids).split():
            seqs = tokenize_bad_words(tok, [word], engine.model_config.vocab_size)
            if any(len(s) > 1 and _contains(free.token_ids, s) for s in seqs):
                chosen = (prompt, free, word, seqs)
                break
        if chosen:
            break
    assert chosen, "no greedy output held a multi-token word to ban"
    prompt, free, word, seqs = chosen
    engine.add_request("banned", prompt + seqs[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                  bad_words=[word]))
    (banned,) = engine.run_to_completion()
    assert not any(_contains(banned.token_ids, s) for s in seqs)
    # greedy up to the first token that would have completed the word
    engine.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                       bad_words=[word]))
    engine.add_request("beside", prompt[::-1], params)        # a request without bad words in the same batch
    again = next(o for o in engine.run_to_completion() if o.request_id == "again")
    cut = next(i for i in range(len(free.token_ids))
               if any(s[-1] == free.token_ids[i] and free.token_ids[i - len(s) + 1:i] == s[:-1]
                      for s in seqs if i - len(s) + 1 >= 0))
    assert again.token_ids[:cut] == free.token_ids[:cut] and again.token_ids[cut] != free.token_ids[cut]
    assert not any(_contains(again.token_ids, s) for s in seqs)


def test_a_word_that_encodes_to_nothing_or_past_the_vocabulary_is_refused(model_dirs, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128))
    vocab = engine.model_config.vocab_size
    for encoded, fragment in (([], "encodes to no token"), ([5, vocab], "outside the model's vocabulary")):
        monkeypatch.setattr(engine.tokenizer, "encode", lambda text, add_special_tokens=True, ids=encoded: ids)
        with pytest.raises(InvalidRequestError, match=fragment):
            engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, bad_words=["zzz"]))
    assert not engine.has_unfinished_requests()


def test_words_that_ban_every_allowed_token_are_refused_by_the_engine_and_the_api(model_dirs, tokenizer):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128))
    word = next(w for w in ("a", "b", "x", "the") if len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    only = tokenizer.encode(word, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="ban every token allowed_token_ids allows"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, allowed_token_ids=only, bad_words=[word]))
    assert not engine.has_unfinished_requests()
    # one allowed token the words leave: it runs, and samples that token only
    out = engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=only + [11],
                                                            bad_words=[word], ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.request_id == out), tokens)
    assert tokens == [11, 11, 11]


def test_words_and_min_tokens_that_together_ban_every_allowed_token_are_refused(model_dirs, tokenizer):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=128))
    word = next(w for w in ("a", "b", "x", "the") if len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    banned = tokenizer.encode(word, add_special_tokens=False)
    eos = engine.eos_token_ids[0]
    # the word bans one allowed token, min_tokens the other (EOS) for the first token: nothing to sample
    with pytest.raises(InvalidRequestError, match="but those that end the output, which min_tokens=1"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, min_tokens=1, bad_words=[word],
                                                          allowed_token_ids=banned + [eos]))
    assert not engine.has_unfinished_requests()
    # without min_tokens EOS may come first: it runs and ends on EOS
    out = engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=2, bad_words=[word],
                                                            allowed_token_ids=banned + [eos]))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.request_id == out and o.finished]
    assert finished[0].finish_reason == "stop" and finished[0].token_ids == [eos]
