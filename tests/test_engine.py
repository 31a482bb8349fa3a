"""Engine behaviour beyond greedy parity: stop conditions, streaming, seeds,
logprobs, aborts, and refusing bad input without disturbing other requests."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.model import CheckpointError, ModelConfigError
from tests.conftest import Reference


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(str(model_dirs["tiny"]), max_model_len=256)


def _greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


PROMPT = "The quick brown fox jumps over"


# ---- logit bias and allowed tokens ---------------------------------------------------------
def test_logit_bias_and_allowed_token_ids_steer_every_token_of_a_batch(llm):
    plain = llm.generate([PROMPT], _greedy(8))[0].token_ids
    favoured = next(t for t in range(5, 200) if t not in plain)
    out = llm.generate([PROMPT] * 3, [_greedy(8, logit_bias={favoured: 100.0}), _greedy(8),
                                      SamplingParams(max_tokens=30, ignore_eos=True, seed=4,
                                                     allowed_token_ids=[7, favoured])])
    assert out[0].token_ids == [favoured] * 8
    assert out[1].token_ids == plain                    # a neighbour in the batch is untouched
    assert set(out[2].token_ids) == {7, favoured}       # sampled, only from the allowed two
    # a bias that leaves the favourite on top changes nothing; one that drops it, the first token
    assert llm.generate([PROMPT], _greedy(8, logit_bias={plain[0]: 1.0}))[0].token_ids == plain
    assert llm.generate([PROMPT], _greedy(1, logit_bias={plain[0]: -100.0}))[0].token_ids != plain[:1]


def test_allowed_tokens_that_min_tokens_forbids_are_refused(llm):
    engine = llm.engine
    eos = engine.eos_token_ids[0]
    try:
        with pytest.raises(InvalidRequestError, match="allows only tokens that end the output") as info:
            engine.add_request("r", [5, 6], SamplingParams(allowed_token_ids=[eos, 9], stop_token_ids=[9],
                                                           min_tokens=2))
        assert info.value.param == "allowed_token_ids"
        engine.add_request("ok", [5, 6], SamplingParams(allowed_token_ids=[eos], max_tokens=2))   # no min_tokens
    finally:
        for request_id in ("r", "ok"):        # the engine is the module's: leave nothing in it
            engine.abort_request(request_id)


# ---- stop conditions -------------------------------------------------------------------
def test_stop_string_is_cut_and_never_streamed(llm):
    full = llm.generate(PROMPT, _greedy())[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut_at = full.text.index(stop)
    out = llm.generate(PROMPT, _greedy(stop=[stop]))[0]
    assert out.text == full.text[:cut_at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    deltas = [o.delta_text for o in llm.stream(PROMPT, _greedy(stop=[stop]))]
    assert "".join(deltas) == out.text
    assert all(stop not in "".join(deltas[:i + 1]) for i in range(len(deltas)))


def test_a_kept_stop_string_ends_the_text_and_streams_without_hold_back(llm):
    full = llm.generate(PROMPT, _greedy())[0]
    stop = full.text[3:6]
    end = full.text.index(stop) + len(stop)
    out = llm.generate(PROMPT, _greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert out.text == full.text[:end] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    deltas = [o.delta_text for o in llm.stream(PROMPT, _greedy(stop=[stop], include_stop_str_in_output=True))]
    assert "".join(deltas) == out.text
    # nothing held back: each token's text goes out with it (the tiny model's tokens are whole characters)
    assert all(len(d) > 0 for d in deltas[:-1]), deltas


def test_stop_token_id_ends_generation(llm):
    full = llm.generate(PROMPT, _greedy())[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPT, _greedy(stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    full = llm.generate(PROMPT, _greedy())[0]
    stop_id = full.token_ids[0]
    out = llm.generate(PROMPT, _greedy(stop_token_ids=[stop_id], min_tokens=6))[0]
    assert len(out.token_ids) >= 6
    assert stop_id not in out.token_ids[:6]
    # ... and no longer: a stop token first sampled past min_tokens ends the request right there
    late = next(p for p in range(6, len(full.token_ids)) if full.token_ids[p] not in full.token_ids[:p])
    stop_id = full.token_ids[late]
    out = llm.generate(PROMPT, _greedy(stop_token_ids=[stop_id], min_tokens=6))[0]
    assert out.token_ids == full.token_ids[:late + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPT, _greedy(max_tokens=5))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_ends_generation_unless_ignored(llm, reference):
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(40)]
    eos = llm.tokenizer.eos_token_id
    ref = reference("tiny")
    ending = [p for p in prompts if eos in ref.greedy(tuple(p), 40)]
    assert ending, "some random prompt should reach EOS within 40 tokens"
    p = ending[0]
    stopped = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert stopped.token_ids == ref.greedy(tuple(p), 40)
    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids[-1]) == ("stop", None, eos)
    assert "<|end_of_text|>" not in stopped.text
    ignored = llm.generate([p], _greedy(max_tokens=40))[0]
    assert len(ignored.token_ids) == 40 and ignored.token_ids[:len(stopped.token_ids)] == stopped.token_ids


def test_generation_config_eos_ids_end_generation_as_in_transformers(model_dirs, reference, tmp_path):
    # generation_config.json may list EOS ids config.json lacks (Llama-3-Instruct's <|eot_id|>)
    d = tmp_path / "generation-eos"
    shutil.copytree(model_dirs["tiny"], d)
    prompt = (7, 99, 23, 311, 42, 5)
    free = reference("tiny").greedy(prompt, 20, ignore_eos=True)
    extra = free[5]
    generation = json.loads((d / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], extra]
    (d / "generation_config.json").write_text(json.dumps(generation))
    expected = Reference(d).greedy(prompt, 20)
    assert expected == free[:free.index(extra) + 1]
    llm = LLM(str(d), max_model_len=256)
    assert extra in llm.engine.eos_token_ids and llm.tokenizer.eos_token_id in llm.engine.eos_token_ids
    stopped = llm.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert stopped.token_ids == expected and stopped.finish_reason == "stop"
    assert stopped.stop_reason == extra          # vLLM's: an EOS other than the model's main one is named
    assert llm.generate([list(prompt)], _greedy(max_tokens=20))[0].token_ids == free
    # min_tokens bans it as it bans the tokenizer's EOS
    banned = llm.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8))[0]
    assert extra not in banned.token_ids[:8]


def test_context_length_ends_generation(model_dirs):
    llm = LLM(str(model_dirs["tiny"]), max_model_len=40)
    prompt = list(range(5, 35))
    out = llm.generate([prompt], _greedy(max_tokens=100))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


# ---- streaming and detokenization ------------------------------------------------------
def test_stream_deltas_add_up_to_the_full_text(llm):
    final = llm.generate(PROMPT, _greedy(max_tokens=40))[0]
    chunks = list(llm.stream(PROMPT, _greedy(max_tokens=40)))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == final.text
    assert [t for c in chunks for t in c.delta_token_ids] == final.token_ids
    assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_streams_and_generate_may_interleave_on_one_llm(llm):
    # whichever call steps the engine keeps the other open streams' outputs for them: before,
    # a stream whose last output came out of another call's step waited for it for ever
    from engine.outputs import OutputKind
    short, long = _greedy(max_tokens=4), _greedy(max_tokens=12)
    expected = {p: llm.generate(p, params)[0].token_ids for p, params in (("Hello", short), (PROMPT, long))}
    a = llm.stream("Hello", short, output_kind=OutputKind.DELTA)
    b = llm.stream(PROMPT, long, output_kind=OutputKind.DELTA)
    got = {"Hello": [], PROMPT: []}
    for name, stream in (("Hello", a), (PROMPT, b)):
        got[name] += next(stream).delta_token_ids
    assert llm.generate("Hello", long)[0].token_ids[:4] == expected["Hello"]   # steps both streams too
    got["Hello"] += [t for out in a for t in out.delta_token_ids]              # every delta kept, none lost
    got[PROMPT] += [t for out in b for t in out.delta_token_ids]
    assert got == expected
    assert not llm.engine.has_unfinished_requests()


def test_generate_waits_for_its_own_requests_not_for_others_in_the_engine(llm):
    """A request added on the engine directly (or left by another caller) that finishes
    first is not counted as one of this call's (it raised KeyError, and aborted the
    call's own prompts)."""
    other = llm.engine.add_request(None, "x", _greedy(max_tokens=1))
    outs = llm.generate(["Hello", PROMPT], [_greedy(max_tokens=2), _greedy(max_tokens=8)])
    assert other not in [o.request_id for o in outs]
    assert [(o.finished, len(o.token_ids)) for o in outs] == [(True, 2), (True, 8)]
    while llm.engine.has_unfinished_requests():                 # the other one ran beside them
        llm.engine.step()
    with pytest.raises(ValueError, match="output_kind must be an OutputKind"):
        next(llm.stream("Hello", _greedy(max_tokens=2), output_kind="delta"))


