"""`pdserve serve`: run the serving cluster until Ctrl-C.

    pdserve serve [MODEL] [--config FILE] [--model PATH] [--host H] [--port P]
                  [--mode disaggregated|colocated] [--prefill-replicas N] [--decode-replicas N]
                  [--prefill-tp N] [--decode-tp N] [--colocated-replicas N] [--colocated-tp N] [-tp N]
                  [--device cpu|cuda] [--dtype D] [--max-model-len L] [--served-model-name NAME ...]
                  [--tokenizer DIR] [--chat-template T] [--max-num-seqs N] [--max-num-batched-tokens N]
                  [--gpu-memory-utilization F] [--kv-cache-memory-gib G] [--block-size N]
                  [--[no-]enable-prefix-caching] [--[no-]enable-chunked-prefill] [--enforce-eager] [--seed N]
                  [--autoscale --slo ttft:MS tpot:MS [--max-replicas N]] [--no-autoscale] [--api-key KEY]
                  [--allowed-origins ORIGIN ... [--allow-credentials]]
                  [--log-level DEBUG|INFO|WARNING|ERROR] [--address RAY_ADDRESS] [--ray-dashboard]

Flags override the config file; with neither, the built-in tiny model is served
by 1 prefill + 1 decode worker at http://127.0.0.1:8000, on GPUs where this
machine has one for each (as vLLM takes the GPU), else on CPU. Joins the Ray
cluster at --address (or a running local one); otherwise starts a local
cluster declaring enough CPUs for every gang, lean on background work
(cluster/serving/local_cluster.py), whose router answers HTTP on the
port itself (cluster/serving/direct_ingress.py), and on Ctrl-C/SIGTERM stops
everything it started. A deployment whose gangs can never be placed on the
cluster is refused before anything is deployed (exit 2, the message on stderr).

--autoscale (or `autoscaling.enabled` in the file) lets the goodput autoscaler
set the replicas per role while serving (cluster/autoscaler/); --max-replicas
is its budget in ranks. It is deployed through Serve's declarative API, the
only one that takes an application-level autoscaling policy.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cluster.cli.plan_goodput import SloAction, parse_slo, unused_slo_problem
from cluster.cli.stop_signal import StopSignal
from cluster.config import CPU_TOKENS_PER_STEP, CUDA_TOKENS_PER_STEP, LOG_LEVELS
from cluster.serving.placement import visible_gpus
from router.http_guard import configured_key_digest

APP_NAME = "pdserve"

# flag (argparse dest) -> dotted DeploymentConfig key
FLAG_SETTINGS = {
    "model": "model.path", "served_model_name": "model.served_model_name", "dtype": "model.dtype",
    "max_model_len": "model.max_model_len", "host": "http.host", "port": "http.port", "mode": "mode",
    "device": "device", "prefill_replicas": "prefill.replicas", "decode_replicas": "decode.replicas",
    "prefill_tp": "prefill.tensor_parallel_size", "decode_tp": "decode.tensor_parallel_size",
    "colocated_replicas": "colocated.replicas", "colocated_tp": "colocated.tensor_parallel_size",
    "autoscale": "autoscaling.enabled", "max_replicas": "autoscaling.budget",
    "allowed_origins": "http.allowed_origins", "allow_credentials": "http.allow_credentials",
    "log_level": "log_level", "chat_template": "model.chat_template",
    # the engine flags vLLM's `vllm serve` takes, under its names
    "max_num_seqs": "engine.max_num_seqs", "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "gpu_memory_utilization": "engine.gpu_memory_utilization", "block_size": "engine.block_size",
    "enable_prefix_caching": "engine.enable_prefix_caching", "enforce_eager": "engine.enforce_eager",
    "kv_cache_memory_gib": "engine.kv_cache_memory_gib", "enable_chunked_prefill": "engine.enable_chunked_prefill",
    "seed": "engine.seed", "tokenizer": "model.tokenizer",
}
# flags of settings a CPU deployment does not use
CUDA_ONLY_FLAGS = ("gpu_memory_utilization", "enforce_eager")
_POOLS = ("prefill", "decode", "colocated")
SERVE_POLICY = "cluster.autoscaler.serve_policy:router_targets"
API_KEY_ENV = "PDSERVE_API_KEY"


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API from a Ray cluster (Ctrl-C stops it)")
    p.add_argument("--config", help="deployment YAML file (see configs/)")
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="the model, as --model (`vllm serve MODEL`)")
    p.add_argument("--model",
                   help="HuggingFace checkpoint directory, or a built-in model: tiny (the default), bench, ...")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the name(s) clients give as `model`; responses carry the first (default: the checkpoint "
                        "directory's name, and MODEL as given)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory whose tokenizer to use in place of the "
                                                      "checkpoint's")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template file (or the template itself) to render chats with, in place of "
                        "the tokenizer's")
    p.add_argument("--host", help="the address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for "
                                  "every interface)")
    p.add_argument("--port", type=int, help="the HTTP port (default 8000)")
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="CORS: origins whose web pages may call the API (e.g. https://chat.example.com), or '*'")
    p.add_argument("--allow-credentials", action="store_true", default=None,
                   help="CORS: browsers may send cookies and HTTP authentication (with origins listed one by one)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"],
                   help="disaggregated (default): prefill and decode replicas, the KV cache handed between them; "
                        "colocated: replicas that run both")
    p.add_argument("--log-level", choices=LOG_LEVELS, type=str.upper,
                   help="what the replicas log, pdserve's lines and Serve's (default INFO)")
    for pool in _POOLS:
        p.add_argument(f"--{pool}-replicas", type=int, metavar="N", help=f"{pool} replicas (default 1)")
        p.add_argument(f"--{pool}-tp", type=int, metavar="N",
                       help=f"the tensor-parallel degree of each {pool} replica (default 1)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int,
                   help="the TP degree of every pool the mode runs, where --prefill-tp / --decode-tp / "
                        "--colocated-tp do not set it")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where the engines run (default: cuda where this machine has a GPU for each rank the "
                        "deployment starts with, else cpu)")
    p.add_argument("--dtype", type=str.lower,
                   choices=["auto", "float32", "float16", "bfloat16", "half", "fp16", "bf16", "float", "fp32"],
                   help="weights and KV cache (auto: the checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--max-model-len", type=_token_count, metavar="TOKENS",
                   help="the longest prompt + output (default: the model's); 8k is 8000, 8K 8192")
    engine = p.add_argument_group("engine (every worker's; a deployment file's engine: section)")
    engine.add_argument("--max-num-seqs", type=int, help="sequences a step holds at most (256)")
    engine.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens a step holds at most, prompt chunks and decodes "
                        f"({CPU_TOKENS_PER_STEP} on CPU, {CUDA_TOKENS_PER_STEP} on CUDA)")
    engine.add_argument("--gpu-memory-utilization", type=float,
                        help="CUDA: the fraction of each GPU the process may fill, weights and KV (0.9)")
    engine.add_argument("--block-size", type=int, help="tokens per KV block (16)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV of prompt prefixes seen before (on)")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="CUDA: run every step eagerly, without CUDA graphs")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="split long prompts across steps (on)")
    engine.add_argument("--kv-cache-memory-gib", type=float, metavar="GIB",
                        help="CPU: the memory each rank's KV cache may take (1.0)")
    engine.add_argument("--seed", type=int, help="seeds the sampling of requests that give no seed (0)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "PDSERVE_API_KEY environment variable, if set); only the key's SHA-256 is deployed")
    p.add_argument("--autoscale", action=argparse.BooleanOptionalAction, default=None,
                   help="let the goodput autoscaler set the replicas per role (needs --slo); --no-autoscale "
                        "turns off a file's autoscaling")
    p.add_argument("--slo", nargs="+", type=parse_slo, action=SloAction, metavar="ttft:MS|tpot:MS",
                   help="the SLOs: admission control refuses what would miss either, the autoscaler "
                        "scales for both, e.g. --slo ttft:1000 tpot:100")
    p.add_argument("--max-replicas", type=int, metavar="RANKS",
                   help="the autoscaler's budget: the ranks (GPUs on CUDA) every role's replicas may use together, "
                        "a TP-N replica counting N (autoscaling.budget; default: the ranks the pools start with; "
                        "per-role bounds: autoscaling.max_replicas in the deployment file)")
    p.add_argument("--address", help="Ray cluster to join (default: a running local one, else start one; "
                                      "'local': always start a new one)")
    p.add_argument("--ray-dashboard", action="store_true",
                   help="start the Ray dashboard with the local cluster (off by default: on a small "
                        "machine its polling takes CPU from the engine)")
    p.set_defaults(func=_cmd_serve)


def config_from_args(args: argparse.Namespace):
    """The deployment the flags and the file describe. Raises ConfigFileError
    (a ValueError) for a file or flags that do not make a valid deployment, or
    a flag that would be ignored."""
    from cluster.config import ConfigFileError, load_config

    positional = getattr(args, "model_path", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            raise ConfigFileError(f"the model is given twice, as {positional} and --model {args.model}: "
                                  "give one")
        args.model = positional
    _refuse_a_model_taken_as_a_value(args)
    overrides = {key: getattr(args, dest, None) for dest, key in FLAG_SETTINGS.items()}
    for name, ms in getattr(args, "slo", None) or []:
        overrides[f"slo.{name}_ms"] = ms
    key = getattr(args, "api_key", None)
    if key is not None and not key.strip():
        raise ConfigFileError("--api-key is empty (an unset variable in --api-key \"$KEY\"?): give the key, or "
                              "leave the flag out to serve without one")
    if key:
        overrides["http.api_key_sha256"] = _key_digest(key, "--api-key")   # wins over the file's key settings
    from_env = os.environ.get(API_KEY_ENV)
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:      # every pool the mode runs, but one its own flag sets
        for pool in _pools_of_mode(args):
            if overrides.get(f"{pool}.tensor_parallel_size") is None:
                overrides[f"{pool}.tensor_parallel_size"] = tp
    config = load_config(args.config, overrides)
    if "device" not in config.model_fields_set and (gpus := visible_gpus()):     # as vLLM: on the GPUs there are
        on_gpus = config.with_default_device(gpus)
        if on_gpus.device == "cuda":
            overrides["device"] = "cuda"     # (for the file's reloads below)
            config = on_gpus
        else:
            print(f"pdserve: serving on cpu: this deployment's {config.ranks()} ranks need as many GPUs and this "
                  f"machine has {gpus}; --device cuda with fewer ranks (--mode colocated, say) serves on them",
                  file=sys.stderr)
    names_own_key = bool(config.http.api_key_env or config.http.api_key_sha256)
    if not key and not names_own_key and from_env is not None and not from_env.strip():
        raise ConfigFileError(f"{API_KEY_ENV} is set but empty (an unset value in an environment file?): give the "
                              "key, or unset the variable to serve without one")
    if not key and from_env and not names_own_key:
        # the variable is the default key: a file that names its own key keeps it
        overrides["http.api_key_sha256"] = _key_digest(from_env, API_KEY_ENV)
        config = load_config(args.config, overrides)
        print(f"pdserve: requiring the API key in {API_KEY_ENV}", file=sys.stderr)
    not_run = set(_POOLS) - set(config.pools())
    unused = [_flag(dest) for dest, setting in FLAG_SETTINGS.items()
              if getattr(args, dest, None) is not None and setting.split(".")[0] in not_run]
    if unused:
        raise ConfigFileError(f"{', '.join(unused)} set a pool that {config.mode.value} mode does not run "
                              f"(its pools: {', '.join(config.pools())}); drop them or change --mode")
    cuda_only = [_flag(dest) for dest in CUDA_ONLY_FLAGS if getattr(args, dest, None) is not None]
    if cuda_only and config.device == "cpu":
        raise ConfigFileError(f"{', '.join(cuda_only)} set what only a CUDA deployment uses, and this one serves on "
                              "cpu: drop them, or give --device cuda")
    if getattr(args, "slo", None) and (problem := unused_slo_problem(config)):
        raise ConfigFileError(problem)
    if getattr(args, "max_replicas", None) is not None and not config.autoscaling.enabled:
        raise ConfigFileError("--max-replicas is the autoscaler's budget: add --autoscale (and --slo), or drop it")
    given = {key for key, value in overrides.items() if value is not None}
    for problem in config.unused_settings(given):     # (after the refusals: a refused flag is no unused setting)
        print(f"pdserve: warning: {problem}", file=sys.stderr)
    return config


def _token_count(text: str) -> int:
    """A token count as vLLM's flags take it: 4096, 8k (8,000), 8K (8,192), 1m, 1M."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4096, 8k = 8000, 8K = 8192)")
    number, unit = match.groups()
    return int(number) * {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 2**20}[unit]


