"""A relay that stops reading us must not hold our pending-handshake slots.

A relayed connection we accept takes a connection slot and a pending-handshake slot as the
relay's `relay.stop` stream opens, before our answer to it is sent; the handshake deadline was
armed only after that answer. A relay holding a reservation of ours that stopped reading our
connection (and kept pinging us, so the keepalive held) then opened stops for made-up sources:
each held its slots until the stream handler's hour-long cap, up to the relay's share of the
pending handshakes (64 of 128). The answer is now sent under the handshake deadline."""

from __future__ import annotations

import asyncio

import pytest

from potluck.net import tcp
from potluck.net.frames import Frame, Kind
from potluck.net.identity import Identity
from potluck.net.relay import RELAY_STOP, RelayService, Stop, reserve
from potluck.net.tcp import TCPTransport
from tests.adversarial.scene import running


@pytest.mark.timeout(60)
def test_stops_from_a_relay_that_stopped_reading_us_give_their_slots_back(arun, monkeypatch):
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT", 1.0)

    async def main():
        relay = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=1.0, keepalive_timeout=5.0)
        target = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=1.0, keepalive_timeout=5.0)
        for p in (relay, target):
            p.puncher.auto = False
        async with running(relay, target):
            RelayService(relay).start()
            relay.add_handler("sink", lambda request, ctx: asyncio.sleep(0, None))
            await target.connect(relay.addresses[0], timeout=10)
            await reserve(target, relay.peer_id)
            to_target = next(c for c in relay.open_connections() if c.peer_id == target.peer_id)
            to_target.link._transport.pause_reading()  # the relay stops reading the target...
            to_target._keepalive_task.cancel()

            async def ping() -> None:  # ...but keeps pinging it, so the target's keepalive holds
                while True:
                    to_target.link.send_nowait(Frame(Kind.PING))
                    await asyncio.sleep(0.5)
            pinger = asyncio.ensure_future(ping())
            try:
                fill = [asyncio.ensure_future(target.call(relay.peer_id, "sink", b"x" * (2**20 - 4096), timeout=3))
                        for _ in range(40)]
                await asyncio.gather(*fill, return_exceptions=True)  # the target's buffer to the relay is full
                for _ in range(5):  # stops for made-up sources: each takes the target's slots
                    await to_target.open_stream(RELAY_STOP, Stop(Identity.generate().peer_id).to_wire(), timeout=None)
                await asyncio.sleep(0.5)
                assert target.pending_handshakes > 0  # the attack is on
                await asyncio.sleep(3 * tcp.HANDSHAKE_TIMEOUT)
                assert target.pending_handshakes == 0, "relayed accepts still hold pending-handshake slots"
            finally:
                pinger.cancel()
    arun(main(), timeout=50)
