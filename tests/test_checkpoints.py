"""Checkpoint variants the loader and model must handle: RoPE scalings given
only in config.json, sharded safetensors with an index, 16-bit dtypes, and the
`pdserve` command that makes checkpoints."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import Reference


def _prompts(n=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def _with_rope(src, dst, rope):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    cfg.pop("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# (dynamic NTK is the plain RoPE within max_position_embeddings, where this runs: its scaled
# frequencies are checked apart, below)
@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0}])
def test_rope_scaling_variants_match_transformers(rope, model_dirs, tmp_path):
    d = _with_rope(model_dirs["tiny"], tmp_path / rope["rope_type"], rope)
    llm = LLM(str(d), max_model_len=512)
    ref = Reference(d)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref.greedy(tuple(p), 16)


def test_dynamic_rope_past_the_original_context_has_transformers_frequencies_at_that_length(model_dirs, tmp_path):
    """Within max_position_embeddings dynamic NTK is the plain RoPE (a greedy comparison
    there checks nothing of it): this checks its scaled frequencies, fixed for an engine of
    2,048 positions, against transformers' at a 2,048-token sequence."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.model import ModelConfig
    from engine.model.rotary import inverse_frequencies
    d = _with_rope(model_dirs["tiny"], tmp_path / "dyn", {"rope_type": "dynamic", "factor": 2.0})
    config = ModelConfig.from_pretrained(d)
    ours = inverse_frequencies(config, 2048)
    theirs, scaling = ROPE_INIT_FUNCTIONS["dynamic"](AutoConfig.from_pretrained(d), "cpu", seq_len=2048)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert scaling == 1.0
    assert not torch.allclose(ours, inverse_frequencies(config, 1024))     # scaled: not the plain frequencies


