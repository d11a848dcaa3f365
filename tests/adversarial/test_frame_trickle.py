"""A peer that trickles a frame must not hold it half-received for good.

Any byte counts as proof of life for the keepalive (a large frame on a slow link takes longer
than its timeout), so a peer that sent most of a large frame and then one byte just inside every
keepalive timeout kept the connection, and the frame's buffer, forever. A frame on its way must
now come at `net.frames.MIN_FRAME_RATE` on average once it has been arriving for
`FRAME_GRACE_SECONDS`, so it is held at most its size over that rate (68 minutes for 64 MiB at
16 KiB/s). Here the rate is raised to 4 MiB/s and the grace cut to 1 s, so that a 4 MiB frame
sent but for its last 100 bytes, then trickled, is dropped within a few seconds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.net import Identity, TCPTransport, frames
from potluck.net.frames import Frame, Kind, encode
from tests.adversarial.scene import running


@pytest.mark.timeout(60)
def test_a_frame_trickled_a_byte_at_a_time_is_dropped_with_its_connection(arun, monkeypatch):
    monkeypatch.setattr(frames, "FRAME_GRACE_SECONDS", 1.0, raising=False)
    monkeypatch.setattr(frames, "MIN_FRAME_RATE", 4 * 2**20, raising=False)

    async def main():
        victim = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=0.2, keepalive_timeout=1.0)
        attacker = TCPTransport(Identity.generate(), host="127.0.0.1", keepalive_interval=None)
        honest = TCPTransport(Identity.generate(), host="127.0.0.1")
        victim.add_handler("echo", lambda request, ctx: asyncio.sleep(0, request))
        async with running(victim, attacker, honest):
            victim_id = await attacker.connect(victim.addresses[0], timeout=10)
            conn = attacker._shared[victim_id][0]
            conn.link.send_nowait = lambda frame: None  # it never answers the victim's pings
            frame = encode(Frame(Kind.REQUEST, 1, {"m": "echo", "t": None}, body=torch.ones(2**20)))
            data = b"".join(bytes(memoryview(b).cast("B")) for b in frame)
            conn.link._transport.write(data[:-100])  # nearly all of a 4 MiB frame, then a byte at a time
            for i in range(30):
                await asyncio.sleep(0.3)  # well inside the 1 s keepalive timeout
                if not victim.open_connections():
                    break
                conn.link._transport.write(data[-100 + i:-99 + i])
            assert not victim.open_connections(), "the victim still holds the trickled frame's connection"
            await honest.connect(victim.addresses[0], timeout=10)
            assert await honest.call(victim_id, "echo", 7, timeout=10) == 7  # the victim keeps serving
    arun(main(), timeout=50)