def _pools_of_mode(args: argparse.Namespace) -> tuple[str, ...]:
    """The pools the deployment's mode runs (--mode, else the file's, else the default),
    before it is validated; every pool for a mode that is not one (validation says so)."""
    from cluster.config import DeploymentConfig, Mode, POOLS_BY_MODE, read_deployment_file
    mode = args.mode or (read_deployment_file(args.config).get("mode") if args.config else None)
    try:
        return POOLS_BY_MODE[Mode(mode or DeploymentConfig.model_fields["mode"].default)]
    except (ValueError, TypeError):
        return _POOLS


def _key_digest(key: str, source: str) -> str:
    """configured_key_digest, its refusal a ConfigFileError (the command's bad-setting exit)."""
    from cluster.config import ConfigFileError
    try:
        return configured_key_digest(key, source)
    except ValueError as exc:
        raise ConfigFileError(str(exc)) from None


def _refuse_a_model_taken_as_a_value(args: argparse.Namespace) -> None:
    """A flag of several values takes every word after it: `--served-model-name a MODEL`
    takes MODEL as a name. Refused when no model was given otherwise and the flag's last
    value is a checkpoint directory or a built-in model's name."""
    from cluster.config import ConfigFileError
    from engine.tiny_model import PRESETS
    if args.model is not None or getattr(args, "model_path", None) is not None:
        return
    for dest in ("served_model_name", "allowed_origins"):
        values = getattr(args, dest, None) or []
        if values and (values[-1] in PRESETS or (Path(os.path.expanduser(values[-1])) / "config.json").is_file()):
            raise ConfigFileError(f"{_flag(dest)} took the model {values[-1]} as one of its values: give the model "
                                  f"first (pdserve serve MODEL {_flag(dest)} ...)")


