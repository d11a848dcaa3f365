"""Shared test helpers: run coroutines on a fresh loop, start peers in other processes."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from potluck.core import compat
from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent
LOOP_KINDS = ["asyncio", "uvloop"]


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A fresh loop of `kind`, as potluck makes its own (`potluck.core.runner.new_event_loop`)."""
    if kind == "uvloop":
        import uvloop
        return lambda: compat.count_cancellations(uvloop.new_event_loop())
    return lambda: compat.count_cancellations(asyncio.new_event_loop())


@pytest.fixture
def arun() -> Callable[..., Any]:
    """Run a coroutine to completion on a fresh standard loop, with a deadline."""
    def run(coro: Coroutine, timeout: float = 60.0, kind: str = "asyncio") -> Any:
        async def bounded():
            async with compat.timeout(timeout):
                return await coro
        with compat.Runner(loop_factory=loop_factory(kind)) as runner:
            return runner.run(bounded())
    return run


class PeerProcess:
    """A test peer in its own process (tests/peer_process.py), killable with a signal."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        self.proc = forkserver.Popen([sys.executable, str(ROOT / "tests" / "peer_process.py"), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RuntimeError("peer process failed to start: " + self.proc.stderr.read())
        self.address = line

    def kill(self, sig: int = 9) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def peer_process():
    started: list[PeerProcess] = []

    def start(*args: str) -> PeerProcess:
        p = PeerProcess(*args)
        started.append(p)
        return p
    yield start
    for p in started:
        p.close()


# Allocations between two young-generation collections of the cyclic GC (CPython's default: 700).
# A big emulated swarm (1000 DHT peers, 256 averagers) keeps millions of objects alive, and at the
# default every few thousand allocations promote survivors until a full collection rescans them
# all: a 1000-peer DHT test spent 95 of its 239 s in 33 of those. At 100k a young collection takes
# about 0.1 s and full ones all but vanish; cyclic garbage waits at most 100k allocations longer.
GC_YOUNG_THRESHOLD = 100_000
gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take what collection built (torch, potluck, every test module: some 200k objects that live
    until exit) out of the cyclic GC's sight: each full collection rescans every tracked object.
    What tests create is collected as usual."""
    gc.freeze()


# A test that ran this long (a big emulated swarm) may leave millions of objects in reference
# cycles: asyncio's cancelled tasks hold their CancelledError, whose traceback holds the frame
# that holds the task. Left to the cyclic GC, they are freed by whichever later test triggers a
# full collection: after a 256-peer Moshpit test that took 3 s, long enough for two peers
# of test_frameworks (one process, one stalled loop) to see each other's progress records expire
# and train alone. Collected right away, no later test pays for them.
COLLECT_AFTER_SECONDS = 2.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    started = time.monotonic()
    yield
    if time.monotonic() - started >= COLLECT_AFTER_SECONDS:
        gc.collect()
