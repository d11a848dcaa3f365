"""Hole punching (net.holepunch): two peers on a relayed connection open a direct one and move
their traffic to it, with the usual identity checks; where the NATs forbid it the relay keeps
carrying the traffic. TCP on 127.0.0.1 (a simultaneous open through a punch's listener), and the
emulated network's NAT model on the virtual clock."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from potluck.core import compat
from potluck.core.errors import MalformedMessage, PeerUnreachable, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.net.connection import CallContext, Connection, Stream
from potluck.net.emulated import EmulatedNetwork
from potluck.net.holepunch import (
    MAX_ATTEMPTS,
    MAX_CANDIDATES,
    MAX_PUNCH_BACKOFF_SECONDS,
    MAX_REMEMBERED_FAILURES,
    PUNCH_BACKOFF_SECONDS,
    PUNCH_TIMEOUT,
    SIGNAL_TIMEOUT,
    Connect,
    Sync,
)
from potluck.net.identity import Identity
from potluck.net.relay import RelayService, reserve
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport
from tests.test_relay import tcp_peers as relayed_tcp_peers

# A deadline for what must happen promptly; generous, never reached.
PROMPT = 10.0
# A whole punch, every try failing (virtual time): the longest a background punch can run.
WHOLE_PUNCH = MAX_ATTEMPTS * (2 * SIGNAL_TIMEOUT + PUNCH_TIMEOUT)


async def echo(request: Any, ctx: CallContext) -> Any:
    return {"echo": request, "relayed": ctx.connection.relayed}


async def bulk(stream: Stream, ctx: CallContext) -> None:
    await stream.send({"relayed": ctx.connection.relayed})


@contextlib.asynccontextmanager
async def tcp_peers(n: int) -> AsyncIterator[list[TCPTransport]]:
    async with relayed_tcp_peers(n, punch=True) as peers:
        for p in peers:
            p.add_handler("echo", echo)
            p.add_stream_handler("bulk", bulk)
        yield peers


async def as_if_relayed(a: Transport, b: Transport) -> tuple[Connection, Connection]:
    """An ordinary connection from `a` to `b`, both ends marked relayed: the protocol runs over it
    as over a relayed one (which it is punched to replace). Returns (a's end, b's end)."""
    await a.connect(b.addresses[0])
    ends = a._shared[b.peer_id][0], b._shared[a.peer_id][0]
    for end in ends:
        end.remote = dataclasses.replace(end.remote, relayed=True)
    return ends


async def until(condition: Callable[[], bool], within: float = PROMPT) -> None:
    async with compat.timeout(within):
        while not condition():
            await asyncio.sleep(0.01)


def direct(t: Transport, peer: Transport) -> list[Connection]:
    return [c for c in t.open_connections() if c.peer_id == peer.peer_id and not c.relayed]


def test_a_peers_candidates_are_capped_and_must_be_addresses_one_host_answers() -> None:
    peer = Identity.generate().peer_id
    good = Connect.from_wire({"op": "connect", "addrs": [f"/ip4/192.0.2.1/tcp/4001/p2p/{peer}", "/emu/7"]})
    assert [str(a) for a in good.addresses] == ["/ip4/192.0.2.1/tcp/4001", "/emu/7"]
    assert Connect.from_wire(Connect(good.addresses).to_wire()) == good
    too_many = [f"/ip4/192.0.2.1/tcp/{4000 + i}" for i in range(MAX_CANDIDATES + 1)]
    for addrs in (too_many, ["/dns/example.org/tcp/1"], [f"/ip4/192.0.2.1/tcp/1/p2p/{peer}/p2p-circuit"],
                  ["/ip4/0.0.0.0/tcp/1"], ["/ip6/ff02::1/tcp/1"], ["/ip4/192.0.2.1/tcp/0"], ["not an address"], [7]):
        with pytest.raises(MalformedMessage):
            Connect.from_wire({"op": "connect", "addrs": addrs})
    with pytest.raises(MalformedMessage):
        Sync.from_wire({"op": "connect", "addrs": []})


def test_tcp_punch_over_a_connection_opens_a_direct_one_that_carries_calls() -> None:
    async def main() -> None:
        async with tcp_peers(2) as (a, b):
            at_a, at_b = await as_if_relayed(a, b)
            # b accepted the connection: it punches (TLS server); a dialed it: TLS client.
            conn = await b.puncher.punch(at_b)
            assert conn.peer_id == a.peer_id and not conn.relayed and not conn.closed
            await until(lambda: bool(direct(a, b)))  # a's end is authenticated a round trip later
            assert len(direct(a, b)) == 1
            assert await b.call(a.peer_id, "echo", 1) == {"echo": 1, "relayed": False}
            assert await a.call(b.peer_id, "echo", 2) == {"echo": 2, "relayed": False}
            await until(lambda: at_a.closed and at_b.closed)  # the replaced one closes once idle
            assert await a.call(b.peer_id, "echo", 3) == {"echo": 3, "relayed": False}

    asyncio.run(main())


def test_tcp_punch_that_reaches_a_peer_with_another_id_fails_and_the_relayed_connection_stays() -> None:
    async def main() -> None:
        async with tcp_peers(3) as (a, b, impostor):
            _, at_b = await as_if_relayed(a, b)
            a.punch_endpoint = impostor.punch_endpoint  # type: ignore[method-assign] - a's tries open the impostor's port
            with pytest.raises(PeerUnreachable, match="failed 3 times"):
                await b.puncher.punch(at_b)
            assert not direct(a, b) and not direct(b, impostor) and not at_b.closed
            assert await b.call(a.peer_id, "echo", "still") == {"echo": "still", "relayed": True}

    asyncio.run(main())


def test_tcp_punch_is_refused_over_a_connection_that_is_not_relayed() -> None:
    async def main() -> None:
        async with tcp_peers(2) as (a, b):
            at_a, at_b = await as_if_relayed(a, b)
            at_a.remote = dataclasses.replace(at_a.remote, relayed=False)  # a's end: direct, as it is
            with pytest.raises(RemoteError, match="relayed connections only"):
                await b.puncher.punch(at_b)
            assert not at_b.closed and len(direct(b, a)) == 0

    asyncio.run(main())


def test_tcp_relayed_connection_is_upgraded_to_a_direct_one() -> None:
    async def main() -> None:
        async with tcp_peers(3) as (relay, target, dialer):
            RelayService(relay).start()
            await target.connect(relay.addresses[0])
            circuits = (await reserve(target, relay.peer_id)).addresses
            target.set_public(False)  # as if behind NAT: it tells others only its circuit addresses
            target.set_relayed_addresses(circuits)
            dialer.add_addresses(target.peer_id, circuits)
            assert await dialer.call(target.peer_id, "echo", "via relay") == {"echo": "via relay", "relayed": True}
            # The target now punches in the background. A bulk stream opened at once (as a state
            # download follows its manifest call) waits for the punch and shares the direct
            # connection: one of its own could only be relayed.
            stream = await dialer.open_stream(target.peer_id, "bulk", timeout=PROMPT)
            assert await stream.recv() == {"relayed": False}
            assert await dialer.call(target.peer_id, "echo", "direct") == {"echo": "direct", "relayed": False}
            await until(lambda: not any(c.relayed for c in dialer.open_connections()))

    asyncio.run(main())


@pytest.mark.parametrize(("target_nat", "dialer_nat", "punched"), [
    ("eim", "eim", True), ("eim", None, True), ("edm", None, True),
    ("edm", "edm", False), ("eim", "edm", False),
])
def test_emulated_punch_succeeds_where_the_nats_allow_it_and_the_relay_stays_otherwise(
        target_nat: str, dialer_nat: str | None, punched: bool) -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.02)
        relay = net.transport()
        target, dialer = net.transport(nat=target_nat), net.transport(nat=dialer_nat)
        for t in (relay, target, dialer):
            t.add_handler("echo", echo)
            await t.start()
        RelayService(relay).start()
        await target.connect(relay.addresses[0])
        dialer.add_addresses(target.peer_id, (await reserve(target, relay.peer_id)).addresses)
        loop = asyncio.get_running_loop()
        assert (await dialer.call(target.peer_id, "echo", 1)) == {"echo": 1, "relayed": True}
        started = loop.time()
        if punched:
            await until(lambda: bool(direct(dialer, target)), within=WHOLE_PUNCH)
            # CONNECT and SYNC through the relay (two hops: 2 x 40 ms round trips, plus half of
            # one), then the direct dial's round trip: well under a second, the first try.
            assert loop.time() - started < 0.5
            assert await dialer.call(target.peer_id, "echo", 2) == {"echo": 2, "relayed": False}
            await until(lambda: not any(c.relayed for c in dialer.open_connections()))
        else:
            await asyncio.sleep(WHOLE_PUNCH)
            assert not direct(dialer, target) and not target.puncher._tasks
            assert await dialer.call(target.peer_id, "echo", 3) == {"echo": 3, "relayed": True}
        for t in (dialer, target, relay):
            await t.close()

    run_virtual(main())


async def emulated_relayed(target_nat: str | None, dialer_nat: str | None) -> tuple[Transport, Transport, Transport]:
    """(relay, target, dialer) on the emulated network: the target reserved a slot on the relay,
    and the dialer knows only the target's circuit addresses."""
    net = EmulatedNetwork(latency=0.02)
    relay = net.transport()
    target, dialer = net.transport(nat=target_nat), net.transport(nat=dialer_nat)
    for t in (relay, target, dialer):
        t.add_handler("echo", echo)
        t.add_stream_handler("bulk", bulk)
        await t.start()
    RelayService(relay).start()
    await target.connect(relay.addresses[0])
    circuits = (await reserve(target, relay.peer_id)).addresses
    target.set_public(False)  # as a reachability check finds: it tells others only its circuit addresses
    target.set_relayed_addresses(circuits)
    dialer.add_addresses(target.peer_id, circuits)
    return relay, target, dialer


