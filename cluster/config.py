"""Deployment configuration: pydantic models, validated once at the edge.

A deployment file (YAML) describes one pdserve cluster: the model, the mode
(disaggregated prefill/decode, or colocated), each worker pool's replica count
and tensor-parallel degree, and the engine options they share. Inner code gets
plain values: `DeploymentConfig.engine_config(role)` builds the EngineConfig a
worker of that role runs.
"""

from __future__ import annotations

import collections.abc
import copy
import functools
import ipaddress
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from engine.core_lending import AUTO as LEDGER_AUTO
from engine.engine_config import EngineConfig


class Mode(str, Enum):
    disaggregated = "disaggregated"
    colocated = "colocated"


# The worker pools (deployment file sections) each mode runs.
POOLS_BY_MODE = {Mode.disaggregated: ("prefill", "decode"), Mode.colocated: ("colocated",)}


class _Strict(BaseModel):
    # errors name the setting and what is wrong with it, without repeating the value given (a
    # secret pasted where its variable's name belongs stays out of logs)
    # (no infinities: `.inf` passes a `gt=0` bound, and no size or count can be infinite)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True, allow_inf_nan=False)


def _env_name(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError("must name an environment variable (letters, digits and _), not hold the secret itself")
    return value


# the name of the environment variable that holds a secret (errors never repeat the value: see _Strict)
EnvName = Annotated[str | None, AfterValidator(_env_name)]


def _bind_host(value: str) -> str:
    """An address a server can bind: an IP (0.0.0.0 / :: for every interface; IPv6 without
    brackets) or a host name."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
            raise ValueError("must be an IP address to listen on (0.0.0.0 for every interface; IPv6 without "
                             "brackets) or a host name") from None
    return value


# dtype spellings vLLM and torch users write -> the name the deployment keeps
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


def _dtype_name(value: Any) -> Any:
    return _DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else value


def _served_names(value: Any) -> Any:
    """One name, or several (the first is the one responses carry; every one is accepted): a list,
    each name once."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return list(dict.fromkeys(value))
    return value


def _listen_address(value: str | None) -> str | None:
    """An address a socket can bind and a peer can connect to: an IP (no brackets, not 0.0.0.0 or ::,
    which peers cannot reach) or a host name."""
    if value is None:
        return None
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
            raise ValueError("must be an IP address (IPv6 without brackets) or a host name, one that peers can "
                             "connect to") from None
        return value
    if ip.is_unspecified:
        raise ValueError("must be an address peers can connect to, not 0.0.0.0 or :: (every interface)")
    return value


class ModelSection(_Strict):
    path: str | None = Field(None, description="HuggingFace checkpoint directory; null: the built-in tiny model")
    served_model_name: Annotated[list[Annotated[str, Field(min_length=1)]] | None, BeforeValidator(_served_names)] \
        = Field(None, min_length=1, description="the name clients use in requests, or a list of names (responses "
                "carry the first; each is accepted); default: the directory name, and `path` as given")
    tokenizer: str | None = Field(None, min_length=1, description="a directory (or built-in model) whose "
                                  "tokenizer to use in place of the checkpoint's (vLLM's --tokenizer)")
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], BeforeValidator(_dtype_name)] = Field(
        "auto", description="auto: the checkpoint's torch_dtype on CUDA, float32 on CPU; also half, fp16, bf16, "
        "float, fp32")
    max_model_len: int | None = Field(None, ge=2)
    chat_template: str | None = Field(
        None, min_length=1, description="a Jinja chat template file (or the template itself) the router renders "
        "chats with, in place of the tokenizer's (vLLM's --chat-template)")

    def served_names(self, checkpoint: str) -> list[str]:
        """The names clients may ask for, the one responses carry first: served_model_name,
        else the checkpoint directory's name (`checkpoint`: `path` resolved) and `path`
        as given (what `vllm serve PATH` serves it as)."""
        if self.served_model_name:
            return list(self.served_model_name)
        names = [Path(checkpoint).name]
        return names + [self.path] if self.path and self.path not in names else names


class WorkerPool(_Strict):
    replicas: int = Field(1, ge=0, description="replicas of this role; each is a TP gang")
    tensor_parallel_size: int = Field(1, ge=1, le=64)


# Default tokens per step. On CPU a step of 512 prompt tokens takes ~0.2 s (bench
# preset, 2 cores), so a burst of prompts gets its first tokens in turn rather than
# all after one long step: at 16 concurrent, goodput 3.5 against 2.95 req/s at 1024
# tokens (median TTFT 635 against 850 ms); 256 tokens gave 3.37 (more steps, each
# with its fixed cost).
CPU_TOKENS_PER_STEP = 512
CUDA_TOKENS_PER_STEP = 2048
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")    # what a deployment's replicas log, at least


