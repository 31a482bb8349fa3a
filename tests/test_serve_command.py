"""`pdserve serve`: flags over config files, the Serve config files' app
builder, and one real run: start, answer, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster.app_builder import build_app
from cluster.cli.main import build_parser
from cluster.cli import serve_command
from cluster.cli.serve_command import autoscaled_application, config_from_args
from cluster.config import ConfigFileError, DeploymentConfig, with_overrides
from engine.tp_group import free_port

REPO = Path(__file__).resolve().parents[1]



def test_flags_override_the_config_file():
    args = build_parser().parse_args(["serve", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--port", "9001",
                                      "--decode-replicas", "2", "--prefill-tp", "2", "--mode", "disaggregated",
                                      "--max-model-len", "512"])
    config = config_from_args(args)
    assert config.http.port == 9001
    assert (config.prefill.replicas, config.prefill.tensor_parallel_size) == (1, 2)
    assert (config.decode.replicas, config.decode.tensor_parallel_size) == (2, 1)
    assert config.model.max_model_len == 512
    assert config.engine.kv_cache_memory_gib == 0.25   # kept from the file


def test_vllm_serves_flags_set_the_model_the_engine_and_every_pools_tp():
    """What a `vllm serve` command line says works here too: the model as its first word, the
    engine's flags under vLLM's names, -tp for every pool the mode runs (a pool's own flag wins)."""
    def serve(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags]))

    config = serve("bench", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--block-size", "32",
                   "--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching", "--enforce-eager", "-tp", "2",
                   "--device", "cuda")
    assert config.model.path == "bench"
    e = config.engine
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.block_size, e.gpu_memory_utilization) == (8, 1024, 32, 0.8)
    assert e.enable_prefix_caching is False and e.enforce_eager is True
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (2, 2)
    config = serve("--tensor-parallel-size", "2", "--decode-tp", "1")
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (2, 1)
    assert serve("--mode", "colocated", "-tp", "2").colocated.tensor_parallel_size == 2
    assert serve("--config", str(REPO / "configs/tiny-cpu.yaml"), "--max-num-seqs", "4").engine.max_num_seqs == 4
    assert serve().engine.enable_prefix_caching is True           # unset flags keep the defaults
    with pytest.raises(ConfigFileError, match="the model is given twice, as bench and --model tiny"):
        serve("bench", "--model", "tiny")
    with pytest.raises(ConfigFileError, match=r"engine\.gpu_memory_utilization \(set on the command line\)"):
        serve("--gpu-memory-utilization", "1.5", "--device", "cuda")


def test_more_vllm_flags_and_spellings(tmp_path, monkeypatch, capsys):
    def serve(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags]))

    config = serve("--dtype", "half", "--max-model-len", "8k", "--seed", "7", "--kv-cache-memory-gib", "0.5",
                   "--no-enable-chunked-prefill", "--tokenizer", "tiny", "--served-model-name", "a", "b")
    assert (config.model.dtype, config.model.max_model_len, config.engine.seed) == ("float16", 8000, 7)
    assert config.engine.kv_cache_memory_gib == 0.5 and config.engine.enable_chunked_prefill is False
    assert config.model.tokenizer == "tiny" and config.model.served_model_name == ["a", "b"]
    assert serve("--dtype", "BF16", "--max-model-len", "8K").model.max_model_len == 8192
    assert serve("--dtype", "BF16").model.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "8kb"])
    # -tp counts before the file's budget is checked: TP-4 pools fill a budget of 8 ranks, TP-2 ones do not
    f = tmp_path / "tp4.yaml"
    f.write_text(yaml.safe_dump({"prefill": {"tensor_parallel_size": 4}, "decode": {"tensor_parallel_size": 4},
                                 "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                                 "autoscaling": {"enabled": True, "budget": 8}}))
    config = serve("--config", str(f), "-tp", "2")
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (2, 2)
    # a flag of several values that took the model: refused, saying to give the model first
    with pytest.raises(ConfigFileError, match=r"--served-model-name took the model .* give the model first"):
        serve("--served-model-name", "a", str(checkpoint_dir_of("tiny")))
    # flags only CUDA uses are refused on CPU; a machine with a GPU serves on it unless told otherwise
    monkeypatch.setattr(serve_command, "visible_gpus", lambda: 0)
    with pytest.raises(ConfigFileError, match="--enforce-eager set what only a CUDA deployment uses, and this one "
                                              "serves on cpu"):
        serve("--enforce-eager")
    assert serve().device == "cpu"
    monkeypatch.setattr(serve_command, "visible_gpus", lambda: 2)
    assert serve().device == "cuda" and serve("--enforce-eager").engine.enforce_eager is True
    assert serve("--device", "cpu").device == "cpu"
    assert serve("--config", str(REPO / "configs/tiny-cpu.yaml")).device == "cpu"    # the file says so
    # too few GPUs for every rank (1 prefill + 1 decode on one GPU): CPU, which places it, and a note why
    monkeypatch.setattr(serve_command, "visible_gpus", lambda: 1)
    assert serve().device == "cpu"
    assert "serving on cpu: this deployment's 2 ranks need as many GPUs and this machine has 1" \
        in capsys.readouterr().err
    assert serve("--mode", "colocated").device == "cuda"
    # a built-in model's name taken as a name, and a name given twice
    with pytest.raises(ConfigFileError, match="--served-model-name took the model bench as one of its values"):
        serve("--served-model-name", "a", "bench")
    assert serve("tiny", "--served-model-name", "a", "a", "b").model.served_model_name == ["a", "b"]


def test_no_flags_serve_the_tiny_model_disaggregated_on_cpu():
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert config.model.path is None and config.device == "cpu"
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8000)
    assert config.mode.value == "disaggregated" and config.prefill.replicas == config.decode.replicas == 1


def test_bad_overrides_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="unknown setting 'decode.replica'"):
        with_overrides(DeploymentConfig(), {"decode.replica": 2})
    with pytest.raises(ValueError, match=r"decode\.replicas"):
        with_overrides(DeploymentConfig(), {"decode.replicas": 0})


def test_flags_supply_what_the_file_lacks_and_ignored_flags_are_refused(tmp_path, capsys):
    f = tmp_path / "autoscaled.yaml"
    f.write_text(yaml.safe_dump({"autoscaling": {"enabled": True, "budget": 3}}))

    def serve(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags]))

    config = serve("--config", str(f), "--slo", "ttft:1000", "tpot:100")     # the file alone is not valid
    assert config.autoscaling.enabled and (config.slo.ttft_ms, config.slo.tpot_ms) == (1000, 100)
    assert not serve("--config", str(f), "--no-autoscale").autoscaling.enabled
    with pytest.raises(ConfigFileError, match="with the settings given on the command line is not a valid pdserve "
                                              "deployment(.|\n)*needs the SLOs"):
        serve("--config", str(f), "--max-replicas", "4")
    with pytest.raises(ConfigFileError, match="--prefill-replicas, --decode-tp set a pool that colocated mode "
                                              "does not run"):
        serve("--mode", "colocated", "--prefill-replicas", "3", "--decode-tp", "2")
    capsys.readouterr()
    with pytest.raises(ConfigFileError, match="--max-replicas is the autoscaler's budget: add --autoscale"):
        serve("--max-replicas", "4")
    assert "warning" not in capsys.readouterr().err      # (it also warned of autoscaler settings unused)


