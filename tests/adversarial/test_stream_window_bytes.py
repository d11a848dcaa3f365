"""A stream's window bounds the bytes a receiver holds, not the number of messages (issue 14: the
window counted messages, so 40 x 32 MiB frames on one stream cost +1.3 GB).

A peer that ignores flow control is now cut off: a DATA frame that arrives while a full window
(`connection.STREAM_WINDOW`, 16 MiB) is unacknowledged is a protocol error that closes the
connection. Here an authenticated peer opens a stream to a handler that does not read yet and
pushes 12 x 8 MiB frames past the window (the old code queued all 96 MiB)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from potluck.core.errors import NetworkError
from potluck.net.frames import Frame, Kind
from tests.adversarial.scene import attacked_server

MiB = 2**20
FRAMES = 12
FRAME_BYTES = 8 * MiB
# Resident memory the attack may add to the process (both ends live in it): the window and the
# frame that overran it, received, plus the attacker's one reused tensor. The old code: 96 MiB
# queued at the receiver.
RSS_BOUND = 48 * MiB
ROUND_TRIP_BOUND = 5.0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(60)
def test_frames_past_the_byte_window_close_the_connection_and_hold_no_memory(arun):
    async def main():
        release = asyncio.Event()

        async def slow_sink(stream, ctx):
            await release.wait()  # does not read until the test is done
            async for _ in stream:
                pass

        async with attacked_server(stream_handlers={"sink": slow_sink}) as (server, attacker, honest, sid):
            try:
                (conn,) = attacker.open_connections()
                stream = await conn.open_stream("sink", timeout=30)
                chunk = torch.ones(FRAME_BYTES // 4)
                await asyncio.sleep(0.2)
                before = _rss()
                sent = 0
                try:
                    for _ in range(FRAMES):  # straight to the link: no waiting for window credit
                        await asyncio.wait_for(conn.link.send(Frame(Kind.DATA, stream.call_id, body=chunk)), 10)
                        sent += 1
                except NetworkError:
                    pass
                deadline = time.monotonic() + 10
                while not conn.closed and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # whatever was still on the wire is read by now
                grown = _rss() - before
                assert await honest.call(sid, "echo", "ok", timeout=ROUND_TRIP_BOUND) == "ok"
                assert grown < RSS_BOUND, f"the attack added {grown / MiB:.0f} MiB of resident memory"
                assert conn.closed and "window overrun" in (conn.close_reason or ""), (sent, conn.close_reason)
            finally:
                release.set()

    arun(main(), timeout=50)
