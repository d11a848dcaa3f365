"""One host cannot take all of a peer's connections (issue 14: no cap on connections; with a
1,024 file-descriptor limit, 1,100 idle connections re-opened as they drop locked new peers out).

Accepted connections are now capped in total, per IP address, per peer id and while in the
handshake (`net.tcp.MAX_CONNECTIONS*`, `MAX_PENDING_HANDSHAKES`, configurable on TCPTransport);
over a cap a connection is refused at once (before TLS: a plain close; after the handshake, for the
per-peer cap, a GOAWAY that says why), and peers already connected (or coming from elsewhere) keep
working. The attacker here connects from 127.0.0.2, a
different address on the loopback interface, so that the honest peer (127.0.0.1) is "elsewhere".
The caps are set on the instance rather than through the constructor so the same test runs
against the code from before the caps (where they are ignored, and every connection is kept)."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.errors import HandshakeError
from potluck.net import Identity, TCPTransport
from tests.adversarial.scene import closed_within, echo, running, tls_connection

ATTACK_CONNECTIONS = 40
PER_IP = 8
PER_PEER = 3
# The deadline of an honest call while the attacker holds its connections (the call fails past
# it): generous for a loaded machine.
ROUND_TRIP_BOUND = 5.0


@pytest.mark.timeout(60)
def test_idle_connections_from_one_address_are_capped_and_others_still_connect(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.max_connections_per_ip = PER_IP
        server.add_handler("echo", echo)
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        async with running(server, honest) as writers:
            addr = server.addresses[0]
            readers = []
            for _ in range(ATTACK_CONNECTIONS):
                reader, writer = await tls_connection(addr.host, addr.port, "127.0.0.2")
                readers.append(reader)
                if writer is not None:
                    writers.append(writer)
            closed = [c for c, _ in await asyncio.gather(*(closed_within(r, 2.0) for r in readers))]
            # Only PER_IP stay (idle, until the handshake deadline); the rest are refused at once.
            assert closed.count(False) == PER_IP, f"{closed.count(False)} idle connections kept"
            sid = await honest.connect(addr, timeout=ROUND_TRIP_BOUND)
            assert await honest.call(sid, "echo", "hi", timeout=ROUND_TRIP_BOUND) == "hi"

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_one_peer_id_cannot_open_unbounded_connections(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.max_connections_per_peer = PER_PEER
        server.add_handler("echo", echo)
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        async with running(server, honest, attacker):
            addr = server.addresses[0]
            opened, refusals = [], []
            for _ in range(PER_PEER + 5):
                try:
                    opened.append(await asyncio.wait_for(attacker.dial(addr, server.peer_id, bulk=True), 10))
                except HandshakeError as e:
                    refusals.append(str(e))
            assert len(opened) == PER_PEER, f"{len(opened)} connections accepted from one peer id"
            assert all("too many connections with" in r for r in refusals)
            sid = await honest.connect(addr, timeout=ROUND_TRIP_BOUND)
            assert await honest.call(sid, "echo", 1, timeout=ROUND_TRIP_BOUND) == 1
            assert await opened[0].call("echo", 2, timeout=ROUND_TRIP_BOUND) == 2  # the accepted ones work

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_stalled_handshakes_are_capped(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.max_pending_handshakes = 4
        async with running(server) as writers:
            addr = server.addresses[0]
            readers = []
            for i in range(10):
                reader, writer = await tls_connection(addr.host, addr.port, f"127.0.0.{10 + i}")
                readers.append(reader)
                if writer is not None:
                    writers.append(writer)
            closed = [c for c, _ in await asyncio.gather(*(closed_within(r, 2.0) for r in readers))]
            assert closed.count(False) == 4, f"{closed.count(False)} stalled handshakes kept"

    arun(main(), timeout=50)
