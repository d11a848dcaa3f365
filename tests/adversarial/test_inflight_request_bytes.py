"""A peer cannot park an unbounded amount of request data on a slow handler (issue 14: 60 waiting
calls x 16 MiB held +960 MB).

The bytes of requests whose handlers are still running are capped per connection
(`connection.MAX_INFLIGHT_REQUEST_BYTES`, 256 MiB; lowered to 32 MiB here so the test is light):
past it a request gets a "busy" error and its bytes are dropped at once. Here an authenticated
peer sends 16 requests of 8 MiB to a handler that waits (the old code held all 128 MiB).

Memory is measured as the request bytes the server holds (each running handler holds its 8 MiB
request): the process's resident size would mostly show the allocator keeping freed blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.net import connection
from potluck.net.frames import Kind
from tests.adversarial.scene import attacked_server, parking_handler, send_raw_requests

MiB = 2**20
REQUESTS = 16
REQUEST_BYTES = 8 * MiB
CAP = 32 * MiB
# Request bytes the server may hold for one connection: the cap (the old code: all 128 MiB).
HELD_BOUND = CAP
ROUND_TRIP_BOUND = 5.0


@pytest.mark.timeout(60)
def test_requests_parked_on_a_slow_handler_are_capped_in_bytes(arun, monkeypatch):
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES", CAP, raising=False)

    async def main():
        slow, release = parking_handler()
        async with attacked_server({"slow": slow}) as (server, attacker, honest, sid):
            try:
                (conn,) = attacker.open_connections()
                payload = torch.ones(REQUEST_BYTES // 4)
                await asyncio.sleep(0.2)
                await send_raw_requests(conn, "slow", REQUESTS, payload)
                await asyncio.sleep(1.0)  # the server has read them all by now
                served = [c for c in server.open_connections() if c.peer_id == attacker.peer_id]
                assert await honest.call(sid, "echo", "ok", timeout=ROUND_TRIP_BOUND) == "ok"
                assert served
                held = len(served[0]._serving) * REQUEST_BYTES
                assert held <= HELD_BOUND, f"the server holds {held / MiB:.0f} MiB of parked requests"
            finally:
                release.set()

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_stream_open_requests_count_in_the_request_bytes(arun, monkeypatch):
    """A stream's OPEN request is held for the stream's life (its handler reads it): 16 streams
    opened with 8 MiB requests on a handler that waits are capped like 16 calls."""
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES", CAP, raising=False)

    async def main():
        stuck, release = parking_handler()
        async with attacked_server(stream_handlers={"stuck": stuck}) as (server, attacker, honest, sid):
            try:
                (conn,) = attacker.open_connections()
                payload = torch.ones(REQUEST_BYTES // 4)
                await asyncio.sleep(0.2)
                await send_raw_requests(conn, "stuck", REQUESTS, payload, kind=Kind.OPEN)
                await asyncio.sleep(1.0)
                served = [c for c in server.open_connections() if c.peer_id == attacker.peer_id]
                assert await honest.call(sid, "echo", "ok", timeout=ROUND_TRIP_BOUND) == "ok"
                assert served
                held = sum(REQUEST_BYTES for s in served[0]._streams.values() if s.request is not None)
                assert held <= HELD_BOUND, f"the server holds {held / MiB:.0f} MiB of stream requests"
            finally:
                release.set()

    arun(main(), timeout=50)
