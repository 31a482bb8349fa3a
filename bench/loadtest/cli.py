"""`pdserve loadtest`: load-test an OpenAI-compatible server, `vllm bench serve` style.

    pdserve loadtest [--base-url URL | --host H --port P] [--endpoint /v1/completions|/v1/chat/completions]
                     [--model NAME|DIR] [--tokenizer DIR] [--api-key KEY] [--num-prompts N]
                     [--dataset-name random|sharegpt|prefix] [--dataset-path FILE]
                     [--request-rate R | --sweep-rates R1,R2,...] [--burstiness B]
                     [--max-concurrency C] [--goodput ttft:MS tpot:MS e2el:MS]
                     [--save-result] [--result-dir DIR] [--result-file NAME] [--plot DIR] ...

Flags are vLLM's wherever the concept is the same, and `vllm bench serve`'s
--host/--port, --backend (openai, vllm: completions; openai-chat: chat) and
--dataset-name prefix_repetition are taken as they are. Defaults differ from
vLLM's where the built-in tiny model (a 1024-token context, CPU serving) needs
it: --num-prompts 100 (vLLM 1000), --random-input-len 128 (1024),
--random-output-len 32 (128), --prefix-repetition-suffix-len 32 (256),
--prefix-repetition-output-len 32 (128); a run stops after --max-duration 600 s
and a request after --request-timeout 300 s (vLLM: no limit, 6 hours);
--temperature 0 is sent (vLLM leaves it to the server); and every latency
(ttft, tpot, itl, e2el) with p90 and p99 is shown by default.

Where the pieces come from:
- the model: --model, else the first model GET /v1/models lists; a --model that
  is a checkpoint directory is sent under the name the server lists for it
  (its directory name, as `pdserve serve` names it) unless --served-model-name says;
- the tokenizer (prompt lengths; output tokens when the server sends no usage):
  --tokenizer, else --model when it is a local directory, else the built-in
  checkpoint when the served name is a pdserve preset ("tiny", ...). Without
  one, output tokens come from the server's usage or else count streamed
  chunks (the report says which), and prompts are sized with the built-in tiny
  tokenizer, so their lengths are approximate (the run says so, and the JSON's
  `prompt_lengths`; each request's `usage_prompt_tokens` has the server's count).

Exit status: 0 when the run completed (failed requests are reported, not fatal),
130 after Ctrl-C (what was measured is printed and saved first), 2 for bad
arguments or a server that cannot be reached.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from bench.loadtest.metrics import METRICS, SLO_METRICS

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                      "openai-chat": "/v1/chat/completions"}     # `vllm bench serve --backend` values


# ------------------------------------------------------------------ argument types


def _goodput_item(text: str) -> tuple[str, float]:
    key, sep, value = text.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if not sep or key not in SLO_METRICS or not (limit > 0 and math.isfinite(limit)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)} and MS a positive "
            "number of milliseconds, e.g. --goodput ttft:500 tpot:50")
    return key, limit


def _metric_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(METRICS)}")
    return names


def _percentile_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated percentiles in (0, 100], e.g. 50,90,99")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated finite rates > 0 in "
                                         "requests/s, e.g. 0.5,1,2,4")
    return values


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {kind.__name__}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_finite(kind: type) -> Any:
    positive = _positive(kind)

    def parse(text: str) -> Any:
        value = positive(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite positive {kind.__name__}")
        return value
    parse.__name__ = f"finite positive {kind.__name__}"
    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a TCP port, 1 to 65535")
    return value


def add_loadtest_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `loadtest` on a `pdserve` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "loadtest", help="load-test an OpenAI-compatible server (vllm bench serve style)",
        description="Stream requests to an OpenAI-compatible server on an arrival schedule and report "
                    "TTFT, TPOT, ITL, end-to-end latency, throughput, goodput and SLO attainment.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default=None, help=f"server root (default {DEFAULT_BASE_URL})")
    server.add_argument("--host", default=None, help="vLLM's: the server's host, instead of --base-url")
    server.add_argument("--port", type=_port, default=None,
                        help="vLLM's: the server's port, instead of --base-url")
    server.add_argument("--endpoint", default=None,
                        help="/v1/completions (default) or /v1/chat/completions")
    server.add_argument("--backend", default=None, choices=list(BACKEND_ENDPOINTS),
                        help="vLLM's: openai or vllm (the completions endpoint), openai-chat (chat)")
    server.add_argument("--model", default=None,
                        help="model name to request, or its checkpoint directory (default: the first "
                             "model GET /v1/models lists)")
    server.add_argument("--served-model-name", default=None,
                        help="the name sent in requests when it differs from --model")
    server.add_argument("--api-key", default=None,
                        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY, else $PDSERVE_API_KEY)")
    server.add_argument("--tokenizer", default=None,
                        help="local tokenizer directory (default: --model if it is a directory, else the "
                             "built-in checkpoint of a pdserve preset name such as 'tiny')")

    _, load, out = add_workload_arguments(p)
    load.add_argument("--sweep-rates", type=_rate_list, default=None,
                      help="run once per rate, e.g. 0.5,1,2,4 (instead of --request-rate)")
    load.add_argument("--request-timeout", type=_positive_finite(float), default=300.0,
                      help="seconds one request may take (default 300)")
    load.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    load.add_argument("--ready-check-timeout-sec", type=_non_negative_float, default=0.0,
                      help="before the run, send the first prompt (untimed) until it succeeds, every 5 s for "
                           "up to this long, and stop with its error if it never does; 0 skips it (default, "
                           "as vLLM's)")
    load.add_argument("--num-warmups", type=_non_negative_int, default=0,
                      help="requests (copies of the first prompt) sent before the timed run, within "
                           "--max-concurrency, as vLLM's benchmark does; left out of the results (default 0)")
    out.add_argument("--plot", default=None, metavar="DIR", help="with --sweep-rates: write PNG plots into DIR")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_loadtest)
    return p


def add_workload_arguments(p: argparse.ArgumentParser,
                           result_name: str = "loadtest-<rate>qps-<model>-<date>.json") -> tuple[Any, Any, Any]:
    """The dataset, load and results flags `pdserve loadtest` and `pdserve simulate`
    share (`result_name`: the command's default result file name); returns the three
    argument groups, for a caller's own flags."""
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix"],
                      type=lambda name: "prefix" if name == "prefix_repetition" else name,
                      help="random, sharegpt, or prefix (vLLM's prefix_repetition, either name)")
    data.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for sharegpt)")
    data.add_argument("--num-prompts", type=_positive(int), default=100, help="requests to send (default 100)")
    data.add_argument("--random-input-len", type=_positive(int), default=128, help="prompt tokens (default 128)")
    data.add_argument("--random-output-len", type=_positive(int), default=32, help="output tokens (default 32)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default 0)")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one random prefix shared by every random prompt (default 0)")
    data.add_argument("--sharegpt-output-len", type=_positive(int), default=None,
                      help="fixed output length for sharegpt (default: each answer's length)")
    data.add_argument("--prefix-repetition-prefix-len", type=_positive(int), default=256,
                      help="prefix dataset: tokens of each shared prefix (default 256)")
    data.add_argument("--prefix-repetition-suffix-len", type=_positive(int), default=32,
                      help="prefix dataset: tokens of each prompt's own suffix (default 32)")
    data.add_argument("--prefix-repetition-num-prefixes", type=_positive(int), default=10,
                      help="prefix dataset: distinct shared prefixes (default 10)")
    data.add_argument("--prefix-repetition-output-len", type=_positive(int), default=32,
                      help="prefix dataset: output tokens (default 32)")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_positive(float), default=None,
                      help="requests/s, Poisson arrivals; inf sends all at once (default inf)")
    load.add_argument("--burstiness", type=_positive(float), default=1.0,
                      help="gamma shape of the arrivals: 1 Poisson, < 1 burstier, > 1 steadier (default 1)")
    load.add_argument("--max-concurrency", type=_positive(int), default=None,
                      help="at most this many requests in flight (default: no limit)")
    load.add_argument("--max-duration", type=_positive(float), default=600.0,
                      help="seconds one run may take; then requests in flight are cut off and what was "
                           "measured is reported (default 600)")
    load.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrivals (default 0)")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", type=_goodput_item, default=None, metavar="KEY:MS",
                     help="SLOs in ms for goodput and SLO attainment, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--percentile-metrics", type=_metric_list, default=list(METRICS),
                     help="latencies to print, from ttft,tpot,itl,e2el (default all)")
    out.add_argument("--metric-percentiles", type=_percentile_list, default=[90.0, 99.0],
                     help="percentiles to print (default 90,99; the JSON always has 90 and 99)")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--result-dir", default=None, help="directory for the result JSON (default: .)")
    out.add_argument("--result-file", "--result-filename", dest="result_file", default=None,
                     help=f"file name of the result JSON (default: {result_name})")
    return data, load, out


def _cmd_loadtest(args: argparse.Namespace) -> int:
    import os
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY") or os.environ.get("PDSERVE_API_KEY") or None
    from bench.loadtest.command import run_loadtest
    return run_loadtest(args)
