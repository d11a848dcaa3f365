"""`potluck compare`: a short run of every mode writes a complete, sane report."""

from __future__ import annotations

import json
import logging
import math
import statistics
from typing import Any

import pytest

from potluck.cli import main
from potluck.cli.compare import MODES, REPORT_KEYS, explain, smooth, table


@pytest.mark.timeout(30)
def test_smooth_averages_losses_in_time_bins():
    curve = smooth([(0.0, 4.0), (0.1, 2.0), (9.9, 1.0), (10.0, 0.5)], bins=2)
    assert curve == [[5.0, 3.0], [10.0, 0.75]]
    assert smooth([]) == []


# Server steps or rounds after which a mode's test accuracy must be clearly above chance.
MIN_UPDATES_TO_LEARN = 20


@pytest.mark.scenario
@pytest.mark.timeout(240)
def test_short_comparison_of_every_mode_writes_a_sane_report(tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING)
    assert main(["compare", "--duration", "4", "--out", str(tmp_path)]) == 0
    # the scenario's dead and slow workers are in the table, not in library WARNING lines around it
    assert not [r for r in caplog.records if r.name.startswith("potluck")], caplog.text[-1500:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(MODES) <= set(report)
    for mode in MODES:
        r = report[mode]
        assert set(REPORT_KEYS) <= set(r), mode
        # Learned something: the loss is below chance level's (ln 10 = 2.303), and a mode that made
        # enough updates beats chance accuracy (0.1) clearly. ps_sync waits for the 4x slow worker
        # every step: 9 updates in 4 s on a quiet machine, 5 on a busy one (accuracy 0.09 then).
        assert math.isfinite(r["final_loss"]) and 0 < r["final_loss"] < math.log(10), (mode, r["final_loss"])
        assert 0.0 <= r["test_accuracy"] <= 1.0
        if r["updates"] >= MIN_UPDATES_TO_LEARN:
            assert r["test_accuracy"] > 0.15, (mode, r["test_accuracy"])
        assert r["samples"] > 0 and r["updates"] > 0
        assert all(len(point) == 2 for point in r["loss_curve"]) and r["loss_curve"]
        # Bytes on the workers' links: counted in every mode, and the same losses against them.
        assert r["bytes_per_sample"]["sent"] > 0 and r["bytes_per_sample"]["received"] > 0, mode
        megabytes = [point[0] for point in r["bytes_curve"]]
        assert megabytes == sorted(megabytes) and megabytes[-1] > 0, (mode, megabytes)
        assert [point[1] for point in r["bytes_curve"]] == [point[1] for point in r["loss_curve"]]
    assert report["settings"]["slow"] == 4.0 and report["settings"]["failure"] is True
    check_explanation_agrees_with_the_figures(report)
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


def check_explanation_agrees_with_the_figures(report: dict[str, Any]) -> None:
    """Recompute the findings from the report's own figures, independently of compare.py, and
    check that the findings and the text say the same."""
    modes = [m for m in MODES if m in report]
    findings, text = report["findings"], report["explanation"]
    accuracies = {m: report[m]["test_accuracy"] for m in modes}
    best, worst = findings["most_accurate"], findings["least_accurate"]
    assert accuracies[best] == max(accuracies.values()) and accuracies[worst] == min(accuracies.values())
    assert f"highest {best} ({accuracies[best]:.3f}), lowest {worst} ({accuracies[worst]:.3f})" in text

    target = statistics.median_high(report[m]["loss_curve"][-1][1] for m in modes)
    assert findings["target_loss"] == target
    seconds = {}
    for m in modes:
        below = [t for t, loss in report[m]["loss_curve"] if loss <= target]
        seconds[m] = min(below) if below else None
    assert findings["seconds_to_target"] == seconds
    reached = sorted((t, MODES.index(m), m) for m, t in seconds.items() if t is not None)
    assert len(reached) >= (len(modes) + 1) // 2  # a median: at least half the modes got there
    first = reached[0][2]
    assert findings["fastest_to_target"] == first
    assert f"loss {target:.4f} (the median" in text and f"first by {first}, after {seconds[first]:.1f} s" in text
    assert "in order: " + ", ".join(f"{m} {t:.1f} s" for t, _, m in reached) in text
    missed = [m for m in modes if seconds[m] is None]
    assert ("never reached by " in text) == bool(missed)
    assert all(f"{m} (final {report[m]['loss_curve'][-1][1]:.4f})" in text for m in missed)

    rates = {m: round(report[m]["samples"] / report[m]["train_seconds"], 1) for m in modes}
    assert findings["samples_per_second"] == rates
    most = max(rates, key=rates.__getitem__)
    assert f"most {most} ({rates[most]:.0f})" in text

    traffic = {m: report[m]["bytes_per_sample"]["sent"] for m in modes if "bytes_per_sample" in report[m]}
    if traffic:
        order = sorted(traffic, key=lambda m: (traffic[m], MODES.index(m)))
        assert f"fewest {order[0]} ({traffic[order[0]]:,.0f})" in text
        assert "; in order: " + ", ".join(f"{m} {traffic[m]:,.0f}" for m in order) + "." in text

    sync, backup = report["ps_sync"]["updates"], report["backup"]["updates"]
    assert (f"({backup} vs {sync})" in text) and (("backup made no more" in text) == (backup <= sync))


def _mode(accuracy: float, curve: list[list[float]], updates: int, samples: int) -> dict[str, Any]:
    return {"final_loss": curve[-1][1], "test_accuracy": accuracy, "wall_seconds": 5.0, "train_seconds": 4.0,
            "samples": samples, "updates": updates, "loss_curve": curve}


def _report(**modes: dict[str, Any]) -> dict[str, Any]:
    return {**modes, "settings": {"duration": 4.0, "workers": 4, "slow": 4.0, "failure": True}}


@pytest.mark.timeout(30)
def test_explanation_follows_the_numbers_not_a_script():
    curves = {"fast": [[1.0, 1.5], [2.0, 0.6], [3.0, 0.5]], "steady": [[1.0, 2.0], [2.0, 1.0], [3.0, 0.8]],
              "stuck": [[1.0, 2.2], [2.0, 2.0], [3.0, 1.9]]}
    report = _report(ps_sync=_mode(0.80, curves["steady"], 50, 800), backup=_mode(0.90, curves["fast"], 100, 1200),
                     dedloc=_mode(0.40, curves["stuck"], 7, 400))
    findings, text = explain(report)
    assert findings == {"target_loss": 0.8, "seconds_to_target": {"ps_sync": 3.0, "backup": 2.0, "dedloc": None},
                        "fastest_to_target": "backup", "most_accurate": "backup", "least_accurate": "dedloc",
                        "samples_per_second": {"ps_sync": 200.0, "backup": 300.0, "dedloc": 100.0}}
    assert "Test accuracy: highest backup (0.900), lowest dedloc (0.400)." in text
    assert ("Smoothed training loss 0.8000 (the median of the modes' final ones) was reached first by backup, "
            "after 2.0 s; the next, ps_sync, took 1.5x as long; in order: backup 2.0 s, ps_sync 3.0 s; "
            "never reached by dedloc (final 1.9000).") in text
    assert "most backup (300), least dedloc (100)" in text
    assert "backup made 2.0x the server steps of ps_sync (100 vs 50)" in text
    assert "- dedloc: potluck.Optimizer" in text and "- ssp:" not in text  # only the modes that ran

    # The same modes with the results the other way round: the text turns round with them.
    report = _report(ps_sync=_mode(0.90, curves["fast"], 100, 1200), backup=_mode(0.40, curves["stuck"], 40, 400),
                     dedloc=_mode(0.80, curves["steady"], 7, 800))
    findings, text = explain(report)
    assert findings["fastest_to_target"] == "ps_sync" and findings["most_accurate"] == "ps_sync"
    assert "highest ps_sync (0.900), lowest backup (0.400)" in text and "never reached by backup" in text
    assert "backup made no more server steps than ps_sync (40 vs 100)" in text
    check_explanation_agrees_with_the_figures(report | {"findings": findings, "explanation": text})
