"""Averaging across real processes over TLS, with members killed by a signal mid-step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from potluck.averaging.allreduce.reduction import bounded_weights
from tests import forkserver
from tests.averaging_process import vector_of
from tests.conftest import ROOT

SIZE = 4_000_000  # 16 MB per peer: the exchange lasts long enough to be interrupted
ALLREDUCE_TIMEOUT = 30.0  # the step's all-reduce deadline, configured in every worker
SENDER_TIMEOUT = 3.0
DEADLINE_MARGIN = 2.0  # a survivor may overrun its deadline by this much (teardown, a loaded machine)


class AveragingProcess:
    def __init__(self, index: int, initial_peer: str | None, out: str, client: bool = False, group: int = 4):
        cmd = [sys.executable, str(ROOT / "tests" / "averaging_process.py"), str(index), "--size", str(SIZE),
               "--group", str(group), "--allreduce-timeout", str(ALLREDUCE_TIMEOUT),
               "--sender-timeout", str(SENDER_TIMEOUT), "--out", out]
        if initial_peer:
            cmd += ["--initial-peer", initial_peer]
        if client:
            cmd.append("--client")
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        self.index = index
        self.out = out
        self.proc = forkserver.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.address = self.proc.stdout.readline().strip()
        self.peer_id = self.proc.stdout.readline().strip()
        assert self.peer_id, "peer process failed to start"
        self.started = threading.Event()
        self.group: dict | None = None
        self.result: dict | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("allreduce-start"):
                self.group = json.loads(line.split(" ", 1)[1])
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

    def vector(self) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(self.out, dtype=np.float32))

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


def pick_victims(roles: tuple[str, ...], group: dict) -> list[int]:
    """Group positions to kill, by role. Join order decides positions, so roles are resolved only
    once the group is known: "reducer" is the last node, whose shard does not start at offset 0
    (a check of the first elements alone would miss its re-reduction); "coordinator" is the first
    node (the coordinator, reducing shard 0); "sender" is the client, which only sends."""
    nodes = [i for i, r in enumerate(group["roles"]) if r == "node"]
    clients = [i for i, r in enumerate(group["roles"]) if r == "client"]
    assert len(nodes) == 3 and len(clients) == 1, group
    by_role = {"sender": clients[0], "reducer": nodes[-1], "coordinator": nodes[0]}
    victims = [by_role[r] for r in roles]
    if "reducer" in roles:
        assert group["part_sizes"][nodes[-1]] > 0 and sum(group["part_sizes"][:nodes[-1]]) > 0, group
    return victims


@pytest.mark.timeout(150)
@pytest.mark.parametrize("roles", [("sender",), ("reducer",), ("sender", "reducer"), ("coordinator",)],
                         ids=["sender", "reducer", "sender+reducer", "coordinator"])
def test_members_killed_by_signal_leave_survivors_identical_and_correct(processes, roles, tmp_path):
    """Survivors hold bit-identical vectors equal, in every shard, to the weighted mean over the
    contributors the step reports, and finish within the all-reduce deadline."""
    first = AveragingProcess(0, None, str(tmp_path / "0.f32"))
    processes.append(first)
    for i in range(1, 4):  # 3 only sends (a client)
        processes.append(AveragingProcess(i, first.address, str(tmp_path / f"{i}.f32"), client=(i == 3)))
    by_id = {p.peer_id: p for p in processes}
    for p in processes:
        p.go()
    for p in processes:
        assert p.started.wait(30), "the all-reduce never started"
    group = first.group
    assert all(p.group == group for p in processes), "members disagree on the group"
    victims = [by_id[group["peers"][i]] for i in pick_victims(roles, group)]
    for v in victims:
        v.kill()
    survivors = [p for p in processes if p not in victims]
    results = [p.finish() for p in survivors]
    assert all(r is not None and r["ok"] for r in results), results
    for r in results:
        assert r["allreduce_seconds"] <= ALLREDUCE_TIMEOUT + DEADLINE_MARGIN, r["allreduce_seconds"]
    assert len({r["digest"] for r in results}) == 1, "survivors differ"
    assert all(r["contributors"] == results[0]["contributors"] for r in results)
    contributors = sorted(by_id[c].index for c in results[0]["contributors"])
    assert contributors == sorted(p.index for p in survivors), contributors

    vectors = [p.vector() for p in survivors]
    assert all(torch.equal(v, vectors[0]) for v in vectors), "survivors' vectors differ"
    weights = bounded_weights({i: i + 1.0 for i in contributors}, tuple(contributors))  # as reducers weigh
    total = sum(weights.values())
    expected = sum(vector_of(i, SIZE) * (weights[i] / total) for i in contributors)
    offset = 0
    for j, size in enumerate(group["part_sizes"]):  # shard by shard, so a failure names the shard
        if size:
            torch.testing.assert_close(vectors[0][offset:offset + size], expected[offset:offset + size],
                                       rtol=0, atol=1e-5, msg=lambda m, j=j: f"shard of member {j}: {m}")
        offset += size
    assert offset == SIZE