def _flag(dest: str) -> str:
    """The command-line flag of an argparse dest."""
    return f"--{dest.replace('_', '-')}"


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.app_builder import resolve_model

    try:
        config = config_from_args(args)
        resolved = resolve_model(config)   # a wrong path, settings the engines would refuse: before a cluster starts
        config.api_key_sha256()   # http.api_key_env names a variable that is not set
        if config.mode.value == "disaggregated" and config.kv_transfer.secret_env:
            config.kv_transfer_secret()   # kv_transfer.secret_env names a variable that is not set
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import ray
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    from cluster.app_builder import build_application
    from cluster.serving.cluster_secret import store_named_secret
    from cluster.serving.direct_ingress import direct_ingress_env
    from cluster.serving.placement import (
        PlacementError,
        check_local_machine,
        local_cluster_cpus,
        placed_config,
    )
    from cluster.serving.port_check import wait_for_port
    from engine.cpu_count import usable_cpus

    machine_cpus = usable_cpus()
    local_env = direct_ingress_env(config.http.port) if config.http.direct_ingress else {}
    local_cpus = local_cluster_cpus(config, machine_cpus)
    try:
        started_ray = _connect(args.address, local_cpus, local_env, args.ray_dashboard, before_starting=lambda:
                               check_local_machine(config, machine_cpus, local_cpus, _machine_gpus(config)))
    except PlacementError as exc:      # a cluster of this machine alone could never place it: none started
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        hint = "check --address, or give --address local" if args.address else "give --address local"
        print(f"error: cannot join the Ray cluster ({exc}): {hint} to start a local cluster{_auth_hint()}",
              file=sys.stderr)
        return 2
    if args.ray_dashboard and not started_ray:
        print("error: --ray-dashboard starts the dashboard with a cluster pdserve starts, and this one joined a "
              "running cluster (whose `ray start --include-dashboard` decides): drop the flag, or give "
              "--address local", file=sys.stderr)
        ray.shutdown()
        return 2
    direct_ingress = started_ray and config.http.direct_ingress
    host, port = config.http.host, config.http.port
    # on a cluster of its own nothing of this server listens yet: the port must be free to bind
    # as the router (direct ingress: no SO_REUSEADDR) or Serve's proxy will bind it
    try:
        problem = started_ray and wait_for_port(host, port, reuse_address=not direct_ingress,
                                                notify=lambda m: print(m, flush=True))
    except KeyboardInterrupt:     # Ctrl-C while it waits (up to a minute): stop the cluster it started
        ray.shutdown()
        return 130
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        ray.shutdown()
        return 2
    try:
        config = placed_config(config, machine_cpus if started_ray else None)
        if config.autoscaling.enabled:
            shipped = autoscaled_application(config, resolved.autoscaling_profile)   # the file's variables too
        app = build_application(config, resolved)
    except (PlacementError, ValueError) as exc:   # ValueError: e.g. http.api_key_env not set
        print(f"error: {exc}", file=sys.stderr)
        ray.shutdown()   # disconnects; stops the cluster only when this process started it
        return 2
    except BaseException:
        ray.shutdown()
        raise
    stop = StopSignal().install()    # from here on Ctrl-C / SIGTERM stop the deploy too, and clean up
    deployed = started_serve = False
    stored_secret_env = None    # the variable whose KV secret this command stored in the cluster
    try:
        started_serve = _start_serve(host, port, direct_ingress)
        if not started_ray:
            _refuse_a_second_pdserve()
        deployed = True
        if config.autoscaling.enabled:
            if config.kv_transfer.secret_env:    # (not before: a second pdserve is refused above)
                stored_secret_env = config.kv_transfer.secret_env
                store_named_secret(stored_secret_env, config.kv_transfer_secret())
            _deploy_autoscaled(shipped)
        else:
            from ray.serve.api import _run
            _run(app, _blocking=False, name=APP_NAME, route_prefix="/")
        if not _wait_running(APP_NAME, stop, notify=lambda m: print(m, flush=True)):
            print("stopped before the deployment was running; cleaning up ...", flush=True)
            return 128 + (stop.signum or 2)
        print(f"pdserve is serving {resolved.info.served_model_name} ({config.mode.value}, on {config.device}) at "
              f"{base_url(host, port)}/v1 (Ctrl-C stops it)", flush=True)
        lost = _watch_application(APP_NAME, stop)
        if lost:
            print(f"error: {lost}; cleaning up ...", file=sys.stderr, flush=True)
            return 1
        print("stopping pdserve ...", flush=True)
    except (RuntimeError, TimeoutError, ConnectionError, ValueError, RayError, RayServeException) as exc:
        # a failed deploy, a route another application holds, a controller or cluster lost
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        stop.force_on_next()
        if stop.requested:
            print("(press Ctrl-C again to quit at once, leaving the clean-up undone)", flush=True)
        _clean_up(started_ray, deployed, started_serve, stored_secret_env)
    return 0