def test_a_failed_join_names_ray_token_authentication_where_this_machine_has_a_token(tmp_path, monkeypatch):
    from cluster.cli.serve_command import _auth_hint
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert _auth_hint() == ""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert "set RAY_AUTH_MODE=token here too" in _auth_hint()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")         # already sent: not the cause
    assert _auth_hint() == ""


def test_hand_off_and_autoscaling_settings_that_do_nothing_are_warned_about(tmp_path, capsys):
    # before: accepted without a word, a misspelt role among them
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"mode": "colocated", "kv_transfer": {"staging_mib": 2048},
                                    "disaggregation": {"policy": "always"},
                                    "autoscaling": {"budget": 3, "min_replicas": {"prefil": 1}}}))
    config_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    err = capsys.readouterr().err
    assert ("warning: colocated mode hands no KV cache over: the settings of kv_transfer and disaggregation "
            "are not used") in err
    assert "warning: autoscaling is off (autoscaling.enabled false): its other settings are not used" in err
    config_from_args(build_parser().parse_args(["serve", "--config", str(path), "--mode", "disaggregated"]))
    err = capsys.readouterr().err
    assert "hands no KV cache over" not in err and "autoscaling is off" in err
    # the README's way to serve an autoscaling file without its autoscaler: no advice to turn it back on
    config = config_from_args(build_parser().parse_args(
        ["serve", "--config", str(REPO / "configs" / "tiny-cpu-autoscale.yaml"), "--no-autoscale"]))
    assert not config.autoscaling.enabled and "warning" not in capsys.readouterr().err


def test_a_file_whose_pools_the_mode_does_not_run_is_warned_about(capsys):
    """--mode colocated on a file written for disaggregated serving: its decode TP degree would
    be dropped without a word."""
    config = config_from_args(build_parser().parse_args(
        ["serve", "--config", str(REPO / "configs" / "tiny-cpu-tp2.yaml"), "--mode", "colocated"]))
    assert config.colocated.tensor_parallel_size == 1
    assert ("warning: colocated mode runs colocated replicas only: the settings of decode: "
            "{'tensor_parallel_size': 2} are not used (set colocated: instead)") in capsys.readouterr().err
    config_from_args(build_parser().parse_args(["serve", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]))
    config_from_args(build_parser().parse_args(["serve", "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
                                                "--mode", "colocated"]))   # its pools are the defaults
    assert "warning" not in capsys.readouterr().err


