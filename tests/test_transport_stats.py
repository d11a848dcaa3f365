"""`transport.stats`: bytes on the wire, counted on both sides of calls and streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.tcp import TCPTransport
from tests.peer_process import echo, sink

PAYLOAD = 100_000  # bytes of tensor per message: far above any frame's header


async def _exchange(a, b) -> None:
    """One call (a request and its echo) and one stream of three messages a -> b."""
    b.add_handler("echo", echo)
    b.add_stream_handler("sink", sink)
    payload = torch.zeros(PAYLOAD, dtype=torch.uint8)
    assert (await a.call(b.peer_id, "echo", payload, timeout=10)).numel() == PAYLOAD
    sent_before = a.stats.bytes_sent
    async with await a.open_stream(b.peer_id, "sink", timeout=10) as stream:
        for _ in range(3):
            await stream.send(payload)
        await stream.close()
        assert await stream.recv() == 3 * PAYLOAD
    assert a.stats.bytes_sent - sent_before >= 3 * PAYLOAD


def test_emulated_stats_count_both_sides_exactly() -> None:
    async def main():
        net = EmulatedNetwork(latency=0.01)
        a, b = net.transport(), net.transport()
        for t in (a, b):
            await t.start()
        a.add_addresses(b.peer_id, b.addresses)
        await _exchange(a, b)
        await asyncio.sleep(1)  # let the last frames (END, WINDOW) arrive
        # The call's request and echo, and the stream's 3 messages: 5 payloads, and headers.
        assert 5 * PAYLOAD <= a.stats.bytes_sent + a.stats.bytes_received < 5 * PAYLOAD + 10_000
        assert 4 * PAYLOAD <= a.stats.bytes_sent < 4 * PAYLOAD + 5_000
        # What one side sent is what the other received: same frames, same sizes.
        assert a.stats.bytes_sent == b.stats.bytes_received
        assert b.stats.bytes_sent == a.stats.bytes_received
        for t in (a, b):
            await t.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_tcp_stats_count_both_sides(arun) -> None:
    async def main():
        a = TCPTransport(Identity.generate(), host="127.0.0.1")
        b = TCPTransport(Identity.generate(), host="127.0.0.1")
        await a.start()
        await b.start()
        await a.connect(b.addresses[0])
        await _exchange(a, b)
        for _ in range(100):  # the stream's last small frames may still be in flight
            if a.stats.bytes_sent == b.stats.bytes_received and b.stats.bytes_sent == a.stats.bytes_received:
                break
            await asyncio.sleep(0.01)
        assert a.stats.bytes_sent == b.stats.bytes_received
        assert b.stats.bytes_sent == a.stats.bytes_received
        assert 4 * PAYLOAD <= a.stats.bytes_sent < 4 * PAYLOAD + 20_000
        assert PAYLOAD <= b.stats.bytes_sent < PAYLOAD + 20_000
        await a.close()
        await b.close()

    arun(main())
