"""Abusing a circuit relay (net.relay), on the emulated network and the virtual clock: hops to peers
without a reservation, floods of reservations and circuits past the caps, a dialer past its byte
budget, and a relay.stop from a peer the target holds no reservation with. Each is refused with
an error that says why, and the relay keeps serving everyone else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from potluck.core.errors import ConnectionLost, PeerUnreachable, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext, Stream
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.net.identity import Identity
from potluck.net.relay import RELAY_STOP, RelayLimits, RelayRefused, RelayService, reserve
from potluck.net.tcp import TCPTransport

MiB = 2**20
DEADLINE = 10.0


async def echo(request: Any, ctx: CallContext) -> Any:
    return request


async def download(stream: Stream, ctx: CallContext) -> None:
    for _ in range(stream.request["n"]):
        await stream.send(bytes(stream.request["size"]))


async def swarm(n: int, limits: RelayLimits) -> tuple[EmulatedNetwork, RelayService, list[EmulatedTransport]]:
    """A relay (with `limits`) and `n` started peers that serve echo and download."""
    net = EmulatedNetwork(latency=0.005)
    relay = net.transport()
    peers = [net.transport() for _ in range(n)]
    for t in (relay, *peers):
        await t.start()
        t.add_handler("echo", echo)
        t.add_stream_handler("download", download)
    service = RelayService(relay, limits)
    service.start()
    return net, service, peers


async def reserved(peer: EmulatedTransport, service: RelayService) -> list:
    await peer.connect(service.transport.addresses[0])
    return (await reserve(peer, service.transport.peer_id)).addresses


def circuit_to(service: RelayService, peer: EmulatedTransport) -> Multiaddr:
    return Multiaddr.circuit(service.transport.addresses[0], peer.peer_id)


def test_a_hop_to_a_peer_without_a_reservation_is_refused() -> None:
    async def main() -> None:
        _, service, (target, dialer) = await swarm(2, RelayLimits())
        with pytest.raises(PeerUnreachable, match="holds no reservation on this relay"):
            await dialer.connect(circuit_to(service, target), timeout=DEADLINE)
        assert service.circuits == 0

    run_virtual(main())


def test_a_flood_of_reservations_and_circuits_past_the_caps_is_refused_and_others_are_still_served() -> None:
    async def main() -> None:
        limits = RelayLimits(max_reservations=3, max_circuits=4, max_circuits_per_peer=2)
        _, service, (target, dialer, *attackers) = await swarm(6, limits)
        address = (await reserved(target, service))[0]
        # Reservations: two attackers fill the relay; the third, and more, are refused.
        for attacker in attackers[:2]:
            await reserved(attacker, service)
        with pytest.raises(RelayRefused, match=r"too many relay reservations \(all 3 are taken\)"):
            await reserved(attackers[2], service)
        assert service.reservations == 3
        # Circuits from one peer: past its two, refused (the hop's error reaches the dialer).
        for _ in range(2):
            await attackers[0].connect(address, timeout=DEADLINE)
        with pytest.raises(PeerUnreachable, match="too many relay circuits from this peer"):
            await attackers[0].connect(address, timeout=DEADLINE)
        # Circuits in all: a second attacker takes the last two, then the relay is full for it ...
        for _ in range(2):
            await attackers[1].connect(address, timeout=DEADLINE)
        with pytest.raises(PeerUnreachable, match=r"too many relay circuits \(all 4 are taken\)"):
            await attackers[2].connect(address, timeout=DEADLINE)
        assert service.circuits == 4
        # ... until circuits end: closing the attackers frees them, and an honest dialer gets through.
        for attacker in attackers:
            await attacker.close()
        await asyncio.sleep(1.0)
        assert service.circuits == 0 and service.reservations == 1
        dialer.add_addresses(target.peer_id, [address])
        assert await dialer.call(target.peer_id, "echo", "still served", timeout=DEADLINE) == "still served"

    run_virtual(main())


def test_a_dialer_past_its_byte_budget_loses_its_circuit_until_the_window_turns() -> None:
    async def main() -> None:
        limits = RelayLimits(max_bytes_per_peer=4 * MiB, bytes_window=60.0)
        _, service, (target, dialer, other) = await swarm(3, limits)
        address = (await reserved(target, service))[0]
        for peer in (dialer, other):
            peer.add_addresses(target.peer_id, [address])
        stream = await dialer.open_stream(target.peer_id, "download", {"n": 8, "size": MiB}, timeout=DEADLINE)
        assert stream.connection.relayed
        with pytest.raises(ConnectionLost, match="over this relay's budget of 4194304 bytes per 60 s"):
            async for _ in stream:
                pass
        # Another peer has a budget of its own.
        assert await other.call(target.peer_id, "echo", "mine", timeout=DEADLINE) == "mine"
        # The dialer is refused until its window is over, then served again.
        with pytest.raises(PeerUnreachable, match="budget"):
            await dialer.connect(address, timeout=DEADLINE)
        await asyncio.sleep(limits.bytes_window)
        assert await dialer.connect(address, timeout=DEADLINE) == target.peer_id

    run_virtual(main())


def test_a_relay_stop_from_a_peer_the_target_holds_no_reservation_with_is_refused() -> None:
    async def main() -> None:
        _, service, (target, attacker) = await swarm(2, RelayLimits())
        await reserved(target, service)
        await attacker.connect(target.addresses[0], timeout=DEADLINE)
        stream = await attacker.open_stream(target.peer_id, RELAY_STOP, {"src": attacker.peer_id.to_bytes()},
                                            timeout=DEADLINE, dedicated=False)
        with pytest.raises(RemoteError, match="holds no reservation with"):
            await stream.recv()
        assert not any(c.relayed for c in target.open_connections())

    run_virtual(main())


def test_relayed_connections_count_in_the_targets_own_caps_under_the_relays_key() -> None:
    async def main() -> None:
        peers = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(3)]
        relay, dialer, other = peers
        target = TCPTransport(Identity.generate(), host="127.0.0.1", max_connections_per_ip=1)
        for t in (relay, target, dialer, other):
            await t.start()
        try:
            RelayService(relay).start()
            await target.connect(relay.addresses[0], timeout=DEADLINE)
            address = (await reserve(target, relay.peer_id)).addresses[0]
            assert await dialer.connect(address, timeout=DEADLINE) == target.peer_id
            with pytest.raises(PeerUnreachable, match=f"too many connections from relay:{relay.peer_id}"):
                await other.connect(address, timeout=DEADLINE)
        finally:
            for t in (other, dialer, target, relay):
                await t.close()

    asyncio.run(main())