def test_an_autoscaled_deployment_ships_the_api_keys_digest_not_its_variable(monkeypatch):
    from router.http_guard import api_key_digest

    monkeypatch.setenv("MY_PDSERVE_KEY", "s3cret")
    config = DeploymentConfig.model_validate({"http": {"api_key_env": "MY_PDSERVE_KEY"},
                                              "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                                              "autoscaling": {"enabled": True, "budget": 3}})
    shipped = autoscaled_application(config)["args"]["config_json"]
    monkeypatch.delenv("MY_PDSERVE_KEY")   # the cluster's processes need not have it
    assert shipped["http"]["api_key_env"] is None
    assert DeploymentConfig.model_validate(shipped).api_key_sha256() == api_key_digest("s3cret")


def test_an_autoscaled_deployment_ships_a_relative_checkpoint_path_as_the_absolute_one(tmp_path, monkeypatch):
    """The app is built in the cluster, whose working directory is not this one."""
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    autoscaled = {"slo": {"ttft_ms": 1000, "tpot_ms": 100}, "autoscaling": {"enabled": True, "budget": 3}}

    def shipped_path(path):
        config = DeploymentConfig.model_validate({**autoscaled, "model": {"path": path}})
        return autoscaled_application(config)["args"]["config_json"]["model"]["path"]

    assert shipped_path("ckpt") == shipped_path("./ckpt/") == str(tmp_path / "ckpt")
    assert shipped_path("bench") == "bench"          # a built-in model: each node builds its own
    assert shipped_path(None) is None


def test_an_autoscaled_deployment_names_the_kv_secrets_key_in_the_cluster_store_not_the_secret(monkeypatch):
    """The app is built in the cluster, whose processes need not have the file's
    variables; Serve shows an application's config (runtime environment
    included) to anyone who asks, so the secret goes to the cluster's store
    (when it deploys, not here) and the config names its key."""
    import json

    monkeypatch.setenv("MY_KV_SECRET", "kv-s3cret")
    config = DeploymentConfig.model_validate({"kv_transfer": {"secret_env": "MY_KV_SECRET"},
                                              "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                                              "autoscaling": {"enabled": True, "budget": 3}})
    application = autoscaled_application(config)
    assert "kv-s3cret" not in json.dumps(application)
    shipped = application["args"]["config_json"]["kv_transfer"]
    assert (shipped["secret_env"], shipped["secret_stored_key"]) == (None, "kv_transfer_secret_env/MY_KV_SECRET")
    monkeypatch.delenv("MY_KV_SECRET")      # not set where the command runs: refused there
    with pytest.raises(ValueError, match="kv_transfer.secret_env"):
        autoscaled_application(config)


def test_the_api_key_variable_is_a_default_a_file_that_names_a_key_keeps_its_own(tmp_path, monkeypatch):
    from router.http_guard import api_key_digest

    monkeypatch.setenv("PDSERVE_API_KEY", "from-the-shell")
    monkeypatch.setenv("PROD_KEY", "from-the-file")
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump({"http": {"api_key_env": "PROD_KEY"}}))

    def key_digest(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).api_key_sha256()

    assert key_digest("--config", str(named)) == api_key_digest("from-the-file")
    assert key_digest() == api_key_digest("from-the-shell")                    # no key in the file
    assert key_digest("--config", str(named), "--api-key", "flag") == api_key_digest("flag")   # a flag wins


def test_settings_the_engines_would_refuse_are_found_before_deploying(tmp_path, monkeypatch):
    from cluster.app_builder import resolve_model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def problems(**overrides):
        with pytest.raises(ValueError) as info:
            resolve_model(with_overrides(DeploymentConfig(), overrides))
        return str(info.value)

    # the tiny model: 4 attention heads, 2 KV heads, context 1024
    assert "decode: num_attention_heads (4) is not divisible by tensor_parallel_size (3)" in \
        problems(**{"decode.tensor_parallel_size": 3})
    message = problems(**{"engine.enable_chunked_prefill": False, "engine.max_num_batched_tokens": 256,
                          "engine.attention_backend": "triton"})
    for role in ("prefill", "decode"):
        assert f"{role}: with chunked prefill off, max_num_batched_tokens (256) must be >= max_model_len (1024)" \
            in message
        assert f"{role}: attention_backend 'triton' on CPU runs only under Triton's interpreter" in message
    small = problems(**{"engine.kv_cache_memory_gib": 2e-6})
    assert "decode: the KV cache on cpu holds 0 blocks of 16 tokens, fewer than one sequence of " \
        "max_model_len=1024 tokens needs (64)" in small
    assert "kv_cache_memory_gib, the CPU memory each rank's KV cache may take (--kv-cache-memory-gib); to " \
        "serve on GPUs, device cuda (--device cuda)" in small       # what to change, on the device it runs on
    (tmp_path / "config.json").write_text((Path(checkpoint_dir_of("tiny")) / "config.json").read_text())
    assert f"no *.safetensors files in {tmp_path}" in problems(**{"model.path": str(tmp_path)})
    resolve_model(with_overrides(DeploymentConfig(), {"decode.tensor_parallel_size": 2}))   # fine
    # the autoscaling profile, read where the path means what the user gave (before: by the
    # router once the workers had loaded, ending the deployment with a traceback)
    autoscaled = {"autoscaling.enabled": True, "autoscaling.budget": 3, "slo.ttft_ms": 1000, "slo.tpot_ms": 100}
    assert f"autoscaling.profile {tmp_path / 'none.json'}: cannot read it (No such file or directory)" in \
        problems(**autoscaled, **{"autoscaling.profile": str(tmp_path / "none.json")})
    import json

    from cluster.perf_model import LinearStepModel
    at_tp2 = tmp_path / "tp2.json"
    at_tp2.write_text(json.dumps(LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0), meta={"tp": 2}).to_json()))
    assert "the profile was measured at TP 2, and the deployment's pools prefill (TP 1), decode (TP 1) run " \
        "at another degree" in problems(**autoscaled, **{"autoscaling.profile": str(at_tp2)})


def test_a_gpu_deployment_that_does_not_fit_its_named_gpus_is_refused_before_deploying(tmp_path):
    """Llama-3-70B's config.json (the weights are not needed to plan) on H100s: one GPU per
    replica cannot hold its 131 GiB of weights; four can."""
    import shutil

    from cluster.app_builder import resolve_model
    shutil.copy(REPO / "configs/models/llama-3-70b/config.json", tmp_path / "config.json")
    for f in Path(checkpoint_dir_of("tiny")).iterdir():       # a tokenizer: the router loads one
        if "token" in f.name:
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.safetensors").write_bytes(b"")

    def deployment(tp: int, gpu: dict) -> DeploymentConfig:
        return with_overrides(DeploymentConfig(), {"device": "cuda", "model.path": str(tmp_path), **gpu,
                                                   "prefill.tensor_parallel_size": tp,
                                                   "decode.tensor_parallel_size": tp})
    with pytest.raises(ValueError) as info:
        resolve_model(deployment(1, {"resources.gpu_type": "H100-SXM"}))
    for role in ("prefill", "decode"):
        assert f"{role}: a TP-1 replica does not fit on H100-SXM: weights need 131.4 GiB per rank" in str(info.value)
        assert f"raise {role}.tensor_parallel_size" in str(info.value)
    assert resolve_model(deployment(4, {"resources.gpu_type": "H100-SXM"})).info.vocab_size == 128256
    assert resolve_model(deployment(1, {})).info.max_model_len == 8192      # GPUs not named: not checked here


def checkpoint_dir_of(name: str) -> str:
    from engine.tiny_model import checkpoint_dir
    return checkpoint_dir(name)


def test_model_names_a_checkpoint_directory_or_a_built_in_model(model_dirs, tmp_path, monkeypatch):
    from engine.tiny_model import checkpoint_dir, preset_model_dir

    assert checkpoint_dir(None) == checkpoint_dir("tiny") == str(preset_model_dir("tiny"))
    assert checkpoint_dir(str(model_dirs["tiny-mqa"])) == str(model_dirs["tiny-mqa"])
    with pytest.raises(FileNotFoundError, match=r"/nowhere is not a HuggingFace checkpoint .*bench, tiny"):
        checkpoint_dir("/nowhere")
    # a checkpoint directory of the preset's name here is what the user meant; a folder that is
    # no checkpoint (the repository's bench/) is not
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench").mkdir()
    assert checkpoint_dir("bench") == str(preset_model_dir("bench"))
    (tmp_path / "bench" / "config.json").write_text((Path(checkpoint_dir("tiny")) / "config.json").read_text())
    assert checkpoint_dir("bench") == str(tmp_path / "bench")
    # as an absolute path: the workers (the in-cluster build, other nodes) have other working directories
    assert checkpoint_dir("./bench/") == checkpoint_dir(".." + os.sep + tmp_path.name + "/bench") == str(tmp_path / "bench")
    monkeypatch.chdir(tmp_path / "bench")
    assert checkpoint_dir(".") == str(tmp_path / "bench")


def test_serve_refuses_a_wrong_model_before_starting_a_cluster(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cluster.cli.main", "serve", "--model", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert f"error: model {tmp_path / 'nowhere'} is not a HuggingFace checkpoint directory" in done.stderr
    assert "Ray" not in done.stderr + done.stdout      # no cluster was started
    done = subprocess.run([sys.executable, "-m", "cluster.cli.main", "serve", "--decode-tp", "3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "error: the workers' engines would refuse this deployment:\n  decode: num_attention_heads" in done.stderr
    assert "Ray" not in done.stderr + done.stdout


def test_a_gpu_deployment_this_machine_cannot_place_is_refused_before_a_local_cluster_starts(monkeypatch, capsys):
    """`pdserve serve --device cuda` starting a cluster of this machine alone: 1 prefill rank + a TP-2
    decode gang need 3 GPUs; with 1 it is refused with the placement message, no cluster started."""
    from cluster.cli import serve_command
    from cluster.serving import local_cluster

    started = []

    class _Started(Exception):
        pass

    def start(*args, **kwargs):
        started.append(args)
        raise _Started
    monkeypatch.setattr(local_cluster, "start_local_cluster", start)
    args = build_parser().parse_args(["serve", "--device", "cuda", "--decode-tp", "2", "--address", "local"])
    monkeypatch.setattr(serve_command, "_machine_gpus", lambda config: 1)
    assert serve_command._cmd_serve(args) == 2
    err = capsys.readouterr().err
    assert "error: cannot place this deployment: a decode gang needs 2 CPUs, 2 GPUs on one node" in err, err
    assert re.search(r"cluster: node this machine: \d+ CPUs, 1 GPU;", err), err
    assert started == []
    monkeypatch.setattr(serve_command, "_machine_gpus", lambda config: 4)    # enough: the cluster starts
    with pytest.raises(_Started):
        serve_command._cmd_serve(args)
    assert len(started) == 1


def test_serve_config_files_name_the_app_builder():
    for path in sorted((REPO / "configs").glob("serve/*.yaml")):
        spec = yaml.safe_load(path.read_text())
        (app,) = spec["applications"]
        assert app["import_path"] == "cluster.app_builder:build_app", path
        assert (REPO / app["args"]["config"]).is_file(), path
        # an autoscaled deployment is only applied through the application-level policy
        autoscaled = yaml.safe_load((REPO / app["args"]["config"]).read_text()).get("autoscaling", {})
        if autoscaled.get("enabled"):
            assert app["autoscaling_policy"]["policy_function"] == "cluster.autoscaler.serve_policy:router_targets"


def test_app_builder_builds_from_the_tiny_serve_config(monkeypatch, tmp_path):
    """The Serve file's builder reads the deployment file it names: its pools and
    its engine settings reach the workers. Its relative path is found from any working
    directory (`serve deploy` builds in a Ray worker), a file of that name there first."""
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load((REPO / "configs/serve/tiny-cpu.yaml").read_text())
    app = build_app(dict(spec["applications"][0]["args"]))
    router = app._bound_deployment
    workers = {name: router.init_kwargs[name]._bound_deployment for name in ("prefill", "decode")}
    assert (router.name, router.init_args[0].served_model_name) == ("Router", "tiny")
    assert {w.name: w.num_replicas for w in workers.values()} == {"PrefillServer": 1, "DecodeServer": 1}
    for worker in workers.values():
        engine = worker.init_args[0]
        # tiny-cpu.yaml's engine section, not the defaults (2048 tokens a step, 1 GiB of KV)
        assert (engine.max_num_batched_tokens, engine.kv_cache_memory_gib, engine.block_size) == (512, 0.25, 16)
    own = tmp_path / spec["applications"][0]["args"]["config"]
    own.parent.mkdir(parents=True)
    own.write_text((REPO / "configs/tiny-cpu.yaml").read_text().replace("max_num_batched_tokens: 512",
                                                                        "max_num_batched_tokens: 256"))
    decode = build_app(dict(spec["applications"][0]["args"]))._bound_deployment.init_kwargs["decode"]
    assert decode._bound_deployment.init_args[0].max_num_batched_tokens == 256      # the working directory's


def check_loadtest_against(base_url: str, out_dir: Path) -> None:
    """`pdserve loadtest` for a handful of requests against the running server.
    The outputs are long enough (40 tokens) to span more than one stream-batching
    interval, so a request's tokens reach the client in more than one read and
    its TPOT is above zero; 5 tokens of the tiny model could all arrive at once."""
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "loadtest", "--base-url", base_url, "--num-prompts", "6",
         "--random-input-len", "24", "--random-output-len", "40", "--ignore-eos", "--request-rate", "20",
         "--goodput", "ttft:60000", "tpot:60000", "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
         "--result-file", "loadtest.json"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out_dir / "loadtest.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0), result.get("error_counts")
    assert result["output_lens"] == [40] * 6 and result["total_output_tokens"] == 240
    assert result["slo_attainment"] == 1.0 and result["request_goodput"] > 0
    assert result["median_ttft_ms"] > 0 and result["median_tpot_ms"] > 0


def test_pdserve_serve_answers_and_stops_cleanly_on_ctrl_c(model_dirs, tmp_path):
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli.main", "serve", "--model", str(model_dirs["tiny"]), "--port", str(port),
         "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32", "--address", "local"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "is serving" in line:
                break
        assert any(f"http://127.0.0.1:{port}/v1" in line for line in lines), "".join(lines[-20:])
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 5
        # the router answers on the port itself (direct ingress), not Serve's HTTP proxy
        assert "ServeReplica:pdserve:Router" in _listener_of(port)
        check_loadtest_against(f"http://127.0.0.1:{port}", tmp_path)
        # the local cluster runs lean: Serve's controller loop slowed, no dashboard modules
        session = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        commands = {pid: _command_line(pid) for pid in session}
        controller = [pid for pid, cmd in commands.items() if "ServeController" in cmd]
        assert len(controller) == 1, commands
        assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5" in Path(f"/proc/{controller[0]}/environ").read_text(
            errors="replace").split("\0")
        assert not [cmd for cmd in commands.values() if "ray-dashboard-" in cmd], commands
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0
        # the console shows the router's HTTP access log, not the workers' internal calls
        output = "".join(lines) + rest
        assert "POST /v1/completions 200" in output, output[-3000:]
        assert "CALL generate" not in output and "CALL stats" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the session's processes (raylet, GCS, workers) all go with it
    deadline = time.monotonic() + 30
    while True:
        left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [], f"processes of the pdserve session still running 30 s after Ctrl-C: {left}"


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:   # exited meanwhile
        return ""


def _listener_of(port: int) -> str:
    """The command line of the process listening on TCP `port` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                inodes.add(f"socket:[{inode}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue   # gone, or not ours to read
    return ""


class _Status:
    """What serve.status() returns, as far as _wait_running reads it."""

    def __init__(self, status, message="", deployments=None):
        from types import SimpleNamespace
        app = SimpleNamespace(status=status, message=message, deployments=deployments or {})
        self.applications = {"pdserve": app}


def test_waiting_for_the_deployment_stops_on_ctrl_c_and_says_what_it_waits_for(monkeypatch):
    """A deploy that never finishes (GPUs held by another job, a huge checkpoint)
    is told about every interval and ends when the user stops it."""
    from types import SimpleNamespace

    from ray import serve

    from cluster.cli import serve_command
    from cluster.cli.stop_signal import StopSignal
    stop, told, polls = StopSignal(), [], []
    pending = {"DecodeWorker": SimpleNamespace(status="UPDATING", message="waiting for resources")}

    def status():
        polls.append(True)
        if len(polls) == 4:
            stop.requested = True      # Ctrl-C while deploying
        return _Status("DEPLOYING", deployments=pending)

    monkeypatch.setattr(serve, "status", status)
    monkeypatch.setattr(serve_command.time, "sleep", lambda s: None)
    assert serve_command._wait_running("pdserve", stop, told.append, every_s=0) is False
    assert len(polls) == 4 and told and "DecodeWorker: UPDATING (waiting for resources)" in told[0]

    monkeypatch.setattr(serve, "status", lambda: _Status("DEPLOY_FAILED", "KV cache too small"))
    with pytest.raises(RuntimeError, match="did not deploy: KV cache too small"):
        serve_command._wait_running("pdserve", StopSignal(), told.append)
    monkeypatch.setattr(serve, "status", lambda: _Status("RUNNING"))
    assert serve_command._wait_running("pdserve", StopSignal(), told.append) is True


def test_a_deploy_whose_replicas_keep_failing_to_start_after_one_started_fails(monkeypatch):
    # Serve retries them for ever (DEPLOY_FAILED only while none has started): the command waited
    # for ever where the README promises an error and exit 2
    from types import SimpleNamespace

    from ray import serve

    from cluster.cli import serve_command
    from cluster.cli.stop_signal import StopSignal
    clock = [0.0]
    failing = {"DecodeServer": SimpleNamespace(status="UPDATING", message="A replica failed to start with "
                                               "exception. Retrying. Error: no config.json in /models/x")}
    monkeypatch.setattr(serve, "status", lambda: _Status("DEPLOYING", deployments=failing))
    monkeypatch.setattr(serve_command.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(serve_command.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    with pytest.raises(RuntimeError, match=r"replicas of DecodeServer kept failing to start for 180 s"
                                           r"(.|\n)*no config.json in /models/x"):
        serve_command._wait_running("pdserve", StopSignal(), lambda _: None)
    assert 180 <= clock[0] <= 181


def test_serve_running_elsewhere_on_a_joined_cluster_is_refused_not_misreported(monkeypatch):
    """Serve keeps the HTTP address it was started with: pdserve must not say it
    serves on another one."""
    from types import SimpleNamespace

    import ray.serve._private.api as serve_api

    from ray import serve

    from cluster.cli import serve_command
    running = SimpleNamespace(http_config=SimpleNamespace(host="0.0.0.0", port=8000))
    monkeypatch.setattr(serve_api, "serve_start", lambda **kw: running)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"other": object()}))
    serve_command._start_serve("0.0.0.0", 8000, direct_ingress=False)        # the same address: fine
    with pytest.raises(RuntimeError, match="HTTP proxy on 0.0.0.0:8000.*--host 0.0.0.0 --port 8000"):
        serve_command._start_serve("127.0.0.1", 9000, direct_ingress=False)
    # where what runs there is a pdserve, the advice to serve on its address would replace it
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"pdserve": object()}))
    with pytest.raises(RuntimeError, match="already runs a pdserve application"):
        serve_command._start_serve("127.0.0.1", 9000, direct_ingress=False)


def test_on_a_joined_cluster_the_serve_it_started_is_stopped_with_its_application(monkeypatch):
    # its proxies kept holding the port after Ctrl-C: the next `pdserve serve --port N` was refused
    import ray

    from ray import serve

    from cluster.cli import serve_command
    calls, apps = [], {}
    monkeypatch.setattr(serve, "delete", lambda name: (calls.append(("delete", name)), apps.pop(name, None)))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append(("shutdown",)))
    monkeypatch.setattr(serve, "status", lambda: type("S", (), {"applications": dict(apps)})())
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("disconnect",)))
    for started_serve, others, expected in (
            (True, {}, [("delete", "pdserve"), ("shutdown",), ("disconnect",)]),
            (True, {"theirs": 1}, [("delete", "pdserve"), ("disconnect",)]),      # another app uses it
            (False, {}, [("delete", "pdserve"), ("disconnect",)])):              # it ran before: theirs
        calls.clear()
        apps.clear()
        apps.update({"pdserve": 1, **others})
        serve_command._clean_up(started_ray=False, deployed=True, started_serve=started_serve)
        assert calls == expected, (started_serve, others)


def test_on_a_joined_cluster_the_kv_secret_stored_for_the_application_goes_with_it(monkeypatch):
    # `pdserve serve --autoscale --address` stored the file's named KV secret in the cluster's
    # key-value store, where it stayed after the application was deleted
    import ray

    from ray import serve

    from cluster.cli import serve_command
    from cluster.serving import cluster_secret
    deleted = []
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr(serve, "status", lambda: type("S", (), {"applications": {}})())
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(cluster_secret, "delete_named_secret", deleted.append)
    serve_command._clean_up(started_ray=False, deployed=True, stored_secret_env="MY_KV_SECRET")
    serve_command._clean_up(started_ray=False, deployed=True)          # it stored none
    serve_command._clean_up(started_ray=False, deployed=False, stored_secret_env="NOT_DEPLOYED")
    assert deleted == ["MY_KV_SECRET"]


def test_an_autoscaled_deploy_keeps_the_clusters_other_declarative_applications(monkeypatch):
    """Serve's declarative API deletes every application a config leaves out."""
    import ray.serve._private.api as serve_api

    from cluster.cli import serve_command
    other = {"name": "other", "route_prefix": "/other", "import_path": "other_app:app"}

    class Client:
        sent = None

        def get_serve_details(self):
            return {"applications": {
                "other": {"source": "declarative", "deployed_app_config": other},
                "scripted": {"source": "imperative", "deployed_app_config": None},
                "pdserve": {"source": "declarative", "deployed_app_config": {"name": "pdserve"}}}}

        def deploy_apps(self, schema, _blocking):
            Client.sent = (schema, _blocking)

    monkeypatch.setattr(serve_api, "serve_start", lambda **kw: Client())
    ours = {"name": "pdserve", "route_prefix": "/", "import_path": "cluster.app_builder:build_app"}
    serve_command._deploy_autoscaled(ours)
    schema, blocking = Client.sent
    assert [app.name for app in schema.applications] == ["other", "pdserve"]
    assert schema.applications[0].import_path == "other_app:app" and blocking is False


def test_a_second_pdserve_on_a_joined_cluster_is_refused_not_deployed_over_the_first(monkeypatch):
    """Deploying would replace the running application, and cleaning up after the
    refusal would delete it."""
    from types import SimpleNamespace

    from ray import serve

    from cluster.cli import serve_command
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"pdserve": object()}))
    with pytest.raises(RuntimeError, match=r"already runs a pdserve application .* \(--address local\)"):
        serve_command._refuse_a_second_pdserve()
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"other": object()}))
    serve_command._refuse_a_second_pdserve()


