"""LLM.chat (vLLM's offline chat API): conversations rendered with the model's
chat template and generated as the same token ids through generate()."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
BYE = [{"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["tiny"]), max_model_len=256)


def _rendered(llm, conversation, **kwargs) -> list[int]:
    ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_conversation_generates_as_its_rendered_prompt(llm):
    (out,) = llm.chat(HELLO, GREEDY)
    prompt = _rendered(llm, HELLO, add_generation_prompt=True)
    assert out.prompt_token_ids == prompt
    assert prompt[-3:] != _rendered(llm, HELLO, add_generation_prompt=False)[-3:]   # the assistant's turn opened
    assert out.token_ids == llm.generate([prompt], GREEDY)[0].token_ids


def test_a_list_of_conversations_gives_one_output_each_in_order(llm):
    outs = llm.chat([HELLO, BYE], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3)])
    assert [o.prompt_token_ids for o in outs] == [_rendered(llm, c, add_generation_prompt=True) for c in (HELLO, BYE)]
    assert [len(o.token_ids) for o in outs] == [6, 3]
    assert outs[0].token_ids == llm.chat(HELLO, GREEDY)[0].token_ids


def test_continuing_the_last_message_renders_it_open(llm):
    started = HELLO + [{"role": "assistant", "content": "Hi, I am"}]
    (out,) = llm.chat(started, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == _rendered(llm, started, continue_final_message=True)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("Hi, I am")


def test_what_cannot_be_rendered_is_a_value_error_that_says_why(llm, monkeypatch):
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message exclude each other"):
        llm.chat(HELLO, GREEDY, continue_final_message=True)

    def refuse(*args, **kwargs):
        raise RuntimeError("Conversation roles must alternate")
    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", refuse)
    with pytest.raises(ValueError, match="cannot render conversation 0: Conversation roles must alternate"):
        llm.chat(HELLO, GREEDY)
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template: give generate"):
        llm.chat(HELLO, GREEDY)


def test_calls_without_sampling_parameters_take_the_checkpoints_generation_config(model_dirs, tmp_path):
    """vLLM's LLM: generation_config.json's recommendations (max_new_tokens as max_tokens) stand in
    for unset sampling parameters; without the file, SamplingParams' own defaults."""
    import json
    import shutil
    d = tmp_path / "recommending"
    shutil.copytree(model_dirs["tiny"], d)
    generation = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() \
        else {}
    (d / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(d), max_model_len=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    (out,) = llm.generate(["Hello"])
    assert len(out.token_ids) == 3 and out.token_ids == llm.generate(["Hello"], defaults)[0].token_ids
    assert len(llm.chat(HELLO)[0].token_ids) == 3
    assert sum(len(o.delta_token_ids) for o in llm.stream("Hello")) == 3
    plain = LLM(str(model_dirs["tiny"]), max_model_len=256).get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)