class EngineSection(_Strict):
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens per engine step (prefill chunks + decodes); default: "
        f"{CPU_TOKENS_PER_STEP} on CPU, {CUDA_TOKENS_PER_STEP} on CUDA")
    kv_cache_memory_gib: float = Field(1.0, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    seed: int = Field(0, ge=-2**63, lt=2**64, description="seeds the sampling of requests that give no seed")
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "triton", "cpp"] = Field(
        "auto", description="triton: paged kernels that read K/V in place (auto on CUDA); cpp: C++ decode "
        "attention reading the blocks in place (auto on CPU, float32); torch: gather + SDPA")
    enforce_eager: bool = Field(False, description="CUDA: run every step eagerly, without CUDA graphs")
    max_cuda_graph_batch_size: int = Field(256, ge=1, description="CUDA: decode batches up to this size "
                                           "replay a graph captured at start-up")
    async_scheduling: Literal["auto"] | bool = Field(
        "auto", description="schedule and launch the next step while the device runs the current one "
        "(auto: on for CUDA; pools with tensor_parallel_size > 1 always step synchronously)")
    skinny_gemm: bool = Field(True, description="CUDA: one-row matmuls through a Triton GEMV")
    cpu_weight_prepack: bool = Field(True, description="CPU: linear weights also kept packed for oneDNN and, "
                                     "float32, in panels for pdserve's few-row kernel (each path used for the "
                                     "batch sizes where it is fastest, measured at load; up to three times the "
                                     "linear weights' memory)")


class KVTransferSection(_Strict):
    timeout_s: float = Field(30.0, gt=0, description="limit on any one wait: connecting a worker pair, one transfer")
    lease_s: float = Field(60.0, gt=0, description="a prefill worker frees KV nobody picked up after this long "
                           "(counted again from the start of a send; a send on the wire keeps it one more lease at most)")
    reserve_timeout_s: float = Field(120.0, gt=0, description="a decode worker refuses a request it found no "
                                     "free KV blocks for in this long")
    staging_mib: float = Field(1024.0, gt=0, description="a decode worker's buffers for incoming KV, and a "
                               "prefill worker's packed copies of the KV it sends, stay within this much per rank "
                               "(hand-offs past it wait for earlier ones to end, a send at most half of timeout_s; one larger than it "
                               "goes alone); "
                               "on a GPU, prefill and decode workers size their KV cache with this much left free "
                               "for them")
    listen_address: Annotated[str | None, AfterValidator(_listen_address)] = Field(
        None, description="the address every decode worker's KV rendezvous store and gloo KV pair sockets listen "
        "on, so for a one-node deployment only: null for each worker's node address (any cluster); the one-node "
        "cluster `pdserve serve` starts itself uses 127.0.0.1 (NCCL's own bootstrap, on CUDA, picks its "
        "interface by NCCL_SOCKET_IFNAME)")
    secret_env: EnvName = Field(None, description="name of the environment variable that holds the secret "
                                   "a prefill worker proves to a decode worker before any KV moves (read where "
                                   "the application is built); default: a random secret made once per Ray cluster")
    secret_stored_key: str | None = Field(None, pattern=r"^[A-Za-z0-9_./-]{1,160}$", description="or the key "
                                          "under which `pdserve serve --autoscale` stored secret_env's value in "
                                          "the Ray cluster's key-value store, so that the application's config, "
                                          "which Serve shows, holds no secret")

    @model_validator(mode="after")
    def _one_secret_source(self):
        if self.secret_env and self.secret_stored_key:
            raise ValueError("give kv_transfer.secret_env or kv_transfer.secret_stored_key, not both")
        return self


class DisaggregationSection(_Strict):
    policy: Literal["always", "conditional"] = Field(
        "conditional", description="always: every prompt runs on a prefill worker; conditional: a decode "
        "worker prefills short prompts, and longer ones when the prefill pool is predicted to be slower")
    local_prefill_max_tokens: int = Field(128, ge=0, description="conditional: prompts of at most this many "
                                          "tokens are prefilled on the decode worker")
    max_remote_wait_ms: float = Field(500.0, ge=0, description="conditional: longer prompts are prefilled on "
                                      "the decode worker only while the prefill pool's predicted wait is longer")


