"""End to end on a real local Ray cluster: the Serve application built from a
DeploymentConfig, driven over HTTP by the official `openai` client, greedy
output equal token for token to transformers on the tiny fp32 checkpoint.

One Ray cluster for the module (conftest.py: ray_cluster), no bigger than a 2-core machine (2 CPUs; 4
logical GPUs only for the bundle-probe test); each deployment shape is one
Serve application (deployed, exercised, deleted) so that only one set of
workers runs at a time. Shapes with more ranks than CPUs give each rank half a
CPU, as a user would on a laptop.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

from bench import serve_app  # noqa: E402

MAX_TOKENS = 12
PROMPTS = ["The quick brown fox", "Once upon a time there", "def fibonacci(n):", "a b c d e f g"]


def deploy(ray_cluster, model_dir, name: str, **shape) -> str:
    """Serves the tiny checkpoint in the given shape as application `name`; its /v1 URL."""
    settings = {
        "model": {"path": str(model_dir), "served_model_name": "tiny", "dtype": "float32", "max_model_len": 256},
        "engine": {"block_size": 8, "max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 0.05},
        "kv_transfer": {"timeout_s": 20, "lease_s": 30},
        "disaggregation": {"policy": "always"},
        **shape}
    base = serve_app.deploy(name, settings, ray_cluster, timeout_s=120) + "/v1"
    if settings.get("mode", "disaggregated") == "disaggregated" and settings.get("prefill", {}).get("replicas", 1):
        # until the router's stats refresh has seen a prefill replica running, it treats the pool
        # as empty and prefills every prompt on a decode replica: tests expect hand-offs
        assert _gauge_names_role(base, "pdserve_worker_torch_threads", "prefill"), name
    return base


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)


def expected_text(reference, tokenizer, prompt_ids: list[int]) -> tuple[str, int]:
    ids = reference("tiny").greedy(tuple(prompt_ids), MAX_TOKENS)
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def check_completions(base_url: str, reference, tokenizer) -> None:
    c = client(base_url)
    for prompt in PROMPTS[:2]:
        text, n = expected_text(reference, tokenizer, tokenizer.encode(prompt))
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == n
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    # one logprob per token, the first one included once, whichever worker sampled it
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    assert len(r.choices[0].logprobs.tokens) == len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens


def check_prompt_scores(base_url: str, reference, tokenizer) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and vLLM's
    prompt_logprobs: each prompt token's logprob is transformers' log-softmax over
    the prompt, whichever worker ran it."""
    import torch
    prompt = PROMPTS[2]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        expected = reference("tiny").model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)
    expected = [expected[p - 1, ids[p]].item() for p in range(1, len(ids))]
    c = client(base_url)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    (choice,) = r.choices
    assert choice.text == prompt and r.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)
    # lm-eval-harness's local-completions request as it sends it; it reads the entries [ctxlen:-1]
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    logprobs = r.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[1:-1] == pytest.approx(expected, abs=2e-4)
    greedy = reference("tiny").greedy(tuple(ids[:2]), 1)[0]      # the model's best token after the first two
    assert (max(logprobs.top_logprobs[2], key=logprobs.top_logprobs[2].get) == logprobs.tokens[2]) == \
        (greedy == ids[2])
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                             extra_body={"prompt_logprobs": 0})
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None
    assert [entry[str(t)]["logprob"] for entry, t in zip(scored[1:], ids[1:])] == pytest.approx(expected, abs=2e-4)


def check_streaming_chat(base_url: str, reference, tokenizer) -> None:
    c = client(base_url)
    messages = [{"role": "user", "content": "Tell me a story"}]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    text, n = expected_text(reference, tokenizer, prompt_ids)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == text
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == len(prompt_ids)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    # vLLM's return_token_ids: the prompt's ids once, then each chunk's new ids, which spell the greedy output
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"return_token_ids": True})
    chunks = [ch.model_dump() for ch in stream]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert [t for ch in chunks[1:] for t in ch["choices"][0]["token_ids"]] == \
        reference("tiny").greedy(tuple(prompt_ids), MAX_TOKENS)


def check_concurrent(base_url: str, reference, tokenizer, n_requests: int = 32) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
        calls = [c.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
                                      max_tokens=MAX_TOKENS, temperature=0) for i in range(n_requests)]
        out = await asyncio.gather(*calls)
        await c.close()
        return [r.choices[0].text for r in out]
    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        assert text == expected_text(reference, tokenizer, tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" {i}"))[0]


def metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        return r.read().decode()


def counter(base_url: str, sample: str) -> float:
    """The value of one sample line (name{labels}) in /metrics; 0 when absent."""
    for line in metrics_text(base_url).splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _counter_reaches(base_url: str, sample: str | tuple[str, ...], minimum: float, timeout_s: float = 10) -> bool:
    """Whether the counter (or the sum of the counters) reaches `minimum` within `timeout_s`."""
    samples = (sample,) if isinstance(sample, str) else sample
    deadline = time.monotonic() + timeout_s
    while sum(counter(base_url, s) for s in samples) < minimum:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _gauge_names_role(base_url: str, name: str, role: str, timeout_s: float = 15) -> bool:
    """Whether the per-worker gauge has a value for a replica of `role` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while role not in role_gauge(base_url, name, timeout_s=0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def worker_gauge(base_url: str, name: str, timeout_s: float = 15) -> dict[str, float]:
    """worker label -> value of a per-worker gauge (waits for the first stats refresh)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = {line.split('worker="')[1].split('"')[0]: float(line.split()[-1])
                  for line in metrics_text(base_url).splitlines() if line.startswith(name + "{")}
        if values or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def role_gauge(base_url: str, name: str, timeout_s: float = 15) -> dict[str, list[float]]:
    """role -> the per-worker gauge's values of that role's replicas (labelled `role-REPLICA_ID`)."""
    by_role: dict[str, list[float]] = {}
    for worker, value in sorted(worker_gauge(base_url, name, timeout_s).items()):
        by_role.setdefault(worker.split("-", 1)[0], []).append(value)
    return by_role


def test_the_kv_transfer_secret_is_made_once_per_ray_cluster(ray_cluster):
    # building the same application again gives the workers the same arguments (Serve updates
    # them in place) and old and new workers the same secret
    from cluster.config import DeploymentConfig

    @ray.remote(num_cpus=0)
    def secret_in_a_worker_process() -> tuple[str, int]:
        import os

        from cluster.config import DeploymentConfig
        return DeploymentConfig().kv_transfer_secret(), os.getpid()

    first, again = DeploymentConfig().kv_transfer_secret(), DeploymentConfig().kv_transfer_secret()
    elsewhere, pid = ray.get(secret_in_a_worker_process.remote(), timeout=60)
    assert first == again == elsewhere and len(first) == 64 and pid != os.getpid()


def test_a_named_kv_secret_stored_in_the_cluster_is_what_an_application_built_there_reads(ray_cluster, monkeypatch):
    # `pdserve serve --autoscale` builds its application in the cluster, where the file's variable
    # need not be set: the secret goes through the cluster's store, the config names its key
    from cluster.cli.serve_command import autoscaled_application
    from cluster.config import DeploymentConfig
    from cluster.serving.cluster_secret import delete_named_secret, store_named_secret

    @ray.remote(num_cpus=0)
    def secret_where_the_app_is_built(config_json: dict) -> str:
        from cluster.config import DeploymentConfig
        return DeploymentConfig.model_validate(config_json).kv_transfer_secret()

    monkeypatch.setenv("E2E_KV_SECRET", "named-s3cret")
    config = DeploymentConfig.model_validate({"kv_transfer": {"secret_env": "E2E_KV_SECRET"},
                                              "slo": {"ttft_ms": 1000, "tpot_ms": 100},
                                              "autoscaling": {"enabled": True, "budget": 3}})
    shipped = autoscaled_application(config)["args"]["config_json"]
    store_named_secret("E2E_KV_SECRET", "named-s3cret")          # as pdserve serve does before it deploys
    assert ray.get(secret_where_the_app_is_built.remote(shipped), timeout=60) == "named-s3cret"
    missing = {**shipped, "kv_transfer": {**shipped["kv_transfer"], "secret_stored_key": "kv_transfer_secret_env/X"}}
    with pytest.raises(ValueError, match="is not in this Ray cluster's key-value store"):
        DeploymentConfig.model_validate(missing).kv_transfer_secret()
    delete_named_secret("E2E_KV_SECRET")                         # as pdserve serve does as it stops
    with pytest.raises(ValueError, match="is not in this Ray cluster's key-value store"):
        DeploymentConfig.model_validate(shipped).kv_transfer_secret()


