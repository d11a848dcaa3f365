"""Peer processes for the benchmarks: start one in its own session, read its events, kill it whole.

A worker prints events as '@@' + JSON on stdout and waits for lines on stdin ("go", ...). Shared by
benchmarks/allreduce.py and benchmarks/training.py (run as scripts, so this folder is on sys.path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable


class Worker:
    """One peer process in its own session; its '@@' stdout lines are events, read into a queue."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.events.put(json.loads(line[2:]))
        self.events.put(None)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-40]

    def expect(self, event: str, timeout: float) -> dict:
        try:
            got = self.events.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no {event!r} from a peer process within {timeout:.0f} s") from None
        if got is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            raise RuntimeError(f"a peer process exited ({self.proc.returncode}) before {event!r}:\n"
                               + "".join(self.stderr[-15:]))
        if got.get("event") != event:
            raise RuntimeError(f"expected {event!r} from a peer process, got {got}")
        return got

    def send(self, line: str) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def kill(self) -> None:
        # The whole session, even if its leader exited: hivemind's DHT processes and Go daemons too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def go(self) -> None:
        self.send("go")


def parse_or_run_worker(parser: argparse.ArgumentParser, run_worker: Callable[[argparse.Namespace], None],
                        workers: Iterable[str] | None = None,
                        data: bool = False) -> argparse.Namespace | None:
    """Add the hidden options a benchmark passes to its own worker processes (`--worker`, one of
    `workers` or a flag if None; `--rank`; `--initial`; `--data` if asked) and parse. In a worker,
    run `run_worker(args)` and return None; in the parent, return the arguments, with SIGTERM
    unwinding the stack so that the finally blocks kill the workers."""
    if workers is None:
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    else:
        parser.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial", help=argparse.SUPPRESS)
    if data:
        parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return args
