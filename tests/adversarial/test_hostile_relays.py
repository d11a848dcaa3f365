"""A relay that grants and renews reservations but never forwards a hop (`relay.hop` accepted, never
answered) costs every fresh dial to the NATed peer it serves a dial_timeout (10 s) on that circuit
address before the next; with both of a peer's relays (`nat.relays.WANTED_RELAYS`) such, nobody
reaches it (each call PeerUnreachable after 20 s), while it keeps both reservations. Anyone can
announce relays under `nat.relays.RELAYS_KEY` (an entry costs one made-up id), and a NATed peer
took its relays at random from the list: 50 ids of one host against 2 honest relays took both
slots 92% of the time.

Now a search tries relays spread over subnets (`RelayReservations._spread`), and a relay whose
connection comes from a subnet we already hold a relay on is passed over while relays of other
subnets are left to try. On the emulated network a peer announces `/emu/<name>`, which does not
show the host its connections come from (`ip=`): that is the case of an attacker whose
announcements lie about its subnet, caught once connected (the second test). The first test is
the case of announcements that show the host (real-IP-looking addresses, as on TCP), where the
order alone keeps one host to one slot.

Figures (emulated network, virtual clock, 4 NATed peers, 50 hostile relay ids on 9.9.9.1, 2 honest
relays): before, 3 of the 4 held only hostile relays, and a call to them failed (PeerUnreachable)
after 20 s; after, all 4 hold an honest relay, and a call to each is answered. Over 8 network seeds
(32 NATed peers): before, 29 held only hostile relays; after, none (22 held an honest relay after
their first search, the other 10 after their second, 30 s later), and every call was answered,
within 10.1 s (one hostile circuit address tried first) or 0.1 s.

Dials are now staggered (`net.transport.DIAL_STAGGER_SECONDS`): a hostile circuit address tried
first costs the stagger, not the dial timeout (seed 29, each of the 4 calls: 10.1 s before, 0.6 s
after).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT, event_loop_clock
from potluck.nat.relays import WANTED_RELAYS, RelayAnnouncer, RelayReservations
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext, Stream
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.relay import RELAY_HOP, RelayService
from potluck.net.transport import DIAL_STAGGER_SECONDS
from potluck.peer import FIRST_RELAY_TIMEOUT
from tests.emulated_swarm import SimPeer, add_peer

HOSTILE_IDS = 50
HOSTILE_IP = "9.9.9.1"
NATED_PEERS = 4
# Searches run every nat.relays.SEARCH_INTERVAL (30 s) while short of relays: time for four (the
# seeds tried needed two at most).
SETTLE_SECONDS = 120.0


async def hang(stream: Stream, ctx: CallContext) -> None:
    """Accept the hop stream, never answer nor forward."""
    await asyncio.sleep(3600)


async def echo(request: Any, ctx: CallContext) -> Any:
    return request


async def relay(net: EmulatedNetwork, peers: list[SimPeer], hostile: bool, ip: str | None = None) -> SimPeer:
    """A public relay that announces itself in the DHT; a hostile one never forwards."""
    peer = await add_peer(net, peers, ip=ip)
    peer.transport.puncher.auto = False
    RelayService(peer.transport).start()
    if hostile:
        peer.transport.add_stream_handler(RELAY_HOP, hang)
    await RelayAnnouncer(peer.transport, peer.dht).start()
    peers.append(peer)
    return peer


async def nated(net: EmulatedNetwork, peers: list[SimPeer]) -> tuple[SimPeer, RelayReservations]:
    """A peer behind NAT that joins the DHT and reserves relays as `potluck.Peer` does once its
    reachability check found it private."""
    transport = net.transport(nat="eim")
    await transport.start()
    transport.puncher.auto = False  # the relays carry everything here
    transport.set_public(False)
    transport.add_handler("echo", echo)
    dht = DHT(transport, initial_peers=[peers[0].transport.addresses[0]], clock=event_loop_clock())
    await dht.astart()
    reservations = RelayReservations(transport, dht)
    reservations.start()
    await reservations.wait_first(FIRST_RELAY_TIMEOUT)
    return SimPeer(transport, dht), reservations


def test_many_hostile_relay_ids_of_one_host_hold_at_most_one_slot_and_the_peer_stays_reachable():
    async def scenario() -> None:
        net = EmulatedNetwork(latency=0.005, seed=29)
        peers: list[SimPeer] = []
        honest = {(await relay(net, peers, hostile=False)).transport.peer_id for _ in range(2)}
        for _ in range(HOSTILE_IDS):
            await relay(net, peers, hostile=True, ip=HOSTILE_IP)
        targets = [await nated(net, peers) for _ in range(NATED_PEERS)]
        await asyncio.sleep(SETTLE_SECONDS)
        dialer = await add_peer(net, peers)
        loop = asyncio.get_running_loop()
        for target, reservations in targets:
            assert len(reservations.held) == WANTED_RELAYS
            assert set(reservations.held) & honest, "both slots went to the hostile host"
            started = loop.time()
            assert await dialer.transport.call(target.transport.peer_id, "echo", 7, timeout=30) == 7
            # At worst a hostile circuit address first: the stagger, then the honest one (virtual clock).
            assert loop.time() - started < DIAL_STAGGER_SECONDS + 1.0 < dialer.transport.dial_timeout
            await reservations.close()
    run_virtual(scenario())


def test_relays_of_one_test_machine_still_fill_every_slot():
    """Relays that all share one subnet (a swarm on one machine) are all there is: a second one of
    that subnet is taken, not passed over for ever."""
    async def scenario() -> None:
        net = EmulatedNetwork(latency=0.005, seed=3)
        peers: list[SimPeer] = []
        for _ in range(3):
            await relay(net, peers, hostile=False, ip="127.0.0.1")
        for _ in range(2):
            _, reservations = await nated(net, peers)
            assert len(reservations.held) == WANTED_RELAYS
            await reservations.close()
    run_virtual(scenario())


def test_announced_addresses_of_one_subnet_get_one_place_in_the_first_round():
    """Announcements that show their host (as on TCP): however many ids one subnet announces, the
    first relays tried are of different subnets; relays announced on one machine are all tried."""
    net = EmulatedNetwork()
    reservations = RelayReservations(net.transport(), dht=None)  # type: ignore[arg-type]
    hostile = {Identity.generate().peer_id: (Multiaddr.parse(f"/ip4/{HOSTILE_IP}/tcp/{4000 + i}"),)
               for i in range(HOSTILE_IDS)}
    honest = {Identity.generate().peer_id: (Multiaddr.parse(f"/ip4/{ip}/tcp/4001"),)
              for ip in ("203.0.113.5", "198.51.100.7")}
    candidates = {**hostile, **honest}
    for seed in range(100):
        reservations._rng = random.Random(seed)
        order = reservations._spread(list(candidates), candidates)
        assert sorted(order) == sorted(candidates)
        assert len(set(order[:3]) & set(hostile)) == 1
    local = {Identity.generate().peer_id: (Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{4000 + i}"),) for i in range(3)}
    assert sorted(reservations._spread(list(local), local)) == sorted(local)