def _start_serve(host: str, port: int, direct_ingress: bool) -> bool:
    """Starts Serve (a no-op where it runs) with its HTTP proxy on host:port, or on
    a free port where the router answers on host:port itself; True when this call
    started it. Raises RuntimeError when Serve already runs on this cluster with
    another address: it keeps its own, and pdserve would not answer where it says."""
    from ray.serve._private.api import serve_start

    from engine.tp_group import free_port
    was_running = _serve_runs()
    proxy_port = free_port(host) if direct_ingress else port
    http = serve_start(http_options={"host": host, "port": proxy_port}).http_config
    if not direct_ingress and (http.host, http.port) != (host, port):
        _refuse_a_second_pdserve()    # (the advice below is for a Serve that runs something else)
        raise RuntimeError(f"Serve already runs on this Ray cluster with its HTTP proxy on {http.host}:{http.port}, "
                           f"and it keeps that address: serve on it (--host {http.host} --port {http.port}, or "
                           f"http.host / http.port in the deployment file), or stop Serve first (`serve shutdown`); "
                           "to run another pdserve beside one this machine already runs, give it a cluster of its "
                           "own (--address local)")
    return not was_running


def _serve_runs() -> bool:
    """Whether Serve's controller runs on the connected cluster."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    if not ray.is_initialized():
        return False
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _check_answers(address: str, timeout_s: float = 10.0) -> None:
    """Raises ConnectionError when nothing accepts a connection at `address`
    (host:port, or ray://host:port); other forms are left to Ray."""
    import socket

    found = re.fullmatch(r"(?:ray://)?\[?([^\[\]]+?)\]?:(\d+)", address)
    if found is None:
        return
    try:
        socket.create_connection((found[1], int(found[2])), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} within {timeout_s:.0f} s: {exc}") from None


def _refuse_a_second_pdserve() -> None:
    """Raises RuntimeError when the joined cluster already runs a pdserve
    application: deploying would replace it, and cleaning up delete it."""
    from ray import serve

    if APP_NAME in serve.status().applications:
        raise RuntimeError(f"this Ray cluster already runs a pdserve application ({APP_NAME!r}); deploying would "
                           "replace it: stop that one first (Ctrl-C on its `pdserve serve`, or "
                           f"`serve.delete({APP_NAME!r})` from Python on that cluster), or give this one a "
                           "cluster of its own (--address local)")


def _clean_up(started_ray: bool, deployed: bool, started_serve: bool = False,
              stored_secret_env: str | None = None) -> None:
    """Stops what this command started: the whole local cluster, or on a joined
    cluster its application (and the KV secret it stored there for variable
    `stored_secret_env`), and Serve too where this command started it and no
    other application runs on it now (its proxies would keep holding the port)."""
    import ray
    from ray import serve

    from cluster.serving.cluster_secret import delete_named_secret

    try:
        if started_ray:
            serve.shutdown()
        elif deployed:
            serve.delete(APP_NAME)
            if stored_secret_env:
                delete_named_secret(stored_secret_env)
            if started_serve and not serve.status().applications:
                serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - the error that brought us here is the one to report
        print(f"pdserve: cleaning up failed: {exc}", file=sys.stderr)
    finally:
        ray.shutdown()


def _deploy_autoscaled(application: dict) -> None:
    """Deploys through Serve's declarative API (what `serve deploy` sends), with
    the application-level policy that applies the router's targets. Serve deletes
    every declaratively deployed application a config leaves out, so the ones
    this cluster runs besides pdserve are sent again as they are."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    client = serve_start()
    details = client.get_serve_details()
    others = [app["deployed_app_config"] for name, app in details.get("applications", {}).items()
              if name != APP_NAME and app.get("source") == "declarative" and app.get("deployed_app_config")
              and app.get("status") != "DELETING"]
    schema = {"applications": [*others, application]}
    if details.get("target_capacity") is not None:      # an operator's setting, kept
        schema["target_capacity"] = details["target_capacity"]
    client.deploy_apps(ServeDeploySchema(**schema), _blocking=False)


def autoscaled_application(config, profile: dict | None = None) -> dict:
    """The Serve application spec of an autoscaled deployment: the app is built
    in the cluster from the whole config, where the variables the file names may
    not be set, nor its paths mean what they meant here. So they are read here
    (ValueError when one is not set): the API key travels as its digest, the KV
    secret in the Ray cluster's key-value store (the config names its key, where
    store_named_secret puts it before the deploy: Serve shows an application's
    config, runtime environment included, to anyone who asks), `profile` (the
    autoscaling profile, as resolve_model read it) as data, and a relative
    checkpoint path as the absolute path it names here."""
    from cluster.serving.cluster_secret import named_secret_key

    http = config.http.model_copy(update={"api_key_sha256": config.api_key_sha256(), "api_key_env": None})
    from engine.chat_template import read_chat_template
    # the template's text, not a path that may mean nothing where the app is built
    template = read_chat_template(config.model.chat_template) if config.model.chat_template else None
    checkpoint = _path_for_the_cluster(config.model.path)
    model = config.model.model_copy(update={
        "path": checkpoint, "tokenizer": _tokenizer_for_the_cluster(config.model.tokenizer),
        "chat_template": template,
        # the path as given stays a name clients may use (it is no longer the path)
        "served_model_name": config.model.served_names(checkpoint or "tiny")})    # (unset: the tiny model)
    kv = config.kv_transfer
    if kv.secret_env:
        config.kv_transfer_secret()     # ValueError: its variable is not set here
        kv = kv.model_copy(update={"secret_env": None, "secret_stored_key": named_secret_key(kv.secret_env)})
    shipped = config.model_copy(update={"http": http, "model": model, "kv_transfer": kv})
    application = {"name": APP_NAME, "route_prefix": "/", "import_path": "cluster.app_builder:build_app",
                   "args": {"config_json": shipped.model_dump(mode="json"),
                            **({"autoscaling_profile": profile} if profile is not None else {})},
                   "autoscaling_policy": {"policy_function": SERVE_POLICY}}
    return application


def _path_for_the_cluster(model: str | None, built_in: Callable[[str], bool] | None = None) -> str | None:
    """model.path (or, with its `built_in` test, model.tokenizer) as a process with another
    working directory must read it: a directory named here as its absolute path; unset, or a
    built-in model's name (which each node builds in its own cache), as given."""
    from engine.tiny_model import names_built_in_model
    if model is None or (built_in or names_built_in_model)(model):
        return model
    return os.path.abspath(os.path.expanduser(model))


