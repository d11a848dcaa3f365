"""Made-up ids of one host cannot multiply what each id may make a peer hold: handler calls in
progress and the bytes of their requests and answers are counted per IP and subnet and in all,
as well as per id (`net.connection.call_shares`).

Before, each id had its own totals (1,056 calls, 320 MiB) and a host could hold 256 connections,
one id each: 256 x 256 MiB of parked requests. Answers were counted nowhere: a caller asking for
large answers and never reading them made the peer hold every one until its deadline. Here the
caps are lowered so the test is light; the attackers are ids on 127.0.0.1, the honest peer is on
another /24 (127.0.1.1)."""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc

import pytest
import torch

from potluck.net import Identity, TCPTransport, connection
from potluck.net.tcp import WRITE_HIGH_WATER
from tests.adversarial.scene import parking_handler, running, send_raw_requests

MiB = 2**20
IDS = 4
REQUEST = 4 * MiB
ANSWER = 2 * MiB
CALLS_PER_ID = 24
PER_ID_BYTES = 16 * MiB
PER_IP_BYTES = 16 * MiB
ROUND_TRIP_BOUND = 10.0


@pytest.fixture
def small_shares(monkeypatch):
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES", PER_ID_BYTES)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES_PER_PEER", PER_ID_BYTES)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES_PER_IP", PER_IP_BYTES, raising=False)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES_PER_SUBNET", PER_IP_BYTES, raising=False)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES", 2 * PER_IP_BYTES, raising=False)


async def _made_up_ids(server: TCPTransport, n: int) -> list:
    """`n` ids on 127.0.0.1, one connection each to `server`."""
    conns = []
    for _ in range(n):
        fake = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=None)
        await fake.start()
        await fake.connect(server.addresses[0], timeout=10)
        (conn,) = fake.open_connections()
        conns.append((fake, conn))
    return conns


@contextlib.asynccontextmanager
async def _scene(handlers: dict, ids: int):
    """A server on 127.0.1.1 serving `handlers`, an honest peer on another /24, and `ids` made-up
    ids on 127.0.0.1, each with its connection to the server."""
    server = TCPTransport(Identity.generate(), host="127.0.1.1")
    honest = TCPTransport(Identity.generate(), host="127.0.2.1")
    for method, handler in handlers.items():
        server.add_handler(method, handler)
    async with running(server, honest):
        fakes = await _made_up_ids(server, ids)
        try:
            yield server, honest, fakes
        finally:
            for fake, _ in fakes:
                await fake.close()


@pytest.mark.timeout(90)
def test_requests_parked_by_made_up_ids_of_one_host_are_capped_per_ip(arun, small_shares):
    async def main():
        park, release = parking_handler()
        echo = lambda request, ctx: asyncio.sleep(0, request)  # noqa: E731
        async with _scene({"slow": park, "echo": echo}, IDS) as (server, honest, fakes):
            try:
                for _, conn in fakes:  # each id fills its own share
                    await send_raw_requests(conn, "slow", PER_ID_BYTES // REQUEST, torch.ones(REQUEST // 4), 10001)
                await asyncio.sleep(1.0)
                held = sum(c._inflight_bytes for c in server.open_connections()
                           if c.peer_id in {fake.peer_id for fake, _ in fakes})
                assert held <= PER_IP_BYTES, (
                    f"{IDS} ids of one host hold {held / MiB:.0f} MiB of requests (its share: {PER_IP_BYTES / MiB:.0f})")
                sid = await honest.connect(server.addresses[0], timeout=10)
                big = torch.arange(REQUEST // 4, dtype=torch.float32)
                assert torch.equal(await honest.call(sid, "echo", big, timeout=ROUND_TRIP_BOUND), big)
            finally:
                release.set()

    arun(main(), timeout=80)


@pytest.mark.timeout(90)
def test_answers_that_made_up_ids_of_one_host_do_not_read_are_capped_per_ip(arun, small_shares):
    async def big(request, ctx):
        return b"\1" * ANSWER  # a fresh answer each call, as a DHT find's records

    async def main():
        async with _scene({"big": big}, IDS) as (server, honest, fakes):
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                for _, conn in fakes:
                    conn.link._transport.pause_reading()  # it asks, and never reads the answers
                    await send_raw_requests(conn, "big", CALLS_PER_ID, None, 10001)
                await asyncio.sleep(2.0)
                held = tracemalloc.get_traced_memory()[0] - before
                # Its share (an answer is held twice while written: the value and its encoding),
                # plus what each stalled link holds (under its 2 MiB high-water mark once a send returns).
                bound = 2 * PER_IP_BYTES + IDS * 3 * MiB
                assert held < bound, (f"{IDS} ids of one host hold {held / MiB:.0f} MiB of unread answers "
                                      f"(at most {bound / MiB:.0f} MiB expected; they asked for "
                                      f"{IDS * CALLS_PER_ID * ANSWER / MiB:.0f})")
                sid = await honest.connect(server.addresses[0], timeout=10)
                assert await honest.call(sid, "big", None, timeout=ROUND_TRIP_BOUND) == b"\1" * ANSWER
            finally:
                tracemalloc.stop()

    arun(main(), timeout=80)


@pytest.mark.timeout(90)
def test_a_link_whose_peer_does_not_read_holds_little_once_its_answer_is_sent(arun, small_shares):
    """An answer goes to a link in pieces, and its call holds (and counts) the rest until the link
    is under its high-water mark again (`net.tcp.WRITE_HIGH_WATER`, 2 MiB): what links whose peer
    does not read hold stays within the host's share. At 8 MiB, as before, sends returned with up
    to 8 MiB left with each link, uncounted: made-up ids asking one after another, on 256 connections
    of one host, held 2 GiB."""
    links = 8

    async def big(request, ctx):
        return torch.ones(2 * MiB)  # 8 MiB

    async def main():
        async with _scene({"big": big}, links) as (server, _, fakes):
            for _, conn in fakes:  # one after another: each answer is sent before the next is asked
                conn.link._transport.pause_reading()
                await send_raw_requests(conn, "big", 1, None, 10001)
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            ids = {fake.peer_id for fake, _ in fakes}
            served = [c for c in server.open_connections() if c.peer_id in ids]
            assert len(served) == links
            held = [c.link._transport.get_write_buffer_size() for c in served]
            assert sum(held) <= PER_IP_BYTES, (
                f"links that do not read hold {[round(h / MiB, 1) for h in held]} MiB of answers")
            assert max(held) <= WRITE_HIGH_WATER + 1 * MiB  # and a piece

    arun(main(), timeout=80)
