"""Issue 29: a relay's reservations and circuits went to whoever made up the most peer ids. The caps
were per peer id: 9 made-up ids took all 64 circuits of a relay in 0.3 s, sending nothing, and the
circuits lived until the 1 h stream deadline; 126 made-up ids filled all 128 reservations, and a new
honest peer behind NAT got "this relay is full" for the hour they last.

Now both are capped per IP and per subnet as well (`net.relay.MAX_*_PER_SUBNET`, `_PER_IP`), and a
circuit that carries nothing for `CIRCUIT_IDLE_SECONDS` ends. Here one attacking host (made-up ids
on one /24, the emulated network's `origin`) uses 1,000 ids while an honest peer from elsewhere gets
its reservation and its circuit. Emulated network, virtual clock. The made-up ids' origin is set on
the transports after they are built, so the same test runs (and fails) against the code from before
origins existed."""

from __future__ import annotations

import asyncio
from typing import Any

from potluck.core.errors import NetworkError
from potluck.core.virtual_time import run_virtual
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.net.origins import origin_of
from potluck.net.relay import RelayService, reserve

MADE_UP_IDS = 1000
ATTACKER_SUBNET = "198.51.100"  # its hosts are ATTACKER_SUBNET.1 .. .10
DEADLINE = 10.0


async def echo(request: Any, ctx: CallContext) -> Any:
    return {"echo": request, "relayed": ctx.connection.relayed}


def on_host(transport: EmulatedTransport, ip: str) -> EmulatedTransport:
    """`transport`'s connections come from `ip` (as `network.transport(ip=...)` builds it)."""
    transport.origin = origin_of(ip)
    return transport


async def started(net: EmulatedNetwork, ip: str | None = None, **options: Any) -> EmulatedTransport:
    transport = net.transport(**options)
    if ip is not None:
        on_host(transport, ip)
    transport.puncher.auto = False  # the relay carries everything here
    transport.add_handler("echo", echo)
    await transport.start()
    return transport


async def relay_and_honest_target(net: EmulatedNetwork) -> tuple[RelayService, EmulatedTransport, Multiaddr]:
    relay = await started(net)
    service = RelayService(relay)
    service.start()
    target = await started(net, nat="eim")
    await target.connect(relay.addresses[0])
    address = (await reserve(target, relay.peer_id)).addresses[0]
    return service, target, address


def test_made_up_ids_of_one_host_get_its_share_of_circuits_and_an_honest_circuit_gets_through() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.005)
        service, target, address = await relay_and_honest_target(net)
        # The attacker's own target behind the relay, and 1,000 made-up dialers, all silent.
        sink = await started(net, f"{ATTACKER_SUBNET}.1", keepalive_interval=None)
        await sink.connect(service.transport.addresses[0])
        sink_address = (await reserve(sink, service.transport.peer_id)).addresses[0]
        piped = 0
        for n in range(MADE_UP_IDS):
            dialer = await started(net, f"{ATTACKER_SUBNET}.{1 + n % 10}", keepalive_interval=None)
            try:
                await dialer.connect(sink_address, timeout=DEADLINE)
                piped += 1
            except NetworkError:
                await dialer.close()
        held = service.circuits
        # An honest dialer from elsewhere reaches the honest target through the relay meanwhile.
        honest = await started(net)
        honest.add_addresses(target.peer_id, [address])
        assert await honest.call(target.peer_id, "echo", 1, timeout=DEADLINE) == {"echo": 1, "relayed": True}
        assert held == piped == service.limits.max_circuits_per_subnet, f"one host holds {held} circuits"
        # The attacker's circuits carry nothing: they end; the honest one (keepalives) stays.
        await asyncio.sleep(2 * service.limits.circuit_idle_seconds)
        assert service.circuits == 1
        assert await honest.call(target.peer_id, "echo", 2, timeout=DEADLINE) == {"echo": 2, "relayed": True}

    run_virtual(main())


def test_made_up_ids_of_one_host_get_its_share_of_reservations_and_an_honest_peer_reserves() -> None:
    async def main() -> None:
        net = EmulatedNetwork(latency=0.005)
        service, _, _ = await relay_and_honest_target(net)
        relay = service.transport
        reserved = 0
        for n in range(MADE_UP_IDS):
            fake = await started(net, f"{ATTACKER_SUBNET}.{1 + n % 10}", nat="eim", keepalive_interval=None)
            await fake.connect(relay.addresses[0])
            try:
                await reserve(fake, relay.peer_id)
                reserved += 1
            except NetworkError:
                await fake.close()
        # A new honest peer behind NAT, elsewhere, gets a slot and can be reached through it.
        newcomer = await started(net, nat="eim")
        await newcomer.connect(relay.addresses[0])
        address = (await reserve(newcomer, relay.peer_id)).addresses[0]
        dialer = await started(net)
        dialer.add_addresses(newcomer.peer_id, [address])
        assert await dialer.call(newcomer.peer_id, "echo", 3, timeout=DEADLINE) == {"echo": 3, "relayed": True}
        assert reserved == service.limits.max_reservations_per_subnet, f"one host holds {reserved} reservations"

    run_virtual(main())