def _tokenizer_for_the_cluster(tokenizer: str | None) -> str | None:
    """model.tokenizer, as _path_for_the_cluster gives model.path."""
    from engine.tiny_model import names_built_in_tokenizer
    return _path_for_the_cluster(tokenizer, names_built_in_tokenizer)


# Serve retries a replica that fails to start for ever once another replica of its deployment has
# started (DEPLOY_FAILED only while none has): a deploy that keeps failing so for this long is one
REPLICA_START_FAILING_LIMIT_S = 180.0


def _wait_running(name: str, stop: StopSignal, notify: Callable[[str], None], every_s: float = 30.0,
                  failing_limit_s: float = REPLICA_START_FAILING_LIMIT_S) -> bool:
    """True once the application is RUNNING, False when a stop was asked for first;
    raises RuntimeError when it fails to deploy, or when a deployment's replicas have
    kept failing to start for `failing_limit_s`. Says every `every_s` what it waits for."""
    from ray import serve

    started = last_told = time.monotonic()
    failing_since: dict[str, float] = {}     # deployment -> when its replicas began failing to start
    while not stop.requested:
        app = serve.status().applications.get(name)
        status = getattr(app, "status", None)
        if status == "RUNNING":
            return True
        now = time.monotonic()
        for d, ds in (app.deployments.items() if app else []):
            if "failed to start" in (ds.message or ""):
                failing_since.setdefault(d, now)
            else:
                failing_since.pop(d, None)
        failing = {d for d, since in failing_since.items() if now - since >= failing_limit_s}
        if status == "DEPLOY_FAILED" or failing:      # (UNHEALTHY while deploying: Serve replaces the replica)
            # the application's message names the deployments; theirs hold the replicas' errors
            causes = [f"{d}: {ds.message}" for d, ds in app.deployments.items() if ds.message]
            why = app.message if status == "DEPLOY_FAILED" else \
                f"replicas of {', '.join(sorted(failing))} kept failing to start for {failing_limit_s:.0f} s"
            raise RuntimeError(f"the application did not deploy: {why}"
                               f"{''.join(chr(10) + '  ' + c for c in causes)}\n(the replicas' logs: logs/serve/ "
                               "in the Ray session's folder, /tmp/ray/session_latest on the node that ran them)")
        if time.monotonic() - last_told >= every_s:
            last_told = time.monotonic()
            waiting = [f"{d}: {getattr(ds.status, 'value', ds.status)}{f' ({ds.message})' if ds.message else ''}"
                       for d, ds in (app.deployments.items() if app else []) if ds.status != "HEALTHY"]
            notify(f"still deploying after {last_told - started:.0f} s (Ctrl-C stops): "
                   f"{'; '.join(waiting) or (app.message if app else 'waiting for Serve')}")
        time.sleep(0.5)
    return False