def test_an_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    steps = 0
    real_step = llm.engine.step

    def step_then_interrupt():
        nonlocal steps
        steps += 1
        if steps == 2:
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", PROMPT], _greedy())
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPT, _greedy())[0].token_ids) == 24


def test_prompt_forms_agree(llm):
    ids = llm.tokenizer.encode(PROMPT)
    a = llm.generate(PROMPT, _greedy())[0]
    b = llm.generate([ids], _greedy())[0]
    c = llm.generate({"prompt_token_ids": ids}, _greedy())[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert a.prompt_token_ids == ids


# ---- sampling ----------------------------------------------------------------------------
def test_seed_gives_same_output_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=s) for s in (None, 1, 2)]
    batch = llm.generate(["a b c", "hello", PROMPT, "x y"], [others[0], others[1], seeded, others[2]])
    assert batch[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99, ignore_eos=True)
    assert llm.generate(PROMPT, other_seed)[0].token_ids != alone


def test_every_bit_of_a_seed_counts(llm):
    # torch's CPU generator keeps a seed's low 32 bits: 7 and 7 + 2**40 drew the same tokens, as did
    # 0, 2**32 and -2**63
    def draw(seed):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        return tuple(llm.generate(PROMPT, params)[0].token_ids)
    big = 8699380357385945087       # and a request's choices take seed + index: neighbours stay apart
    assert len({draw(7), draw(7 + 2**40), draw(0), draw(2**32), draw(-2**63), draw(-2), draw(big),
                draw(big + 1)}) == 8    # (-1 is no seed, as vLLM reads it)
    # a seed below 2**32 seeds torch's generator as it is: its tokens are what they were
    from engine.sampler import seeded_generator
    assert torch.equal(seeded_generator(7, "cpu").get_state(), torch.Generator().manual_seed(7).get_state())
    # a seed is its 64 bits, signed or not: -2 and 2**64 - 2 draw alike (a choice's seed wraps so)
    assert draw(2**64 - 2) == draw(-2) != draw(2**64 - 1)