def test_an_empty_api_key_is_refused_not_taken_for_no_key():
    with pytest.raises(ValueError, match="--api-key is empty"):
        config_from_args(build_parser().parse_args(["serve", "--api-key", ""]))
    with pytest.raises(ValueError, match="--api-key is empty"):
        config_from_args(build_parser().parse_args(["serve", "--api-key", "  "]))


def test_an_empty_api_key_variable_is_refused_not_taken_for_no_key(monkeypatch, tmp_path):
    from router.http_guard import api_key_digest
    # set but empty, as an environment file with an unset value leaves it: it served without a key
    for empty in ("", " "):
        monkeypatch.setenv("PDSERVE_API_KEY", empty)
        with pytest.raises(ValueError, match="PDSERVE_API_KEY is set but empty"):
            config_from_args(build_parser().parse_args(["serve"]))
    # a key given on the command line is the key: the variable is not read
    config = config_from_args(build_parser().parse_args(["serve", "--api-key", "flag"]))
    assert config.api_key_sha256() == api_key_digest("flag")
    # nor where the deployment file names its own key's variable
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump({"http": {"api_key_env": "PROD_KEY"}}))
    monkeypatch.setenv("PROD_KEY", "from-the-file")
    config = config_from_args(build_parser().parse_args(["serve", "--config", str(named)]))
    assert config.api_key_sha256() == api_key_digest("from-the-file")