class HttpSection(_Strict):
    host: Annotated[str, AfterValidator(_bind_host)] = Field(
        "127.0.0.1", min_length=1, description="the address to listen on; 0.0.0.0 for every interface")
    port: int = Field(8000, ge=1, le=65535)
    api_key_env: EnvName = Field(None, description="name of the environment variable that holds the API "
                                    "key (read where the application is built); never the key itself")
    api_key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="or the key's SHA-256 "
                                       "(hex); `pdserve serve --api-key` / PDSERVE_API_KEY set this")
    protect_metrics: bool = Field(True, description="with an API key, GET /metrics needs it too")
    direct_ingress: bool = Field(True, description="on a cluster `pdserve serve` starts itself, the router "
                                 "answers HTTP on `port` (Ray Serve's direct ingress) instead of Serve's "
                                 "HTTP proxy, one process hop fewer per streamed chunk")
    stream_interval_ms: float = Field(50.0, ge=0, le=1000, description="stream batching: a worker sends "
                                      "mid-stream tokens to the router at most this often, the steps in "
                                      "between in one message (first tokens and finishes go at once); 0: "
                                      "one message per engine step")
    allowed_origins: list[str] = Field(default_factory=list, description="CORS: the origins whose web pages may "
                                       "call the API (e.g. https://chat.example.com), or [\"*\"] for any; empty: "
                                       "no CORS headers, so browsers let only pages of the server's own origin read "
                                       "its answers")
    allow_credentials: bool = Field(False, description="CORS: browsers may send cookies and HTTP authentication "
                                    "with cross-origin requests (only with origins listed one by one)")

    @model_validator(mode="after")
    def _one_key_source(self):
        if self.api_key_env and self.api_key_sha256:
            raise ValueError("give http.api_key_env or http.api_key_sha256, not both: with both, one key "
                             "would be silently ignored")
        return self

    @model_validator(mode="after")
    def _check_cors(self):
        for i, origin in enumerate(self.allowed_origins):
            # as a browser sends it: lower case, no default port (the match is exact)
            if origin != "*" and not re.fullmatch(r"https?://([a-z0-9.-]+|\[[0-9a-f:.]+\])(:[0-9]{1,5})?", origin):
                raise ValueError(f"allowed_origins[{i}] is not an origin as browsers send it: give "
                                 "scheme://host[:port] in lower case, with no path, query or trailing slash "
                                 "(e.g. https://chat.example.com), or \"*\" for any origin")
            if origin.startswith("https://") and origin.endswith(":443") or \
                    origin.startswith("http://") and origin.endswith(":80"):
                raise ValueError(f"allowed_origins[{i}] names its scheme's default port, which browsers leave "
                                 "out of the origin they send: drop the port")
        if self.allow_credentials and not self.allowed_origins:
            raise ValueError("allow_credentials does nothing without allowed_origins: list the origins whose pages "
                             "may send credentials, or drop allow_credentials")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials with allowed_origins \"*\" would let every web site send requests "
                             "with its visitors' cookies: list the origins one by one, or drop allow_credentials")
        return self


class LimitsSection(_Strict):
    """What one request may ask for; past a limit it gets a 400 (413 for the body) naming it."""
    max_request_body_bytes: int = Field(16 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1, description="null: the model's context")
    max_tokens: int | None = Field(None, ge=1, description="null: what the context leaves")
    max_logprobs: int = Field(20, ge=0)
    max_stop_sequences: int = Field(16, ge=0)
    max_stop_chars: int = Field(1024, ge=1, description="characters of one stop string (the engine searches a "
                                "window that long on every step)")
    max_stop_token_ids: int = Field(256, ge=0)
    max_n: int = Field(16, ge=1, description="choices one request may ask for (n)")
    max_logit_bias: int = Field(1024, ge=0, description="token ids one request's logit_bias may name")
    max_allowed_token_ids: int = Field(1024, ge=0, description="token ids one request's allowed_token_ids may name")
    max_prompts: int = Field(256, ge=1, description="prompts one /v1/completions request may batch")
    max_logprob_entries: int = Field(1 << 22, ge=1, description="logprob entries (a token's and its "
                                     "alternatives') one non-streamed response may carry in all")


def _known_gpu_type(name: str | None) -> str | None:
    """A GPU type the memory planner and the roofline model know, by its canonical name."""
    if name is None:
        return None
    from engine.memory_planner import resolve_gpu_type
    try:
        return resolve_gpu_type(name).name
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("--gpu-type: ")) from None


class Resources(_Strict):
    cpus_per_rank: float | None = Field(None, ge=0.0001, le=1024, description="CPUs each rank's bundle reserves; null: "
                                        "on CPU, the node's cores shared equally among all ranks of the "
                                        "deployment (at least 1 each); on CUDA, 1")
    lend_idle_cores: bool = Field(True, description="CPU: an idle one-rank engine lends its cores to busy ones "
                                  "on the same machine (decode and colocated engines borrow, prefill engines "
                                  "only lend); engine/core_lending.py")
    gpu_type: Annotated[str | None, AfterValidator(_known_gpu_type)] = Field(
        None, description="H100-SXM, H200 or A100-80GB (or h100, h200, a100): the GPUs `pdserve simulate` "
        "models for this deployment")
    gpu_memory_gib: float | None = Field(None, gt=0)
    check_placement: bool = Field(True, description="refuse a deployment whose gangs the connected cluster's "
                                  "nodes could never hold (counted by what they have in all: gangs that wait for "
                                  "what other jobs hold now are placed when it is freed); false: deploy with a "
                                  "warning and let Ray place them when nodes come (a cluster whose autoscaler adds "
                                  "nodes on demand)")


