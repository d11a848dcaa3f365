"""The all-reduce on slow links. Paced sends: a peer that knows its upload (`Averager(bandwidth=...)`)
shares it between the links with data waiting (`TransferStats.pace`, `TCPLink.pace`), so the
round's flows fill the uplink without overfilling its queue; each link is unpaced once the step is
over. Smaller chunks where the group's links are slow (`chunk_elements`), so the last result
does not crawl out long after the last piece came."""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.allreduce import CHUNK_ELEMENTS, AllReduceService, chunk_elements
from potluck.averaging.allreduce.member import MIN_CHUNK_ELEMENTS
from potluck.averaging.allreduce.transfer_stats import MIN_LINK_PACE, PACE_IDLE_BYTES, TransferStats
from potluck.compression import get_codec
from potluck.core.virtual_time import run_virtual
from potluck.net.identity import Identity
from potluck.net.tcp import TCPLink, TCPTransport
from potluck.net.tcp_sockets import PACED_QUEUE_MIN, PACED_QUEUE_SECONDS
from potluck.optim import Optimizer
from tests.emulated_swarm import make_swarm

MiB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
UNLIMITED = 2**32 - 1  # what the socket reads back once its pace is lifted (~0U)


class PacedLink:
    """A link that holds what it is given until `drain()`, and records its pace."""

    def __init__(self):
        self.written, self.queued, self.rates = 0, 0, []

    def unsent(self) -> int:
        return self.queued

    def pace(self, rate: float | None) -> None:
        self.rates.append(rate)

    def channel(self) -> SimpleNamespace:
        async def send(message):
            self.written += message["t"].numel() * 4
            self.queued += message["t"].numel() * 4
        return SimpleNamespace(loopback=False, connection=SimpleNamespace(link=self), send=send)