def test_a_deployment_file_that_is_not_text_is_a_clear_error(tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x80\x81\xfe\xff" * 16)
    with pytest.raises(ValueError, match=r"cannot read deployment file .*model\.safetensors: it is not UTF-8"):
        config_from_args(build_parser().parse_args(["serve", "--config", str(binary)]))


def test_an_address_where_nothing_answers_is_refused_at_once(monkeypatch):
    import socket

    from cluster.cli import serve_command
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    serve_command._check_answers(f"127.0.0.1:{port}")
    serve_command._check_answers(f"ray://127.0.0.1:{port}")
    listener.close()
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
        serve_command._check_answers(f"127.0.0.1:{port}", timeout_s=2)
    serve_command._check_answers("auto")      # left to Ray


@pytest.mark.parametrize("setting", ["engine.kv_cache_memory_gib", "resources.cpus_per_rank",
                                     "kv_transfer.staging_mib"])
def test_infinite_or_nan_sizes_in_a_deployment_file_are_refused(tmp_path, setting):
    section, field = setting.split(".")
    for value in (".inf", ".nan"):
        path = tmp_path / "deploy.yaml"
        path.write_text(f"{section}: {{{field}: {value}}}\n")
        with pytest.raises(ValueError, match=f"{section}.{field}\n  Input should be a finite number"):
            config_from_args(build_parser().parse_args(["serve", "--config", str(path)]))


def test_a_checkpoint_without_its_sizes_or_tokenizer_is_refused_before_deploying(tmp_path):

    from cluster.app_builder import resolve_model
    from engine.model import ModelConfig

    tiny = Path(checkpoint_dir_of("tiny"))
    config = json.loads((tiny / "config.json").read_text())
    for name, change, message in [
            ("no_hidden", {"hidden_size": None}, "hidden_size (got None)"),
            ("str_heads", {"num_attention_heads": "4"}, "num_attention_heads (got '4')"),
            ("zero_layers", {"num_hidden_layers": 0}, "num_hidden_layers (got 0)"),
            ("odd_width", {"hidden_size": 30}, "is not a multiple of the number of attention heads")]:
        (tmp_path / name).mkdir()
        edited = {k: v for k, v in {**config, **change}.items() if v is not None}
        (tmp_path / name / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=re.escape(message)):
            ModelConfig.from_pretrained(tmp_path / name)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tokenizer / f).write_bytes((tiny / f).read_bytes())
    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        resolve_model(with_overrides(DeploymentConfig(), {"model.path": str(no_tokenizer)}))


