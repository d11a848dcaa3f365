"""`potluck demo --task lm`, run as a user runs it, shortened: peers and a lone process learn bytes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.scenario
@pytest.mark.timeout(200)
def test_lm_demo_learns_below_the_unigram_entropy_and_writes_its_report(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "potluck", "demo", "--task", "lm", "--peers", "2", "--duration",
                           "12", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    from potluck.cli.demo_lm import REPORT_KEYS
    assert set(REPORT_KEYS) <= set(report)
    unigram = report["unigram_bits_per_byte"] * math.log(2)  # nats, like the losses
    assert report["val_loss"] < unigram, report  # learned from context, not only byte frequencies
    assert math.isclose(report["bits_per_byte"], report["val_loss"] / math.log(2), rel_tol=1e-3)
    assert report["mode"] == "diloco" and report["bytes_sent_per_sample"] > 0
    assert len(report["data"]["corpus_digest"]) == 64
    for curve in report["curves"].values():
        assert curve[0]["val_loss"] > curve[-1]["val_loss"]
        assert [p["samples"] for p in curve] == sorted(p["samples"] for p in curve)
    assert (tmp_path / "lm.png").stat().st_size > 10_000
    assert "bits/byte" in proc.stdout
    assert report["verdict"] in proc.stdout and "at equal wall time" in report["verdict"]  # one line