def test_emulated_bulk_stream_opened_while_a_punch_runs_takes_the_direct_connection() -> None:
    async def main() -> None:
        relay, target, dialer = await emulated_relayed("eim", "eim")
        assert (await dialer.call(target.peer_id, "echo", 1)) == {"echo": 1, "relayed": True}
        assert target.puncher._active  # the punch is in flight as the bulk stream opens
        stream = await dialer.open_stream(target.peer_id, "bulk", timeout=PROMPT)
        assert await stream.recv() == {"relayed": False}
        assert not any(c.relayed and c.remote.bulk for c in dialer.open_connections())
        for t in (dialer, target, relay):
            await t.close()

    run_virtual(main())


def test_emulated_failed_punch_is_not_tried_again_with_that_peer_until_its_backoff_ends() -> None:
    async def main() -> None:
        relay, target, dialer = await emulated_relayed("edm", "edm")
        tries = 0
        endpoint = target.punch_endpoint

        def counted() -> Any:
            nonlocal tries
            tries += 1
            return endpoint()

        target.punch_endpoint = counted  # type: ignore[method-assign] - count the target's tries

        async def new_relayed_connection() -> None:
            for conn in direct(dialer, target) + [c for c in dialer.open_connections() if c.peer_id == target.peer_id]:
                conn.close("a new relayed connection is wanted")
            assert (await dialer.call(target.peer_id, "echo", 1)) == {"echo": 1, "relayed": True}
            await asyncio.sleep(WHOLE_PUNCH)  # any punch it starts has ended

        await new_relayed_connection()
        assert tries == MAX_ATTEMPTS and not direct(dialer, target)  # failed: backing off
        await new_relayed_connection()
        assert tries == MAX_ATTEMPTS  # within the backoff: no punch started
        await asyncio.sleep(PUNCH_BACKOFF_SECONDS)
        await new_relayed_connection()
        assert tries == 2 * MAX_ATTEMPTS  # after it: tried again (and failed: the backoff doubles)
        await asyncio.sleep(PUNCH_BACKOFF_SECONDS)
        await new_relayed_connection()
        assert tries == 2 * MAX_ATTEMPTS
        assert (await dialer.call(target.peer_id, "echo", 2)) == {"echo": 2, "relayed": True}
        for t in (dialer, target, relay):
            await t.close()

    run_virtual(main())