@pytest.mark.parametrize("flags, says", [(["--host", ""], "http.host"), (["--served-model-name", ""],
                                         r"model.served_model_name\[0\]")])
def test_empty_names_are_refused_not_replaced(flags, says):
    with pytest.raises(ValueError, match=rf"{says} \(set on the command line\)\n  String should have at least 1 "
                                         "character"):
        config_from_args(build_parser().parse_args(["serve", *flags]))


def test_slos_that_nothing_would_serve_are_refused(tmp_path):
    off = tmp_path / "off.yaml"
    off.write_text("admission: {enabled: false}\n")
    with pytest.raises(ValueError, match="--slo sets the SLOs admission control and the autoscaler serve"):
        config_from_args(build_parser().parse_args(["serve", "--config", str(off), "--slo", "ttft:1000"]))
    assert config_from_args(build_parser().parse_args(["serve", "--slo", "ttft:1000"])).slo.ttft_ms == 1000


def test_an_autoscaled_deployment_ships_its_profile_as_data(tmp_path, monkeypatch):
    """The app is built in the cluster, where the profile's path may mean nothing:
    its contents, read by `pdserve serve`, go with the application and are used there."""
    import json

    from cluster.app_builder import build_app
    from cluster.perf_model import LinearStepModel
    profile = LinearStepModel((1e-3, 1e-5, 0.0, 5e-5, 0.0), meta={"tp": 1}).to_json()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    config = DeploymentConfig.model_validate({"slo": {"ttft_ms": 1000, "tpot_ms": 100},
                                              "autoscaling": {"enabled": True, "budget": 3, "profile": str(path)}})
    args = autoscaled_application(config, profile)["args"]
    assert args["autoscaling_profile"] == profile
    path.unlink()                          # not there where the cluster builds it
    # built in the cluster, Ray connected (the placement check's cluster stood in for)
    import ray

    from cluster.serving import placement
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(placement, "placed_config", lambda c: placement.resolve_cpus_per_rank(c, 3))
    router = build_app(args)._bound_deployment
    assert router.init_kwargs["autoscaling_profile"] == profile
    with pytest.raises(ValueError, match="cannot read it"):
        build_app({"config_json": args["config_json"]})