def test_linear_and_dynamic_rope_scalings_reach_past_max_position_embeddings(model_dirs, tmp_path, caplog):
    # how such checkpoints extend their context (vLLM takes max_position_embeddings x factor);
    # they were refused past max_position_embeddings, and the dynamic-NTK code never ran
    from engine.model import ModelConfig
    from engine.model_worker import resolve_max_model_len
    from engine.engine_config import EngineConfig
    linear = _with_rope(model_dirs["tiny"], tmp_path / "lin", {"rope_type": "linear", "factor": 4.0})
    mc = ModelConfig.from_pretrained(linear)
    assert (mc.max_position_embeddings, mc.longest_context, mc.default_context) == (1024, 4096, 4096)
    dynamic_dir = _with_rope(model_dirs["tiny"], tmp_path / "dyn", {"rope_type": "dynamic", "factor": 2.0})
    dynamic = ModelConfig.from_pretrained(dynamic_dir)
    # dynamic: fixed for the engine's context, as vLLM; past 1024 that differs from transformers'
    # frequencies for shorter sequences, so it is asked for, not the default
    assert (dynamic.longest_context, dynamic.default_context) == (2048, 1024)
    with caplog.at_level("WARNING", logger="engine.model.model_config"):
        assert resolve_max_model_len(EngineConfig(model=str(dynamic_dir), max_model_len=1024), dynamic) == 1024
        assert not caplog.records                              # within max_position_embeddings: transformers'
        assert resolve_max_model_len(EngineConfig(model=str(dynamic_dir), max_model_len=2048), dynamic) == 2048
    assert "every output, short prompts' too, differs from transformers'" in caplog.text
    with pytest.raises(ValueError, match=r"\(2048: its max_position_embeddings 1024 times its dynamic RoPE "
                                         r"scaling factor 2\)"):
        resolve_max_model_len(EngineConfig(model=str(dynamic_dir), max_model_len=3000), dynamic)
    # past max_position_embeddings, linear scaling is what transformers computes too
    llm = LLM(str(linear), max_model_len=1400)
    prompt = [random.Random(3).randrange(3, 512) for _ in range(1200)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.token_ids == Reference(linear).greedy(tuple(prompt), 8)


def test_rope_scaling_changes_the_output(model_dirs, tmp_path):
    """Guards the test above: a scaled RoPE is not silently ignored."""
    d = _with_rope(model_dirs["tiny"], tmp_path / "lin", {"rope_type": "linear", "factor": 4.0})
    plain, scaled = LLM(str(model_dirs["tiny"]), max_model_len=512), LLM(str(d), max_model_len=512)
    prompts = _prompts(6, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    a = [o.token_ids for o in plain.generate(prompts, params)]
    b = [o.token_ids for o in scaled.generate(prompts, params)]
    assert a != b


def test_sharded_checkpoint_with_index(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = model_dirs["tiny-qwen2"]
    d = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.save_pretrained(str(d), max_shard_size="60KB")
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(d))
    assert len(list(d.glob("*.safetensors"))) > 2 and (d / "model.safetensors.index.json").exists()
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    whole = [o.token_ids for o in LLM(str(src), max_model_len=256).generate(prompts, params)]
    parts = [o.token_ids for o in LLM(str(d), max_model_len=256).generate(prompts, params)]
    assert parts == whole


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype, model_dirs):
    prompts = _prompts(10, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    fp32 = LLM(str(model_dirs["tiny"]), max_model_len=256, dtype="float32")
    half = LLM(str(model_dirs["tiny"]), max_model_len=256, dtype=dtype)
    assert half.engine.kv_cache.tensor.dtype == getattr(torch, dtype)
    assert next(half.engine.model.parameters()).dtype == getattr(torch, dtype)
    a = [o.token_ids[0] for o in fp32.generate(prompts, params)]
    b = [o.token_ids[0] for o in half.generate(prompts, params)]
    assert sum(x == y for x, y in zip(a, b)) >= 8, (a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(model_dirs):
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    cpu = LLM(str(model_dirs["tiny"]), max_model_len=256, device="cpu")
    gpu = LLM(str(model_dirs["tiny"]), max_model_len=256, device="cuda", dtype="float32")
    assert [o.token_ids for o in gpu.generate(prompts, params)] == \
        [o.token_ids for o in cpu.generate(prompts, params)]


def test_cli_makes_a_model_and_generates(tmp_path, capsys):
    from cluster.cli.main import main
    d = tmp_path / "cli-model"
    assert main(["make-tiny-model", str(d), "--preset", "tiny-mqa"]) == 0
    assert (d / "config.json").exists() and (d / "tokenizer.json").exists()
    assert main(["generate", "--model", str(d), "--prompt", "Hello there", "--max-tokens", "7",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "-> 7 tokens, finish_reason=length" in out
    assert main(["generate", "--model", str(d), "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["make-tiny-model", str(d), "--preset", "nope"]) == 2


def test_default_model_is_built_once(tmp_path, monkeypatch):
    from engine.tiny_model import default_model_dir, ensure_default_model
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    path = ensure_default_model()
    assert path == default_model_dir() and str(path).startswith(str(tmp_path))
    stamp = (path / "config.json").stat().st_mtime_ns
    assert ensure_default_model() == path and (path / "config.json").stat().st_mtime_ns == stamp
    out = LLM(None, max_model_len=128).generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}    # None: the key left out
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, says", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
     r"quantized checkpoints \(quant_method=fp8\) are not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
     r"per-layer-type RoPE parameters \(full_attention, sliding_attention\) are not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 with linear RoPE is not supported"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types chunked_attention are not supported: pdserve's layers attend as full_attention or "
     "sliding_attention"),
])
def test_checkpoints_the_model_would_compute_wrongly_are_refused(model_dirs, tmp_path, changes, says):
    # each of these loaded and gave wrong logits (an fp8 weight cast without its scale, a GELU MLP run as SiLU,
    # per-layer RoPE or a partial rotation run as one full RoPE)
    from engine.model import ModelConfig, ModelConfigError
    d = _with_config(model_dirs["tiny"], tmp_path / "variant", **changes)
    with pytest.raises(ModelConfigError, match=says):
        ModelConfig.from_pretrained(d)


def test_eos_ids_join_generation_config_jsons_unless_it_is_absent_or_unreadable(model_dirs, tmp_path):
    from engine.model import ModelConfig
    d = tmp_path / "generation"
    shutil.copytree(model_dirs["tiny"], d)
    config_eos = json.loads((d / "config.json").read_text())["eos_token_id"]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [config_eos, 300, 301]}))
    assert ModelConfig.from_pretrained(d).eos_token_ids == (config_eos, 300, 301)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 300}))
    assert ModelConfig.from_pretrained(d).eos_token_ids == (config_eos, 300)
    (d / "generation_config.json").write_text("{not json")
    assert ModelConfig.from_pretrained(d).eos_token_ids == (config_eos,)
    (d / "generation_config.json").unlink()
    assert ModelConfig.from_pretrained(d).eos_token_ids == (config_eos,)


