"""Two machines of two local ranks each (4 processes, Gloo on 127.0.0.1) train as two peers
with `MachineOptimizer`; killing a local rank takes its machine out, and the other goes on. A
machine whose model is sharded with FSDP (`fully_shard`) trains as the unsharded model would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent
TOGETHER = 3  # epochs both machines train before a rank of machine 1 is killed
ALONE = 2  # epochs machine 0 trains after that


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(directory: Path, machine: int, rank: int) -> list[dict]:
    path = directory / f"m{machine}r{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)  # other processes' files: nothing to wait on instead


@pytest.mark.timeout(120)
def test_two_machines_of_two_ranks_train_as_two_peers_and_a_dead_rank_takes_its_machine_out(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    ports = [free_port(), free_port()]
    epochs = {0: TOGETHER + ALONE, 1: 1000}
    procs = {(m, r): forkserver.Popen([sys.executable, str(ROOT / "tests" / "machine_process.py"), str(m), str(r),
                                       "--port", str(ports[m]), "--dir", str(tmp_path), "--epochs", str(epochs[m])],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for m in (0, 1) for r in (0, 1)}
    try:
        def at(machine, rank, epoch):
            return next((r for r in records(tmp_path, machine, rank) if r.get("epoch") == epoch), None)
        wait_until(lambda: all(at(m, r, TOGETHER) for m, r in procs), 60, f"every rank at epoch {TOGETHER}")
        digests = {(m, r): at(m, r, TOGETHER)["digest"] for m, r in procs}
        assert len(set(digests.values())) == 1, digests  # both machines, every local rank
        assert all(at(m, 0, e)["peers"] == 2 for m in (0, 1) for e in range(1, TOGETHER + 1)), \
            [records(tmp_path, m, 0) for m in (0, 1)]

        procs[1, 1].send_signal(signal.SIGKILL)
        assert procs[1, 0].wait(60) == 3, procs[1, 0].stderr.read()[-2000:]
        assert "leaves the run" in records(tmp_path, 1, 0)[-1]["lost"]
        for r in (0, 1):
            assert procs[0, r].wait(60) == 0, procs[0, r].stderr.read()[-2000:]
        final = [at(0, r, TOGETHER + ALONE)["digest"] for r in (0, 1)]
        assert final[0] == final[1]
        assert final[0] != digests[0, 0]  # machine 0 went on training
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stderr.close()


@pytest.mark.timeout(90)
def test_fsdp_sharded_machine_trains_exactly_as_the_unsharded_model(tmp_path):
    """Two local ranks shard the model (`fully_shard`, Gloo); rank 0 steps full host copies and
    hands the shards back: after every epoch the gathered parameters equal an unsharded copy
    trained by hand with the same mean gradients, on both ranks."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    port = free_port()
    procs = [forkserver.Popen([sys.executable, str(ROOT / "tests" / "machine_fsdp_process.py"), str(r), "--port",
                               str(port), "--dir", str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for p in procs:
            assert p.wait(80) == 0, p.stderr.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stderr.close()
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["sharded"] and result["epochs"] == [1, 2, 3]
        assert max(result["errors"]) < 1e-6, result["errors"]
    assert results[0]["digest"] == results[1]["digest"]
