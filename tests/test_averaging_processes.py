"""Averaging across real processes over TLS, with members killed by a signal mid-step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.averaging_process import vector_of
from tests.conftest import ROOT

SIZE = 4_000_000  # 16 MB per peer: the exchange lasts long enough to be interrupted


class AveragingProcess:
    def __init__(self, index: int, initial_peer: str | None, client: bool = False, group: int = 4):
        cmd = [sys.executable, str(ROOT / "tests" / "averaging_process.py"), str(index), "--size", str(SIZE),
               "--group", str(group)]
        if initial_peer:
            cmd += ["--initial-peer", initial_peer]
        if client:
            cmd.append("--client")
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        self.index = index
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.address = self.proc.stdout.readline().strip()
        self.peer_id = self.proc.stdout.readline().strip()
        assert self.peer_id, "peer process failed to start"
        self.started = threading.Event()
        self.result: dict | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("allreduce-start"):
                self.started.set()
            elif line.startswith("{"):
                self.result = json.loads(line)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> dict | None:
        self.proc.wait(timeout)
        self._reader.join(5)
        return self.result

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


@pytest.fixture
def processes():
    started: list[AveragingProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victims", [(3,), (1,), (1, 3)], ids=["sender", "reducer", "sender+reducer"])
def test_members_killed_by_signal_leave_survivors_identical_and_correct(processes, victims):
    first = AveragingProcess(0, None)
    processes.append(first)
    for i in range(1, 4):
        processes.append(AveragingProcess(i, first.address, client=(i == 3)))  # 3 only sends (client mode)
    ids = {p.peer_id: p.index for p in processes}
    for p in processes:
        p.go()
    for v in victims:
        assert processes[v].started.wait(30), "the all-reduce never started"
    for v in victims:
        processes[v].kill()
    survivors = [p for p in processes if p.index not in victims]
    results = [p.finish() for p in survivors]
    assert all(r is not None and r["ok"] for r in results), results
    assert len({r["digest"] for r in results}) == 1, "survivors differ"
    contributors = sorted(ids[c] for c in results[0]["contributors"])
    assert not set(victims) & set(contributors), contributors
    assert contributors == sorted(p.index for p in survivors)
    weights = {i: i + 1.0 for i in contributors}
    total = sum(weights.values())
    expected = sum(vector_of(i, SIZE)[:1000] * (weights[i] / total) for i in contributors)
    torch.testing.assert_close(torch.tensor(results[0]["sample"]), expected, rtol=0, atol=1e-5)
