"""A relay that stops forwarding must not leave our relayed link's resources behind.

Closing a relayed link sends what it queued through the relay stream, then ends it. A relay
that stopped taking our bytes (no flow-control credit) and kept its own connection to us alive
held that send forever: the relay stream, the connection to the relay, the link and its count
towards the per-peer connection cap all stayed after the link's own keepalive had closed it.
The close now gives up after `net.relay.PIPE_CLOSE_GRACE` (here 1 s). Without TLS: with it, the
TLS shutdown's own timeout ended the pipe (on Python 3.11; 3.10 has none)."""

from __future__ import annotations

import asyncio

import pytest

from potluck.net import relay as relay_module
from potluck.net.identity import Identity
from potluck.net.relay import RELAY_HOP, RelayService, reserve
from potluck.net.tcp import TCPTransport
from tests.adversarial.scene import running


@pytest.mark.timeout(60)
def test_a_relayed_link_whose_relay_stopped_forwarding_is_let_go(arun, monkeypatch):
    monkeypatch.setattr(relay_module, "PIPE_CLOSE_GRACE", 1.0)
    forward = RelayService._pump

    async def stalled_pump(self, src, dst, payer, origin, circuit, towards_target):
        if not towards_target:
            return await forward(self, src, dst, payer, origin, circuit, towards_target)
        moved = 0
        while moved < 2**20:  # the handshake and a little more, then it stops reading the dialer
            chunk = await src.recv()
            moved += len(chunk)
            circuit.last = asyncio.get_running_loop().time()
            await dst.send(chunk)
        await asyncio.sleep(3600)

    async def no_idle_limit(self, circuit):
        await asyncio.sleep(3600)
    monkeypatch.setattr(RelayService, "_pump", stalled_pump)
    monkeypatch.setattr(RelayService, "_watch", no_idle_limit)

    async def main():
        def peer() -> TCPTransport:
            return TCPTransport(Identity.generate(), host="127.0.0.1", insecure=True,
                                keepalive_interval=0.5, keepalive_timeout=2.0)
        relay, target, dialer = peer(), peer(), peer()
        target.keepalive_interval = None  # only the dialer's keepalive ends the relayed link
        for p in (relay, target, dialer):
            p.puncher.auto = False
        async with running(relay, target, dialer):
            RelayService(relay).start()
            target.add_handler("big", lambda request, ctx: asyncio.sleep(0, None))
            await target.connect(relay.addresses[0], timeout=10)
            dialer.add_addresses(target.peer_id, (await reserve(target, relay.peer_id)).addresses)
            with pytest.raises(Exception):  # noqa: B017 - the call fails one way or another
                await dialer.call(target.peer_id, "big", b"x" * (20 * 2**20), timeout=5)
            await asyncio.sleep(6)  # the keepalive (2 s) closes the link; the close gives up after 1 s
            hops = [s for c in dialer.open_connections() if c.peer_id == relay.peer_id
                    for s in c._streams.values() if s.method == RELAY_HOP]
            assert not hops, "the relay stream of the closed link is still open"
            assert dialer._links_per_peer.get(target.peer_id) is None
            assert not [link for link in dialer._links if link.relay is not None]
    arun(main(), timeout=50)
