"""What `pdserve loadtest` does once its arguments are parsed (bench/loadtest/cli.py parses them).

1. Check flag combinations argparse cannot (--plot needs --sweep-rates, ...).
2. Ask the server for its models (GET /v1/models): an unreachable server is
   exit status 2; the model to request and its context length come from here.
3. Find a local tokenizer (see cli.py's docstring for where from) and build
   the dataset with it; without one, size the prompts with the built-in tiny
   tokenizer (lengths then approximate, and said so).
4. Run once, or once per --sweep-rates rate; print each run's table (and the
   sweep's summary and plots); save the JSON with --save-result.

Exit status: 0 when the run completed (failed requests are reported, not
fatal), 130 after Ctrl-C (what was measured is printed and saved first), 2 for
a LoadtestError: bad arguments or a server that cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadtest.cli import BACKEND_ENDPOINTS, DEFAULT_BASE_URL
from bench.loadtest.client import Unauthorized, fetch_models
from bench.loadtest.datasets import (
    DatasetError,
    SampleRequest,
    length_range,
    num_special_tokens,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from bench.loadtest.metrics import summarize
from bench.loadtest.report import JSON_PERCENTILES, build_result, format_table, vllm_json
from bench.loadtest.runner import RunConfig, RunResult, run_benchmark, run_cancellable
from bench.loadtest.sweep import format_sweep_table, run_sweep, write_plots
from cluster.cli.output_file import output_problem
from engine.tiny_model import PRESETS, ensure_default_model, ensure_preset_model
from engine.tokenizer import load_tokenizer


READY_RETRY_S = 5.0     # between the ready check's tries, as vLLM's


class LoadtestError(Exception):
    """A problem the user fixes by changing the command line or starting the server."""


def run_loadtest(args: argparse.Namespace) -> int:
    """Run the command for parsed `args`; returns the exit status (see the module docstring)."""
    try:
        return _loadtest(args)
    except LoadtestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _loadtest(args: argparse.Namespace) -> int:
    _check_combinations(args)
    if args.dataset_name == "random" and not args.ignore_eos:
        # as vllm bench serve: random prompts run to the lengths drawn for them, whatever a random model says
        args.ignore_eos = True
        print("random dataset: --ignore-eos on, as vllm bench serve sets it (each request generates its drawn "
              "output length)", file=sys.stderr)
    cards = _probe_server(args.base_url, model_given=bool(args.model or args.served_model_name),
                          api_key=args.api_key)
    model = _request_model_name(args, cards)
    card = next((c for c in cards if c.get("id") == model), {})
    max_model_len = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None
    tokenizer, tokenizer_source = _resolve_tokenizer(args, model)
    if tokenizer is None:
        prompt_tokenizer = load_tokenizer(ensure_default_model())
        prompt_lengths = "approximate: counted by pdserve's built-in tiny tokenizer"
        print(f"tokenizer: none found locally for {model}; output tokens are counted from the server's usage, "
              "or else as streamed chunks; prompt lengths are approximate (sized with pdserve's built-in "
              "tokenizer). Pass --tokenizer DIR to count with the model's own tokenizer.", file=sys.stderr)
    else:
        prompt_tokenizer, prompt_lengths = tokenizer, "the model's tokenizer"
        print(f"tokenizer: {tokenizer_source}; output tokens are counted from the server's usage, or else "
              "with this tokenizer", file=sys.stderr)
    # A sweep gets a dataset per rate (seed, seed + 1, ...); see sweep.py for why.
    seeds = [args.seed + i for i in range(len(args.sweep_rates or [None]))]
    try:
        datasets = [_build_dataset(args, prompt_tokenizer, max_model_len, seed, lengths_seed=args.seed)
                    for seed in seeds]
    except DatasetError as exc:
        raise LoadtestError(str(exc)) from None
    # the prefix dataset's lengths leave out the BOS the server adds (as vLLM's prefix_repetition counts them)
    _warn_context(datasets[0], max_model_len,
                  uncounted=num_special_tokens(prompt_tokenizer) if args.dataset_name == "prefix" else 0)
    try:
        config = RunConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                           request_rate=math.inf if args.request_rate is None else args.request_rate,
                           burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                           max_duration=args.max_duration, request_timeout=args.request_timeout,
                           temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
                           disable_tqdm=args.disable_tqdm, api_key=args.api_key)
    except ValueError as exc:
        raise LoadtestError(str(exc)) from None
    _ready_check_and_warm_up(datasets[0][0], config, tokenizer, args.ready_check_timeout_sec, args.num_warmups)
    meta = {"tokenizer": tokenizer_source, "prompt_lengths": prompt_lengths, "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path,
            # JSON has no infinity: "inf", as request_rate
            "max_duration": "inf" if args.max_duration is not None and math.isinf(args.max_duration)
            else args.max_duration}
    if args.sweep_rates:
        return _sweep(args, datasets, config, tokenizer, meta)
    return _single(args, datasets[0], config, tokenizer, meta)


def _ready_check_and_warm_up(first: SampleRequest, config: RunConfig, tokenizer: Any, ready_check_s: float,
                             num_warmups: int) -> None:
    """As vLLM's benchmark (0.32) before its run: with `ready_check_s` > 0, the first
    prompt, untimed, every READY_RETRY_S until it succeeds (LoadtestError once that
    long has passed without: a wrong endpoint, model or key fails here, not in
    every request of the run); then `num_warmups` copies of it within
    --max-concurrency. Neither counts in the results."""
    quiet = replace(config, disable_tqdm=True)
    if ready_check_s > 0:
        print(f"ready check: the first prompt, for up to {ready_check_s:g} s ...", file=sys.stderr)
        deadline = time.monotonic() + ready_check_s
        while True:
            test = run_cancellable(run_benchmark([first], quiet, tokenizer=tokenizer, offsets=[0.0]))
            if test.cancelled:            # Ctrl-C: no run after it
                raise KeyboardInterrupt
            record = test.records[0]
            if record.succeeded:
                break
            if time.monotonic() + READY_RETRY_S > deadline:
                raise LoadtestError(f"the ready check's request failed: {record.error}; check --base-url, "
                                    "--endpoint, --model and the server's log")
            time.sleep(READY_RETRY_S)
    if num_warmups:
        print(f"warming up: {num_warmups} requests ...", file=sys.stderr)
        warm = replace(quiet, request_rate=math.inf)
        if run_cancellable(run_benchmark([first] * num_warmups, warm, tokenizer=tokenizer)).cancelled:
            raise KeyboardInterrupt


def resolve_server_flags(args: argparse.Namespace) -> None:
    """--base-url and --endpoint from vLLM's --host/--port and --backend where those
    are given; a contradiction is an error (LoadtestError)."""
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            raise LoadtestError("give either --base-url or --host/--port, not both")
        host = args.host or "127.0.0.1"
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host    # an IPv6 address
        args.base_url = f"http://{host}:{args.port or 8000}"
    args.base_url = args.base_url or DEFAULT_BASE_URL
    implied = BACKEND_ENDPOINTS.get(args.backend)
    if implied and args.endpoint and args.endpoint.rstrip("/") != implied:
        raise LoadtestError(f"--backend {args.backend} sends to {implied}, and --endpoint is {args.endpoint}; "
                            "drop one of them")
    args.endpoint = args.endpoint or implied or "/v1/completions"


def _check_combinations(args: argparse.Namespace) -> None:
    resolve_server_flags(args)
    if args.sweep_rates and args.request_rate is not None:
        raise LoadtestError("give either --request-rate or --sweep-rates, not both")
    if args.plot and not args.sweep_rates:
        raise LoadtestError("--plot draws a rate sweep; add --sweep-rates R1,R2,...")
    check_dataset_flags(args)
    if args.base_url.rstrip("/").endswith("/v1"):
        raise LoadtestError("--base-url is the server root (e.g. http://127.0.0.1:8000), without /v1; --endpoint "
                            "adds the path")
    if not 0 <= args.temperature <= 2:     # (NaN too: every request would be refused, as past 2)
        raise LoadtestError(f"--temperature must be in [0, 2] (OpenAI's and vLLM's range), got {args.temperature}")
    if not args.endpoint.rstrip("/").endswith("completions"):
        raise LoadtestError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {args.endpoint}")
    check_result_path(args)
    if args.plot:
        _check_writable_dir(Path(args.plot), "--plot")


def check_dataset_flags(args: argparse.Namespace) -> None:
    """The dataset flags (shared with `pdserve simulate`) make sense together."""
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise LoadtestError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
    if args.dataset_name != "sharegpt":
        given = [flag for flag, value in (("--dataset-path", args.dataset_path),
                                          ("--sharegpt-output-len", args.sharegpt_output_len)) if value is not None]
        if given:
            raise LoadtestError(f"{' and '.join(given)} apply to --dataset-name sharegpt, and the dataset is "
                                f"{args.dataset_name}; add --dataset-name sharegpt or drop them")
    # what the dataset is built from is checked before the server is asked anything
    if args.dataset_path is not None and not os.access(args.dataset_path, os.R_OK):
        why = "not readable" if os.path.exists(args.dataset_path) else "no such file"
        raise LoadtestError(f"--dataset-path {args.dataset_path}: {why}")
    if args.dataset_path is not None and os.path.isdir(args.dataset_path):
        raise LoadtestError(f"--dataset-path {args.dataset_path} is a directory: name the JSON file")
    try:
        length_range(1, args.random_range_ratio)
    except DatasetError as exc:
        raise LoadtestError(str(exc)) from None


def check_result_path(args: argparse.Namespace) -> None:
    """Before the run (shared with `pdserve simulate`): with --save-result, the result can be
    written where --result-dir and --result-file put it."""
    if not args.save_result:
        return
    directory = Path(args.result_dir or ".")
    _check_writable_dir(directory, "--result-dir")
    if args.result_file and (problem := output_problem(directory / args.result_file)):
        raise LoadtestError(f"--result-file {directory / args.result_file}: {problem}")


def _check_writable_dir(directory: Path, flag: str) -> None:
    """Before the run: files can be written into `directory` (made if missing)."""
    if directory.exists() and not directory.is_dir():
        raise LoadtestError(f"{flag} {directory}: it is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoadtestError(f"{flag} {directory}: cannot make the directory ({exc.strerror or exc})") from None
    if not os.access(directory, os.W_OK):
        raise LoadtestError(f"{flag} {directory}: the directory is not writable")


def _probe_server(base_url: str, *, model_given: bool, api_key: str | None = None) -> list[dict]:
    """The server's model cards; raises LoadtestError when it cannot be reached or
    refuses the API key."""
    async def probe() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await fetch_models(session, base_url, api_key=api_key)

    try:
        return asyncio.run(probe())
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError) as exc:
        raise LoadtestError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc}); start it "
                            "(pdserve serve) or point --base-url at it") from None
    except Unauthorized as exc:
        given = "the API key given was refused" if api_key else "it wants an API key"
        raise LoadtestError(f"{exc}: {given}; pass --api-key KEY (or set OPENAI_API_KEY)") from None
    except ValueError as exc:
        if not model_given:
            raise LoadtestError(f"{exc}; pass --model NAME") from None
        print(f"warning: {exc}; going on with --model", file=sys.stderr)
        return []


def _request_model_name(args: argparse.Namespace, cards: list[dict]) -> str:
    ids = [c["id"] for c in cards]
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        if not ids:
            raise LoadtestError(f"{args.base_url}/v1/models lists no model; pass --model NAME")
        return ids[0]
    if not ids or args.model in ids:
        return args.model
    if Path(args.model).name in ids:
        return Path(args.model).name
    raise LoadtestError(f"the server serves {', '.join(ids)}, not --model {args.model}; pass one of those "
                        "(or --served-model-name NAME)")


def _resolve_tokenizer(args: argparse.Namespace, model: str) -> tuple[Any, str | None]:
    """(tokenizer, where it came from), or (None, None) when no local one fits."""
    if args.tokenizer:
        try:
            return load_tokenizer(args.tokenizer), args.tokenizer
        except ValueError as exc:
            raise LoadtestError(f"--tokenizer: {exc}") from None
    if args.model and Path(args.model).is_dir():
        try:
            return load_tokenizer(args.model), args.model
        except ValueError:
            pass  # a directory without tokenizer files: fall through to the other sources
    if model in PRESETS:
        path = ensure_preset_model(model)
        return load_tokenizer(path), f"{path} (built-in {model} checkpoint)"
    for name in dict.fromkeys(n for n in (args.model, model) if n):
        try:   # a hub id whose tokenizer is in the local HuggingFace cache, as vLLM's benchmark loads it
            return load_tokenizer(name), f"{name} (the local HuggingFace cache)"
        except ValueError:
            pass
    return None, None


def _build_dataset(args: argparse.Namespace, tokenizer: Any, max_model_len: int | None,
                   seed: int, lengths_seed: int) -> list[SampleRequest]:
    """The dataset of one run. Random prompts take their lengths from `lengths_seed`
    (a sweep's rates then see one mix of lengths); the other datasets' lengths are
    their prompts', chosen by `seed`."""
    if args.dataset_name == "random":
        return random_dataset(tokenizer, num_prompts=args.num_prompts, input_len=args.random_input_len,
                              output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                              prefix_len=args.random_prefix_len, seed=seed, lengths_seed=lengths_seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_dataset(tokenizer, args.dataset_path, num_prompts=args.num_prompts,
                                output_len=args.sharegpt_output_len, max_model_len=max_model_len, seed=seed)
    return prefix_dataset(tokenizer, num_prompts=args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
                          suffix_len=args.prefix_repetition_suffix_len,
                          num_prefixes=args.prefix_repetition_num_prefixes,
                          output_len=args.prefix_repetition_output_len, seed=seed)


def _warn_context(requests: list[SampleRequest], max_model_len: int | None, *, uncounted: int = 0) -> None:
    """`uncounted`: the special tokens (a BOS) the server adds that the prompt lengths leave out."""
    if max_model_len is None:
        return
    too_long = sum(r.prompt_len + uncounted + r.expected_output_len > max_model_len for r in requests)
    if too_long:
        print(f"warning: {too_long} of {len(requests)} requests may not fit the server's {max_model_len}-token "
              "context and may fail; shorten the prompts or outputs", file=sys.stderr)


def _percentiles(args: argparse.Namespace) -> list[float]:
    return sorted(set(JSON_PERCENTILES) | set(args.metric_percentiles))


def _slos(args: argparse.Namespace) -> dict[str, float]:
    return dict(args.goodput or [])


def _summarize(args: argparse.Namespace, run: RunResult, meta: dict, title: str) -> dict:
    """Print one run's table; return its JSON result."""
    summary = summarize(run.records, num_requests=run.num_requests, duration=run.duration,
                        slos_ms=_slos(args), percentiles=_percentiles(args))
    result = build_result(run, summary, meta=meta)
    peak = (result["max_output_tokens_per_s"], result["max_concurrent_requests"])
    print(format_table(summary, metrics=args.percentile_metrics, percentiles=args.metric_percentiles,
                       title=title, interrupted=run.interrupted, peak=peak), flush=True)
    return result


def _single(args: argparse.Namespace, requests: list[SampleRequest], config: RunConfig, tokenizer: Any,
            meta: dict) -> int:
    run = run_cancellable(run_benchmark(requests, config, tokenizer=tokenizer))
    result = _summarize(args, run, meta, "Serving Benchmark Result")
    if args.save_result:
        rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
        concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
        _save(args, result, f"loadtest-{rate}qps{concurrency}-{_safe(config.model)}")
    return 130 if run.cancelled else 0


def _sweep(args: argparse.Namespace, datasets: list[list[SampleRequest]], config: RunConfig, tokenizer: Any,
           meta: dict) -> int:
    results: list[dict] = []
    runs: list[RunResult] = []

    def on_run(run: RunResult) -> None:
        runs.append(run)
        results.append(_summarize(args, run, meta, f"Rate {run.config.request_rate:g} req/s"))

    run_cancellable(run_sweep(datasets, config, args.sweep_rates, tokenizer=tokenizer, on_run=on_run))
    print(format_sweep_table(results))
    if args.save_result:     # first: the measurements outlive a plot that fails
        _save(args, {"sweep_rates": args.sweep_rates, "runs": results}, f"loadtest-sweep-{_safe(config.model)}")
    if args.plot and results:
        try:
            for path in write_plots(results, args.plot):
                print(f"wrote {path}")
        except OSError as exc:
            print(f"error: cannot write the plots into {args.plot} ({exc.strerror or exc})", file=sys.stderr)
    return 130 if runs and runs[-1].cancelled else 0


def _safe(name: str) -> str:
    """A model name (maybe a path) as a file-name fragment."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name or name).strip("_") or "model"


def _save(args: argparse.Namespace, result: dict, stem: str) -> None:
    name = args.result_file or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(args.result_dir or ".") / name
    text = json.dumps(vllm_json(result), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / Path(name).name
        fallback.write_text(text)
        print(f"error: cannot write {path} ({exc.strerror or exc}); saved the result to {fallback} instead",
              file=sys.stderr)
        return
    print(f"saved the result to {path}")
