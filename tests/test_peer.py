"""`potluck.Peer`, the event-loop runner and the `potluck` command: life cycle and clean exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import potluck
from potluck.core.errors import DeadlineExceeded, PeerUnreachable
from potluck.core.runner import CallerThread, LoopRunner, acquire_runner, release_runner
from tests import forkserver
from tests.conftest import ROOT


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_peers_shutdown_leaves_no_threads_sockets_or_tasks():
    threads_before = {t.ident for t in threading.enumerate()}
    fds_before = open_fds()
    with potluck.Peer(host="127.0.0.1") as a, potluck.Peer(initial_peers=a.addresses, host="127.0.0.1") as b:
        async def echo(request, ctx):
            return request
        a.transport.add_handler("echo", echo)
        assert b.call(a.peer_id, "echo", [1, 2]) == [1, 2]
        runner = b._runner
        loop_thread = [t for t in threading.enumerate() if t.name == "potluck-loop"]
        assert len(loop_thread) == 1  # one loop for all peers of the process
    assert not runner.is_running and runner.loop.is_closed()
    assert {t.ident for t in threading.enumerate()} <= threads_before
    leaked = [os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - fds_before
              if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [x for x in leaked if x.startswith("socket:")], leaked


@pytest.mark.timeout(30)
def test_peer_addresses_and_identity_file_survive_restart(tmp_path):
    key = tmp_path / "peer.key"
    with potluck.Peer(host="127.0.0.1", identity_path=str(key)) as first:
        peer_id = first.peer_id
        assert first.addresses and all(a.endswith(f"/p2p/{peer_id}") for a in first.addresses)
        assert first.addresses[0].startswith("/ip4/127.0.0.1/tcp/")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    with potluck.Peer(host="127.0.0.1", identity_path=str(key)) as second:
        assert second.peer_id == peer_id


@pytest.mark.timeout(30)
def test_unreachable_initial_peers_give_a_clear_error():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(PeerUnreachable, match="could not reach any initial peer"):
        potluck.Peer(initial_peers=[f"/ip4/127.0.0.1/tcp/{port}"], host="127.0.0.1")
    assert {t.ident for t in threading.enumerate()} <= threads_before


@pytest.mark.timeout(30)
def test_client_mode_peer_has_no_addresses_but_works():
    with potluck.Peer(host="127.0.0.1") as server, \
            potluck.Peer(initial_peers=server.addresses, client_mode=True) as client:
        assert client.addresses == []

        async def hello(request, ctx):
            return f"hello {request}"
        client.transport.add_handler("hello", hello)
        assert server.call(client.peer_id, "hello", "client") == "hello client"


@pytest.mark.timeout(30)
def test_a_call_lends_its_waiting_thread_to_its_work_and_only_while_it_waits():
    """`CallerThread`: work a call hands over runs in the thread blocked in that call; an error
    reaches the coroutine; work handed after the call returned (a background task's) runs in the
    pool instead of waiting for a thread that has gone; a deadline still holds."""
    runner = LoopRunner()
    caller = CallerThread()
    me = threading.get_ident()
    later: list[asyncio.Future] = []

    async def call():
        here = await caller.run(threading.get_ident)
        with pytest.raises(ZeroDivisionError):
            await caller.run(lambda: 1 / 0)

        async def afterwards():
            await asyncio.sleep(0.2)  # the call has returned by now
            return await caller.run(threading.get_ident)
        later.append(asyncio.ensure_future(afterwards()))
        return here
    assert runner.run(call(), caller=caller) == me

    async def background():
        return await later[0]
    there = runner.run(background(), timeout=5)
    assert there not in (me, runner._thread.ident)

    async def never():
        await asyncio.sleep(30)
    with pytest.raises(DeadlineExceeded):  # a lent thread waiting for work still honours the deadline
        runner.run(never(), timeout=0.3, caller=CallerThread())
    runner.shutdown()


@pytest.mark.timeout(30)
def test_runner_deadline_cancels_the_coroutine_and_refuses_reentry():
    runner = LoopRunner()
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
    with pytest.raises(DeadlineExceeded):
        runner.run(slow(), timeout=0.2)
    assert cancelled.wait(5)

    async def reenter():
        return runner.run(asyncio.sleep(0))
    with pytest.raises(RuntimeError, match="await the async"):
        runner.run(reenter(), timeout=5)
    runner.shutdown()
    assert not runner.is_running
    with pytest.raises(RuntimeError, match="shut down"):
        runner.run(asyncio.sleep(0))


@pytest.mark.timeout(30)
def test_shared_runner_stops_with_its_last_user():
    a = acquire_runner()
    b = acquire_runner()
    assert a is b
    release_runner()
    assert a.is_running
    release_runner()
    assert not a.is_running


def _potluck(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return forkserver.Popen([sys.executable, "-m", "potluck", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_potluck_peer_prints_addresses_and_exits_cleanly(sig):
    procs = [_potluck("peer", "--host", "127.0.0.1", "--relay")]
    try:
        first = procs[0]
        assert first.stdout.readline().startswith("peer id: ")
        assert "join with" in first.stdout.readline()
        address = first.stdout.readline().split("--initial-peers")[1].strip()
        assert first.stdout.readline().startswith("No initial peers to check reachability with")
        assert first.stdout.readline().startswith("relaying for peers behind NAT")
        second = _potluck("peer", "--host", "127.0.0.1", "--initial-peers", address)
        procs.insert(0, second)
        assert second.stdout.readline().startswith("peer id: ")
        assert "join with" in second.stdout.readline()
        joins = second.stdout.readline().split("--initial-peers")[1].strip()
        # the public address: the one the first peer dialed back
        assert second.stdout.readline().strip() == f"Publicly reachable at {joins}: 1 of 1 peers asked connected back."
        for proc in procs:
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, err
            assert "stopped" in out
            assert "Traceback" not in err
    finally:
        for proc in procs:  # a failed check leaves no peer running
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.timeout(60)
def test_potluck_peer_with_bad_initial_peer_says_what_is_wrong():
    proc = _potluck("peer", "--initial-peers", "/ip4/999.1.1.1/tcp/5")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "999.1.1.1" in err and "Traceback" not in err


def test_potluck_help_lists_commands():
    proc = _potluck("--help")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "peer" in out and "demo" in out


@pytest.mark.timeout(30)
def test_stop_signal_ends_a_wait_without_taking_a_lock_in_the_handler(monkeypatch):
    """A handler that takes a lock can deadlock with the main thread it interrupts (seen: `potluck
    peer` hung on SIGTERM inside `Event.wait`); StopSignal's handler only sets a flag."""
    from potluck.cli import signals
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = signals.StopSignal()
        assert not stop.wait(0)
        sleeping = threading.Event()
        real_sleep = time.sleep
        monkeypatch.setattr(signals.time, "sleep", lambda s: (sleeping.set(), real_sleep(s)))
        threading.Thread(target=lambda: sleeping.wait(10) and os.kill(os.getpid(), signal.SIGTERM)).start()
        assert stop.wait(25) and stop.is_set()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
