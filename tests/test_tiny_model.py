"""Tiny checkpoints: loadable offline, stated shapes, deterministic, usable tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

from engine.tiny_model import (
    PRESETS,
    checkpoint_dir,
    default_model_dir,
    ensure_built_in_checkpoint,
    ensure_default_model,
    make_tiny_model,
    tokenizer_dir,
)
from engine.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]

# preset -> (model_type, heads, kv_heads, head_dim, hidden, tied, vocab)
EXPECTED = {
    "tiny": ("llama", 4, 2, 16, 64, False, 512),
    "tiny-mqa": ("llama", 4, 1, 16, 64, True, 512),
    "tiny-qwen2": ("qwen2", 4, 2, 16, 64, True, 512),
    "tiny-qwen3": ("qwen3", 4, 2, 32, 64, True, 512),
    "tiny-mistral": ("mistral", 8, 4, 32, 64, False, 512),
    "tiny-llama3-rope": ("llama", 4, 2, 16, 64, False, 512),
    "bench": ("llama", 8, 4, 64, 512, False, 8192),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """preset -> checkpoint directory, each preset built once per session."""
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = make_tiny_model(tmp_path_factory.mktemp(preset), preset)
        return built[preset]

    return get


@pytest.fixture(scope="session")
def loaded(model_dir):
    """preset -> (config, tokenizer, model), loaded the way the engine loads them."""
    cache: dict[str, tuple] = {}

    def get(preset: str):
        if preset not in cache:
            path = model_dir(preset)
            cache[preset] = (
                AutoConfig.from_pretrained(path, local_files_only=True),
                AutoTokenizer.from_pretrained(path, local_files_only=True),
                AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval(),
            )
        return cache[preset]

    return get


def test_every_preset_is_covered():
    assert set(PRESETS) == set(EXPECTED)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_loads_offline_with_stated_shapes(preset, loaded, model_dir):
    model_type, heads, kv_heads, head_dim, hidden, tied, vocab = EXPECTED[preset]
    config, tokenizer, model = loaded(preset)

    assert config.model_type == model_type
    assert config.num_attention_heads == heads
    assert config.num_key_value_heads == kv_heads
    assert getattr(config, "head_dim", None) in (None, head_dim)
    assert config.hidden_size == hidden
    assert config.tie_word_embeddings is tied
    assert config.vocab_size == len(tokenizer) == vocab

    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (heads * head_dim, hidden)
    assert tuple(attn.k_proj.weight.shape) == (kv_heads * head_dim, hidden)
    assert tuple(attn.o_proj.weight.shape) == (hidden, heads * head_dim)
    shares = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shares is tied
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(set(ids)) == 3
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    generation = GenerationConfig.from_pretrained(model_dir(preset), local_files_only=True)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids
    # Norm weights are not the all-ones default, so a loader that skips them shows.
    assert not torch.allclose(model.model.norm.weight, torch.ones_like(model.model.norm.weight))


def test_qwen2_has_nonzero_qkv_bias_and_llama_has_none(loaded):
    qwen_attn = loaded("tiny-qwen2")[2].model.layers[0].self_attn
    for proj in (qwen_attn.q_proj, qwen_attn.k_proj, qwen_attn.v_proj):
        assert proj.bias is not None
        assert proj.bias.abs().min() > 0
    assert qwen_attn.o_proj.bias is None
    llama_attn = loaded("tiny")[2].model.layers[0].self_attn
    assert llama_attn.q_proj.bias is None


def test_qwen3_has_query_and_key_norms_over_head_dim_that_are_not_ones(loaded):
    attn = loaded("tiny-qwen3")[2].model.layers[0].self_attn
    for norm in (attn.q_norm, attn.k_norm):
        assert tuple(norm.weight.shape) == (32,)
        assert not torch.allclose(norm.weight, torch.ones_like(norm.weight))
    assert attn.q_proj.bias is None and attn.o_proj.bias is None      # attention_bias false, as Qwen3's


def test_mistral_has_no_sliding_window(loaded):
    assert loaded("tiny-mistral")[0].sliding_window is None


def test_llama3_rope_scaling_round_trips_and_changes_frequencies(loaded):
    config, _, model = loaded("tiny-llama3-rope")
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0
    assert rope["low_freq_factor"] == 1.0
    assert rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 256
    assert config.max_position_embeddings == 2048

    plain = loaded("tiny")[2].model.rotary_emb.inv_freq
    scaled = model.model.rotary_emb.inv_freq
    # Wavelengths under original_max / high_freq_factor = 64 are kept; those over
    # original_max / low_freq_factor = 256 are stretched by the factor.
    assert torch.allclose(scaled[0], plain[0])
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)
    assert loaded("tiny")[0].rope_parameters["rope_type"] == "default"


def test_bench_parameter_count(loaded):
    model = loaded("bench")[2]
    assert 20_000_000 <= sum(p.numel() for p in model.parameters()) <= 50_000_000


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_gives_identical_files_different_seed_differs(tmp_path, model_dir):
    reference = _file_bytes(model_dir("tiny"))
    again = _file_bytes(make_tiny_model(tmp_path / "again", "tiny", seed=0))
    assert again == reference

    other = _file_bytes(make_tiny_model(tmp_path / "other", "tiny", seed=1))
    assert other.keys() == reference.keys()
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert other["tokenizer.json"] == reference["tokenizer.json"]


_BPE_DIGESTS = """
import hashlib
from engine.tiny_model import _train_bpe
print(" ".join(hashlib.sha256(_train_bpe(n, "llama").to_str().encode()).hexdigest() for n in (512, 8192)))
"""


def test_tokenizer_training_is_deterministic_across_processes():
    """BPE training counts pairs in hash maps seeded per process; merges must not depend on it."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _BPE_DIGESTS], check=True, cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.split()
        for _ in range(3)
    ]
    assert len(runs[0]) == 2
    assert runs[0] == runs[1] == runs[2]