class MigrationSection(_Strict):
    max_migrations: int = Field(3, ge=0, description="times a request whose worker fails is continued on "
                                "another one (0: it fails with the worker)")


class SloSection(_Strict):
    ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token SLO: admission control refuses "
                                  "what would miss it; the autoscaler scales for it")
    tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token SLO (admission control, the autoscaler)")


class AdmissionSection(_Strict):
    enabled: bool = Field(True, description="the router refuses (429, Retry-After) what it cannot serve in time")
    max_waiting_requests: int | None = Field(1024, ge=1, description="requests waiting for their first token; "
                                             "null: no bound")
    max_waiting_prompt_tokens: int | None = Field(1 << 18, ge=1, description="their prompt tokens; null: no bound")
    slo_factor: float = Field(1.0, gt=0, description="with slo.ttft_ms: refuse a request whose predicted time to "
                              "first token is past this many times the SLO")
    overload_wait_factor: float | None = Field(0.25, ge=0, description="with slo.ttft_ms, while prompts arrive "
                                               "faster than the prefill replicas serve them: admit a request only "
                                               "while what still waits ahead of it takes at most this many times its "
                                               "own prefill (keeps admitted TTFT near its unloaded value); null: "
                                               "admit up to the SLO")
    tpot_headroom: float = Field(0.8, gt=0, le=1, description="with slo.tpot_ms: admit a request only while "
                                 "the decode replicas' predicted step time, with it, stays within this share of "
                                 "the SLO")

    def settings(self, slo: "SloSection"):
        """The router's AdmissionSettings, or None when admission control is off."""
        from router.admission import AdmissionSettings
        if not self.enabled:
            return None
        return AdmissionSettings(self.max_waiting_requests, self.max_waiting_prompt_tokens,
                                 slo.ttft_ms / 1000 if slo.ttft_ms else None, self.slo_factor,
                                 slo.tpot_ms / 1000 if slo.tpot_ms else None, tpot_headroom=self.tpot_headroom,
                                 overload_wait_factor=self.overload_wait_factor)


class AutoscalingSection(_Strict):
    enabled: bool = Field(False, description="set the replicas per role while serving, for goodput at the SLOs "
                          "(slo: section)")
    budget: int | None = Field(None, ge=1, description="ranks (GPUs; CPU ranks on CPU) all roles may use "
                               "together; null: the ranks the pools start with (the split moves, the total stays)")
    min_replicas: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="per role (prefill, decode or colocated); default 1 (decode and "
        "colocated need at least 1)")
    max_replicas: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="per role; default: as many as the budget holds")
    interval_s: float = Field(10.0, gt=0, description="how often the policy decides")
    startup_s: float = Field(30.0, ge=0, description="from asking for a replica to its first request: the "
                             "load is predicted this far ahead")
    upscale_cooldown_s: float = Field(0.0, ge=0)
    downscale_cooldown_s: float = Field(60.0, ge=0)
    downscale_window_s: float = Field(120.0, ge=0, description="a scale-down that frees ranks must hold the "
                                      "load of every interval of this window (a lull shorter than it keeps the "
                                      "replicas)")
    predictor: Literal["constant", "ewma", "trend"] = "ewma"
    profile: str | None = Field(None, description="step-time profile (pdserve profile); null: fitted to the "
                                "steps the workers measure while serving")
    correct_profile: bool = Field(True, description="scale the profile by the steps the workers measure "
                                  "(false: trust it as it is)")
    ttft_percentile: float = Field(0.9, gt=0, lt=1, description="the share of TTFTs a prefill replica's "
                                   "rated capacity keeps within the TTFT SLO")
    slo_headroom: float = Field(0.8, gt=0, le=1, description="the modelled decode step is held to this share "
                                "of the TPOT SLO; on shared cores, a role whose observed p90 is within this share "
                                "of its SLO is not seen short")
    downscale_headroom: float = Field(0.8, gt=0, le=1, description="a scale-down needs the remaining replicas "
                                      "to hold the load at this share of their capacity")
    split_margin: float = Field(0.2, ge=0, description="a re-split must serve this share more than the "
                                "current split (no see-saw between near-equal splits)")
    warmup_steps: int = Field(20, ge=0, description="a replica's first steps, left out of the profile's "
                              "correction")
    refusal_pressure: float = Field(0.1, ge=0, le=1, description="on shared cores: the share of arrivals "
                                    "admission control refuses on a role's account that shows the role short")
    pressure_window_s: float = Field(30.0, gt=0, description="the window refusal_pressure is taken over")
    length_finish_share: float = Field(0.9, gt=0, description="where at least this share of finished requests "
                                       "ran to their max_tokens, a larger max_tokens on the arrivals raises the "
                                       "output length the policy expects (above 1: never)")

    def settings(self, mode: str, initial: dict[str, WorkerPool], slo: "SloSection", *, lend_idle_cores: bool = False):
        """The policy's AutoscaleSettings for `mode`, whose pools start as `initial`;
        `lend_idle_cores`: CPU replicas that lend idle cores (resources.lend_idle_cores)."""
        from cluster.autoscaler.policy import AutoscaleSettings
        tp = {role: pool.tensor_parallel_size for role, pool in initial.items()}
        budget = self.budget or sum(p.replicas * p.tensor_parallel_size for p in initial.values())
        return AutoscaleSettings(
            ttft_slo_s=slo.ttft_ms / 1000, tpot_slo_s=slo.tpot_ms / 1000, mode=mode,
            min_replicas=dict(self.min_replicas), max_replicas=dict(self.max_replicas), tensor_parallel=tp,
            budget=budget, interval_s=self.interval_s, startup_s=self.startup_s,
            upscale_cooldown_s=self.upscale_cooldown_s, downscale_cooldown_s=self.downscale_cooldown_s,
            downscale_window_s=self.downscale_window_s, predictor=self.predictor, correct_models=self.correct_profile,
            lend_idle_cores=lend_idle_cores, ttft_percentile=self.ttft_percentile, slo_headroom=self.slo_headroom,
            downscale_headroom=self.downscale_headroom, split_margin=self.split_margin,
            warmup_steps=self.warmup_steps, refusal_pressure=self.refusal_pressure,
            pressure_window_s=self.pressure_window_s, length_finish_share=self.length_finish_share)