def test_remembered_punch_failures_are_capped_and_forgotten_once_long_over() -> None:
    async def main() -> None:
        puncher = EmulatedNetwork().transport().puncher
        peers = [Identity.generate().peer_id for _ in range(MAX_REMEMBERED_FAILURES + 1)]
        for peer in peers:
            puncher._failed(peer, set())
        assert len(puncher._failures) == MAX_REMEMBERED_FAILURES and peers[0] not in puncher._failures
        assert "failed in a row" in (puncher._refusal(peers[-1]) or "")
        for _ in range(10):  # failing again and again: the backoff doubles up to its cap
            await asyncio.sleep(MAX_PUNCH_BACKOFF_SECONDS)
            puncher._failed(peers[1], set())
        loop = asyncio.get_running_loop()
        assert puncher._failures[peers[1]] == (11, loop.time() + MAX_PUNCH_BACKOFF_SECONDS)
        assert list(puncher._failures) == [peers[1]]  # the others' backoffs are long over: forgotten
        await asyncio.sleep(2 * MAX_PUNCH_BACKOFF_SECONDS)
        assert puncher._refusal(peers[1]) is None
        puncher._failed(peers[1], set())  # long past its backoff: starts over
        assert puncher._failures[peers[1]] == (1, loop.time() + PUNCH_BACKOFF_SECONDS)

    run_virtual(main())
