"""A short soak run (issue 12): two real peer processes in sync mode keep their memory flat, keep
advancing epochs, and end with identical parameters.

Runs `benchmarks/soak.py --scenarios processes` (the same measurement, shorter) and checks its
figures. The bounds are generous on purpose: before issue 12's fixes each peer grew by about
100 MB per epoch (over a GB in this run).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TRAIN_SECONDS = 35  # with process start-up and the finish epochs: under a minute
WARMUP_SECONDS = 12  # Adam's state, averager buffers and connections exist after the first epochs
SAMPLE_SECONDS = 1.0
MAX_GROWTH_MB = 64  # per peer after the warm-up; the model's parameters are 7 MB
# Liveness, not speed: a healthy pair advances an epoch every second or so; a gap this long means a
# round hung (waiting out averaging_timeout, a deadlock, a swap storm), not a slow machine.
STALL_LIMIT_SECONDS = 15


def soak_rows() -> dict[tuple[str, str | None], dict]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--scenarios", "processes",
         "--minutes", str(TRAIN_SECONDS / 60), "--warmup", str(WARMUP_SECONDS), "--sample", str(SAMPLE_SECONDS)],
        capture_output=True, text=True, timeout=TRAIN_SECONDS + 80)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and rows, proc.stderr[-3000:]
    assert not any(r.get("error") for r in rows), rows
    return {(r["metric"], r.get("peer")): r for r in rows}


@pytest.mark.scenario
@pytest.mark.timeout(TRAIN_SECONDS + 120)
def test_two_peer_processes_keep_memory_flat_epochs_advancing_and_params_identical():
    rows = soak_rows()
    for peer in ("0", "1"):
        growth = rows[("rss_growth_after_warmup", peer)]
        samples = rows[("rss_over_time", peer)]["samples"]
        assert growth["value"] is not None and growth["value"] <= MAX_GROWTH_MB, \
            f"peer {peer}: RSS grew by {growth['value']} MB after the warm-up; [s, MB, epoch]: {samples}"
        heap = rows[("heap_growth_after_warmup", peer)]  # what the peer holds, as glibc's malloc counts it
        if platform.libc_ver()[0] == "glibc":
            assert heap["value"] is not None and heap["value"] <= MAX_GROWTH_MB, \
                f"peer {peer}: malloc's memory in use grew by {heap['value']} MB after the warm-up: " \
                f"{rows[('heap_over_time', peer)]['samples']}"
    stall = rows[("longest_stall", None)]
    assert stall["value"] < STALL_LIMIT_SECONDS, f"epochs stopped advancing for {stall['value']} s: {stall}"
    assert min(rows[("epochs_per_minute", None)]["epochs_at_stop"]) > 0
    identical = rows[("params_identical", None)]
    assert identical["value"] is True, f"parameters differ at the final epoch: {identical}"
