"""A caller that asks for probe replies and does not read them must not hold ours.

A pipeline node answers any peer's bandwidth probe with up to MAX_PROBE_BYTES of zeros; each
reply was a fresh 8 MiB tensor, and a caller that stopped reading kept every reply waiting for
its link: 200 requests of 69 bytes held 1.6 GB. Replies are now views of one buffer."""

from __future__ import annotations

import asyncio
import types

import pytest

from potluck.net.frames import Frame, Kind
from potluck.net.identity import Identity
from potluck.net.tcp import TCPTransport
from potluck.pipeline.messages import ProbeRequest
from potluck.pipeline.profiling import MAX_PROBE_BYTES, PROBE_METHOD, serve_probes
from tests.adversarial.scene import running

REQUESTS = 100
MiB = 2**20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MiB


@pytest.mark.timeout(60)
def test_probe_replies_a_caller_does_not_read_share_one_buffer(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
        async with running(server, attacker):
            serve_probes(types.SimpleNamespace(transport=server))
            await attacker.connect(server.addresses[0], timeout=10)
            (conn,) = attacker.open_connections()
            await asyncio.sleep(0.3)
            conn.link._transport.pause_reading()  # it asks, and stops reading
            before = rss_mib()
            for i in range(REQUESTS):
                await conn.link.send(Frame(Kind.REQUEST, 1 + 2 * i, {"m": PROBE_METHOD, "t": 600.0},
                                           body=ProbeRequest(MAX_PROBE_BYTES).to_wire()))
            await asyncio.sleep(2.0)
            served = next(c for c in server.open_connections() if c.peer_id == attacker.peer_id)
            assert len(served._serving) > REQUESTS // 2  # the replies are waiting for the caller
            grown = rss_mib() - before
            assert grown < REQUESTS * MAX_PROBE_BYTES / MiB / 4, f"{grown:.0f} MiB held for unread probe replies"
    arun(main(), timeout=50)
