"""A peer that sends pings but never reads must not grow our queue of answers to them.

While a send holds a link's writer (a large answer the other side does not read), the link queues
its control frames (pongs, window updates, refusals of calls) behind it: one per ping of the
other side, without end. Past `net.connection.MAX_CONTROL_FRAMES` the link is now closed."""

from __future__ import annotations

import asyncio

import pytest

from potluck.net import Identity, TCPTransport
from potluck.net.connection import MAX_CONTROL_FRAMES
from potluck.net.frames import Frame, Kind
from tests.adversarial.scene import running


@pytest.mark.timeout(60)
def test_pings_from_a_peer_that_does_not_read_end_its_connection(arun):
    async def main():
        victim = TCPTransport(Identity.generate(), host="127.0.0.1")
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=None)
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        victim.add_handler("big", lambda request, ctx: asyncio.sleep(0, b"\0" * (48 * 2**20)))
        victim.add_handler("echo", lambda request, ctx: asyncio.sleep(0, request))
        async with running(victim, attacker, honest):
            victim_id = await attacker.connect(victim.addresses[0], timeout=10)
            (conn,) = attacker.open_connections()
            conn.link._transport.pause_reading()  # it stops reading: the victim's answer stalls its writer
            await conn.link.send(Frame(Kind.REQUEST, 1, {"m": "big", "t": 60.0}, body=None))
            await asyncio.sleep(1.0)
            for _ in range(MAX_CONTROL_FRAMES + 100):
                await conn.link.send(Frame(Kind.PING))
            await asyncio.sleep(1.0)
            assert not [c for c in victim.open_connections() if c.peer_id == attacker.peer_id], \
                "the victim still queues answers for a peer that does not read them"
            await honest.connect(victim.addresses[0], timeout=10)
            assert await honest.call(victim_id, "echo", 5, timeout=10) == 5
    arun(main(), timeout=50)