def test_logprobs_match_transformers(llm, reference):
    ref = reference("tiny")
    out = llm.generate(PROMPT, _greedy(max_tokens=5, logprobs=3))[0]
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = ref.model(torch.tensor([ids + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[len(ids) - 1:-1]
    assert len(out.logprobs) == 5
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.rank == 1  # greedy picks the best
        assert lp.logprob == pytest.approx(expected[step, lp.token_id].item(), abs=1e-4)
        top_ids = expected[step].topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids


# ---- aborts and bad input ----------------------------------------------------------------
def test_abort_frees_blocks(model_dirs):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256))
    keep = engine.add_request("keep", PROMPT, _greedy(max_tokens=8))
    gone = engine.add_request("gone", "another prompt here", _greedy(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.abort_request(gone)
    assert not engine.abort_request("nope")
    finals = engine.run_to_completion()
    assert [o.request_id for o in finals] == [keep]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 2, 10**6], r"token id 1000000 at position 2 is outside the vocabulary \[0, 512\)"),
    ([-1], "token id -1 at position 0"),
    (list(range(1, 257)), r"256 tokens but the model's context is 256 tokens.*at most 255"),
])
def test_bad_prompts_are_refused_and_others_continue(model_dirs, reference, prompt, match):
    engine = LLMEngine(EngineConfig(model=str(model_dirs["tiny"]), max_model_len=256))
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("good", ids, SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()
    with pytest.raises(InvalidRequestError, match=match) as err:
        engine.add_request("bad", prompt, _greedy())
    assert err.value.param == "prompt"
    (out,) = engine.run_to_completion()
    assert out.token_ids == reference("tiny").greedy(tuple(ids), 12)


def test_bad_stop_token_and_duplicate_id(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids.*99999"):
        engine.add_request("x", PROMPT, SamplingParams(stop_token_ids=[99999]))
    engine.add_request("dup", PROMPT, _greedy(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", PROMPT, _greedy())
    engine.run_to_completion()


def test_a_prompt_of_no_prompt_form_is_named_with_its_index(llm):
    import numpy as np
    import torch
    for prompts, says in ((np.array([1, 2, 3]), "got ndarray"), (torch.tensor([1, 2]), "got Tensor"),
                          (["a", [1, True]], "prompt 1 must be a str, a list of int token ids"),
                          (["a", {"prompt_token_ids": np.array([1, 2])}], "prompt 1 must be .* holding ndarray"),
                          # bytes are a sequence of ints: they ran as token ids
                          (b"Hello", "got bytes"), ([{"prompt": b"Hello"}], "prompt 0 must be"),
                          ([{"prompt": 123}], "prompt 0 must be"), ([{"prompt": None}], "prompt 0 must be")):
        with pytest.raises(ValueError, match=says):        # (a TypeError from deep inside, or "outside the vocabulary")
            llm.generate(prompts, _greedy(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([{"prompt_token_ids": (5, 6, 7)}], _greedy(max_tokens=1))[0].finished     # a tuple is fine
    # a prompt_token_ids of None leaves the text to decide (it was list(None), a TypeError)
    assert llm.generate([{"prompt": "fine", "prompt_token_ids": None}], _greedy(max_tokens=1))[0].finished
    with pytest.raises(InvalidRequestError, match="prompt must be text or a list of token ids; got bytes"):
        llm.engine.add_request("raw-bytes", b"Hello", _greedy(max_tokens=1))
    # one dict prompt is checked as one in a list is (it ran its ids unchecked: "token id 'a' ... is
    # outside the vocabulary")
    for prompt, says in (({"prompt_token_ids": "abc"}, "prompt 0 must be .* holding str"),
                         ({"prompt_token_ids": np.array([1, 2])}, "prompt 0 must be .* holding ndarray")):
        with pytest.raises(ValueError, match=says):
            llm.generate(prompt, _greedy(max_tokens=1))
    # the engine takes numpy and torch integers for ids, and names what is not one
    llm.engine.add_request("np-ids", [np.int64(5), torch.tensor(6), 7], _greedy(max_tokens=1))
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert outs[-1].prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in outs[-1].prompt_token_ids)
    for ids, says in (([5.0], "float 5.0 at position 0"), ([1, True], "bool True at position 1"),
                      ([torch.tensor(True)], "Tensor tensor\\(True\\) at position 0"),
                      ([torch.tensor([[6]])], "Tensor tensor\\(\\[\\[6\\]\\]\\) at position 0")):
        with pytest.raises(InvalidRequestError, match=f"prompt token ids must be integers; got {says}"):
            llm.engine.add_request("bad-ids", ids, _greedy(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_generate_validates_every_prompt_before_running(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate(["fine", ""], _greedy())
    assert not llm.engine.has_unfinished_requests()


def test_unknown_architecture_is_named(model_dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"unsupported model_type 'gpt2'.*GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(d))


def test_a_multimodal_config_is_named_by_its_type_not_its_missing_sizes(model_dirs, tmp_path):
    # Llama-3.2-Vision keeps its sizes under text_config: "needs vocab_size" would send the user the wrong way
    d = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], d)
    cfg = json.loads((d / "config.json").read_text())
    text_config = {k: cfg.pop(k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads")}
    cfg.update(architectures=["MllamaForConditionalGeneration"], model_type="mllama", text_config=text_config)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"unsupported model_type 'mllama'.*MllamaForConditional"):
        LLM(str(d))


def test_missing_tensor_is_named(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], d)
    (f,) = d.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        LLM(str(d))


@pytest.mark.parametrize("damage", ["lfs_pointer", "truncated"])
def test_an_unreadable_weights_file_is_named_with_its_likely_cause(model_dirs, tmp_path, damage):
    d = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], d)
    (f,) = d.glob("*.safetensors")
    if damage == "lfs_pointer":     # cloned without `git lfs pull`
        f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 1234567\n")
    else:                           # a download that stopped half way: the header reads, the data does not
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{f.name} is not a readable safetensors file \(a Git LFS "):
        LLM(str(d))


def test_missing_config_and_bad_options(tmp_path, model_dirs):
    with pytest.raises(ModelConfigError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match=r"max_model_len \(5000\) is larger than the model supports \(1024: its "
                                         r"max_position_embeddings is 1024\)"):
        LLM(str(model_dirs["tiny"]), max_model_len=5000)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        LLM(str(model_dirs["tiny"]), max_model_len=256, num_kv_blocks=3)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig(model="x", block_size=0)
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):   # (it started, then refused all)
        EngineConfig(model="x", max_model_len=1)
    # values that pass for others: "false" is true, None fails deep in torch (a bare TypeError)
    for bad, says in (({"enable_prefix_caching": "false"}, "enable_prefix_caching must be true or false"),
                      ({"seed": None}, "seed must be an integer within 64 bits"),
                      ({"seed": 2**70}, "seed must be an integer within 64 bits"),
                      ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be a finite number"),
                      ({"kv_cache_memory_gib": float("nan")}, "kv_cache_memory_gib must be a finite number"),
                      ({"kv_transfer_staging_gib": float("inf")}, "kv_transfer_staging_gib must be a finite"),
                      # 1 == True passed the choice and missed the TP check: -1 placeholders on other ranks
                      ({"async_scheduling": 1, "tensor_parallel_size": 2}, "async_scheduling must be auto"),
                      ({"device": None}, "device must be auto, cpu or cuda")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model="x", **bad)