def test_a_known_upload_is_split_evenly_between_the_links_with_data_waiting():
    async def main():
        links = [PacedLink() for _ in range(3)]
        stats = TransferStats(pace=30e6)
        for link in links:
            await stats.send(link.channel(), {"t": torch.zeros(MiB // 4)})
        assert [link.rates[-1] for link in links] == [10e6] * 3
        links[0].queued = links[1].queued = PACE_IDLE_BYTES  # delivered but control frames
        stats.received(links[2].channel(), None, 0)  # any sample splits again
        assert [link.rates[-1] for link in links] == [30e6] * 3
        stats.unpace()
        assert [link.rates[-1] for link in links] == [None] * 3
        await stats.send(links[0].channel(), {"t": torch.zeros(MiB // 4)})  # a late send: stays unpaced
        assert links[0].rates[-1] is None
    run_virtual(main())


def test_no_link_is_paced_to_a_crawl_and_an_unknown_upload_paces_nothing():
    async def main():
        links = [PacedLink() for _ in range(8)]
        stats = TransferStats(pace=20e3)
        for link in links:
            await stats.send(link.channel(), {"t": torch.zeros(MiB // 4)})
        assert {link.rates[-1] for link in links} == {MIN_LINK_PACE}
        unpaced = PacedLink()
        measured = TransferStats()
        await measured.send(unpaced.channel(), {"t": torch.zeros(MiB // 4)})
        measured.unpace()
        assert unpaced.rates == []
    run_virtual(main())


def _pacing(sock: socket.socket) -> int:
    return struct.unpack("Q", sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8).ljust(8, b"\0"))[0]


@linux_only
def test_a_tcp_link_caps_its_socket_and_its_queues_and_lifts_the_caps():
    async def main():
        peers = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(2)]
        for p in peers:
            await p.start()

        async def echo(stream, ctx):
            await stream.send(await stream.recv())
        peers[1].add_stream_handler("echo", echo)
        try:
            await peers[0].connect(peers[1].addresses[0])
            stream = await peers[0].open_stream(peers[1].peer_id, "echo")
            link = stream.connection.link
            sock = link._transport.get_extra_info("socket")
            default_high = link._transport.get_write_buffer_limits()[1]
            link.pace(12.5e6)
            assert _pacing(sock) == 12_500_000
            # ... and queues 20 ms of that at most, in the kernel and in the transport's buffer
            queue = int(12.5e6 * PACED_QUEUE_SECONDS)
            assert sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == queue
            assert link._transport.get_write_buffer_limits()[1] == queue < default_high
            await stream.send(b"x" * 100_000)
            assert len(await stream.recv(timeout=10)) == 100_000
            link.pace(20e3)  # a crawl still queues a frame or two
            assert sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == PACED_QUEUE_MIN
            link.pace(None)
            assert _pacing(sock) in (UNLIMITED, 2**64 - 1)
            assert sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT) == 0  # the system's default again
            assert link._transport.get_write_buffer_limits()[1] == default_high
            await stream.close()
        finally:
            for p in peers:
                await p.close()
    asyncio.run(main())


@linux_only
@pytest.mark.timeout(60)
def test_peers_that_know_their_upload_pace_the_round_and_unpace_after(monkeypatch):
    """Three peers over TCP average 2M floats, each told a 50 MB/s link: the round's links are
    paced to shares of it while data waits, every link is unpaced when the step is over, and
    the average is exact."""
    calls: dict[int, list[float | None]] = {}
    links: dict[int, TCPLink] = {}
    real = TCPLink.pace

    def spy(self, rate):
        calls.setdefault(id(self), []).append(rate)
        links[id(self)] = self
        real(self, rate)
    monkeypatch.setattr(TCPLink, "pace", spy)
    peers = []
    try:
        for _ in range(3):
            peers.append(potluck.Peer(host="127.0.0.1", initial_peers=peers[0].addresses if peers else []))
        values = [torch.full((2_000_000,), float(i)) for i in range(3)]
        avgs = [Averager(p, [v], "paced", target_group_size=3, min_group_size=3, matchmaking_time=2.0,
                         bandwidth=(50e6, 80e6)) for p, v in zip(peers, values, strict=True)]
        assert (avgs[0].bandwidth, avgs[0].download_bandwidth) == (50e6, 80e6)
        results = [None] * 3

        def step(i):
            results[i] = avgs[i].step(timeout=30)
        threads = [threading.Thread(target=step, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        for a in avgs:
            with a.get_tensors() as tensors:
                assert torch.equal(tensors[0], torch.full((2_000_000,), 1.0))
        assert len(calls) == 12  # each of 3 peers: 2 links of its pieces and 2 of its results
        for rates in calls.values():
            assert rates[-1] is None
            assert all(50e6 / 4 <= r <= 50e6 for r in rates[:-1] if r is not None) and rates[0] is not None
        for link in links.values():
            sock = None if link._transport is None else link._transport.get_extra_info("socket")
            if sock is not None and sock.fileno() >= 0:
                assert _pacing(sock) in (UNLIMITED, 2**64 - 1)
        for a in avgs:
            a.shutdown()
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.parametrize("bandwidth", [0, -1.0, float("nan"), float("inf"), (1e6,), (1e6, 0), "fast", True])
def test_a_bandwidth_that_is_not_bytes_per_second_is_refused(bandwidth):
    peer = SimpleNamespace(transport=SimpleNamespace(peer_id="p", client_mode=False), dht=None)
    with pytest.raises((ValueError, TypeError), match="bandwidth"):
        Averager(peer, [torch.zeros(4)], "job", bandwidth=bandwidth)


def test_the_optimizer_gives_its_averagers_the_bandwidth_it_was_told():
    with potluck.Peer(host="127.0.0.1") as peer:
        param = torch.nn.Parameter(torch.zeros(3))
        opt = Optimizer(peer, "told", [param], lambda p: torch.optim.SGD(p, 0.1), batch_size_per_step=1,
                        target_batch_size=2, bandwidth=(2.5e6, 12.5e6), start=False)
        state = opt.context.state.averager
        assert (state.bandwidth, state.download_bandwidth) == (2.5e6, 12.5e6)
        assert opt.context.settings.averaging()["bandwidth"] == (2.5e6, 12.5e6)
        opt.shutdown()
        with pytest.raises(ValueError, match="bandwidth"):
            Optimizer(peer, "told", [param], lambda p: torch.optim.SGD(p, 0.1), batch_size_per_step=1,
                      target_batch_size=2, bandwidth=0, start=False)


def test_a_group_on_slow_links_streams_smaller_chunks_and_every_member_picks_the_same():
    assert chunk_elements([(100e6, 100e6)] * 4) == CHUNK_ELEMENTS  # the default estimate: as before
    assert chunk_elements([(1e9, 1e9)] * 16) == CHUNK_ELEMENTS
    assert chunk_elements([(12.5e6, 12.5e6)] * 4) == 2**16  # 100 Mbit/s: 256 KiB in 0.13 s of a sixth
    assert chunk_elements([(12.5e6, 12.5e6)] * 3 + [(2.5e6, 12.5e6)]) == MIN_CHUNK_ELEMENTS
    assert chunk_elements([(1.0, 1.0)] * 4) == MIN_CHUNK_ELEMENTS
    assert chunk_elements([(1.0, 1.0)]) == CHUNK_ELEMENTS  # alone: nothing streamed
    # a codec's chunk takes as long on the wire: 8x the float32 elements under 4 bits (capped)
    assert chunk_elements([(12.5e6, 12.5e6)] * 4, get_codec("blockwise8").wire_bytes) == 2**18
    assert chunk_elements([(12.5e6, 12.5e6)] * 3 + [(2.5e6, 12.5e6)], get_codec("blockwise4").wire_bytes) == 2**16
    assert chunk_elements([(12.5e6, 12.5e6)] * 3 + [(2.5e6, 12.5e6)], get_codec("none").wire_bytes) \
        == MIN_CHUNK_ELEMENTS
    # and a shard in at least PIPELINE_CHUNKS chunks, so that its results stream while pieces come
    assert chunk_elements([(12.5e6, 12.5e6)] * 4, 1.0, shard=250_000) == 2**16
    assert chunk_elements([(12.5e6, 12.5e6)] * 4, 1.0, shard=1_640_000) == 2**18
    assert chunk_elements([(100e6, 100e6)] * 4, 4.0, shard=10_000) == MIN_CHUNK_ELEMENTS


@pytest.mark.parametrize(("keep_sealed", "compression", "floats", "chunk"),
                         [(False, "none", 10**6, 2**16), (True, "none", 10**6, CHUNK_ELEMENTS),
                          (False, "blockwise4", 10**6, 2**16), (False, "blockwise4", 4 * 10**6, 2**18)])
def test_averagers_told_a_slow_link_average_exactly_in_smaller_chunks(monkeypatch, keep_sealed, compression,
                                                                       floats, chunk):
    """Four peers told 100 Mbit/s links average 1M floats: their all-reduce streams chunks of
    2^16 elements, and the mean is exact; under 4 bits a chunk's bytes take as long with 8x the
    elements (capped at CHUNK_ELEMENTS), where the shards are big enough to be cut in
    PIPELINE_CHUNKS of them. Verified training's averagers (`keep_sealed`) keep the default
    chunk: their accusations locate blocks by it."""
    chunks = []
    real = AllReduceService.run

    async def spy(self, *args, **kwargs):
        chunks.append(kwargs.get("chunk"))
        return await real(self, *args, **kwargs)
    monkeypatch.setattr(AllReduceService, "run", spy)

    async def main():
        net, peers = await make_swarm(4, bandwidth=12.5e6, latency=0.025)
        values = [torch.randn(floats, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        avgs = [Averager(p, [v], "slow", target_group_size=4, min_group_size=4, matchmaking_time=1.0,
                         bandwidth=12.5e6, keep_sealed=keep_sealed, compression=compression)
                for p, v in zip(peers, values, strict=True)]
        await asyncio.gather(*(a.astep() for a in avgs))
        expected = torch.stack(values).mean(0)
        for a in avgs:  # (4-bit codes: within a seventh of a block's absmax, there about 5)
            torch.testing.assert_close(a._tensors[0], expected, rtol=0, atol=1e-6 if compression == "none" else 0.8)
            assert torch.equal(a._tensors[0], avgs[0]._tensors[0])
        assert chunks == [chunk] * 4
    run_virtual(main())
