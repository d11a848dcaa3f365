"""Churn benchmark: does the demo's swarm stall when one of its peers is killed mid-round?

Runs `potluck demo` (4 peers, sync mode; at 35% of the run the client-mode peer is killed with
SIGKILL, at 50% a newcomer joins) --runs times, one after another, and reads the survivors' logs.
Each surviving peer logs a line per epoch, so the longest gap between two lines of a survivor,
after its first 20 s (start-up), is the longest time the swarm made it wait. Before the
all-reduce learned of a killed client-mode member from its lost connections, the survivors
waited out the sender timeout (10 s) or the whole averaging timeout (20 s) in about half the runs.

Prints one JSON object per run, then a summary:
  {"run": k, "longest_stall_s": ..., "per_peer": {"peer-0": ..., ...}, "test_accuracy": ...}
  {"summary": true, "runs": N, "stalls_over_5s": ..., "longest_stall_s": ..., "median_stall_s": ...}

Usage: python benchmarks/demo_churn.py [--runs 8] [--duration 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SURVIVORS = ("peer-0", "peer-1", "peer-3")  # peer-2 is the one killed; peer-4 joins late
STARTUP_SECONDS = 20.0


def longest_gap(log: Path) -> float:
    """The longest silence between two log lines of one peer, start-up excluded."""
    times = [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
             for line in log.read_text().splitlines() if line[:2] == "20" and line[4] == "-"]
    if len(times) < 2:
        return float("nan")
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)
            if (a - times[0]).total_seconds() > STARTUP_SECONDS]
    return max(gaps, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--out", default=None, help="where the demo reports go (default: a temporary folder)")
    args = parser.parse_args()
    base = Path(args.out or tempfile.mkdtemp(prefix="potluck-churn-"))
    stalls = []
    for k in range(args.runs):
        out = base / f"run{k}"
        result = subprocess.run([sys.executable, "-m", "potluck", "demo", "--out", str(out),
                                 "--duration", str(args.duration)], capture_output=True, text=True)
        if result.returncode != 0:
            print(json.dumps({"run": k, "error": result.stderr[-2000:]}), flush=True)
            continue
        per_peer = {name: round(longest_gap(out / f"{name}.log"), 2) for name in SURVIVORS}
        stall = max(per_peer.values())
        stalls.append(stall)
        report = json.loads((out / "report.json").read_text())
        print(json.dumps({"run": k, "longest_stall_s": stall, "per_peer": per_peer,
                          "test_accuracy": report.get("test_accuracy")}), flush=True)
    if stalls:
        print(json.dumps({"summary": True, "runs": len(stalls), "stalls_over_5s": sum(s > 5 for s in stalls),
                          "longest_stall_s": max(stalls), "median_stall_s": statistics.median(stalls)}), flush=True)


if __name__ == "__main__":
    main()
