"""Messages waiting in the streams a peer serves are counted like requests: per peer id, per IP
and subnet and in all (`net.connection.call_shares`).

Each stream buffers up to its window (16 MiB) of messages its handler has not read, and a peer
may have 1,056 calls (streams included) in progress: before, the bytes waiting in those windows
were counted nowhere, so made-up ids of one host opening streams to a handler that reads late
(an all-reduce part waits up to 10 s for its step to start here) made a peer hold a window per
stream (256 early streams per IP: 4 GiB). Now a message over its origin's share fails its stream
with a "busy" error. Here the caps and the window are lowered so the test is light."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from potluck.core.errors import NetworkError, PotluckError
from potluck.net import Identity, TCPTransport, connection
from tests.adversarial.scene import running

MiB = 2**20
WINDOW = 4 * MiB
IDS = 4
STREAMS_PER_ID = 4
SHARE = 16 * MiB


@pytest.fixture
def small_shares(monkeypatch):
    monkeypatch.setattr(connection, "STREAM_WINDOW", WINDOW)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES", SHARE)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_REQUEST_BYTES_PER_PEER", SHARE)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES_PER_IP", SHARE, raising=False)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES_PER_SUBNET", SHARE, raising=False)
    monkeypatch.setattr(connection, "MAX_INFLIGHT_BYTES", 2 * SHARE, raising=False)


def _waiting(server: TCPTransport, ids: set) -> int:
    """Bytes of messages waiting in the streams `server` holds with the peers `ids`."""
    return sum(frame.size for c in server.open_connections() if c.peer_id in ids
               for stream in c._streams.values() for frame in stream._inbox)


@contextlib.asynccontextmanager
async def _server_and_client(method: str, handler):
    """A server on 127.0.1.1 serving the stream `method`, and a client connected to it."""
    server = TCPTransport(Identity.generate(), host="127.0.1.1")
    client = TCPTransport(Identity.generate(), host="127.0.0.1")
    server.add_stream_handler(method, handler)
    async with running(server, client):
        yield server, client, await client.connect(server.addresses[0], timeout=10)


@pytest.mark.timeout(90)
def test_messages_waiting_in_streams_of_made_up_ids_of_one_host_are_capped_per_ip(arun, small_shares):
    release = asyncio.Event()

    async def late(stream, ctx):  # reads nothing until released, as a part waiting for its step
        await release.wait()

    async def echo(stream, ctx):
        async for message in stream:
            await stream.send(message)

    async def main():
        server = TCPTransport(Identity.generate(), host="127.0.1.1")
        honest = TCPTransport(Identity.generate(), host="127.0.2.1")
        server.add_stream_handler("late", late)
        server.add_stream_handler("echo", echo)
        fakes = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(IDS)]
        async with running(server, honest, *fakes):
            sid = None
            for fake in fakes:
                sid = await fake.connect(server.addresses[0], timeout=10)
            try:
                streams = []
                for fake in fakes:
                    for _ in range(STREAMS_PER_ID):
                        streams.append(stream := await fake.open_stream(sid, "late", timeout=30))
                        with contextlib.suppress(NetworkError, PotluckError):  # refused meanwhile
                            for _ in range(WINDOW // MiB - 1):  # a window's worth, less its headers
                                await stream.send(torch.ones(MiB // 4), timeout=5)
                await asyncio.sleep(1.0)
                held = _waiting(server, {fake.peer_id for fake in fakes})
                assert held <= SHARE, (f"{IDS} ids of one host have {held / MiB:.0f} MiB waiting in streams "
                                       f"(its share: {SHARE / MiB:.0f} MiB)")
                refused = [s for s in streams if s.finished]
                assert refused and all("Busy" in str(s._error) for s in refused)
                await honest.connect(server.addresses[0], timeout=10)
                async with await honest.open_stream(sid, "echo", timeout=30) as stream:
                    big = torch.arange(MiB // 2, dtype=torch.float32)
                    await stream.send(big, timeout=10)
                    assert torch.equal(await stream.recv(timeout=10), big)
            finally:
                release.set()

    arun(main(), timeout=80)


@pytest.mark.timeout(60)
def test_what_streams_hold_is_given_back_when_read_aborted_or_lost(arun, small_shares):
    release = asyncio.Event()

    async def reader(stream, ctx):
        await release.wait()
        await stream.recv()  # one read, the rest left when the handler ends

    async def main():
        async with _server_and_client("reader", reader) as (server, client, sid):
            calls, nbytes = server._call_shares
            for ending in ("handler ends", "abort", "lost"):
                release.clear()
                stream = await client.open_stream(sid, "reader", timeout=30)
                for _ in range(3):
                    await stream.send(torch.ones(MiB // 4), timeout=5)
                await asyncio.sleep(0.3)
                assert nbytes.held_by_peer(client.peer_id) >= 3 * MiB
                if ending == "abort":
                    stream.abort()
                elif ending == "lost":
                    for conn in client.open_connections():
                        conn.close()
                release.set()
                for _ in range(50):
                    if not nbytes.held and not calls.held:
                        break
                    await asyncio.sleep(0.1)
                assert not nbytes.counted() and not calls.counted(), ending
                if ending == "lost":
                    break

    arun(main(), timeout=50)


@pytest.mark.timeout(60)
def test_a_stream_that_ended_with_an_error_gives_back_its_unread_messages_when_aborted(arun, small_shares):
    """The other side ends a stream with an error while messages it sent wait unread here; the
    caller's `async with` then aborts it: those messages no longer count against that peer (they
    stayed counted for the connection's life, and its share shrank with every such stream)."""
    async def fail_after_sending(stream, ctx):
        for _ in range(3):
            await stream.send(torch.ones(MiB // 4))
        raise RuntimeError("the handler gives up")

    async def main():
        async with _server_and_client("fails", fail_after_sending) as (_, client, sid):
            with contextlib.suppress(RuntimeError):
                async with await client.open_stream(sid, "fails", timeout=30) as stream:
                    await asyncio.sleep(0.5)  # its messages and its error are in
                    assert stream._error is not None and stream._inbox
                    raise RuntimeError("the caller gives up too")
            conn = stream.connection
            assert conn._inflight_bytes == 0 and stream.call_id not in conn._streams

    arun(main(), timeout=50)