def test_a_qwen2_config_whose_layers_slide_caps_the_context_at_its_window(model_dirs, tmp_path, caplog):
    # Qwen2 slides only with use_sliding_window, from layer max_window_layers on; sliding-window
    # attention is not implemented, so the context is capped at the window (as for Mistral)
    from engine.model import ModelConfig
    # (no layer_types: transformers derives them from use_sliding_window and max_window_layers)
    sliding = _with_config(model_dirs["tiny-qwen2"], tmp_path / "sliding", use_sliding_window=True,
                           sliding_window=32, max_window_layers=0, layer_types=None)
    off = _with_config(model_dirs["tiny-qwen2"], tmp_path / "off", use_sliding_window=False, sliding_window=32,
                       layer_types=None)
    assert ModelConfig.from_pretrained(sliding).sliding_window == 32
    assert ModelConfig.from_pretrained(off).sliding_window is None
    with caplog.at_level("INFO", logger="engine.model.model_config"):
        llm = LLM(str(sliding))
    assert llm.engine.max_model_len == 32
    assert "max_model_len 32: the model's sliding window" in caplog.text      # said, not silent


def test_a_context_past_the_sliding_window_is_refused_naming_the_window(model_dirs, tmp_path):
    d = _with_config(model_dirs["tiny-mistral"], tmp_path / "window", sliding_window=32)
    with pytest.raises(ValueError, match=r"supports \(32: its attention slides over a window of 32 tokens, which "
                                         r"pdserve does not implement \(its max_position_embeddings is 1024\)\)"):
        LLM(str(d), max_model_len=512)


def test_weights_are_made_in_the_serving_dtype():
    # made in float32 and cast after, a model would need twice its memory while it is built
    from engine.model import ModelConfig, build_model
    from engine.tiny_model import ensure_preset_model
    config = ModelConfig.from_pretrained(ensure_preset_model("tiny"))
    made = []
    real = torch.nn.Parameter.__new__

    def record(cls, data=None, requires_grad=True):
        made.append(data.dtype)
        return real(cls, data, requires_grad)
    torch.nn.Parameter.__new__ = record
    try:
        model = build_model(config, max_positions=64, dtype=torch.bfloat16, device="meta")
    finally:
        torch.nn.Parameter.__new__ = real
    assert made and set(made) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


