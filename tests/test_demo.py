"""`potluck demo`, run as a user runs it: a swarm of processes that must learn digits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(300)
def test_demo_trains_to_95_percent_with_churn_and_writes_its_report(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "potluck", "demo", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["test_accuracy"] >= 0.95, report["test_accuracy"]
    assert report["killed"] and report["joined"]
    assert report["samples_per_peer"][report["joined"]] > 0  # the newcomer trained after joining
    for key in ("single_peer_test_accuracy", "wall_seconds", "epochs", "samples_per_peer"):
        assert key in report
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert "swarm test accuracy" in proc.stdout
    # The demo's monitor recorded the run and credits only the demo's peers, some of them with samples.
    monitor = report["monitor"]
    assert monitor["db"] == str(tmp_path / "ledger.db") and (tmp_path / "ledger.db").is_file()
    assert monitor["exit_code"] == 0
    assert (monitor["url"] or monitor["db"]) in proc.stdout.split("swarm test accuracy")[0]  # announced early
    credited = {c["peer"]: c["samples"] for c in monitor["contributors"]}
    assert set(credited) <= set(report["samples_per_peer"]) and sum(credited.values()) > 0, credited
    assert "samples credited" in proc.stdout


def test_demo_help_documents_the_report_keys():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-m", "potluck", "demo", "--help"], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    for word in ("--mode", "--duration", "--out", "test_accuracy", "loss.png", "--no-monitor", "ledger.db"):
        assert word in out