def test_dtype_is_stored(tmp_path):
    path = make_tiny_model(tmp_path / "bf16", "tiny", dtype="bfloat16")
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_refuses_to_overwrite_unless_asked_and_only_a_checkpoint_made_here(tmp_path, model_dir):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty"):
        make_tiny_model(target, "tiny")
    # not a checkpoint made here: not deleted even when asked (it deleted any directory given)
    with pytest.raises(FileExistsError, match="holds no checkpoint made here"):
        make_tiny_model(target, "tiny", overwrite=True)
    assert (target / "keep.txt").read_text() == "x"
    made = make_tiny_model(tmp_path / "made", "tiny-mqa")
    (made / "keep.txt").write_text("x")
    assert make_tiny_model(made, "tiny", overwrite=True) == made
    assert not (made / "keep.txt").exists()
    assert _file_bytes(made) == _file_bytes(model_dir("tiny"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "made"]     # no staging left over
    with pytest.raises(FileExistsError, match="is not a directory"):
        make_tiny_model(target / "keep.txt", "tiny")
    with pytest.raises(KeyError):
        make_tiny_model(tmp_path / "nope", "no-such-preset")


def test_the_cli_says_why_it_will_not_write_a_checkpoint(tmp_path, capsys):
    from cluster.cli.main import main
    (tmp_path / "keep.txt").write_text("x")
    assert main(["make-tiny-model", str(tmp_path)]) == 2          # (a traceback, exit 1)
    assert "is not empty (--overwrite" in capsys.readouterr().err


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(loaded, text):
    tokenizer = loaded("tiny")[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text())
def test_qwen2_tokenizer_round_trips_nfc_text(loaded, text):
    tokenizer = loaded("tiny-qwen2")[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_bos_is_prepended_only_with_special_tokens(loaded, preset):
    tokenizer = loaded(preset)[1]
    plain = tokenizer("Hello, café 日本語 😀", add_special_tokens=False).input_ids
    with_bos = tokenizer("Hello, café 日本語 😀").input_ids
    assert with_bos == [tokenizer.bos_token_id] + plain
    assert tokenizer.bos_token_id not in plain
    assert tokenizer.encode("<|end_of_text|>", add_special_tokens=False) == [tokenizer.eos_token_id]


def test_merges_compress_text_more_with_a_larger_vocabulary(loaded):
    text = "The quick brown fox jumps over the lazy dog. Serving systems batch requests."
    tiny = loaded("tiny")[1].encode(text, add_special_tokens=False)
    bench = loaded("bench")[1].encode(text, add_special_tokens=False)
    assert len(bench) < len(tiny) < 0.6 * len(text.encode())


def test_chat_template_renders_roles_and_generation_prompt(loaded):
    tokenizer = loaded("tiny")[1]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n<|user|>\nHi!<|end_of_text|>\n"
        "<|assistant|>\nHello.<|end_of_text|>\n<|user|>\nBye<|end_of_text|>\n<|assistant|>\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == without + "<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_greedy_generate_is_peaked_but_varied(loaded):
    _, tokenizer, model = loaded("tiny")
    inputs = tokenizer("The weather today is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=20, min_new_tokens=20, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
    new = out.sequences[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new) == 20
    assert len(set(new)) >= 8, new
    top_prob = torch.stack([s[0].softmax(-1).max() for s in out.scores])
    # Uniform would be 1/512; clear winners mean a large share on the argmax.
    assert top_prob.mean() > 0.2
    again = model.generate(**inputs, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert again[0, inputs.input_ids.shape[1]:].tolist() == new


def test_default_model_dir_honours_pdserve_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / "models" / "tiny"
    monkeypatch.delenv("PDSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert default_model_dir() == tmp_path / "user" / ".cache" / "pdserve" / "models" / "tiny"


def test_a_checkpoint_path_under_the_home_directory_is_found(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(model_dir("tiny"), tmp_path / "models" / "mine")
    assert checkpoint_dir("~/models/mine") == str(tmp_path / "models" / "mine")


def test_a_node_builds_the_built_in_tokenizer_another_node_resolved(monkeypatch, tmp_path, model_dir):
    # model.tokenizer naming a built-in model reaches the workers as the resolving node's cache path
    from engine import EngineConfig, LLMEngine
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    engine = LLMEngine(EngineConfig(model=str(model_dir("tiny")), tokenizer=str(tmp_path / "models" / "tiny"),
                                    max_model_len=64))
    assert (tmp_path / "models" / "tiny" / "tokenizer.json").is_file()
    assert engine.tokenizer.encode("hello") == load_tokenizer(model_dir("tiny")).encode("hello")


def test_a_tokenizer_setting_names_a_built_in_model_unless_a_directory_here_holds_one(monkeypatch, tmp_path,
                                                                                     model_dir):
    from cluster.cli.serve_command import _tokenizer_for_the_cluster
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert tokenizer_dir("tiny") == str(tmp_path / "home" / "models" / "tiny")       # built here
    assert _tokenizer_for_the_cluster("tiny") == "tiny"                               # each node builds its own
    (tmp_path / "tiny").mkdir()                      # a directory of that name with a tokenizer, no config.json
    shutil.copy(Path(model_dir("tiny")) / "tokenizer.json", tmp_path / "tiny")
    assert tokenizer_dir("tiny") == _tokenizer_for_the_cluster("tiny") == str(tmp_path / "tiny")


def test_a_node_builds_a_built_in_model_another_node_resolved(monkeypatch, tmp_path, model_dir):
    # the path the resolving node named, on a node whose cache has no model yet
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    path = tmp_path / "models" / "tiny"
    ensure_built_in_checkpoint(str(path))
    assert _file_bytes(path) == _file_bytes(model_dir("tiny"))
    other = tmp_path / "elsewhere" / "tiny"          # not a preset's cache directory: left alone
    ensure_built_in_checkpoint(other)
    assert not other.exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


def test_ensure_default_model_builds_once_and_replaces_stale(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / "models" / "tiny"
    assert _file_bytes(path) == _file_bytes(model_dir("tiny"))
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny"]  # no staging left over

    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    (path / "pdserve_recipe.json").write_text("{}")  # a model from an older recipe
    assert ensure_default_model() == path
    assert _file_bytes(path) == _file_bytes(model_dir("tiny"))
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny"]


def test_a_model_that_is_a_file_is_refused_saying_what_it_is(tmp_path):
    from engine.tiny_model import checkpoint_dir
    gguf = tmp_path / "llama-3-8b.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="is a GGUF file, which pdserve does not load"):
        checkpoint_dir(str(gguf))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is a file; give a HuggingFace checkpoint "
                                                r"directory"):
        checkpoint_dir(str(weights))
    with pytest.raises(FileNotFoundError, match="is not a HuggingFace checkpoint directory"):
        checkpoint_dir(str(tmp_path / "nowhere"))