def test_disaggregated_one_prefill_one_decode(ray_cluster, model_dirs, reference, tokenizer):
    base = deploy(ray_cluster, model_dirs["tiny"], "pd11")
    try:
        check_completions(base, reference, tokenizer)
        check_streaming_chat(base, reference, tokenizer)
        check_concurrent(base, reference, tokenizer)
        assert [m.id for m in client(base).models.list().data] == ["tiny"]
        # 2 CPUs, 2 TP-1 ranks: one CPU, so one torch thread, each (whatever Ray set OMP_NUM_THREADS to)
        threads = worker_gauge(base, "pdserve_worker_torch_threads")
        assert role_gauge(base, "pdserve_worker_torch_threads") == {"prefill": [1.0], "decode": [1.0]}
        assert all(len(worker.split("-", 1)[1]) > 1 for worker in threads), threads   # replica ids, not positions
        # ... and the decode worker steps on both cores while the prefill worker is idle; prefill never borrows
        borrowed = role_gauge(base, "pdserve_worker_cpu_borrowed_steps_total")
        assert borrowed["decode"][0] > 0 and borrowed["prefill"] == [0.0], borrowed
        # every request of the checks above (7 + 32), each handed off ("always"): once in each figure
        for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_kv_transfer_time_seconds_count",
                     "pdserve_request_prefill_time_seconds_count", "pdserve_e2e_request_latency_seconds_count"):
            _counter_reaches(base, name, 39)
            assert counter(base, name) == 39, name
        check_prompt_scores(base, reference, tokenizer)     # scored on the prefill worker, then handed off
    finally:
        serve.delete("pd11")


def test_one_prefill_two_decoders_and_bad_input(ray_cluster, model_dirs, reference, tokenizer):
    # conditional: the ~9-token "a b c ..." prompts are prefilled on a decode worker, the longer ones handed off
    base = deploy(ray_cluster, model_dirs["tiny"], "pd12", decode={"replicas": 2},
                  resources={"cpus_per_rank": 0.5},
                  disaggregation={"policy": "conditional", "local_prefill_max_tokens": 10})
    try:
        check_concurrent(base, reference, tokenizer, n_requests=16)
        prefills = {role: counter(base, f'pdserve_prefills_total{{worker_role="{role}"}}')
                    for role in ("prefill", "decode")}
        assert prefills["prefill"] > 0 and prefills["decode"] > 0, prefills
        assert counter(base, "pdserve_kv_transfer_time_seconds_count") == prefills["prefill"]
        c = client(base)
        bad = [dict(prompt="hi", max_tokens=0), dict(prompt="hi", n=0), dict(prompt=[100000], max_tokens=2),
               dict(prompt="hi " * 400, max_tokens=2), dict(prompt="hi", temperature=-1)]
        for kwargs in bad:
            with pytest.raises(openai.BadRequestError) as info:
                c.completions.create(model="tiny", **kwargs)
            assert info.value.status_code == 400
            assert set(info.value.body) >= {"message", "type", "param", "code"}, info.value.body
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
        check_completions(base, reference, tokenizer)  # still serving
        check_n_choices(base, reference, tokenizer)    # (handed off or not, concurrent calls of one request)
        # a client that goes away mid-stream: its blocks are freed on both sides
        aborted = 'pdserve_requests_total{finish_reason="abort"}'
        before = counter(base, aborted)
        stream = c.completions.create(model="tiny", prompt="abandoned", max_tokens=200, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        _wait_kv_idle(base)
        assert counter(base, aborted) == before + 1      # cut off, not run to its 200 tokens
    finally:
        serve.delete("pd12")


def _wait_kv_idle(base: str, timeout_s: float = 30) -> None:
    """Until every worker's KV cache usage reads 0, in figures the router refreshed
    after this call (it reads the workers every STATS_PERIOD_S: a figure from
    before the work being checked would pass without looking)."""
    from router.ingress import STATS_PERIOD_S
    time.sleep(2 * STATS_PERIOD_S)
    deadline = time.monotonic() + timeout_s
    while True:
        usage = [line for line in metrics_text(base).splitlines()
                 if line.startswith("pdserve_kv_cache_usage_ratio{")]
        if usage and all(float(line.split()[-1]) == 0.0 for line in usage):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still in use after the client left: {usage}")
        time.sleep(0.5)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)])
