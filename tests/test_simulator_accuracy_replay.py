"""The simulator-accuracy benchmark's replay: the committed live record,
calibrated and simulated again, gives the committed results (the README's
accuracy table) — so a change to the simulator or its calibration shows here
and its table is regenerated with `--replay`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def test_replaying_the_recorded_live_run_reproduces_the_committed_accuracy_table(tmp_path):
    out = tmp_path / "replayed.json"
    done = subprocess.run([sys.executable, "bench/simulator_accuracy.py", "--replay",
                           str(RESULTS / "simulator_accuracy_record.json"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    replayed = json.loads(out.read_text())["deployments"]
    committed = json.loads((RESULTS / "simulator_accuracy.json").read_text())["deployments"]
    assert set(replayed) == {"colocated", "1P+1D", "1P+2D"}
    for name, deployment in committed.items():
        for load, row in deployment["loads"].items():
            again = replayed[name]["loads"][load]
            assert again["measured"] == row["measured"], (name, load)
            for key in ("simulated", "simulated_online", "uncorrected"):
                for figure, value in row[key].items():
                    expected = None if value is None else pytest.approx(value, rel=1e-9)
                    assert again[key][figure] == expected, \
                        (f"{name} {load} {key} {figure}: the replay no longer gives the committed figure; "
                         "rerun `python bench/simulator_accuracy.py --replay "
                         "bench/results/simulator_accuracy_record.json` and update the README's table")
    assert "of 45 figures within" in done.stdout
