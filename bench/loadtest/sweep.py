"""A request-rate sweep: one run per rate, then a summary table and plots.

Each rate gets its own prompts (the caller builds one dataset per rate, the
CLI with seeds seed, seed + 1, ...), so a server's prefix cache does not carry
one rate's prompts into the next and flatter its TTFT. Random prompts keep one
mix of lengths across the rates (drawn from the first seed); ShareGPT prompts
are other conversations per rate, so their lengths differ from rate to rate. Each rate is one full
run (runner.run_benchmark) with its own --max-duration, so a sweep takes at
most len(rates) times that. A run stopped by its time limit still counts and
the sweep goes on; a cancelled one (Ctrl-C) ends the sweep, keeping the rates
measured so far.

Plots (PNG, written with matplotlib's object API, so no pyplot or global
backend state is touched), x = offered request rate:
- slo_attainment.png: SLO attainment (%) (only when SLOs were given);
- ttft.png and tpot.png: median, p90 and p99;
- throughput.png: request throughput and goodput against the offered rate
  (with the y = x line: a server keeping up sits on it), output tokens/s on
  a second axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.loadtest.datasets import SampleRequest
from bench.loadtest.runner import RunConfig, RunResult, run_benchmark


async def run_sweep(datasets: Sequence[Sequence[SampleRequest]], config: RunConfig, rates: Sequence[float], *,
                    tokenizer: Any = None,
                    on_run: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """One run per rate, in the given order, rate i sending `datasets[i]`; `on_run` sees
    each result as it is done."""
    if len(datasets) != len(rates):
        raise ValueError(f"a sweep needs one dataset per rate, got {len(datasets)} for {len(rates)} rates")
    results = []
    for requests, rate in zip(datasets, rates, strict=True):
        run = await run_benchmark(requests, replace(config, request_rate=rate), tokenizer=tokenizer)
        results.append(run)
        if on_run is not None:
            on_run(run)
        if run.cancelled:
            break
    return results


def _value(result: Mapping[str, Any], key: str) -> float:
    value = result.get(key)
    return float("nan") if value is None else float(value)


def format_sweep_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One line per rate from build_result dicts."""
    header = (f"{'rate':>7} {'ok':>5} {'failed':>6} {'req/s':>7} {'goodput':>7} {'SLO %':>6} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    lines = ["Rate sweep (latencies in ms)", header, "-" * len(header)]
    for r in results:
        attainment = r.get("slo_attainment")
        lines.append(
            f"{str(r['request_rate']):>7} {r['completed']:>5} {r['failed']:>6} "
            f"{r['request_throughput']:>7.2f} {_value(r, 'request_goodput'):>7.2f} "
            f"{float('nan') if attainment is None else attainment * 100:>6.1f} "
            f"{_value(r, 'median_ttft_ms'):>9.1f} {_value(r, 'p99_ttft_ms'):>9.1f} "
            f"{_value(r, 'median_tpot_ms'):>9.1f} {_value(r, 'p99_tpot_ms'):>9.1f}")
    return "\n".join(lines)


def write_plots(results: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write the sweep's PNGs into `out_dir` (created if missing); returns their paths.

    `results` are build_result dicts with finite request rates.
    """
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ordered = sorted(results, key=lambda r: float(r["request_rate"]))
    rates = [float(r["request_rate"]) for r in ordered]
    written = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, format="png", dpi=100)
        written.append(path)

    if any(r.get("slo_attainment") is not None for r in ordered):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ax.plot(rates, [_value(r, "slo_attainment") * 100 for r in ordered], marker="o")
        slos = ordered[0].get("slos_ms") or {}
        ax.set_title("SLO attainment (" + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) + ")")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("requests meeting every SLO (%)")
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        save(fig, "slo_attainment.png")

    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for stat, label in (("median", "median"), ("p90", "p90"), ("p99", "p99")):
            ax.plot(rates, [_value(r, f"{stat}_{metric}_ms") for r in ordered], marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.legend()
        ax.grid(True, alpha=0.3)
        save(fig, f"{metric}.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(rates, rates, linestyle=":", color="gray", label="offered")
    ax.plot(rates, [_value(r, "request_throughput") for r in ordered], marker="o", label="throughput")
    if any(r.get("request_goodput") is not None for r in ordered):
        ax.plot(rates, [_value(r, "request_goodput") for r in ordered], marker="s", label="goodput")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("completed requests/s")
    tokens = ax.twinx()
    tokens.plot(rates, [_value(r, "output_throughput") for r in ordered], marker="^", color="tab:red",
                label="output tokens/s")
    tokens.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    tokens.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = tokens.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="upper left")
    ax.set_title("Throughput")
    ax.grid(True, alpha=0.3)
    save(fig, "throughput.png")
    return written
