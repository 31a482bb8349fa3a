"""What a run reports: the printed table and the JSON result.

The JSON uses `vllm bench serve`'s key names where the concept is the same, so
scripts written for vLLM's result files read these too:

- run: date, backend ("openai" or "openai-chat", as vLLM names the two
  endpoints), base_url, endpoint, model_id (also as model), num_prompts,
  request_rate ("inf" when unpaced; JSON has no infinity), burstiness,
  max_concurrency, seed, whatever the caller adds as `meta` (the CLI:
  tokenizer, dataset_name, dataset_path, max_duration), tokenizer_id (meta's
  tokenizer), interrupted (why it stopped early, or null);
- totals: duration (s), completed, failed, unfinished (of the failed, those cut
  off in flight), not_sent, total_input_tokens, total_output_tokens,
  request_throughput, output_throughput, total_token_throughput (per second),
  request_goodput (good requests/s), slo_attainment (good / (completed + failed)),
  good_requests, slos_ms, token_count_methods, error_counts,
  max_output_tokens_per_s and max_concurrent_requests (vLLM's peaks);
- latency, in ms, for each of ttft, tpot, itl, e2el: mean_X_ms, median_X_ms,
  std_X_ms and pN_X_ms for each percentile N (always 90 and 99, plus
  --metric-percentiles); in the file (vllm_json) 0.0 for a metric with no
  values, as vLLM writes it, and metrics_without_values names those;
- per request, in send order (vLLM's lists): input_lens, output_lens, ttfts (s),
  itls (s, a list per request), generated_texts, errors; plus `requests`, one
  record per request with its times in ms (see `request_record`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from bench.loadtest.client import RequestRecord
from bench.loadtest.metrics import METRICS, Summary, e2el, itls, peaks, tpot, ttft
from bench.loadtest.runner import RunResult

# Always in the JSON, whatever --metric-percentiles says (the p90 and p99).
JSON_PERCENTILES = (90.0, 99.0)

_TITLES = MappingProxyType({"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                            "itl": "Inter-token Latency", "e2el": "End-to-end Latency"})
_METHODS = MappingProxyType({"usage": "server usage", "tokenizer": "local tokenizer", "chunks": "streamed chunks"})
_WIDTH = 50
_SHOWN_ERRORS = 10


def percentile_name(p: float) -> str:
    """vLLM's spelling of a percentile in key names: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"       # str(p), every digit: p99.99999


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _rate(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def request_record(record: RequestRecord, start_time: float) -> dict[str, Any]:
    """One request as JSON: offsets from the run start in s, latencies in ms."""
    return {
        "index": record.index,
        "scheduled_offset_s": record.scheduled_offset,
        "send_offset_s": None if record.send_time is None else record.send_time - start_time,
        "prompt_len": record.prompt_len,
        "expected_output_len": record.expected_output_len,
        "output_tokens": record.output_tokens,
        "token_count_method": record.token_count_method,
        "usage_prompt_tokens": record.usage_prompt_tokens,
        "succeeded": record.succeeded,
        "unfinished": record.unfinished,
        "status": record.status,
        "error": record.error,
        "ttft_ms": _ms(ttft(record)),
        "tpot_ms": _ms(tpot(record)),
        "e2el_ms": _ms(e2el(record)),
        "itl_ms": [gap * 1000.0 for gap in itls(record)],
        "generated_text": record.text,
    }


def build_result(run: RunResult, summary: Summary, *, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON result of one run; `meta` adds run facts the runner does not know (dataset, tokenizer)."""
    config = run.config
    result: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "backend": "openai-chat" if config.chat else "openai",
        "model_id": config.model,
        "model": config.model,
        "num_prompts": run.num_requests,
        "request_rate": _rate(config.request_rate),
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
        **dict(meta or {}),
        "tokenizer_id": (meta or {}).get("tokenizer"),
        "interrupted": run.interrupted,
        "duration": summary.duration,
        "completed": summary.completed,
        "failed": summary.failed,
        "unfinished": summary.unfinished,
        "not_sent": summary.not_sent,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.request_goodput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "slo_attainment": summary.slo_attainment,
        "good_requests": summary.good,
        "slos_ms": dict(summary.slos_ms),
        "token_count_methods": dict(summary.token_count_methods),
        "error_counts": dict(summary.error_counts),
    }
    records = run.records
    result["max_output_tokens_per_s"], result["max_concurrent_requests"] = peaks(records)
    # a metric with no values (TPOT when every output is one token, all when every request failed):
    # None here, for this project's own tables and plots; vllm_json() writes 0.0 for the file
    result["metrics_without_values"] = [name for name in METRICS if summary.latency[name].mean is None]
    for name in METRICS:
        stats = summary.latency[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            result[f"{percentile_name(p)}_{name}_ms"] = value
    result.update({
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [(r.output_tokens or 0) if r.succeeded else 0 for r in records],   # as vLLM: 0 if failed
        "ttfts": [ttft(r) or 0.0 for r in records],
        "itls": [itls(r) for r in records],
        "generated_texts": [r.text for r in records],
        "errors": [r.error or "" for r in records],
        "requests": [request_record(r, run.start_time) for r in records],
    })
    return result


def vllm_json(result: dict[str, Any]) -> dict[str, Any]:
    """`result` (build_result's, or {"runs": [...]} of them) as the file is written: a
    latency with no values as 0.0, as vLLM writes it, so scripts that read floats
    do not break (metrics_without_values names them)."""
    if "runs" in result:
        return {**result, "runs": [vllm_json(run) for run in result["runs"]]}
    latency = [k for k in result if k.endswith("_ms") and k.split("_")[-2] in METRICS and result[k] is None]
    return {**result, **{k: 0.0 for k in latency}}


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(summary: Summary, *, metrics: Sequence[str] = METRICS,
                 percentiles: Sequence[float] = JSON_PERCENTILES, title: str = "Serving Benchmark Result",
                 interrupted: str | None = None, peak: tuple[float, int] | None = None) -> str:
    """vLLM's result table for `summary`: the selected latency metrics, each with mean,
    median and the selected percentiles (which must be among those summarized); `peak`:
    metrics.peaks of the run."""
    lines = [f"{' ' + title + ' ':=^{_WIDTH}}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<40} {value}")

    if interrupted:
        row("Stopped early:", interrupted)
    row("Successful requests:", str(summary.completed))
    row("Failed requests:", str(summary.failed))
    if summary.unfinished:
        row("  of which unfinished at the stop:", str(summary.unfinished))
    if summary.not_sent:
        row("Requests not sent:", str(summary.not_sent))
    row("Benchmark duration (s):", _fmt(summary.duration))
    row("Total input tokens:", str(summary.total_input_tokens))
    row("Total generated tokens:", str(summary.total_output_tokens))
    row("Request throughput (req/s):", _fmt(summary.request_throughput))
    if summary.slos_ms:
        row("SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in summary.slos_ms.items()))
        row("Request goodput (req/s):", _fmt(summary.request_goodput))
        attainment = None if summary.slo_attainment is None else summary.slo_attainment * 100.0
        row("SLO attainment (%):", _fmt(attainment, 1))
    row("Output token throughput (tok/s):", _fmt(summary.output_throughput))
    if peak is not None:
        row("Peak output token throughput (tok/s):", _fmt(peak[0]))
        row("Peak concurrent requests:", str(peak[1]))
    row("Total token throughput (tok/s):", _fmt(summary.total_token_throughput))
    methods = ", ".join(f"{_METHODS.get(m, m)} ({n})" for m, n in summary.token_count_methods.items()) or "n/a"
    row("Output tokens counted by:", methods)
    for name in metrics:
        stats = summary.latency[name]
        short = name.upper()
        lines.append(f"{_TITLES[name]:-^{_WIDTH}}")
        row(f"Mean {short} (ms):", _fmt(stats.mean))
        row(f"Median {short} (ms):", _fmt(stats.median))
        for p in percentiles:
            row(f"P{percentile_name(p)[1:]} {short} (ms):", _fmt(stats.percentiles.get(p)))
    if summary.error_counts:
        lines.append(f"{'Errors':-^{_WIDTH}}")
        items = list(summary.error_counts.items())
        for message, count in items[:_SHOWN_ERRORS]:
            lines.append(f"{count:>6} x {message}")
        if len(items) > _SHOWN_ERRORS:
            lines.append(f"       ... and {len(items) - _SHOWN_ERRORS} more kinds of error")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