def test_an_unset_kv_transfer_secret_is_refused_before_a_cluster_starts(monkeypatch, tmp_path, capsys):
    from cluster.cli import serve_command
    connects = []
    monkeypatch.setattr(serve_command, "_connect", lambda *a, **k: connects.append(a) or True)
    monkeypatch.delenv("KV_PAIR_SECRET", raising=False)
    named = tmp_path / "secret.yaml"
    named.write_text(yaml.safe_dump({"kv_transfer": {"secret_env": "KV_PAIR_SECRET"}}))
    args = build_parser().parse_args(["serve", "--config", str(named)])
    assert serve_command._cmd_serve(args) == 2
    assert "kv_transfer.secret_env names KV_PAIR_SECRET, which is not set here" in capsys.readouterr().err
    assert connects == []                  # refused before any cluster was started or joined


def test_a_section_whose_settings_are_all_commented_out_takes_its_defaults(tmp_path):
    from cluster.config import DeploymentConfig, load_config
    path = tmp_path / "commented.yaml"
    path.write_text("mode: colocated\nengine:\n  # max_num_seqs: 64\nhttp:\n")
    config = load_config(path)
    assert config.mode.value == "colocated"
    assert (config.engine, config.http) == (DeploymentConfig().engine, DeploymentConfig().http)
    assert load_config(path, {"http.port": 8001}).http.port == 8001
    path.write_text("model: 3\n")                    # not a section of settings: still refused
    with pytest.raises(ValueError, match=r"model\n  Input should be a valid dictionary"):
        load_config(path)