class DeploymentConfig(_Strict):
    model: ModelSection = ModelSection()
    mode: Mode = Mode.disaggregated
    device: Literal["cpu", "cuda"] = "cpu"
    http: HttpSection = HttpSection()
    prefill: WorkerPool = WorkerPool()
    decode: WorkerPool = WorkerPool()
    colocated: WorkerPool = WorkerPool()
    engine: EngineSection = EngineSection()
    kv_transfer: KVTransferSection = KVTransferSection()
    disaggregation: DisaggregationSection = DisaggregationSection()
    resources: Resources = Resources()
    slo: SloSection = SloSection()
    migration: MigrationSection = MigrationSection()
    admission: AdmissionSection = AdmissionSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    limits: LimitsSection = LimitsSection()
    log_level: Literal[LOG_LEVELS] | None = Field(None, description="what the replicas log, pdserve's lines "
                                                  "and Serve's; null: Serve's level (INFO, or a Serve config "
                                                  "file's logging_config); PDSERVE_LOG_LEVEL in the replicas' "
                                                  "environment overrides it for pdserve's")

    @model_validator(mode="after")
    def _autoscaling_is_complete(self) -> "DeploymentConfig":
        a = self.autoscaling
        if not a.enabled:
            return self
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ValueError("autoscaling.enabled needs the SLOs it scales for: set slo.ttft_ms and slo.tpot_ms "
                             "(pdserve serve --autoscale --slo ttft:MS tpot:MS)")
        roles = set(self.pools())
        for name in ("min_replicas", "max_replicas"):
            unknown = set(getattr(a, name)) - roles
            if unknown:
                raise ValueError(f"autoscaling.{name} names {', '.join(sorted(unknown))}; in {self.mode.value} "
                                 f"mode the roles are {', '.join(sorted(roles))}")
        for role in roles - {"prefill"}:
            if a.min_replicas.get(role, 1) < 1:
                raise ValueError(f"autoscaling.min_replicas.{role} must be at least 1: every request "
                                 f"{'decodes' if role == 'decode' else 'runs'} on a {role} replica")
        try:
            settings = self.autoscaling_settings()
        except ValueError as exc:
            raise ValueError(f"autoscaling: {exc}") from None
        pools = self.pools()
        starting = sum(p.replicas * p.tensor_parallel_size for p in pools.values())
        if starting > settings.budget:
            layout = " + ".join(f"{role} {p.replicas} x TP {p.tensor_parallel_size}" for role, p in pools.items())
            raise ValueError(f"the pools start with {starting} ranks ({layout}), more than autoscaling.budget "
                             f"({settings.budget}) allows: raise the budget (--max-replicas) or start with fewer "
                             f"replicas ({', '.join(f'{role}.replicas' for role in pools)})")
        for role, pool in pools.items():
            low, high = settings.min_for(role), settings.max_for(role)
            if not low <= pool.replicas <= high:
                raise ValueError(f"{role}.replicas ({pool.replicas}) is outside the autoscaler's bounds for "
                                 f"{role}, {low} to {high} (autoscaling.min_replicas / max_replicas): start "
                                 "within them")
        if not settings.can_move():
            floor = " + ".join(f"{role} {settings.min_for(role)}" for role in settings.roles)
            room = "min_replicas.prefill: 0 (the decode replicas then prefill themselves), or " \
                if self.mode is Mode.disaggregated and settings.min_for("prefill") > 0 else ""
            raise ValueError(f"autoscaling could never change a replica count: the minimum replicas ({floor}) "
                             f"already fill the budget of {settings.budget} ranks"
                             f"{'' if a.budget else ' (by default, the ranks the pools start with)'}; give it "
                             f"room: {room}a larger budget (autoscaling.budget; pdserve serve --max-replicas N)")
        return self

    def api_key_sha256(self) -> str | None:
        """The SHA-256 of the API key the router requires, or None for no key.
        Raises ValueError when http.api_key_env names a variable that is not set."""
        from router.http_guard import configured_key_digest
        if self.http.api_key_sha256:
            return self.http.api_key_sha256.lower()
        if self.http.api_key_env:
            return configured_key_digest(_named_variable("http.api_key_env", self.http.api_key_env,
                                                         "set it to the API key, or give the key with pdserve "
                                                         "serve --api-key"),
                                         "the variable http.api_key_env names")
        return None

    def kv_transfer_secret(self) -> str:
        """The secret every KV-transfer pair of this deployment proves: the named
        variable's, else the Ray cluster's own (cluster/serving/cluster_secret.py).
        Raises ValueError when kv_transfer.secret_env names a variable that is not set,
        or kv_transfer.secret_stored_key a key this Ray cluster does not hold."""
        if self.kv_transfer.secret_stored_key:
            from cluster.serving.cluster_secret import stored_secret
            value = stored_secret(self.kv_transfer.secret_stored_key)
            if not value:
                raise ValueError(f"kv_transfer.secret_stored_key {self.kv_transfer.secret_stored_key!r} is not in "
                                 "this Ray cluster's key-value store: deploy with `pdserve serve` again, or name "
                                 "the secret's variable in kv_transfer.secret_env")
            return value
        if not self.kv_transfer.secret_env:
            from cluster.serving.cluster_secret import cluster_secret
            return cluster_secret()
        return _named_variable("kv_transfer.secret_env", self.kv_transfer.secret_env,
                               "set it, or leave secret_env out for a random secret per Ray cluster")

    def autoscaling_settings(self):
        """The autoscaling policy's settings (autoscaling.enabled must be true)."""
        return self.autoscaling.settings(self.mode.value, self.pools(), self.slo,
                                         lend_idle_cores=self.lends_idle_cores())

    def kv_transfer_staging_gib(self) -> float:
        """What each rank's KV cache leaves free for hand-off buffers on a GPU
        (kv_transfer.staging_mib; nothing in colocated mode, which hands nothing off)."""
        return 0.0 if self.mode is Mode.colocated else self.kv_transfer.staging_mib / 1024

    def lends_idle_cores(self) -> bool:
        """Whether one-rank CPU engines lend idle cores to each other (engine/core_lending.py)."""
        return self.device == "cpu" and self.resources.lend_idle_cores

    @model_validator(mode="after")
    def _pools_match_mode(self) -> "DeploymentConfig":
        if self.mode is Mode.disaggregated:
            if self.prefill.replicas < 1 or self.decode.replicas < 1:
                raise ValueError("disaggregated mode needs prefill.replicas >= 1 and decode.replicas >= 1 "
                                 "(or set mode: colocated)")
        elif self.colocated.replicas < 1:
            raise ValueError("colocated mode needs colocated.replicas >= 1")
        return self

    def pools(self) -> dict[str, WorkerPool]:
        """The worker pools this mode runs, by role."""
        return {role: getattr(self, role) for role in POOLS_BY_MODE[self.mode]}

    def unused_settings(self, given: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Settings given that do nothing, each said with what to do instead: the pools this mode
        does not run (e.g. decode's TP degree in a file that `--mode colocated` switched), the
        hand-off's sections in colocated mode, the autoscaler's settings with autoscaling off
        (unless `given`, the dotted settings the command line gave, turned it off: a file's
        autoscaler kept for another run)."""
        problems = []
        runs = self.pools()
        unused = [f"{role}: {pool.model_dump(exclude_defaults=True)}"
                  for role, pool in (("prefill", self.prefill), ("decode", self.decode), ("colocated", self.colocated))
                  if role not in runs and pool != WorkerPool()]
        if unused:
            problems.append(f"{self.mode.value} mode runs {' and '.join(runs)} replicas only: the settings of "
                            f"{'; '.join(unused)} are not used (set {' and '.join(f'{role}:' for role in runs)} "
                            "instead)")
        if self.mode is Mode.colocated:
            handoff = [name for name in ("kv_transfer", "disaggregation")
                       if getattr(self, name).model_dump(exclude_defaults=True)]
            if handoff:
                problems.append(f"colocated mode hands no KV cache over: the settings of {' and '.join(handoff)} "
                                "are not used (drop them, or serve in disaggregated mode)")
        if not self.autoscaling.enabled and "autoscaling.enabled" not in given and \
                self.autoscaling.model_dump(exclude_defaults=True):
            problems.append("autoscaling is off (autoscaling.enabled false): its other settings are not used "
                            "(set autoscaling.enabled: true, or pdserve serve --autoscale, to use them)")
        return problems

    def with_default_device(self, gpus: float) -> "DeploymentConfig":
        """This deployment, on cuda where it names no device (neither in the file nor by a
        flag) and `gpus` (the machine's or the cluster's) hold a GPU for each of its ranks:
        as vLLM, on the GPUs where there are some (where too few, it stays on CPU, which
        places any deployment)."""
        if "device" in self.model_fields_set or gpus < self.ranks():
            return self
        return with_overrides(self, {"device": "cuda"})

    def ranks(self) -> int:
        """The ranks (on CUDA, GPUs) of the replicas the deployment starts with."""
        return sum(pool.replicas * pool.tensor_parallel_size for pool in self.pools().values())

    def tokenizer_path(self) -> str | None:
        """model.tokenizer's directory (None: the checkpoint's own tokenizer)."""
        from engine.tiny_model import tokenizer_dir
        return tokenizer_dir(self.model.tokenizer) if self.model.tokenizer else None

    def tokens_per_step(self) -> int:
        """engine.max_num_batched_tokens, or the default for the device."""
        if self.engine.max_num_batched_tokens is not None:
            return self.engine.max_num_batched_tokens
        return CPU_TOKENS_PER_STEP if self.device == "cpu" else CUDA_TOKENS_PER_STEP

    def engine_config(self, role: str, model_path: str) -> EngineConfig:
        """The engine options one rank-0 worker of `role` runs with; on CPU, as
        many torch threads per rank as its bundle has CPUs (when resolved)."""
        pool = self.pools()[role]
        e = self.engine
        cpus = self.resources.cpus_per_rank
        return EngineConfig(
            model=model_path, tokenizer=self.tokenizer_path(),
            seed=e.seed, dtype=self.model.dtype, device=self.device,
            max_model_len=self.model.max_model_len, block_size=e.block_size,
            kv_cache_memory_gib=e.kv_cache_memory_gib, gpu_memory_utilization=e.gpu_memory_utilization,
            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=self.tokens_per_step(),
            enable_chunked_prefill=e.enable_chunked_prefill, enable_prefix_caching=e.enable_prefix_caching,
            tensor_parallel_size=pool.tensor_parallel_size, attention_backend=e.attention_backend,
            # a prefill worker never runs a decode step: no decode graphs to capture and reserve memory for
            enforce_eager=e.enforce_eager or role == "prefill", max_cuda_graph_batch_size=e.max_cuda_graph_batch_size,
            cpu_weight_prepack=e.cpu_weight_prepack, skinny_gemm=e.skinny_gemm,
            async_scheduling=e.async_scheduling if pool.tensor_parallel_size == 1 else False,
            cpu_threads=max(1, int(cpus)) if self.device == "cpu" and cpus is not None else None,
            kv_transfer_staging_gib=self.kv_transfer_staging_gib(),
            cpu_core_ledger=LEDGER_AUTO if self.lends_idle_cores() else None)


class ConfigFileError(ValueError):
    """A deployment file that cannot be read or does not validate."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                overrides_from: str = "on the command line") -> DeploymentConfig:
    """The deployment in the YAML file at `path` (None: the defaults) with the
    dotted `overrides` (e.g. {"prefill.replicas": 2}; None values skipped) put
    in before it is validated, so a command-line flag can supply what the file
    lacks; `overrides_from` says where they were given, in errors. Raises ConfigFileError."""
    data = read_deployment_file(path) if path is not None else {}
    try:
        return DeploymentConfig.model_validate(_with_dotted(data, overrides or {}))
    except ValidationError as exc:
        what = f"{path}" if path is not None else "the defaults"
        given = {key for key, value in (overrides or {}).items() if value is not None}
        flags = f" with the settings given {overrides_from}" if given else ""
        raise ConfigFileError(f"{what}{flags} is not a valid pdserve deployment:\n"
                              f"{_described(exc, given, overrides_from)}") from None


def read_deployment_file(path: str | Path) -> dict[str, Any]:
    """The sections of the deployment YAML file at `path`, as plain dicts, not yet
    validated (an empty file, or one of comments only: {}, the defaults). Raises
    ConfigFileError for a file that cannot be read or is not a mapping of sections."""
    import yaml
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"cannot read deployment file {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"cannot read deployment file {path}: it is not UTF-8 text ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path} is not a valid pdserve deployment file: it holds a "
                              f"{type(data).__name__}, not a mapping of sections")
    if "applications" in data:
        raise ConfigFileError(f"{path} is a Ray Serve config file (it has `applications:`), not a pdserve "
                              "deployment file: run it with `serve run` / `serve deploy`, or give pdserve the "
                              "deployment file its application's `args: config:` names")
    # a section whose settings are all commented out reads as null: its defaults, as if left out
    return {key: {} if value is None and _section_model(DeploymentConfig, key) else value
            for key, value in data.items()}