def test_heterogeneous_tensor_parallelism(ray_cluster, model_dirs, reference, tokenizer, prefill_tp, decode_tp):
    name = f"tp{prefill_tp}{decode_tp}"
    base = deploy(ray_cluster, model_dirs["tiny"], name, prefill={"tensor_parallel_size": prefill_tp},
                  decode={"tensor_parallel_size": decode_tp}, resources={"cpus_per_rank": 0.5})
    try:
        check_completions(base, reference, tokenizer)
        check_concurrent(base, reference, tokenizer, n_requests=8)
    finally:
        serve.delete(name)


def test_colocated(ray_cluster, model_dirs, reference, tokenizer):
    base = deploy(ray_cluster, model_dirs["tiny"], "colo", mode="colocated")
    try:
        # the one replica gets both CPUs of the cluster, and runs torch on both
        assert role_gauge(base, "pdserve_worker_torch_threads") == {"colocated": [2.0]}
        check_completions(base, reference, tokenizer)
        check_streaming_chat(base, reference, tokenizer)
        check_concurrent(base, reference, tokenizer)
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as health:
            assert health.status == 200
        check_n_choices(base, reference, tokenizer)
        check_prompt_scores(base, reference, tokenizer)
    finally:
        serve.delete("colo")


def check_n_choices(base_url: str, reference, tokenizer) -> None:
    """n choices: greedy ones are each transformers' output; seeded sampled ones differ
    from each other and come back the same when asked again; a batch of prompts."""
    c = client(base_url)
    text, _ = expected_text(reference, tokenizer, tokenizer.encode(PROMPTS[0]))
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert [(ch.index, ch.text) for ch in r.choices] == [(i, text) for i in range(3)]
    sampled = [[ch.text for ch in c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                       temperature=1.0, seed=11, n=3).choices] for _ in range(2)]
    assert sampled[0] == sampled[1] and len(set(sampled[0])) == 3
    # a batch of prompts, n of each: choice p * n + j is prompt p's, each transformers' greedy output
    batch = PROMPTS[1:3]
    r = c.completions.create(model="tiny", prompt=batch, max_tokens=MAX_TOKENS, temperature=0, n=2)
    expected = [expected_text(reference, tokenizer, tokenizer.encode(p))[0] for p in batch]
    assert [(ch.index, ch.text) for ch in r.choices] == [(i, expected[i // 2]) for i in range(4)]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in batch)


def test_a_tp_gang_sees_one_gpu_per_bundle_in_rank_order(ray_cluster):
    """The cluster declares 4 logical GPUs (no CUDA needed): a replica-like actor
    in bundle 0 of a 3-bundle group finds the GPUs of all three bundles."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.serving.gang_devices import claim_gang_gpus

    @ray.remote(num_cpus=0, num_gpus=1)
    class Replica:
        async def claim(self, n):
            import os
            own = [str(i) for i in ray.get_gpu_ids()]
            gpus = await claim_gang_gpus(n)
            return own, gpus, os.environ["CUDA_VISIBLE_DEVICES"]

    @ray.remote(num_cpus=0, num_gpus=1)
    def bundle_gpu() -> str:
        return str(ray.get_gpu_ids()[0])

    pg = placement_group([{"GPU": 1}] * 3, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        actor = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        own, gpus, visible = ray.get(actor.claim.remote(3), timeout=60)
        # rank r's GPU is bundle r's: the replica's own first, then what bundles 1 and 2 hold
        others = ray.get([bundle_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=k)).remote() for k in (1, 2)], timeout=60)
        assert gpus == own + others and len(set(gpus)) == 3
        assert visible == ",".join(gpus)
        ray.kill(actor)
    finally:
        remove_placement_group(pg)


def _replica_pids(app: str, deployment: str) -> list[int]:
    """The processes of a deployment's replicas (Ray titles them ray::ServeReplica:APP:DEPLOYMENT)."""
    import subprocess
    out = subprocess.run(["pgrep", "-f", f"^ray::ServeReplica:{app}:{deployment}"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


MIGRATION_MAX_TOKENS = 224   # with the longest of PROMPTS, within the deployment's max_model_len (256)


def _kill_the_busiest(pids: list[int]) -> None:
    """SIGKILLs the process of `pids` that uses the most CPU over 0.1 s (the replica
    whose engine is stepping: the one holding streams)."""
    import os
    import signal

    def cpu_ticks(pid: int) -> int:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])   # utime + stime
    before = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(0.1)
    busiest = max(pids, key=lambda pid: cpu_ticks(pid) - before[pid])
    os.kill(busiest, signal.SIGKILL)


def _texts_with_a_kill(base_url: str, prompts: list[list[int]], max_tokens: int, kill,
                       kill_after_chunks: int) -> list[str]:
    """Streams every prompt at once and calls `kill()` once, when the first stream has
    `kill_after_chunks` chunks. Each stream's text as the client assembled it."""
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=180, max_retries=0)
        killed = asyncio.Event()

        async def one(prompt: list[int]) -> str:
            text, chunks = "", 0
            stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                chunks += 1
                if chunks >= kill_after_chunks and not killed.is_set():
                    killed.set()
                    await asyncio.to_thread(kill)
            return text

        out = await asyncio.gather(*[one(p) for p in prompts])
        await c.close()
        return out
    return asyncio.run(run())


def test_streams_survive_a_killed_decode_or_prefill_worker(ray_cluster, model_dirs, reference, tokenizer):
    """SIGKILL of one of two decode replicas mid-stream, then of the prefill replica while
    prompts are prefilled or handed off: every stream completes, equal to transformers' greedy
    (the text the client assembled, token for token)."""
    import os
    import signal
    # two sequences a step: a replica's streams run a few at a time, so that the kill lands while it
    # holds some (all at once, the tiny model's 224 tokens could end before it on a fast machine)
    base = deploy(ray_cluster, model_dirs["tiny"], "mig", decode={"replicas": 2}, resources={"cpus_per_rank": 0.5},
                  engine={"block_size": 8, "max_num_seqs": 2, "max_num_batched_tokens": 512,
                          "kv_cache_memory_gib": 0.05})
    try:
        prompts = [tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} {i}") for i in range(16)]
        decode_pids = _replica_pids("mig", "DecodeServer")
        assert len(decode_pids) == 2
        # the kill must land while the streams run (the tiny model streams 150 tokens in well under a
        # second: so as many as max_model_len allows), on a decode replica that holds streams (the
        # router may have placed every one on the other). The second chunk is the first from a decode
        # replica; killed then, a replica could hold only requests still being handed off to it. Two
        # sequences a step leave each replica ~1 s of streams, so the fourth chunk (~100 ms of decoding
        # in) comes when every request is decoding or queued on its replica, with most of it to go
        texts = _texts_with_a_kill(base, prompts, MIGRATION_MAX_TOKENS, lambda: _kill_the_busiest(decode_pids), 4)
        for prompt, text in zip(prompts, texts):
            ids = reference("tiny").greedy(tuple(prompt), MIGRATION_MAX_TOKENS, ignore_eos=True)
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
        # the router counts a request when its handler ends, which can be just after the client's last chunk
        assert _counter_reaches(base, "pdserve_request_migrations_total", 1)
        # ~10,000 prompt tokens (~213 each): about twenty 512-token steps of the prefill worker, so that
        # the first token reaches the client while most prompts still wait there
        long_prompts = [tokenizer.encode(" ".join(["story"] * 70) + f" {i}") for i in range(48)]
        (prefill_pid,) = _replica_pids("mig", "PrefillServer")
        # the first token comes from the prefill worker: killed then, it holds that request's KV for the
        # hand-off and the other prompts still wait for it
        migrations = "pdserve_request_migrations_total"
        local_prefills = 'pdserve_prefills_total{worker_role="decode"}'
        before = counter(base, migrations) + counter(base, local_prefills)
        texts = _texts_with_a_kill(base, long_prompts, 20, lambda: os.kill(prefill_pid, signal.SIGKILL), 1)
        # whether a request was caught mid-prefill or mid-hand-off depends on timing (the continuation
        # itself is tested without Ray in tests/test_migration.py): here, none may be lost or changed
        for prompt, text in zip(long_prompts, texts):
            ids = reference("tiny").greedy(tuple(prompt), 20, ignore_eos=True)
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
        # and the kill did cut some. A request held there for its hand-off, or whose prefill call failed
        # first, migrates; one still queued there when the router sees the prefill pool empty is
        # prefilled on a decode worker instead (which of the two depends on timing); the router counts
        # a request when its handler ends
        assert _counter_reaches(base, (migrations, local_prefills), before + 1), \
            "the prefill worker's death cut no request"
    finally:
        serve.delete("mig")
