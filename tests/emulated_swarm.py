"""Many emulated peers (transport + DHT) in one virtual-time loop, for tests of upper layers.

Each DHT publishes its peer's signed record at start, so any peer can call any other by id alone.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import VirtualTimeLoop, virtual_time_loop
from potluck.dht import DHT, event_loop_clock
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport


@dataclass
class SimPeer:
    """What the upper layers need from a peer: a transport and a DHT (async use only)."""

    transport: EmulatedTransport
    dht: DHT


async def make_swarm(n: int, latency: float = 0.005, bandwidth: float | None = 100e6,
                     client_mode: tuple[int, ...] = ()) -> tuple[EmulatedNetwork, list[SimPeer]]:
    net = EmulatedNetwork(latency=latency)
    peers: list[SimPeer] = []
    for i in range(n):
        peers.append(await add_peer(net, peers, bandwidth, client=i in client_mode))
    return net, peers


async def add_peer(net: EmulatedNetwork, peers: list[SimPeer], bandwidth: float | None = 100e6,
                   client: bool = False, download: float | None = None, ip: str | None = None) -> SimPeer:
    """A peer with `bandwidth` each way (or `download` for its download, if given), seen at `ip`
    (default: a host of its own)."""
    transport = net.transport(upload=bandwidth, download=download or bandwidth, client_mode=client, ip=ip)
    await transport.start()
    bootstrap = [peers[0].transport.addresses[0]] if peers else []
    dht = DHT(transport, initial_peers=bootstrap, clock=event_loop_clock())
    await dht.astart()
    return SimPeer(transport, dht)


T = TypeVar("T")


def run_on_shared_runner(scenario: Coroutine[Any, Any, T], timeout: float = 120) -> T:
    """Run `scenario` on the shared runner, with a virtual-time loop: `potluck.Peer` and the
    Optimizer run on that runner, as they do outside tests."""
    runner = acquire_runner(virtual_time_loop)
    try:
        assert isinstance(runner.loop, VirtualTimeLoop)
        return runner.run(scenario, timeout=timeout)
    finally:
        release_runner()
