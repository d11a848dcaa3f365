"""A peer cannot multiply the per-connection limits by opening more connections (issue 14).

Concurrent handler calls (`MAX_CONCURRENT_CALLS`) and request bytes in progress
(`MAX_INFLIGHT_REQUEST_BYTES`) are capped per connection, and one peer id may hold up to
`MAX_CONNECTIONS_PER_PEER` (32) connections: before, one peer could park 32 x 256 MiB of requests
on a slow handler. Now the same "busy" error also answers a request past a per-peer total across
all of that peer's connections (`MAX_CALLS_PER_PEER`, `MAX_INFLIGHT_REQUEST_BYTES_PER_PEER`).
Here the caps are lowered so the test is light, and one peer id opens several bulk connections and
fills each one's own budget; an honest peer's calls are served meanwhile.

What the server holds is measured as the request bytes (and handler tasks) it keeps for the
attacker's connections: the process's resident size would mostly show the allocator keeping freed
blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.net import connection
from tests.adversarial.scene import attacked_server, parking_handler, send_raw_requests

MiB = 2**20
CONNECTIONS = 4
REQUEST_BYTES = 8 * MiB
PER_CONNECTION_BYTES = 32 * MiB
PER_PEER_BYTES = 32 * MiB
PER_CONNECTION_CALLS = 8
PER_PEER_CALLS = 8
ROUND_TRIP_BOUND = 5.0
SETTLE = 1.0  # the server has read every request sent by then
RAW_IDS = 10001  # call ids of the raw requests (odd: the dialer's), clear of the connection's own


def _held_by(server, peer_id) -> tuple[int, int, int]:
    """(request bytes, handler tasks, connections) the server keeps for `peer_id`."""
    served = [c for c in server.open_connections() if c.peer_id == peer_id]
    return sum(c._inflight_bytes for c in served), sum(len(c._serving) for c in served), len(served)


async def _bulk_connections(attacker, server, n: int):
    return [await asyncio.wait_for(attacker.dial(server.addresses[0], server.peer_id, bulk=True), 10)
            for _ in range(n)]


@pytest.mark.timeout(60)
def test_request_bytes_are_capped_across_a_peers_connections(arun, monkeypatch):
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES", PER_CONNECTION_BYTES)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES_PER_PEER", PER_PEER_BYTES, raising=False)

    async def main():
        slow, release = parking_handler()
        async with attacked_server({"slow": slow}) as (server, attacker, honest, sid):
            try:
                conns = await _bulk_connections(attacker, server, CONNECTIONS)
                payload = torch.ones(REQUEST_BYTES // 4)
                per_connection = PER_CONNECTION_BYTES // REQUEST_BYTES
                for conn in conns:  # each connection's own budget, filled
                    await send_raw_requests(conn, "slow", per_connection, payload, RAW_IDS)
                await asyncio.sleep(SETTLE)
                held, tasks, n = _held_by(server, attacker.peer_id)
                assert n >= CONNECTIONS
                assert held <= PER_PEER_BYTES, (
                    f"one peer holds {held / MiB:.0f} MiB of requests over {n} connections "
                    f"(per-peer cap {PER_PEER_BYTES / MiB:.0f} MiB)")
                assert tasks >= 1
                # An honest peer is served meanwhile, a large request too.
                big = torch.arange(REQUEST_BYTES // 4, dtype=torch.float32)
                assert torch.equal(await honest.call(sid, "echo", big, timeout=ROUND_TRIP_BOUND), big)
                # The attacker's own (non-raw) call is refused with the usual "busy" error.
                with pytest.raises(Exception, match="Busy"):
                    await conns[0].call("slow", payload, timeout=ROUND_TRIP_BOUND)
            finally:
                release.set()
            # Once the handlers finish, the budget is free again.
            await asyncio.sleep(0.5)
            assert _held_by(server, attacker.peer_id)[0] == 0
            assert await conns[-1].call("slow", payload, timeout=ROUND_TRIP_BOUND) is None

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_concurrent_calls_are_capped_across_a_peers_connections(arun, monkeypatch):
    monkeypatch.setattr(connection, "MAX_CONCURRENT_CALLS", PER_CONNECTION_CALLS)
    monkeypatch.setattr(connection, "MAX_CALLS_PER_PEER", PER_PEER_CALLS, raising=False)

    async def main():
        slow, release = parking_handler()
        async with attacked_server({"slow": slow}) as (server, attacker, honest, sid):
            try:
                conns = await _bulk_connections(attacker, server, CONNECTIONS)
                for conn in conns:
                    await send_raw_requests(conn, "slow", PER_CONNECTION_CALLS, b"x", RAW_IDS)
                await asyncio.sleep(SETTLE)
                _, tasks, n = _held_by(server, attacker.peer_id)
                assert n >= CONNECTIONS
                assert tasks <= PER_PEER_CALLS, (
                    f"one peer runs {tasks} handler calls over {n} connections (per-peer cap {PER_PEER_CALLS})")
                assert await honest.call(sid, "echo", "ok", timeout=ROUND_TRIP_BOUND) == "ok"
            finally:
                release.set()

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_a_peers_accounting_goes_with_its_last_connection(arun):
    """Nothing is kept per peer once all its connections are closed."""
    async def main():
        slow, release = parking_handler()
        async with attacked_server({"slow": slow}) as (server, attacker, honest, sid):
            conns = await _bulk_connections(attacker, server, 2)
            for conn in conns:
                await send_raw_requests(conn, "slow", 1, b"x")
            await asyncio.sleep(0.3)
            calls, nbytes = server._call_shares
            assert calls.held_by_peer(attacker.peer_id) == 2 and nbytes.held_by_peer(attacker.peer_id) > 0
            assert server._links_per_peer[attacker.peer_id] == 3  # its shared connection and two bulk ones
            await attacker.close()
            for _ in range(50):
                if not calls.held_by_peer(attacker.peer_id):
                    break
                await asyncio.sleep(0.1)
            assert calls.held_by_peer(attacker.peer_id) == nbytes.held_by_peer(attacker.peer_id) == 0
            assert attacker.peer_id not in server._links_per_peer
            assert not calls.counted() and not nbytes.counted()  # nothing kept: the honest peer has no call running
            release.set()

    arun(main(), timeout=50)


def test_the_per_peer_totals_leave_room_for_an_honest_peers_connections():
    """An honest peer's full shared connection still leaves each of its other connections (one
    bulk stream each) a call, and one more request of the largest frame."""
    from potluck.net import tcp
    from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE

    assert connection.MAX_CALLS_PER_PEER >= connection.MAX_CONCURRENT_CALLS + tcp.MAX_CONNECTIONS_PER_PEER
    assert connection.MAX_INFLIGHT_REQUEST_BYTES_PER_PEER >= connection.MAX_INFLIGHT_REQUEST_BYTES + DEFAULT_MAX_FRAME_SIZE
    # ... and still bound what one peer makes us hold far below what its 32 connections would.
    assert connection.MAX_INFLIGHT_REQUEST_BYTES_PER_PEER < 2 * connection.MAX_INFLIGHT_REQUEST_BYTES
