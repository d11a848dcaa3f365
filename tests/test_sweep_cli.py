"""`potluck sweep`: real processes on 127.0.0.1 share a sweep; one is killed with SIGKILL mid-trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from potluck.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """\
run_id = "cli-test"
kind = "grid"
metric = "score"
[space]
x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
"""


def slow_objective(params: dict) -> dict:
    """A trial that takes 1.5 s of (modeled) training: the sweep outlasts the second peer's start-up."""
    time.sleep(1.5)
    return {"score": params["x"] ** 2}


class SweepProcess:
    def __init__(self, config: Path, out: Path, *extra: str):
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "potluck", "sweep", str(config), "--out", str(out), "--host", "127.0.0.1",
             "--lease", "3", "--objective", "test_sweep_cli:slow_objective", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip())
                self.changed.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = [line for line in self.lines if text in line]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not found:
                    raise AssertionError(f"no {text!r} in the output:\n" + "\n".join(self.lines))
                self.changed.wait(left)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.mark.scenario  # 15-30 s of processes: run by CI after the suite (pyproject.toml)
@pytest.mark.timeout(120)
def test_peer_killed_mid_sweep_has_its_trial_rerun_and_every_trial_appears_once(tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text(CONFIG)
    first = SweepProcess(config, tmp_path / "a")
    second = None
    try:
        address = first.wait_for("--initial-peers").split("--initial-peers ")[1]
        second = SweepProcess(config, tmp_path / "b", "--initial-peers", address)
        second.wait_for("trial ")  # it finished a trial and has claimed the next one
        second.proc.kill()
        assert first.proc.wait(90) == 0, "\n".join(first.lines)
    finally:
        first.close()
        if second is not None:
            second.close()
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert [r["index"] for r in results] == list(range(10))
    assert [r["metrics"]["score"] for r in results] == [x * x for x in range(1, 11)]
    peers = {r["peer"] for r in results}
    second_id = next(line for line in second.lines if "peer id" in line).split("peer id ")[1]
    assert second_id in peers and len(peers) == 2  # both worked; the killed one's last trial was re-run
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["trials"] == 10 and report["best"]["params"] == {"x": 10}
    assert (tmp_path / "a" / "sweep.png").exists()
    assert (tmp_path / "a" / "results.csv").read_text().count("\n") == 11


@pytest.mark.timeout(30)
def test_sweep_command_with_a_malformed_config_gives_a_clear_error(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text('run_id = "x"\nkind = "grid"\n[space]\nlr = []\n')
    assert main(["sweep", str(config), "--out", str(tmp_path / "out")]) == 1
    assert "space.lr is an empty list" in capsys.readouterr().err
