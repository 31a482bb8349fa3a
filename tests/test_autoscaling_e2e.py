"""The goodput autoscaler on a real local Ray cluster no bigger than this
machine: `pdserve serve` with autoscaling starts 2 prefill + 1 decode within a
budget of 3 ranks; an output-heavy load makes it move one rank from prefill to
decode (Serve stops a prefill replica and starts a decode one), and every
request completes, the ones in flight during the move included.

The step-time profile is synthetic and trusted as it is (correct_profile:
false), so the decision depends only on the load's rate and lengths, not on
how fast this machine happens to run: decodes cost 5 ms a sequence, so one
decode replica holds ~15 sequences within the 80 ms TPOT budget, ~1.9 req/s of
100-token outputs; 3.5 req/s needs two, and prompts of 16 tokens need one
prefill replica.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import yaml

from cluster.perf_model.linear_model import LinearStepModel
from engine.tp_group import free_port


def _metric(port: int, name: str, role: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf'^{name}{{role="{role}"}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else None


def _complete(port: int, prompt: list[int], max_tokens: int) -> int:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def test_output_heavy_load_moves_a_rank_from_prefill_to_decode(model_dirs, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LinearStepModel((2e-3, 1e-5, 0.0, 5e-3, 0.0)).to_json()))
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(model_dirs["tiny"]), "served_model_name": "tiny", "max_model_len": 256,
                  "dtype": "float32"},
        "prefill": {"replicas": 2}, "decode": {"replicas": 1},
        # no lent cores: the synthetic profile's decode is slow and the move itself is under test
        # (with lending the policy counts the idle prefill cores and holds the split)
        "resources": {"lend_idle_cores": False},
        "slo": {"ttft_ms": 1000, "tpot_ms": 100},
        # admission control off: on a loaded machine a replica starting up slows the others' steps,
        # and a 429 it then gives is its own feature (tests/test_admission.py), not a request lost
        # in the move, which is what this test looks for
        "admission": {"enabled": False},
        "autoscaling": {"enabled": True, "budget": 3, "interval_s": 2,
                        "startup_s": 2, "downscale_cooldown_s": 0, "profile": str(profile),
                        "correct_profile": False},
    }))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli.main", "serve", "--config", str(config), "--port", str(port),
         "--address", "local"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "RAY_ADDRESS": ""},
        cwd=tmp_path, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("is serving" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.5)
        results: list[int | BaseException] = []
        stop = threading.Event()

        def client(seed: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = [(seed * 997 + i * 31 + k) % 200 + 10 for k in range(16)]
                try:
                    results.append(_complete(port, prompt, 100))
                except BaseException as exc:  # noqa: BLE001 - counted below
                    results.append(exc)
                i += 1
                time.sleep(0.6)

        clients = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(4)]
        for c in clients:
            c.start()
        moved_at = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (_metric(port, "pdserve_autoscaler_current_replicas", "decode") == 2
                    and _metric(port, "pdserve_autoscaler_current_replicas", "prefill") == 1):
                moved_at = time.monotonic()
                break
            time.sleep(1.0)
        time.sleep(4.0)                       # requests keep flowing across the move
        stop.set()
        for c in clients:
            c.join(timeout=150)
        log = "".join(lines)
        assert moved_at is not None, log[-4000:]
        assert _metric(port, "pdserve_autoscaler_target_replicas", "decode") == 2
        assert "autoscaler: prefill -> 1" in log and "decode -> 2" in log, log[-4000:]
        failures = [r for r in results if not isinstance(r, int)]
        assert not failures, failures[:3]
        assert len(results) >= 8 and all(r == 100 for r in results)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
