"""A message of nothing but empty msgpack arrays cannot make a peer build millions of Python
objects (issue 14: one 16 MiB HELLO header of empty arrays cost 5 s of CPU and +1.2 GB, and froze
the peer for everyone meanwhile).

Before the handshake such a frame is now refused by its size (see
test_frames_before_the_handshake). After it, decoding has a budget proportional to the bytes
received (`serialization.DECODE_FREE_CONTAINERS` + 1 container per `BYTES_PER_CONTAINER` bytes):
it stops as soon as the budget is spent, and the sender's connection is closed as a protocol
error. Here an authenticated peer sends a 4 MiB request body of 4 M empty arrays (the old code
built all 4 M lists: ~260 MiB)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import msgpack
import pytest

from potluck.core.errors import ProtocolError
from potluck.net import Identity, TCPTransport
from potluck.net.frames import PREFIX, VERSION, FrameDecoder, Kind

MiB = 2**20
BODY = 4 * MiB
# What decoding the hostile frame may cost in Python allocations: the frame's own bytes held a
# few times over (receive buffer, header, body) plus what the budget lets it build (512 K lists,
# ~32 MiB). The old code: 4 M lists, ~260 MiB.
MEMORY_BOUND = 96 * MiB
# A legitimate call after the attack: generous for a loaded 2-core machine under tracemalloc.
ROUND_TRIP_BOUND = 10.0


async def echo(request, ctx):
    return request


def _empty_arrays_frame(n: int) -> bytes:
    body = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n  # array32 of n empty arrays
    header = msgpack.packb([1, {"m": "echo", "t": 5}, [], body], use_bin_type=True)
    return PREFIX.pack(VERSION, Kind.REQUEST, 0, len(header), 0) + header


def test_a_body_of_empty_arrays_is_refused_within_its_budget():
    """The decoder alone: refuses the frame, having built a bounded number of objects."""
    frame = _empty_arrays_frame(BODY)
    decoder = FrameDecoder(64 * MiB)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(ProtocolError, match="arrays and maps"):
            decoder.feed(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < MEMORY_BOUND, f"decoding cost {(peak - before) / MiB:.0f} MiB"


def test_budget_keeps_ordinary_messages_decodable():
    import torch

    from potluck.core import serialization

    state = {f"layer{i}": {"w": torch.zeros(()), "step": i, "name": "adam"} for i in range(5000)}
    packed = serialization.pack([state, [[i, i + 1] for i in range(1000)]])
    decoder = FrameDecoder(64 * MiB)
    header = msgpack.packb([1, None, packed.specs, packed.body], use_bin_type=True)
    payload = b"".join(bytes(b) for b in packed.buffers)
    (frame,) = decoder.feed(PREFIX.pack(VERSION, Kind.REQUEST, 0, len(header), len(payload)) + header + payload)
    assert len(frame.body[0]) == 5000 and frame.body[1][999] == [999, 1000]


@pytest.mark.timeout(120)
def test_an_authenticated_peer_sending_empty_arrays_is_cut_off_and_others_keep_working(arun):
    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.0.1")
        server.add_handler("echo", echo)
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1")
        for t in (server, honest, attacker):
            await t.start()
        try:
            sid = await honest.connect(server.addresses[0], timeout=10)
            await attacker.connect(server.addresses[0], timeout=10)
            assert await honest.call(sid, "echo", "before", timeout=10) == "before"
            (conn,) = attacker.open_connections()
            frame = _empty_arrays_frame(BODY)
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                conn.link._write_now([frame])  # raw bytes on the authenticated connection
                deadline = time.monotonic() + 60
                while not conn.closed and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                start = time.monotonic()
                assert await honest.call(sid, "echo", "after", timeout=ROUND_TRIP_BOUND) == "after"
                round_trip = time.monotonic() - start
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert conn.closed and "arrays and maps" in (conn.close_reason or "")
            assert peak - before < MEMORY_BOUND, f"the attack cost {(peak - before) / MiB:.0f} MiB"
            assert round_trip < ROUND_TRIP_BOUND
        finally:
            for t in (attacker, honest, server):
                await t.close()

    arun(main(), timeout=110)
