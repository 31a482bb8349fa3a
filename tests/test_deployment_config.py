"""Deployment files: every shipped file validates, GPU files fit according to
the memory planner, and mistakes get messages that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import ConfigFileError, DeploymentConfig, EngineSection, Mode, load_config
from engine.memory_planner import plan
from engine.model import ModelConfig
from engine.tiny_model import ensure_preset_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODELS = {"llama-3-8b": CONFIGS / "models" / "llama-3-8b", "llama-3-70b": CONFIGS / "models" / "llama-3-70b"}


def test_shipped_files_validate():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= {"tiny-cpu.yaml", "tiny-cpu-tp2.yaml", "llama-3-8b-1xh100.yaml",
                                        "llama-3-70b-8xh100.yaml"}
    for f in files:
        load_config(f)


def test_tiny_tp2_shards_decode_only():
    c = load_config(CONFIGS / "tiny-cpu-tp2.yaml")
    assert c.mode is Mode.disaggregated
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (1, 2)
    e = c.engine_config("decode", "/m")
    assert (e.tensor_parallel_size, e.device, e.max_model_len, e.dtype) == (2, "cpu", 1024, "float32")


def test_async_scheduling_reaches_the_engine_and_tensor_parallel_pools_step_synchronously():
    c = load_config(CONFIGS / "tiny-cpu-tp2.yaml").model_copy(
        update={"engine": EngineSection(async_scheduling=True, skinny_gemm=False)})
    assert c.engine_config("prefill", "/m").async_scheduling is True
    assert c.engine_config("prefill", "/m").skinny_gemm is False
    assert c.engine_config("decode", "/m").async_scheduling is False      # TP 2
    assert DeploymentConfig().engine_config("decode", "/m").async_scheduling == "auto"
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineSection(async_scheduling="sometimes")


@pytest.mark.parametrize("device, engine, expected", [
    ("cpu", {}, 512), ("cuda", {}, 2048), ("cpu", {"max_num_batched_tokens": 96}, 96),
    ("cuda", {"max_num_batched_tokens": 8192}, 8192)])
def test_tokens_per_step_default_by_device_and_the_set_value_wins(device, engine, expected):
    c = DeploymentConfig(device=device, engine=engine)
    assert c.tokens_per_step() == expected
    if device == "cpu":   # a CUDA EngineConfig needs a visible GPU
        assert c.engine_config("prefill", "/m").max_num_batched_tokens == expected


@pytest.mark.parametrize("name, model", [("llama-3-8b-1xh100.yaml", "llama-3-8b"),
                                         ("llama-3-70b-8xh100.yaml", "llama-3-70b")])
def test_gpu_files_fit_by_the_planner(name, model):
    c = load_config(CONFIGS / name)
    mc = ModelConfig.from_pretrained(MODELS[model])
    gpus = 0
    for role, pool in c.pools().items():
        p = plan(mc, tp=pool.tensor_parallel_size, gpu_memory_gib=c.resources.gpu_memory_gib,
                 gpu_memory_utilization=c.engine.gpu_memory_utilization, dtype=c.model.dtype,
                 max_model_len=c.model.max_model_len, gpu_type=c.resources.gpu_type)
        assert p.fits, (role, p.problems)
        assert p.max_concurrent_sequences >= 32, (role, p.max_concurrent_sequences)
        gpus += pool.replicas * pool.tensor_parallel_size
    assert gpus == {"llama-3-8b": 1, "llama-3-70b": 8}[model]


@pytest.mark.parametrize("data, match", [
    ({"prefill": {"replicas": 0}}, r"disaggregated mode needs prefill.replicas >= 1"),
    ({"decode": {"tensor_parallel_size": 0}}, r"decode.tensor_parallel_size\n.*greater than or equal to 1"),
    ({"mode": "split"}, r"mode\n.*'disaggregated' or 'colocated'"),
    ({"engine": {"gpu_memory_utilization": 1.5}}, r"engine.gpu_memory_utilization\n.*less than or equal to 1"),
    ({"model": {"dtype": "int8"}}, r"model.dtype"),
    ({"prefil": {}}, r"prefil\n.*Extra inputs are not permitted"),
    ({"http": {"stream_interval_ms": -5}}, r"http.stream_interval_ms\n.*greater than or equal to 0"),
    ({"resources": {"gpu_type": "V100"}}, r"resources.gpu_type\n.*unknown GPU type 'V100'; choose one of H100-SXM "
     r"\(h100\), H200 \(h200\), A100-80GB \(a100\)"),
])
def test_mistakes_name_the_field(tmp_path, data, match):
    import yaml
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigFileError, match=match) as refused:
        load_config(f)
    # the setting and what is wrong, not pydantic's header, type codes and links
    assert not any(noise in str(refused.value) for noise in ("validation error for", "[type=", "errors.pydantic.dev"))


def test_a_mistake_the_command_line_made_says_so(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text("decode: {replicas: 1}\n")
    with pytest.raises(ConfigFileError) as refused:
        load_config(f, {"http.port": 0})
    assert str(refused.value).splitlines()[1:] == ["http.port (set on the command line)",
                                                  "  Input should be greater than or equal to 1"]


def test_mistakes_name_the_setting_meant_and_where_it_was_given(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("engine: {max_num_seq: 8}\nhttp: {prot: 9000}\ndecode: {replicas: 1}\n")
    with pytest.raises(ConfigFileError) as refused:
        load_config(f)
    message = str(refused.value)
    assert "engine.max_num_seq\n  Extra inputs are not permitted; did you mean engine.max_num_seqs?" in message
    assert "http.prot\n  Extra inputs are not permitted; did you mean http.port?" in message
    f.write_text("nothing_like_it: 1\n")
    with pytest.raises(ConfigFileError, match=r"nothing_like_it\n  Extra inputs are not permitted$"):
        load_config(f)
    # a Ray Serve config file given where a deployment file belongs
    with pytest.raises(ConfigFileError, match="is a Ray Serve config file .* run it with `serve run`"):
        load_config(CONFIGS / "serve" / "tiny-cpu.yaml")
    # settings from a Serve config file's args say so, not "the command line"
    with pytest.raises(ConfigFileError, match=r"decode\.replicas \(set in the Serve config's args\)"):
        load_config(None, {"decode.replicas": "two"}, overrides_from="in the Serve config's args")


def test_model_names_tokenizer_dtype_spellings_and_host():
    model = DeploymentConfig.model_validate({"model": {"path": "models/llama", "dtype": "half"}}).model
    assert model.dtype == "float16"
    # unnamed: the directory's name, and the path as given (what `vllm serve PATH` serves it as)
    assert model.served_names("/abs/models/llama") == ["llama", "models/llama"]
    assert DeploymentConfig().model.served_names("/cache/tiny") == ["tiny"]
    named = DeploymentConfig.model_validate({"model": {"served_model_name": "chat"}}).model
    assert named.served_names("/abs/x") == ["chat"]
    assert DeploymentConfig.model_validate({"model": {"served_model_name": ["a", "b"]}}).model.served_names("/x") \
        == ["a", "b"]
    for bad in ({"served_model_name": []}, {"dtype": "int8"}):
        with pytest.raises(ValidationError):
            DeploymentConfig.model_validate({"model": bad})
    c = DeploymentConfig.model_validate({"model": {"tokenizer": "tiny"}, "engine": {"seed": 5}})
    e = c.engine_config("prefill", "/m")
    assert e.tokenizer == str(ensure_preset_model("tiny"))    # a built-in model's name: its directory
    assert e.seed == 5 and DeploymentConfig().engine_config("prefill", "/m").tokenizer is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "node-1.example.com"):
        assert DeploymentConfig.model_validate({"http": {"host": host}}).http.host == host
    with pytest.raises(ValidationError, match="must be an IP address to listen on"):
        DeploymentConfig.model_validate({"http": {"host": "not a host"}})


def test_a_deployment_naming_no_device_takes_the_gpus_there_are():
    unnamed = DeploymentConfig.model_validate({"decode": {"replicas": 2}})
    assert unnamed.with_default_device(0).device == "cpu"
    on_gpus = unnamed.with_default_device(8)
    assert on_gpus.device == "cuda" and on_gpus.decode.replicas == 2
    assert DeploymentConfig.model_validate({"device": "cpu"}).with_default_device(8).device == "cpu"


def test_a_gpu_type_is_taken_by_any_of_its_names_and_kept_by_its_own():
    for name in ("H100-SXM", "h100", "H100"):
        assert DeploymentConfig.model_validate({"resources": {"gpu_type": name}}).resources.gpu_type == "H100-SXM"


def test_unreadable_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model: [unclosed")
    with pytest.raises(ConfigFileError, match="cannot read deployment file"):
        load_config(f)
    assert DeploymentConfig().mode is Mode.disaggregated


@pytest.mark.parametrize("text, match", [
    ("[model]:\n  name: tiny\n", r"a key must be a name, not a list"),
    ("false\n", "holds a bool, not a mapping of sections"),
    ("[]\n", "holds a list, not a mapping of sections"),
    ("0\n", "holds a int, not a mapping of sections"),
])
def test_a_file_that_is_not_a_mapping_of_named_sections_is_refused(tmp_path, text, match):
    f = tmp_path / "deployment.yaml"
    f.write_text(text)
    with pytest.raises(ConfigFileError, match=match):
        load_config(f)
    f.write_text("# nothing set yet\n")
    assert load_config(f) == DeploymentConfig()


def test_autoscaling_section_is_checked_where_it_is_wrong():
    with pytest.raises(ValidationError, match="set slo.ttft_ms and slo.tpot_ms"):
        DeploymentConfig.model_validate({"autoscaling": {"enabled": True}})
    with pytest.raises(ValidationError, match="in disaggregated mode the roles are decode, prefill"):
        DeploymentConfig.model_validate({"slo": {"ttft_ms": 1000, "tpot_ms": 50}, "autoscaling": {"enabled": True,
                                                         "max_replicas": {"colocated": 2}}})
    with pytest.raises(ValidationError, match="need 2 ranks, more than the budget of 1"):
        DeploymentConfig.model_validate({"slo": {"ttft_ms": 1000, "tpot_ms": 50}, "autoscaling": {"enabled": True,
                                                         "budget": 1}})
    c = load_config(CONFIGS / "tiny-cpu-autoscale.yaml")
    s = c.autoscaling_settings()
    assert (s.budget, s.ttft_slo_s, s.tpot_slo_s, s.roles) == (3, 1.0, 0.1, ("prefill", "decode"))
    # the default budget is the ranks the pools start with
    c = DeploymentConfig.model_validate({"decode": {"replicas": 2, "tensor_parallel_size": 2},
                                         "slo": {"ttft_ms": 1000, "tpot_ms": 50}, "autoscaling": {"enabled": True}})
    assert c.autoscaling_settings().budget == 5


@pytest.mark.parametrize("autoscaling, pools, match", [
    ({"budget": 3}, {"prefill": {"replicas": 3}}, r"the pools start with 4 ranks \(prefill 3 x TP 1 \+ decode 1 x "
     r"TP 1\), more than autoscaling.budget \(3\) allows: raise the budget \(--max-replicas\)"),
    ({"min_replicas": {"prefill": -1}}, {}, r"autoscaling.min_replicas.prefill\n.*greater than or equal to 0"),
    ({"budget": 4, "min_replicas": {"prefill": 2}}, {}, r"prefill.replicas \(1\) is outside the autoscaler's bounds "
     r"for prefill, 2 to 4"),
    ({"budget": 4, "max_replicas": {"decode": 2}}, {"decode": {"replicas": 3}}, r"decode.replicas \(3\) is outside"),
    # bounds no replica count meets: said as such, not "start within them"
    ({"budget": 6, "min_replicas": {"decode": 3}, "max_replicas": {"decode": 2}}, {"decode": {"replicas": 3}},
     r"autoscaling: decode: max_replicas 2 < min_replicas 3"),
    ({"budget": 4, "min_replicas": {"prefill": 5}}, {}, r"the minimum replicas need 6 ranks, more than the budget "
     r"of 4: raise the budget"),
    ({"budget": 4, "min_replicas": {"decode": 0}}, {}, r"autoscaling.min_replicas.decode must be at least 1"),
    # nothing could move: the default budget is the 2 ranks the pools start with, each role's floor 1
    ({}, {}, r"autoscaling could never change a replica count: the minimum replicas \(prefill 1 \+ decode 1\) "
     r"already fill the budget of 2 ranks \(by default, the ranks the pools start with\); give it room: "
     r"min_replicas.prefill: 0 .*or a larger budget"),
    ({"budget": 3, "min_replicas": {"prefill": 2}}, {"prefill": {"replicas": 2}}, r"the minimum replicas "
     r"\(prefill 2 \+ decode 1\) already fill the budget of 3 ranks; give it room"),
])
def test_autoscaled_pools_start_within_the_budget_and_bounds(autoscaling, pools, match):
    data = {"slo": {"ttft_ms": 1000, "tpot_ms": 100}, "autoscaling": {"enabled": True, **autoscaling}, **pools}
    with pytest.raises(ValidationError, match=match):
        DeploymentConfig.model_validate(data)
    fixed = DeploymentConfig.model_validate({**data, "autoscaling": {"enabled": True, "budget": 4,
                                                                     "min_replicas": {"prefill": 0}}})
    assert fixed.autoscaling_settings().budget == 4


@pytest.mark.timeout(30)
def test_room_to_move_counts_each_roles_ranks_and_not_every_split():
    """The check that autoscaling can move anything: one more replica of a role costs its
    TP degree, and a huge budget is checked without listing its splits (~budget² of them)."""
    slo = {"slo": {"ttft_ms": 1000, "tpot_ms": 100}}
    wide_decode = {**slo, "decode": {"tensor_parallel_size": 4}}
    with pytest.raises(ValidationError, match=r"the minimum replicas \(prefill 1 \+ decode 1\) already fill the "
                                              r"budget of 6 ranks"):
        DeploymentConfig.model_validate({**wide_decode, "autoscaling": {"enabled": True, "budget": 6,
                                                                        "max_replicas": {"prefill": 1}}})
    # room for a prefill replica (1 rank) but not a decode one (4): valid (a refusal raises)
    DeploymentConfig.model_validate({**wide_decode, "autoscaling": {"enabled": True, "budget": 6}})
    # room for a decode replica only once the budget holds its 4 ranks
    DeploymentConfig.model_validate({**wide_decode, "autoscaling": {"enabled": True, "budget": 9,
                                                                    "max_replicas": {"prefill": 1}}})
    huge = DeploymentConfig.model_validate({**slo, "autoscaling": {"enabled": True, "budget": 1_000_000}})
    assert huge.autoscaling_settings().budget == 1_000_000


def test_a_secret_pasted_for_a_variables_name_is_refused_and_not_repeated(monkeypatch):
    for section, field in (("http", "api_key_env"), ("kv_transfer", "secret_env")):
        with pytest.raises(ValidationError) as info:
            DeploymentConfig.model_validate({section: {field: "sk-live-4f9a1c2b7e"}})
        assert f"{section}.{field}" in str(info.value) and "not hold the secret itself" in str(info.value)
        assert "4f9a1c2b7e" not in str(info.value)
    # a secret that happens to look like a name is not printed either; a variable's usual name is
    monkeypatch.delenv("MY_API_KEY", raising=False)
    pasted = DeploymentConfig.model_validate({"http": {"api_key_env": "Zq8xK2mW9"},
                                              "kv_transfer": {"secret_env": "a3f9c2e1"}})
    with pytest.raises(ValueError, match="http.api_key_env names a variable, which is not set here") as info:
        pasted.api_key_sha256()
    assert "Zq8xK2mW9" not in str(info.value)
    with pytest.raises(ValueError, match="kv_transfer.secret_env names a variable") as info:
        pasted.kv_transfer_secret()
    assert "a3f9c2e1" not in str(info.value)
    with pytest.raises(ValueError, match="http.api_key_env names MY_API_KEY, which is not set here"):
        DeploymentConfig.model_validate({"http": {"api_key_env": "MY_API_KEY"}}).api_key_sha256()


def test_the_kv_secret_comes_from_one_source():
    with pytest.raises(ValidationError, match="give kv_transfer.secret_env or kv_transfer.secret_stored_key, not both"):
        DeploymentConfig.model_validate({"kv_transfer": {"secret_env": "KV_SECRET",
                                                         "secret_stored_key": "kv_transfer_secret_env/KV_SECRET"}})


def test_the_api_key_comes_from_one_source_in_a_file():
    # before: both accepted, the digest silently preferred, and the key in the variable never required
    with pytest.raises(ValidationError, match="give http.api_key_env or http.api_key_sha256, not both"):
        DeploymentConfig.model_validate({"http": {"api_key_env": "MY_API_KEY", "api_key_sha256": "0" * 64}})


def test_a_flag_does_not_hide_a_malformed_section_of_the_file(tmp_path):
    import yaml
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"slo": 5}))
    with pytest.raises(ConfigFileError, match="slo must be a section of settings"):
        load_config(f, {"slo.ttft_ms": 100})
    f.write_text("slo:\n")                    # an empty section takes the flag
    assert load_config(f, {"slo.ttft_ms": 100}).slo.ttft_ms == 100


def test_a_gpu_deployment_is_built_where_no_gpu_is_visible():
    import torch

    from engine import EngineConfig, LLMEngine
    config = load_config(CONFIGS / "llama-3-8b-1xh100.yaml")
    assert config.engine_config("colocated", "/models/llama").device == "cuda"   # the builder needs no GPU
    if not torch.cuda.is_available():   # the engine itself does
        with pytest.raises(ValueError, match="device is cuda but no CUDA device is visible"):
            LLMEngine(EngineConfig(model="/models/llama", device="cuda"))


def test_autoscaling_thresholds_in_the_file_reach_the_policy():
    thresholds = {"ttft_percentile": 0.95, "slo_headroom": 0.7, "downscale_headroom": 0.6, "split_margin": 0.35,
                  "warmup_steps": 7, "refusal_pressure": 0.25, "pressure_window_s": 45.0,
                  "length_finish_share": 0.8}
    c = DeploymentConfig.model_validate({"slo": {"ttft_ms": 1000, "tpot_ms": 50},
                                         "autoscaling": {"enabled": True, "budget": 3, **thresholds}})
    s = c.autoscaling_settings()
    assert {name: getattr(s, name) for name in thresholds} == thresholds
    defaults = DeploymentConfig.model_validate({"slo": {"ttft_ms": 1000, "tpot_ms": 50},
                                                "autoscaling": {"enabled": True, "budget": 3}}).autoscaling_settings()
    policy_defaults = type(s)(ttft_slo_s=1.0, tpot_slo_s=0.05)
    assert {n: getattr(defaults, n) for n in thresholds} == {n: getattr(policy_defaults, n) for n in thresholds}
    with pytest.raises(ValidationError, match="autoscaling.refusal_pressure"):
        DeploymentConfig.model_validate({"autoscaling": {"refusal_pressure": 1.5}})
    with pytest.raises(ValidationError, match="autoscaling.ttft_percentile"):
        DeploymentConfig.model_validate({"autoscaling": {"ttft_percentile": 1.0}})
    with pytest.raises(ValidationError, match="autoscaling.length_finish_share"):
        DeploymentConfig.model_validate({"autoscaling": {"length_finish_share": 0}})


def test_the_kv_transfer_staging_budget_reaches_the_disaggregated_engines_only():
    c = load_config(CONFIGS / "tiny-cpu.yaml", {"kv_transfer.staging_mib": 512})
    assert c.engine_config("prefill", "/m").kv_transfer_staging_gib == 0.5
    assert c.engine_config("decode", "/m").kv_transfer_staging_gib == 0.5
    colocated = load_config(CONFIGS / "tiny-cpu.yaml", {"mode": "colocated"})
    assert colocated.engine_config("colocated", "/m").kv_transfer_staging_gib == 0.0
    with pytest.raises(ConfigFileError, match="staging_mib"):
        load_config(None, {"kv_transfer.staging_mib": 0})


def test_a_setting_given_twice_in_a_section_is_refused(tmp_path):
    """YAML would keep the last silently: an edit that missed the line already there."""
    path = tmp_path / "deploy.yaml"
    path.write_text("engine:\n  max_num_seqs: 4\n  max_num_seqs: 8\n")
    with pytest.raises(ConfigFileError, match="'max_num_seqs' is given twice in one section"):
        load_config(path)
    path.write_text("base: &b {max_num_seqs: 4}\nengine:\n  <<: *b\n  max_num_seqs: 8\n")   # a merge is not a repeat
    with pytest.raises(ConfigFileError, match=r"base\n  Extra inputs are not permitted"):   # an unknown section
        load_config(path)


def test_prefill_workers_capture_no_decode_graphs_on_a_gpu():
    # a prefill engine never runs a decode step: its decode CUDA graphs took start-up time and a
    # reserve of GPU memory (the largest batch's peak, every graph's logits) from its KV cache
    config = load_config(CONFIGS / "llama-3-70b-8xh100.yaml")
    prefill, decode = (config.engine_config(role, "/models/llama") for role in ("prefill", "decode"))
    assert (prefill.uses_cuda_graphs(), decode.uses_cuda_graphs()) == (False, True)


def test_cpus_per_rank_below_rays_resource_granularity_is_refused():
    # Ray counts resources in steps of 0.0001: a smaller share would be rounded to none
    with pytest.raises(ValidationError, match=r"resources.cpus_per_rank\n.*greater than or equal to 0.0001"):
        DeploymentConfig.model_validate({"resources": {"cpus_per_rank": 0.00001}})
    assert DeploymentConfig.model_validate({"resources": {"cpus_per_rank": 0.0001}}).resources.cpus_per_rank == 0.0001