def base_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _watch_application(name: str, stop: StopSignal, *, poll_s: float = 5.0, unhealthy_limit_s: float = 600.0,
                       misses_allowed: int = 3, clock: Callable[[], float] = time.monotonic,
                       notify: Callable[[str], None] | None = None) -> str | None:
    """Serves until a stop is asked for (None), or until the application is gone
    (deleted, Serve shut down) or Serve has not answered `misses_allowed` polls in
    a row, or it has been UNHEALTHY for `unhealthy_limit_s` (Serve replacing a
    replica of a large model takes minutes): then why, so the command exits
    non-zero and a supervisor restarts it, as vLLM exits when its engine dies.
    Each change of the application's status is told to `notify` (default: printed
    with the time), with Serve's message: an operator sees a replica failing and
    coming back as it happens, not only when the command gives up."""
    from ray import serve

    notify = notify or _print_with_time
    told = "RUNNING"      # (the status the caller saw before it started watching)
    unhealthy_since = None
    misses = gone = 0
    next_poll = clock() + poll_s
    while not stop.requested:
        if clock() < next_poll:
            time.sleep(0.2)
            continue
        next_poll = clock() + poll_s
        try:
            app = serve.status().applications.get(name)
            misses = 0
        except Exception as exc:      # the controller restarting, or lost with the cluster
            misses += 1
            if misses > misses_allowed:
                return f"Serve has not answered for {misses} polls ({type(exc).__name__}: {exc})"
            continue
        status = getattr(app, "status", None)
        status = getattr(status, "value", status)     # Serve's ApplicationStatus, as its name
        if app is None or status in ("DELETING", "NOT_STARTED"):
            gone += 1
            if gone >= 2:     # seen twice in a row, not a status read mid-update
                return f"the {name!r} application is gone ({status or 'deleted'}: by `serve shutdown`, " \
                       "`serve.delete()` or a `serve deploy` without it?)"
            continue
        gone = 0
        if status != told:
            message = getattr(app, "message", "") if status != "RUNNING" else ""
            notify(f"the {name!r} application is {status}{f': {message}' if message else ''}")
            told = status
        if status in ("UNHEALTHY", "DEPLOY_FAILED"):
            unhealthy_since = unhealthy_since or clock()
            if clock() - unhealthy_since >= unhealthy_limit_s:
                return (f"the {name!r} application has been {status} for {clock() - unhealthy_since:.0f} s: "
                        f"{app.message}")
        else:
            unhealthy_since = None
    return None


