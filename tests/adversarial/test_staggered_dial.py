"""A dead first address costs a fresh dial the stagger, not the dial timeout.

A relay can grant a NATed peer a reservation and then never answer `relay.hop`; a peer that holds
one such relay and one honest one stays reachable, but a dial that tried the hostile circuit
address first waited the whole dial timeout (10 s) on it before the next address. So did any
address that takes a connection and never speaks (a stale address, a silent listener).

Now `Transport._dial_first` staggers its attempts (Happy Eyeballs, RFC 8305): the next address
starts once the ones in flight went `DIAL_STAGGER_SECONDS` without an answer, the first connection
wins, and the others are cancelled, a connection they made all the same closed.

Figures (TCP on 127.0.0.1, dial_timeout 10 s, the hostile relay's circuit address first): before,
the call failed with PeerUnreachable at its 3 s deadline (the dial would have taken 10 s); after,
it is answered in about 0.5 s (the stagger, then the honest circuit).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from potluck.core import compat
from potluck.core.virtual_time import run_virtual
from potluck.net.address import Multiaddr
from potluck.net.connection import Connection
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import PeerID
from potluck.net.relay import RELAY_HOP, RelayService
from potluck.net.transport import DIAL_STAGGER_SECONDS, Transport
from tests.adversarial.test_hostile_relays import hang
from tests.test_lifetimes import cyclic_garbage, gc_saving_garbage
from tests.test_relay import fetch, reserved_on, serving, tcp_peers

# The call's deadline: far above what a staggered dial needs (the stagger and a handshake, ~0.5 s),
# far below the dial timeout the dead first address used to cost.
DEADLINE = 5.0
DIAL_TIMEOUT = 10.0
# A deadline for what must happen promptly; never reached.
PROMPT = 10.0


@contextlib.asynccontextmanager
async def silent_listener() -> AsyncIterator[Multiaddr]:
    """A TCP listener on 127.0.0.1 that accepts connections and never says a word."""
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, writer: held.append(writer), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}")
    finally:
        server.close()
        for writer in held:
            writer.close()
        await server.wait_closed()


def open_with(t: Transport, peer: PeerID) -> list[Connection]:
    return [c for c in t.open_connections() if c.peer_id == peer]


def test_a_relay_that_never_answers_hop_first_in_the_dial_order_costs_the_stagger_not_the_dial_timeout() -> None:
    async def main() -> None:
        async with tcp_peers(5) as (hostile, honest, target, dialer, streamer):
            for relay in (hostile, honest):
                RelayService(relay).start()
            hostile.add_stream_handler(RELAY_HOP, hang)  # grants reservations, never forwards
            serving(target)
            # The NATed peer announces its two circuit addresses, the hostile one first.
            circuits = [*await reserved_on(target, hostile), *await reserved_on(target, honest)]
            target.set_public(False)
            target.set_relayed_addresses(circuits)
            loop = asyncio.get_running_loop()
            for t in (dialer, streamer):
                assert t.dial_timeout == DIAL_TIMEOUT
                t.add_addresses(target.peer_id, circuits)
                assert t.addresses_of(target.peer_id)[0].relay == hostile.peer_id
            started = loop.time()
            reply = await dialer.call(target.peer_id, "echo", "hi", timeout=DEADLINE)
            took = loop.time() - started
            assert reply == {"echo": "hi", "relayed": True}
            assert DIAL_STAGGER_SECONDS <= took < DEADLINE  # the hostile circuit was tried first, for the stagger
            assert len(open_with(dialer, target.peer_id)) == 1
            # The address that answered is vouched for: the next fresh dial tries it first.
            assert dialer.addresses_of(target.peer_id)[0].relay == honest.peer_id
            # A bulk stream's dedicated connection, as a first contact: the same.
            started = loop.time()
            async with compat.timeout(DEADLINE):
                assert await fetch(streamer, target.peer_id, 2, 1000) == [bytes([0]) * 1000, bytes([1]) * 1000]
            assert DIAL_STAGGER_SECONDS <= loop.time() - started < DEADLINE

    asyncio.run(main())


def test_a_silent_first_address_costs_the_stagger_not_the_dial_timeout() -> None:
    async def main() -> None:
        async with tcp_peers(2) as (target, dialer), silent_listener() as silent:
            serving(target)
            dialer.add_addresses(target.peer_id, [silent, target.listen_addresses[0]])
            reply = await dialer.call(target.peer_id, "echo", "hi", timeout=DEADLINE)
            assert reply == {"echo": "hi", "relayed": False}
            assert len(open_with(dialer, target.peer_id)) == 1

    asyncio.run(main())


def test_when_two_attempts_connect_one_connection_stays_and_the_other_is_closed(arun) -> None:
    """The first address answers slowly (its connection is held until the second has one too):
    both attempts connect, one connection is kept, the other closed, on both sides."""
    async def main() -> None:
        async with tcp_peers(3) as (relay, target, dialer):
            RelayService(relay).start()
            serving(target)
            circuits = await reserved_on(target, relay)
            dialer.add_addresses(target.peer_id, [target.listen_addresses[0], *circuits])
            made: list[Connection] = []
            both = asyncio.Event()
            real_dial = dialer.dial

            async def dial(address: Multiaddr, expected: PeerID | None, bulk: bool, **kwargs: Any) -> Connection:
                conn = await real_dial(address, expected, bulk, **kwargs)
                if expected != target.peer_id:  # the circuit's own dial of its relay
                    return conn
                made.append(conn)
                if len(made) == 2:
                    both.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await both.wait()  # cancelled: it connected all the same, and says so
                return conn

            dialer.dial = dial  # type: ignore[method-assign]
            with gc_saving_garbage():
                reply = await dialer.call(target.peer_id, "echo", "hi", timeout=PROMPT)
                assert len(made) == 2, "the second address was not tried"
                kept = open_with(dialer, target.peer_id)
                assert len(kept) == 1 and kept[0] in made and reply["relayed"] == kept[0].relayed
                assert [c for c in made if c.closed] == [c for c in made if c is not kept[0]]
                assert sum(1 for c in dialer._all if c.peer_id == target.peer_id) == 1
                assert dialer._shared[target.peer_id] == kept
                async with compat.timeout(PROMPT):  # the closed one is noticed at the other end
                    while len(open_with(target, dialer.peer_id)) != 1:
                        await asyncio.sleep(0.01)
                assert cyclic_garbage() == []

    arun(main())  # (a loop as potluck makes its own: on 3.10, timeouts that leave no cycles)


@pytest.mark.parametrize("bulk", [False, True])
def test_a_caller_cancelled_mid_dial_leaves_no_attempt_running_and_no_connection(bulk: bool) -> None:
    """Two silent addresses, then the peer's own, whose attempt connects and then waits: the caller
    is cancelled while all three are in flight."""
    async def main() -> None:
        async with tcp_peers(2) as (target, dialer), silent_listener() as one, silent_listener() as two:
            serving(target)
            real = target.listen_addresses[0].without_peer_id()
            dialer.add_addresses(target.peer_id, [one, two, real])
            running: list[Multiaddr] = []
            connected = asyncio.Event()
            real_dial = dialer.dial

            async def dial(address: Multiaddr, expected: PeerID | None, bulk: bool, **kwargs: Any) -> Connection:
                assert expected == target.peer_id
                running.append(address)
                try:
                    conn = await real_dial(address, expected, bulk, **kwargs)
                    connected.set()
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(3600)  # cancelled: it connected all the same, and says so
                    return conn
                finally:
                    running.remove(address)

            dialer.dial = dial  # type: ignore[method-assign]
            with gc_saving_garbage():
                if bulk:
                    caller = asyncio.ensure_future(dialer.open_stream(target.peer_id, "download", {"n": 1, "size": 1},
                                                                      timeout=None, dedicated=True))
                else:  # a call's own deadline leaves the dial going: the dial is what gets cancelled
                    caller = asyncio.ensure_future(dialer._dial_known(target.peer_id, bulk=False))
                async with compat.timeout(PROMPT):
                    await connected.wait()
                assert sorted(map(str, running)) == sorted(map(str, [one, two, real]))
                caller.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await caller
                assert running == []
                assert open_with(dialer, target.peer_id) == []
                assert not any(c.peer_id == target.peer_id for c in dialer._all)
                assert target.peer_id not in dialer._shared and target.peer_id not in dialer._bulk_idle
                assert cyclic_garbage() == []

    asyncio.run(main())


def test_a_healthy_first_address_wins_alone() -> None:
    """On the virtual clock: the peer's own address answers within the stagger, so its circuit
    address (a relay that would connect us too) is never tried."""
    async def main() -> None:
        net = EmulatedNetwork(latency=0.05)  # a 100 ms round trip
        relay, target, dialer = net.transport(), serving(net.transport()), net.transport()
        for t in (relay, target, dialer):
            await t.start()
        RelayService(relay).start()
        circuits = await reserved_on(target, relay)
        dialer.add_addresses(target.peer_id, [target.addresses[0], *circuits])
        tried: list[Multiaddr] = []
        real_dial = dialer.dial

        async def dial(address: Multiaddr, expected: PeerID | None, bulk: bool, **kwargs: Any) -> Connection:
            if expected == target.peer_id:
                tried.append(address)
            return await real_dial(address, expected, bulk, **kwargs)

        dialer.dial = dial  # type: ignore[method-assign]
        assert await dialer.call(target.peer_id, "echo", "hi", timeout=PROMPT) == {"echo": "hi", "relayed": False}
        assert tried == [target.addresses[0].without_peer_id()]
        assert len(open_with(dialer, target.peer_id)) == 1
        assert open_with(dialer, relay.peer_id) == []
        stream = await dialer.open_stream(target.peer_id, "download", {"n": 1, "size": 10}, timeout=PROMPT)
        assert [chunk async for chunk in stream] == [bytes(10)]
        assert len(tried) == 2 and not tried[1].is_circuit  # the bulk dial too
        for t in (dialer, target, relay):
            await t.close()

    run_virtual(main())