def _described(exc: ValidationError, given: set[str], given_by: str) -> str:
    """Each error as the setting it is about (marked where it was `given_by`), what is
    wrong, and for an unknown setting the known one its name is closest to; without
    pydantic's header, type codes and links."""
    lines = []
    for error in exc.errors():
        setting = ".".join(part for part in error["loc"] if isinstance(part, str))
        # a list's item as setting[i]
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message += _closest_setting(error["loc"])
        if where:
            mark = f" (set {given_by})" if setting in given else ""
            lines.append(f"{where}{mark}\n  {message}")
        else:
            lines.append(message)
    return "\n".join(lines)


def _closest_setting(loc: tuple) -> str:
    """"; did you mean X?" for an unknown setting at `loc` whose name is close to a known
    one of its section, else ""."""
    import difflib
    model: type[BaseModel] = DeploymentConfig
    for part in loc[:-1]:
        model = _section_model(model, str(part)) if isinstance(part, str) else None
        if model is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.7)
    return f"; did you mean {'.'.join(str(p) for p in loc[:-1]) + '.' if loc[:-1] else ''}{close[0]}?" \
        if close else ""


@functools.lru_cache(maxsize=1)
def _unique_key_loader():
    """yaml's SafeLoader, refusing a key given twice in one mapping (it would keep
    the last silently: an edit that missed the setting already there)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":    # `<<: *anchor` merges, not a setting
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, collections.abc.Hashable):    # e.g. an INI-style `[model]:` header
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a key must be a name, not a {type(key).__name__}",
                        key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one section", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def with_overrides(config: DeploymentConfig, overrides: dict[str, Any]) -> DeploymentConfig:
    """A copy of `config` with dotted keys replaced (None values skipped), validated again."""
    return DeploymentConfig.model_validate(_with_dotted(config.model_dump(mode="json"), overrides))


def _with_dotted(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` (a deployment as plain dicts) with dotted keys set; ValueError for a
    key that names no setting."""
    data = copy.deepcopy(data)
    for key, value in overrides.items():
        if value is None:
            continue
        *sections, leaf = key.split(".")
        model: type[BaseModel] = DeploymentConfig
        node = data
        for depth, part in enumerate(sections, 1):
            section = _section_model(model, part)
            if section is None:
                raise ValueError(f"unknown setting {key!r}")
            model = section
            if node.get(part) is None:             # missing, or an empty section in the file
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigFileError(f"{'.'.join(sections[:depth])} must be a section of "
                                      f"settings (a mapping), not {type(node[part]).__name__}; {key} cannot be set")
            node = node[part]
        if leaf not in model.model_fields:
            raise ValueError(f"unknown setting {key!r}")
        node[leaf] = value
        for replaced in _REPLACES.get(key, ()):
            node.pop(replaced, None)
    return data


# A setting given on the command line that replaces others of the file: a key given to
# `pdserve serve` (--api-key, PDSERVE_API_KEY) instead of the one the file names.
_REPLACES = {"http.api_key_sha256": ("api_key_env",)}


def _section_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model of `model`'s section `name` (a mapping of settings), or None when
    `name` is a plain setting or no setting at all."""
    field = model.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _named_variable(setting: str, name: str, instead: str) -> str:
    """The value of the environment variable `name` that `setting` names; ValueError
    (ending with `instead`: what to do) when it is not set where the application is built."""
    import os
    value = os.environ.get(name)
    if not value:
        # named only when it looks like a variable's name: a secret pasted in its place stays unprinted
        shown = name if re.fullmatch(r"[A-Z][A-Z0-9_]{0,63}", name) else "a variable"
        raise ValueError(f"{setting} names {shown}, which is not set here (it must hold the name of an "
                         f"environment variable, not the secret itself); {instead}")
    return value