def _print_with_time(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pdserve: {message}", flush=True)


def _machine_gpus(config) -> int:
    """The CUDA GPUs torch sees on this machine (0 for a CPU deployment, whose check needs none)."""
    return visible_gpus() if config.device == "cuda" else 0


def _connect(address: str | None, local_cpus: int, local_env: dict[str, str], dashboard: bool,
             before_starting: Callable[[], None] = lambda: None) -> bool:
    """Joins `address`, or a running local cluster, or starts one declaring
    `local_cpus` CPUs with `local_env` in its processes' environment (and the
    Ray dashboard if `dashboard`); True when this process started it (and must
    stop it). A RAY_ADDRESS where nothing answers is a ConnectionError at once; the
    cluster `ray start` last started here, dead without `ray stop`, is replaced by a
    new local one (ray.init would retry it for minutes, then fail). `before_starting`
    runs before a local cluster starts, and may raise to start none."""
    from cluster.serving.local_cluster import start_local_cluster as start

    def start_local_cluster(*args, **kwargs) -> None:
        before_starting()
        start(*args, **kwargs)
    if address == "local":
        start_local_cluster(local_cpus, local_env, dashboard=dashboard)
        return True
    if address:
        _check_answers(address)   # ray.init retries an address where nothing listens for minutes
        _init_ray(address)
        return False
    from_env = os.environ.get("RAY_ADDRESS")
    if from_env:
        try:
            _check_answers(from_env)
        except ConnectionError as exc:
            raise ConnectionError(f"RAY_ADDRESS={from_env}: {exc}; unset RAY_ADDRESS to start a local cluster") \
                from None
    else:
        from ray._private.services import find_bootstrap_address
        last = find_bootstrap_address(None)      # the cluster `ray start` last started on this machine
        if last:
            try:
                _check_answers(last, timeout_s=2.0)
            except ConnectionError:
                # it died without `ray stop` (killed, out of memory, a restart): ray.init would retry it
                # for minutes, then fail
                print(f"pdserve: the Ray cluster last started on this machine ({last}) does not answer; "
                      "starting a new one", flush=True)
                start_local_cluster(local_cpus, local_env, dashboard=dashboard)
                return True
    try:
        _init_ray("auto")
        return False
    except ClusterJoinError:      # a cluster is there, and joining it failed: say so
        raise
    except ConnectionError:       # none runs here
        if from_env:
            raise
        start_local_cluster(local_cpus, local_env, dashboard=dashboard)
        return True


def _auth_hint() -> str:
    """A note for a failed join where this machine has a Ray authentication token: a cluster
    started with token authentication refuses a client that does not send it."""
    if os.environ.get("RAY_AUTH_MODE") == "token" or not (Path.home() / ".ray" / "auth_token").is_file():
        return ""
    return ("; if that cluster uses Ray's token authentication (a `ray start` where ~/.ray/auth_token exists "
            "turns it on), set RAY_AUTH_MODE=token here too")


class ClusterJoinError(ConnectionError):
    """A cluster answered, and joining it failed (not a Ray cluster, a version mismatch)."""


def _init_ray(address: str) -> None:
    """ray.init(address); Ray's RuntimeError for a port that answers but is no Ray
    cluster, or a version mismatch, as ClusterJoinError."""
    import ray
    try:
        ray.init(address=address)
    except RuntimeError as exc:
        raise ClusterJoinError(f"{type(exc).__name__}: {exc}") from None
