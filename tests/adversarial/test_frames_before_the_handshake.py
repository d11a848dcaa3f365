"""A stranger cannot make a peer allocate what it has not sent (issue 14, "Before authentication":
16 bytes after the TLS handshake announcing a 64 MiB header made the server allocate 64 MiB at
once, and hold it for the 10 s handshake deadline; 12 such connections cost +770 MiB).

Now a frame before the handshake may be at most `HANDSHAKE_MAX_FRAME` (8 KiB): a larger one is
refused as soon as its 16-byte prefix arrives, and the decoder's buffer grows only as bytes come
in, whatever a prefix announces."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest

from potluck.net import Identity, TCPTransport
from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE, PREFIX, VERSION, FrameDecoder, Kind
from tests.adversarial.scene import closed_within, echo, running, tls_connection

MiB = 2**20
ATTACKERS = 4  # 4 x 64 MiB is enough to show the old behaviour without exhausting a test machine
# What the attack may cost the server in Python allocations while it lasts (the old code: 64 MiB
# per attacker). The honest round trips and the attackers' own buffers fit well within this.
MEMORY_BOUND = 8 * MiB
# A legitimate call during the attack: milliseconds normally; generous for a loaded 2-core machine.
ROUND_TRIP_BOUND = 5.0


@pytest.mark.timeout(60)
def test_announced_64_mib_headers_before_the_handshake_allocate_nothing(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.add_handler("echo", echo)
        client = TCPTransport(Identity.generate(), host="127.0.0.1")
        async with running(server, client) as writers:
            server_id = await client.connect(server.addresses[0], timeout=10)
            addr = server.addresses[0]
            assert await client.call(server_id, "echo", "warm", timeout=10) == "warm"
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                readers = []
                for _ in range(ATTACKERS):
                    reader, writer = await tls_connection(addr.host, addr.port)
                    assert writer is not None, "the server refused a TLS connection"
                    # 16 bytes: a HELLO whose header is announced as (almost) 64 MiB.
                    writer.write(PREFIX.pack(VERSION, Kind.HELLO, 0, DEFAULT_MAX_FRAME_SIZE - PREFIX.size, 0))
                    await writer.drain()
                    readers.append(reader)
                    writers.append(writer)
                await asyncio.sleep(0.5)  # the server has read every prefix by now
                start = time.monotonic()
                assert await client.call(server_id, "echo", "during", timeout=ROUND_TRIP_BOUND) == "during"
                round_trip = time.monotonic() - start
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak - before < MEMORY_BOUND, f"the attack cost {(peak - before) / MiB:.0f} MiB"
            assert round_trip < ROUND_TRIP_BOUND
            # Refused at once, not held until the handshake deadline (10 s).
            for reader in readers:
                assert (await closed_within(reader, 5.0))[0]

    arun(main(), timeout=50)


def test_a_frame_buffer_grows_only_as_its_bytes_arrive():
    """The decoder itself (no sockets), even with the authenticated 64 MiB frame limit: a prefix
    announcing a 32 MiB header allocates nothing of it; 1 MiB of header costs a few MiB."""
    decoder = FrameDecoder(DEFAULT_MAX_FRAME_SIZE)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert decoder.feed(PREFIX.pack(VERSION, Kind.REQUEST, 0, 32 * MiB, 0)) == []
        _, peak_after_prefix = tracemalloc.get_traced_memory()
        chunk = b"\x00" * (64 * 1024)
        for _ in range(16):
            assert decoder.feed(chunk) == []
        _, peak_after_one_mib = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_after_prefix - before < 1 * MiB
    # The buffer at most doubles past the received MiB, and while it grows the old and the new
    # one exist together: at most ~3 MiB, against 32 MiB at once before.
    assert peak_after_one_mib - before < 5 * MiB
