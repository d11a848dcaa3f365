"""`potluck authority` and `potluck peer --authority` as real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import forkserver
from tests.conftest import ROOT

ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
# Deadline for a process to print an expected line (start-up imports torch: a few seconds).
LINE_DEADLINE = 60.0


def potluck(*args: str) -> list[str]:
    return [sys.executable, "-m", "potluck", *args]


def wait_for_line(proc: subprocess.Popen, needle: str) -> str:
    """The first stdout line containing `needle`, within LINE_DEADLINE seconds (read by a thread:
    a select() on a buffered text pipe misses lines already buffered)."""
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")] and None,
                              daemon=True)
    reader.start()
    proc.reader = reader  # type: ignore[attr-defined] - joined by stop() before the pipe is closed
    deadline = time.monotonic() + LINE_DEADLINE
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if needle in line:
            return line.strip()
    raise AssertionError(f"no line with {needle!r} within {LINE_DEADLINE} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    reader = getattr(proc, "reader", None)
    if reader is not None:
        reader.join(10)  # the child has exited: its end of the pipe is closed, so readline ends
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.timeout(180)
def test_authority_command_admits_an_invited_peer_and_refuses_a_stranger(tmp_path):
    policy = tmp_path / "run.policy"
    made = forkserver.run(potluck("authority", "add-invite", "--policy", str(policy), "--name", "volunteer"),
                          capture_output=True, text=True, env=ENV, timeout=60, check=True)
    code = made.stdout.split("invite:")[1].split()[0]
    authority = forkserver.Popen(potluck("authority", "--run-id", "cli-run", "--key", str(tmp_path / "auth.key"),
                                         "--policy", str(policy), "--host", "127.0.0.1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    member = None
    try:
        address = wait_for_line(authority, "--authority").split()[-1]
        member = forkserver.Popen(potluck("peer", "--host", "127.0.0.1", "--initial-peers", address,
                                          "--authority", address, "--credential", f"invite:{code}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        assert "member 'volunteer' of run 'cli-run'" in wait_for_line(member, "member ")
        stranger = forkserver.run(potluck("peer", "--host", "127.0.0.1", "--authority", address,
                                          "--credential", f"invite:{code}"),
                                  capture_output=True, text=True, env=ENV, timeout=60)
        assert stranger.returncode == 1
        assert "unknown or used up" in stranger.stderr
        saved = json.loads(policy.read_text())
        assert list(saved["invites"].values())[0]["uses_left"] == 0
        assert list(saved["allow"].values()) == ["volunteer"]
    finally:
        if member is not None:
            stop(member)
        stop(authority)
