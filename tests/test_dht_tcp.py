"""The DHT over real TCP/TLS: 16 `potluck peer` processes, used by client-mode peers in this process."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

import potluck
from tests.conftest import ROOT

PROCESSES = 16
# Starting 16 interpreters that import torch takes ~10 s on 2 cores; this bounds a stuck start.
START_DEADLINE = 90.0


def start_peer(*initial: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    args = [sys.executable, "-m", "potluck", "peer", "--host", "127.0.0.1"]
    if initial:
        args += ["--initial-peers", *initial]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def read_address(proc: subprocess.Popen, deadline: float) -> str:
    """The `--initial-peers` address a `potluck peer` prints, waiting at most until `deadline`.
    Reads the raw pipe (no buffered readline), so select() sees every byte that arrives."""
    fd = proc.stdout.fileno()
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"--initial-peers" not in data or not data.split(b"--initial-peers", 1)[1].count(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise TimeoutError(f"peer printed no address in time; output so far: {data!r}")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"peer exited with {proc.wait()}: {data!r}")
            data += chunk
    return data.split(b"--initial-peers", 1)[1].split(b"\n", 1)[0].strip().decode()


@pytest.mark.scenario
@pytest.mark.timeout(180)
def test_sixteen_processes_store_get_subkeys_and_expiration_over_tcp():
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + START_DEADLINE
        procs.append(start_peer())
        first = read_address(procs[0], deadline)
        procs += [start_peer(first) for _ in range(PROCESSES - 1)]
        addresses = [first] + [read_address(p, deadline) for p in procs[1:]]

        # Client-mode peers hold no records, so everything found below lives in the processes.
        with potluck.Peer(initial_peers=[addresses[5]], client_mode=True) as writer, \
                potluck.Peer(initial_peers=[addresses[11]], client_mode=True) as other:
            now = potluck.get_dht_time()
            assert writer.dht.store("run/config", {"lr": 0.1, "batch": 256}, now + 300)
            assert writer.dht.store_many([(f"expert.{i}", {"host": f"h{i}"}, now + 300) for i in range(20)]) \
                == [True] * 20
            assert writer.dht.store("group/0", "w-addr", now + 300, subkey=writer.peer_id)
            assert other.dht.store("group/0", "o-addr", now + 300, subkey=other.peer_id)
            assert other.dht.store("short-lived", "soon gone", now + 2.0)
            assert not other.dht.store("run/config", "stale", now + 100)  # earlier expiration loses
            got = other.dht.get("run/config")
            assert got.value == {"lr": 0.1, "batch": 256} and got.expiration_time == now + 300
            group = writer.dht.get("group/0", latest=True)
            assert {s: v.value for s, v in group.value.items()} == {writer.peer_id: "w-addr",
                                                                   other.peer_id: "o-addr"}
            assert writer.dht.get("short-lived").value == "soon gone"
            time.sleep(max(0.0, now + 2.0 - potluck.get_dht_time()) + 0.1)  # let the record expire
            assert writer.dht.get("short-lived", latest=True) is None

        # Kill three processes with SIGKILL; a newcomer through another process still finds it all.
        for proc in procs[1:4]:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        with potluck.Peer(initial_peers=[addresses[9]], client_mode=True) as fresh:
            found = fresh.dht.get_many(["run/config", "group/0"] + [f"expert.{i}" for i in range(20)],
                                       latest=True)
            assert found["run/config"].value == {"lr": 0.1, "batch": 256}
            assert set(found["group/0"].value) == {writer.peer_id, other.peer_id}
            assert all(found[f"expert.{i}"].value == {"host": f"h{i}"} for i in range(20))
        assert all(p.poll() is None for p in procs[4:])  # the serving processes are all still up
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            proc.stdout.close()
