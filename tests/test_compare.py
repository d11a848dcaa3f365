"""`potluck compare`: a short run of every mode writes a complete, sane report."""

from __future__ import annotations

import json
import math

import pytest

from potluck.cli import main
from potluck.cli.compare import MODES, REPORT_KEYS, smooth, table


@pytest.mark.timeout(30)
def test_smooth_averages_losses_in_time_bins():
    curve = smooth([(0.0, 4.0), (0.1, 2.0), (9.9, 1.0), (10.0, 0.5)], bins=2)
    assert curve == [[5.0, 3.0], [10.0, 0.75]]
    assert smooth([]) == []


@pytest.mark.timeout(240)
def test_short_comparison_of_every_mode_writes_a_sane_report(tmp_path, capsys):
    assert main(["compare", "--duration", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(MODES) <= set(report)
    for mode in MODES:
        r = report[mode]
        assert set(REPORT_KEYS) <= set(r), mode
        assert math.isfinite(r["final_loss"]) and 0 < r["final_loss"] < 2.5, (mode, r["final_loss"])  # ln 10 = 2.3
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert r["test_accuracy"] > 0.15, (mode, r["test_accuracy"])  # learned something (chance: 0.1)
        assert r["samples"] > 0 and r["updates"] > 0
        assert all(len(point) == 2 for point in r["loss_curve"]) and r["loss_curve"]
    assert report["settings"]["slow"] == 4.0 and report["settings"]["failure"] is True
    assert "backup" in report["explanation"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert table({m: report[m] for m in MODES}) in printed


@pytest.mark.timeout(30)
def test_compare_refuses_too_few_workers(tmp_path):
    with pytest.raises(SystemExit, match="at least 3"):
        main(["compare", "--workers", "2", "--out", str(tmp_path)])


@pytest.mark.timeout(30)
def test_compare_refuses_a_non_positive_duration(tmp_path):
    with pytest.raises(SystemExit, match="must be positive"):
        main(["compare", "--duration", "0", "--out", str(tmp_path)])
