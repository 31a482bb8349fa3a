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


def test_messages_are_rendered_as_the_server_renders_them(llm):
    # text parts joined (they reached the template as a list: a Jinja error), a developer message as the system
    # one (it rendered as <|developer|>), and the explicit arguments over the same keys in chat_template_kwargs
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [HELLO[0], {"role": "user", "content": "Hello\nthere"}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == _rendered(llm, joined, add_generation_prompt=True)
    developer = [{"role": "developer", "content": "Be brief."}, HELLO[1]]
    assert llm.chat(developer, GREEDY)[0].prompt_token_ids == _rendered(llm, HELLO, add_generation_prompt=True)
    (out,) = llm.chat(HELLO, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    assert out.prompt_token_ids == _rendered(llm, HELLO, add_generation_prompt=True)
    with pytest.raises(ValueError, match="conversation 0: message 1: content must be a string or a list of text"):
        llm.chat([HELLO[0], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_vllms_call_forms_are_taken(llm):
    # use_tqdm (third, as vLLM's), a template of the call's own, the defaults of what this engine has no use for
    (out,) = llm.chat(HELLO, GREEDY, False, lora_request=None, tools=None,
                      chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Be brief. Hello there "
    (text,) = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert text.prompt == "Hello" and llm.generate([[5, 6, 7]], GREEDY)[0].prompt is None
    assert llm.get_tokenizer() is llm.tokenizer
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate("Hello", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="tools is not supported"):
        llm.chat(HELLO, GREEDY, tools=[{"type": "function"}])
    with pytest.raises(TypeError, match=r"not a dict: pass SamplingParams\(\*\*the_dict\)"):
        llm.generate("Hello", {"max_tokens": 3})
    # cumulative_logprob: the sum of the tokens' logprobs, where they were asked for
    (scored,) = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    assert scored.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in scored.logprobs))
    assert scored.cumulative_logprob < 0 and text.cumulative_logprob is None


def test_vllms_constructor_arguments_that_change_nothing_are_taken(model_dirs):
    from engine import LLM
    llm = LLM(str(model_dirs["tiny"]), max_model_len=64, trust_remote_code=True, revision=None, swap_space=4,
              disable_log_stats=True, kv_cache_memory_bytes=1 << 26)
    try:
        assert llm.engine.config.kv_cache_memory_gib == pytest.approx(1 / 16)
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError, match="the engine was shut down"):   # with one rank as with several
        llm.generate("Hello", GREEDY)
    with pytest.raises(ValueError, match=r"LLM\(quantization='awq'\) is not supported"):
        LLM(str(model_dirs["tiny"]), quantization="awq")
    with pytest.raises(ValueError, match="unknown argument 'max_modle_len'.*max_model_len"):
        LLM(str(model_dirs["tiny"]), max_modle_len=64)


def test_named_templates_and_template_arguments_in_the_kwargs(llm):
    own = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = {"default": own, "tool_use": "{{ 'tools' }}"}     # named templates
    try:
        assert llm.chat(HELLO, GREEDY)[0].prompt_token_ids == _rendered(llm, HELLO, add_generation_prompt=True,
                                                                        chat_template=own)
    finally:
        llm.tokenizer.chat_template = own
    # the template and its traits are the call's own: not set behind them through the kwargs
    with pytest.raises(ValueError, match="chat_template_kwargs may not set chat_template"):
        llm.chat(HELLO, GREEDY, chat_template_kwargs={"chat_template": "{{ 'x' }}"})
    with pytest.raises(ValueError, match="may not set tools"):
        llm.chat(HELLO, GREEDY, chat_template_kwargs={"tools": [{"type": "function"}]})
