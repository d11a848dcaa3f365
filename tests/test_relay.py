"""Circuit relays (net.relay): a peer reachable only through a relay serves calls and bulk streams,
end-to-end TLS keeps the relay from reading or altering them, and a dead relay is replaced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from potluck.core import compat
from potluck.core.errors import ConnectionLost, NetworkError
from potluck.core.virtual_time import run_virtual
from potluck.net.connection import CallContext, Stream
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.relay import RELAY_HOP, RELAY_STOP, RelayLimits, RelayService, reserve
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport
from tests.test_lifetimes import cyclic_garbage, free_port, gc_saving_garbage, open_and_close_many

MiB = 2**20
MARKER = "secret-marker-7f3a"
# A deadline for what must happen promptly (a relay's death noticed); generous, never reached.
PROMPT = 10.0


async def echo(request: Any, ctx: CallContext) -> Any:
    return {"echo": request, "relayed": ctx.connection.relayed}


async def download(stream: Stream, ctx: CallContext) -> None:
    """Send `n` chunks of `size` bytes (chunk i is filled with i % 256), one per request message."""
    n, size = stream.request["n"], stream.request["size"]
    for i in range(n):
        await stream.send(bytes([i % 256]) * size)
        if stream.request.get("paced"):
            await stream.recv()  # the caller asks for each chunk after the first


def serving(t: Transport) -> Transport:
    t.add_handler("echo", echo)
    t.add_stream_handler("download", download)
    return t


@contextlib.asynccontextmanager
async def tcp_peers(n: int, insecure: bool = False, punch: bool = False) -> AsyncIterator[list[TCPTransport]]:
    """`n` started transports on 127.0.0.1; without `punch` relayed connections stay relayed (these
    tests watch the relay carry the traffic)."""
    peers = [TCPTransport(Identity.generate(), host="127.0.0.1", insecure=insecure) for _ in range(n)]
    for p in peers:
        p.puncher.auto = punch
        await p.start()
    try:
        yield peers
    finally:
        for p in reversed(peers):
            await p.close()


async def reserved_on(peer: Transport, relay: Transport) -> list:
    """`peer` connects to `relay`, reserves, and is known to others only by its circuit addresses."""
    await peer.connect(relay.addresses[0])
    return (await reserve(peer, relay.peer_id)).addresses


@contextlib.contextmanager
def tap(relay: Transport, flip_after: list[int] | None = None) -> Any:
    """Record the bytes `relay` pipes (what it sends on relay streams); with `flip_after` = [k],
    flip one bit of every chunk it forwards once k more chunks went by."""
    seen: list[bytes] = []
    original = Stream.send

    async def send(self: Stream, message: Any, timeout: float | None = None) -> None:
        if self.method in (RELAY_HOP, RELAY_STOP) and self.connection in relay.open_connections() \
                and isinstance(message, bytes):
            seen.append(message)
            if flip_after is not None:
                flip_after[0] -= 1
                if flip_after[0] < 0:
                    message = bytes([message[0] ^ 1]) + message[1:]
        await original(self, message, timeout)

    Stream.send = send  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Stream.send = original  # type: ignore[method-assign]


async def fetch(t: Transport, peer: Any, n: int, size: int) -> list[bytes]:
    stream = await t.open_stream(peer, "download", {"n": n, "size": size}, timeout=PROMPT)
    return [chunk async for chunk in stream]


def test_tcp_calls_and_bulk_streams_through_a_relay_in_tls_the_relay_cannot_read() -> None:
    async def main() -> None:
        async with tcp_peers(3) as (relay, target, dialer):
            RelayService(relay).start()
            serving(target)
            circuits = await reserved_on(target, relay)
            assert circuits[0].is_circuit and circuits[0].peer_id == target.peer_id
            dialer.add_addresses(target.peer_id, circuits)  # its direct listener is never told
            with tap(relay) as seen:
                reply = await dialer.call(target.peer_id, "echo", MARKER, timeout=PROMPT)
                chunks = await fetch(dialer, target.peer_id, 8, MiB)
            assert reply == {"echo": MARKER, "relayed": True}
            assert chunks == [bytes([i]) * MiB for i in range(8)]
            piped = b"".join(seen)
            assert len(piped) > 8 * MiB  # the bulk bytes went through the relay ...
            assert MARKER.encode() not in piped and bytes([5]) * 64 not in piped  # ... encrypted
            assert all(c.relayed for c in dialer.open_connections() if c.peer_id == target.peer_id)

    asyncio.run(main())


def test_tcp_a_relay_that_alters_a_byte_breaks_the_connection_instead_of_delivering_it() -> None:
    async def main() -> None:
        async with tcp_peers(3) as (relay, target, dialer):
            RelayService(relay).start()
            serving(target)
            dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
            assert (await dialer.call(target.peer_id, "echo", "hi", timeout=PROMPT))["echo"] == "hi"
            with tap(relay, flip_after=[0]), pytest.raises(ConnectionLost):
                await dialer.call(target.peer_id, "echo", MARKER, timeout=PROMPT)

    asyncio.run(main())


@pytest.mark.parametrize("insecure", [False, True])
def test_tcp_relay_dies_mid_stream_then_the_target_reserves_on_another(insecure: bool) -> None:
    async def main() -> None:
        async with tcp_peers(4, insecure) as (relay, relay2, target, dialer):
            RelayService(relay).start()
            RelayService(relay2).start()
            serving(target)
            dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
            stream = await dialer.open_stream(target.peer_id, "download",
                                              {"n": 100, "size": 1024, "paced": True}, timeout=PROMPT)
            assert await stream.recv() == bytes([0]) * 1024
            await relay.close()
            with pytest.raises(ConnectionLost):
                async with compat.timeout(PROMPT):
                    while True:
                        await stream.send("next")
                        await stream.recv()
            dialer.add_addresses(target.peer_id, await reserved_on(target, relay2))
            assert await fetch(dialer, target.peer_id, 2, 1000) == [bytes([0]) * 1000, bytes([1]) * 1000]

    asyncio.run(main())


def test_emulated_calls_streams_and_a_relay_crash_on_the_virtual_clock() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        relay, relay2, dialer = (net.transport() for _ in range(3))
        target = serving(net.transport(client_mode=True))  # never listens: reachable only through relays
        for t in (relay, relay2, target, dialer):
            await t.start()
        RelayService(relay).start()
        RelayService(relay2).start()
        dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
        assert await dialer.call(target.peer_id, "echo", "hi", timeout=PROMPT) == {"echo": "hi", "relayed": True}
        assert await fetch(dialer, target.peer_id, 3, MiB) == [bytes([i]) * MiB for i in range(3)]
        stream = await dialer.open_stream(target.peer_id, "download",
                                          {"n": 100, "size": 1024, "paced": True}, timeout=PROMPT)
        await stream.recv()
        net.crash(relay.peer_id)
        started = asyncio.get_running_loop().time()
        with pytest.raises(NetworkError):
            while True:
                await stream.send("next")
                await stream.recv()
        assert asyncio.get_running_loop().time() - started < 1.0  # the reset is noticed at once
        dialer.add_addresses(target.peer_id, await reserved_on(target, relay2))
        assert await dialer.call(target.peer_id, "echo", "again", timeout=PROMPT) == {"echo": "again", "relayed": True}
        for t in (dialer, target, relay2):
            await t.close()

    run_virtual(main())


def test_emulated_a_limited_relay_carries_a_punchs_worth_for_a_short_while_and_says_why_it_ends() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        relay, dialer = net.transport(), net.transport()
        target = serving(net.transport(client_mode=True))  # reachable only through the relay
        for t in (relay, target, dialer):
            await t.start()
        limits = RelayLimits.limited()
        RelayService(relay, limits).start()
        dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
        assert await dialer.call(target.peer_id, "echo", "hi", timeout=PROMPT) == {"echo": "hi", "relayed": True}
        # More than a circuit may carry each way: the circuit ends, with a reason that says what to do.
        with pytest.raises(NetworkError, match="this relay is limited: a circuit carries 131072 bytes each way"):
            await fetch(dialer, target.peer_id, 2, limits.circuit_bytes)
        # A new circuit carries calls (keepalives keep it from idling) until its time is up.
        assert await dialer.call(target.peer_id, "echo", "again", timeout=PROMPT) == {"echo": "again", "relayed": True}
        relayed = [c for c in dialer.open_connections() if c.relayed and c.peer_id == target.peer_id]
        await asyncio.sleep(limits.circuit_seconds / 2)
        assert not any(c.closed for c in relayed)
        await asyncio.sleep(limits.circuit_seconds / 2 + 1.0)
        assert relayed and all(c.closed for c in relayed)
        for t in (dialer, target, relay):
            await t.close()

    run_virtual(main())


def test_emulated_dialers_of_one_subnet_share_its_byte_budget() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        relay = net.transport()
        target = serving(net.transport(client_mode=True))
        dialers = [net.transport(ip=f"198.51.100.{n}") for n in (1, 2)]  # two hosts of one /24
        for t in (relay, target, *dialers):
            await t.start()
        RelayService(relay, RelayLimits(max_bytes_per_peer=4 * MiB, max_bytes_per_subnet=6 * MiB)).start()
        address = await reserved_on(target, relay)
        for d in dialers:
            d.add_addresses(target.peer_id, address)
        assert len(await fetch(dialers[0], target.peer_id, 3, MiB)) == 3  # its own 4 MiB would allow 3 more
        with pytest.raises(NetworkError, match="the subnet 198.51.100.0/24 went over this relay's budget"):
            await fetch(dialers[1], target.peer_id, 4, MiB)
        for t in (*dialers, target, relay):
            await t.close()

    run_virtual(main())


def test_emulated_circuits_end_with_the_reservations_connection() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.01)
        relay, target, dialer = (serving(net.transport()) for _ in range(3))
        for t in (relay, target, dialer):
            await t.start()
        service = RelayService(relay)
        service.start()
        address = (await reserved_on(target, relay))[0]
        assert await dialer.connect(address, timeout=PROMPT) == target.peer_id
        relayed = [c for c in dialer.open_connections() if c.relayed]
        assert len(relayed) == 1 and service.circuits == 1
        for conn in target.open_connections():
            if conn.peer_id == relay.peer_id:
                conn.close("leaving the relay")
        await asyncio.sleep(1.0)
        assert relayed[0].closed and service.circuits == 0 and service.reservations == 0
        with pytest.raises(NetworkError, match="holds no reservation"):
            await dialer.connect(address, timeout=PROMPT)

    run_virtual(main())


def test_closed_relayed_connections_leave_no_cyclic_garbage(arun) -> None:
    async def emulated() -> None:
        net = EmulatedNetwork(latency=0.01)
        relay, dialer, target = (net.transport() for _ in range(3))
        for t in (relay, dialer, target):
            await t.start()
        RelayService(relay).start()
        dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
        with gc_saving_garbage():
            await open_and_close_many(dialer, target, "/emu/nobody")
            await asyncio.sleep(10.0)  # virtual time: every close has reached the other side
            assert cyclic_garbage() == []

    async def tls() -> None:
        async with tcp_peers(3) as (relay, dialer, target):
            RelayService(relay).start()
            dialer.add_addresses(target.peer_id, await reserved_on(target, relay))
            with gc_saving_garbage():
                await open_and_close_many(dialer, target, f"/ip4/127.0.0.1/tcp/{free_port()}")
                async with compat.timeout(PROMPT):
                    while any(link.relay for link in (*dialer._links, *target._links)):
                        await asyncio.sleep(0.01)
                assert cyclic_garbage() == []

    run_virtual(emulated())
    arun(tls())  # (a loop as potluck makes its own: on 3.10, timeouts that leave no cycles)