def test_a_build_leaves_other_threads_tensors_in_their_dtype():
    # torch's default dtype is the process's: a build that set it would make another engine's
    # thread (a sampler's counts, a step's inputs) create bfloat16 tensors while it ran
    import threading
    from engine.model import ModelConfig, build_model
    from engine.tiny_model import ensure_preset_model
    config = ModelConfig.from_pretrained(ensure_preset_model("tiny"))
    building, other_made = threading.Event(), threading.Event()
    seen = []
    real = torch.nn.Parameter.__new__

    def pause_in_the_build(cls, data=None, requires_grad=True):
        if not building.is_set():
            building.set()
            assert other_made.wait(10)
        return real(cls, data, requires_grad)

    def other_engine():
        assert building.wait(10)
        seen.append(torch.ones(2).dtype)
        other_made.set()

    thread = threading.Thread(target=other_engine)
    thread.start()
    torch.nn.Parameter.__new__ = pause_in_the_build
    try:
        model = build_model(config, max_positions=64, dtype=torch.bfloat16, device="meta")
    finally:
        torch.nn.Parameter.__new__ = real
    thread.join()
    assert seen == [torch.float32]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_checkpoint_larger_than_its_config_says_is_refused(model_dirs, tmp_path):
    # each rank narrows the checkpoint to its slice: a tensor larger than config.json implies used to
    # load without complaint (the slice fits), computing with part of the weights
    from engine.model import CheckpointError
    src = model_dirs["tiny"]
    cfg = json.loads((src / "config.json").read_text())
    d = _with_config(src, tmp_path / "half", intermediate_size=cfg["intermediate_size"] // 2)
    with pytest.raises(CheckpointError, match=r"mlp\..*expected \(%d, %d\)" % (cfg["intermediate_size"] // 2,
                                                                              cfg["hidden_size"])):
        LLM(str(d))


def _rewrite_tensors(src, dst, rename):
    """A copy of checkpoint `src` whose tensors are renamed by `rename(name)`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({rename(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return dst


def test_a_config_without_architectures_runs_by_its_model_type(model_dirs, tmp_path):
    # as a bare LlamaConfig().save_pretrained() writes it; transformers picks the class from model_type
    d = _with_config(model_dirs["tiny"], tmp_path / "no-arch", architectures=None)
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = [o.token_ids for o in LLM(str(model_dirs["tiny"]), max_model_len=128).generate(prompts, params)]
    assert [o.token_ids for o in LLM(str(d), max_model_len=128).generate(prompts, params)] == expected


def test_weights_saved_without_the_model_prefix_load(model_dirs, tmp_path):
    # a base model's state dict ("layers.0...", "embed_tokens.weight"), as transformers loads it too
    d = _rewrite_tensors(model_dirs["tiny"], tmp_path / "bare", lambda k: k.removeprefix("model."))
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = [o.token_ids for o in LLM(str(model_dirs["tiny"]), max_model_len=128).generate(prompts, params)]
    assert [o.token_ids for o in LLM(str(d), max_model_len=128).generate(prompts, params)] == expected


def test_fused_projections_and_a_broken_index_are_checkpoint_errors(model_dirs, tmp_path):
    from engine.model import CheckpointError
    fused = _rewrite_tensors(model_dirs["tiny"], tmp_path / "fused",
                             lambda k: k.replace("self_attn.q_proj", "self_attn.qkv_proj"))
    with pytest.raises(CheckpointError, match=r"qkv_proj.* a fused projection"):
        LLM(str(fused))
    broken = shutil.copytree(model_dirs["tiny"], tmp_path / "broken-index")
    (broken / "model.safetensors").rename(broken / "model-00001-of-00001.safetensors")
    (broken / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"is not a safetensors index .*KeyError"):
        LLM(str(broken))


def test_the_one_model_file_wins_over_a_leftover_index_and_its_shards(model_dirs, tmp_path):
    # transformers reads model.safetensors before an index; the engine read the index first, so a
    # newer model.safetensors copied over an older sharded revision served the old shards' weights,
    # and a save_pretrained over a sharded save (it removes the shards, keeps their index) was refused
    from transformers import AutoModelForCausalLM
    src = model_dirs["tiny-qwen2"]
    old = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for p in old.parameters():
            p.mul_(1.5)
    old.save_pretrained(str(tmp_path / "old"), max_shard_size="60KB")
    d = shutil.copytree(src, tmp_path / "updated")
    for f in (tmp_path / "old").glob("model*.safetensors*"):
        shutil.copy(f, d / f.name)
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 2
    prompts = _prompts()
    expected = _greedy_ids(src, prompts)
    assert _greedy_ids(d, prompts) == expected
    shutil.copytree(src, tmp_path / "old", dirs_exist_ok=True, ignore=shutil.ignore_patterns("model*"))
    assert _greedy_ids(tmp_path / "old", prompts) != expected      # the shards hold other weights
    for shard in d.glob("model-*.safetensors"):
        shard.unlink()
    assert _greedy_ids(d, prompts) == expected


def _greedy_ids(model_dir, prompts, max_tokens=8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in LLM(str(model_dir), max_model_len=128).generate(prompts, params)]


def test_a_tied_config_whose_checkpoint_stores_a_trained_head_runs_that_head(model_dirs, tmp_path):
    # a fine-tune of a tied model that trained lm_head but kept tie_word_embeddings: transformers
    # keeps the stored head (they differ), where the engine used to drop it for the embedding
    from safetensors.torch import load_file, save_file
    d = tmp_path / "trained-head"
    shutil.copytree(model_dirs["tiny-mqa"], d)
    [path] = d.glob("*.safetensors")
    tensors = load_file(str(path))
    assert "lm_head.weight" not in tensors          # a tied model is saved with the embedding alone
    generator = torch.Generator().manual_seed(5)
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn(embedding.shape, generator=generator) * embedding.std()
    save_file(tensors, str(path), metadata={"format": "pt"})
    prompts = _prompts(3)
    got = _greedy_ids(d, prompts)
    reference = Reference(d)
    assert got == [reference.greedy(tuple(p), 8, ignore_eos=True) for p in prompts]
    assert got != _greedy_ids(model_dirs["tiny-mqa"], prompts)   # the head changed the output


def test_a_tied_checkpoint_that_stores_only_the_head_loads_it_as_the_embedding(model_dirs, tmp_path):
    # transformers ties to whichever of the pair the checkpoint has
    d = _rewrite_tensors(model_dirs["tiny-mqa"], tmp_path / "head-only",
                         lambda k: "lm_head.weight" if k == "model.embed_tokens.weight" else k)
    prompts = _prompts(2)
    reference = Reference(d)
    assert _greedy_ids(d, prompts) == [reference.greedy(tuple(p), 8, ignore_eos=True) for p in prompts]
    assert _greedy_ids(d, prompts) == _greedy_ids(model_dirs["tiny-mqa"], prompts)


def test_the_model_class_follows_model_type_as_transformers_picks_it(model_dirs, tmp_path):
    # a Qwen2 config listing LlamaForCausalLM still runs as Qwen2 (q/k/v biases) in transformers
    d = _with_config(model_dirs["tiny-qwen2"], tmp_path / "qwen2-as-llama", architectures=["LlamaForCausalLM"])
    prompts = _prompts(2)
    reference = Reference(d)
    assert type(reference.model).__name__ == "Qwen2ForCausalLM"
    assert _greedy_ids(d, prompts) == [reference.greedy(tuple(p), 8, ignore_eos=True) for p in prompts]


def test_weights_no_parameter_takes_are_refused_not_dropped(model_dirs, tmp_path):
    # a Qwen3 checkpoint whose config says llama loaded without its query/key norms: garbage, silently
    from engine.model import CheckpointError
    d = _with_config(model_dirs["tiny-qwen3"], tmp_path / "qwen3-as-llama", model_type="llama",
                     architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"holds 4 tensor\(s\) that no parameter of LlamaForCausalLM takes: "
                                              r"model.layers.0.self_attn.k_norm.weight"):
        LLM(str(d))


def test_rotary_caches_a_trainer_saved_are_skipped_as_transformers_skips_them(model_dirs, tmp_path):
    # (inv_freq, cos_cached, sin_cached: computed from the config here; vLLM skips them too)
    from safetensors.torch import load_file, save_file
    d = tmp_path / "with-rotary-caches"
    shutil.copytree(model_dirs["tiny"], d)
    weights = load_file(d / "model.safetensors")
    for cache in ("inv_freq", "cos_cached", "sin_cached"):
        weights[f"model.layers.0.self_attn.rotary_emb.{cache}"] = torch.ones(8)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(2)
    assert _greedy_ids(d, prompts) == _greedy_ids(model_dirs["tiny"], prompts)


def test_model_safetensors_is_the_checkpoint_whatever_other_files_lie_beside_it(model_dirs, tmp_path):
    # a repository may keep another format beside transformers' file (Mistral's consolidated.safetensors,
    # the same weights under other names): transformers reads model.safetensors alone, and so must we
    from safetensors.torch import load_file, save_file
    d = tmp_path / "with-consolidated"
    shutil.copytree(model_dirs["tiny"], d)
    weights = load_file(d / "model.safetensors")
    save_file({f"layers.{k.replace('.', '_')}": v for k, v in weights.items()}, d / "consolidated.safetensors")
    prompts = _prompts(2)
    assert _greedy_ids(d, prompts) == _greedy_ids(model_dirs["tiny"], prompts)


def test_bias_flags_apply_only_where_transformers_reads_them(model_dirs):
    # Mistral's and Qwen2's projections fix their biases; Llama and Qwen3 read attention_bias, Llama mlp_bias
    from types import SimpleNamespace

    from engine.model import ModelConfig
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                attention_bias=True, mlp_bias=True)
    flags = {}
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        config = ModelConfig.from_hf_config(SimpleNamespace(model_type=model_type, **base))
        flags[model_type] = (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm)
    assert flags == {"llama": (True, True, True, False), "mistral": (False, False, False, False),
                     "qwen2": (True, False, False, False), "qwen3": (True, True, False, True)}


def test_a_classifier_of_a_supported_family_is_refused_not_served_as_a_generator(model_dirs, tmp_path):
    # model_type picks the class, but a checkpoint whose architectures are all heads of another kind
    # (a reward model, a classifier) has no language-model head to generate with
    from engine.model import ModelConfig, ModelConfigError
    for arch in ("LlamaForSequenceClassification", "Qwen2ForRewardModel"):
        d = _with_config(model_dirs["tiny"], tmp_path / arch, architectures=[arch])
        with pytest.raises(ModelConfigError, match=f"{arch} is not a causal language model"):
            ModelConfig.from_pretrained(d)


def test_a_tied_config_beside_unreadable_weight_files_still_reads(model_dirs, tmp_path):
    # `pdserve plan` and the deploy step need config.json alone: weight files that are LFS pointers
    # (or a truncated download) made the tied-head check raise a SafetensorError traceback
    from engine.model import ModelConfig
    d = tmp_path / "pointers"
    shutil.copytree(model_dirs["tiny-mqa"], d)
    for path in d.glob("*.safetensors"):
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    assert ModelConfig.from_pretrained(d).tie_word_embeddings is True
