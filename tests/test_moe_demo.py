"""`potluck demo --mode moe`, run as a user runs it, shortened: experts on two servers, one killed,
the trainers' own parameters identical after every update both took."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.scenario
@pytest.mark.timeout(120)
def test_moe_demo_learns_digits_with_a_server_killed_and_writes_its_report(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "potluck", "demo", "--mode", "moe", "--duration", "14",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["test_accuracy"] >= 0.9, report
    assert report["killed"] == "server-1"
    assert report["experts_at_start"] == 8
    assert report["experts_alive_at_end"] == 4 and all(u.startswith("ffn.0.") for u in report["experts_alive"])
    assert all(steps > 0 for steps in report["steps"].values())
    shared = report["shared_parameters"]  # the trainers' own parameters, data parallel (sync mode)
    assert shared["epochs_compared"] > 0 and shared["epochs_agreeing"] == shared["epochs_compared"], shared
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert "killed server-1" in proc.stdout and "test accuracy" in proc.stdout