def test_serve_run_with_an_import_path_refuses_an_autoscaled_deployment():
    """`serve run cluster.app_builder:build_app config=...` builds before Ray is
    connected, and without a Serve config file no application-level policy would
    apply the autoscaler's targets (Serve's own policy would scale the workers)."""
    from cluster.app_builder import build_app
    with pytest.raises(ValueError, match="only a Serve config file carries"):
        build_app({"config": str(REPO / "configs" / "tiny-cpu-autoscale.yaml")})
    build_app({"config": str(REPO / "configs" / "tiny-cpu.yaml")})      # not autoscaled: built (no error)


def test_a_serve_config_file_says_the_deployments_address_is_not_used(caplog):
    from cluster.app_builder import build_app
    with caplog.at_level("WARNING", logger="cluster.app_builder"):
        build_app({"config": str(REPO / "configs" / "tiny-cpu.yaml")})     # its address is the default one
        assert "http_options" not in caplog.text
        build_app({"config": str(REPO / "configs" / "tiny-cpu.yaml"), "http.port": 9000})
    assert "the deployment's http.port is not used here: the Serve config's http_options set the address" \
        in caplog.text


def test_the_log_level_reaches_every_deployment_and_the_workers_keep_no_access_log():
    from cluster.app_builder import build_application
    from cluster.serving.placement import resolve_cpus_per_rank
    for args, level in ((["serve"], None), (["serve", "--log-level", "warning"], "WARNING")):
        app = build_application(resolve_cpus_per_rank(config_from_args(build_parser().parse_args(args)), 2))
        router = app._bound_deployment
        workers = [router.init_kwargs[role]._bound_deployment for role in ("prefill", "decode")]
        # none asked for: the router sets no logging config, so a Serve config file's applies to it
        assert (router._deployment_config.logging_config or {}).get("log_level") == level
        for worker in workers:
            assert (worker._deployment_config.logging_config["log_level"],
                    worker._deployment_config.logging_config["enable_access_log"]) == (level or "INFO", False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "LOUD"])
