"""Many emulated peers (transport + DHT) in one virtual-time loop, for tests of upper layers.

Each DHT publishes its peer's signed record at start, so any peer can call any other by id alone.
"""

from __future__ import annotations

from dataclasses import dataclass

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
                   client: bool = False, download: float | None = None) -> SimPeer:
    """A peer with `bandwidth` each way (or `download` for its download, if given)."""
    transport = net.transport(upload=bandwidth, download=download or bandwidth, client_mode=client)
    await transport.start()
    bootstrap = [peers[0].transport.addresses[0]] if peers else []
    dht = DHT(transport, initial_peers=bootstrap, clock=event_loop_clock())
    await dht.astart()
    return SimPeer(transport, dht)
