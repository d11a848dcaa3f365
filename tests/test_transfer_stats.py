"""A member's upload estimate (`TransferStats`) counts what its links delivered, not what their
buffers took: over TCP a send returns once up to 8 MiB of transport buffer and the kernel's send
queue hold the bytes, and counting those measured 13-50x the link (benchmarks/wan.py)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import torch

from potluck.averaging.allreduce.transfer_stats import TransferStats
from potluck.core import compat
from potluck.core.virtual_time import run_virtual
from potluck.net.identity import Identity
from potluck.net.tcp import WRITE_HIGH_WATER, TCPTransport

MiB = 2**20


class BufferedLink:
    """A link whose sends return at once into a buffer that drains at `rate` bytes/s."""

    def __init__(self, rate: float):
        self.rate, self.queued, self.since, self.written = rate, 0.0, 0.0, 0

    def _drain(self) -> None:
        now = asyncio.get_running_loop().time()
        self.queued = max(0.0, self.queued - (now - self.since) * self.rate)
        self.since = now

    def unsent(self) -> int:
        self._drain()
        return int(self.queued)

    async def send(self, nbytes: int) -> None:
        self._drain()
        self.queued += nbytes
        self.written += nbytes
        await asyncio.sleep(0.001)  # taking the bytes into the buffer


def test_upload_counts_the_bytes_a_buffered_link_delivered_not_what_its_buffer_took():
    async def main():
        link = BufferedLink(rate=10 * MiB)
        channel = SimpleNamespace(loopback=False, connection=SimpleNamespace(link=link))
        channel.send = lambda message: link.send(message["t"].numel() * 4)
        stats = TransferStats()
        for _ in range(8):  # 8 MiB handed over in about 8 ms; the link delivers 10 MiB/s
            await stats.send(channel, {"t": torch.zeros(MiB // 4)})
        for _ in range(60):  # chunks arrive while the buffer drains (each a sample)
            await asyncio.sleep(0.01)
            stats.received(channel, None, 0)
        await asyncio.sleep(0.5)  # idle, then one more send
        await stats.send(channel, {"t": torch.zeros(MiB // 4)})
        assert stats.sent_bytes == 9 * MiB
        # Timing the sends would say 9 MiB in 9 ms: 1 GiB/s.
        assert 9.5 * MiB < stats.upload < 10.5 * MiB
        assert 5 * MiB < stats.delivered_bytes < 8 * MiB  # (the stretch in which it drained is not counted)
    run_virtual(main())


def test_a_link_without_buffers_of_its_own_counts_every_byte_sent():
    async def main():
        async def send(message):
            await asyncio.sleep(0.1)  # the emulated network: a send returns once uploaded
        channel = SimpleNamespace(loopback=False, connection=SimpleNamespace(link=object()), send=send)
        stats = TransferStats()
        await stats.send(channel, {"t": torch.zeros(MiB // 4)})
        assert stats.delivered_bytes == MiB and abs(stats.upload - 10 * MiB) < 1e-6 * MiB
    run_virtual(main())


def test_a_tcp_link_reports_the_bytes_its_peer_has_not_acknowledged():
    """The receiver stops reading: what the sender's send took stays in its buffers, and
    `unsent()` says so; once the receiver reads again it falls to 0."""
    async def main():
        peers = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(2)]
        for p in peers:
            await p.start()
        resume = asyncio.Event()

        async def sink(stream, ctx):
            transport = stream.connection.link._transport
            transport.pause_reading()
            await stream.send("paused")
            await resume.wait()
            transport.resume_reading()
            with contextlib.suppress(Exception):
                while True:
                    await stream.recv()
        peers[1].add_stream_handler("sink", sink)
        try:
            await peers[0].connect(peers[1].addresses[0])
            stream = await peers[0].open_stream(peers[1].peer_id, "sink")
            assert await stream.recv(timeout=10) == "paused"
            link = stream.connection.link
            stats = TransferStats()
            for _ in range(3):  # 1.5 MiB in all: under the high-water mark, so each send returns
                await stats.send(stream, {"t": torch.zeros(WRITE_HIGH_WATER // 16)})
            assert link.unsent() > 1 * MiB  # the receiver's kernel took at most a few hundred KiB
            assert stats.delivered_bytes < 1 * MiB
            resume.set()
            async with compat.timeout(10):
                while link.unsent():
                    await asyncio.sleep(0.01)  # nothing to wait on: the kernel's queue is polled
            await stream.close()
        finally:
            for p in peers:
                await p.close()
    asyncio.run(main())
