"""Swarms with peers behind NAT on the emulated network under the virtual clock (issue 16).

NATed peers are `potluck.Peer`s on transports with the emulated NAT model: each finds itself
private with the reachability check at start, reserves on the relays announced in the DHT and
publishes circuit addresses, through which others dial it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

import potluck
from potluck.averaging.state_transfer import StateServer, download_state
from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import ConnectionLost
from potluck.core.names import RunNames
from potluck.moe import ExpertServer
from potluck.moe.expert import aforward, alocate
from potluck.moe.experts import make_expert
from potluck.net.connection import CallContext, Stream
from potluck.net.emulated import EmulatedNetwork
from potluck.net.reachability import DIALBACK_CALL_TIMEOUT
from potluck.optim import Optimizer
from potluck.peer import FIRST_RELAY_TIMEOUT, RECHECK_INTERVAL
from tests.emulated_swarm import run_on_shared_runner

T = TypeVar("T")
BATCH = 8
# The averager whose state the NATed donor serves.
STATE = RunNames("nat").averager("state")


async def public_peers(network: EmulatedNetwork, n: int, relays: int) -> list[potluck.Peer]:
    """`n` public peers, the first `relays` of them relays."""
    peers: list[potluck.Peer] = []
    for i in range(n):
        peers.append(await potluck.Peer.create(peers[0].addresses if peers else [], transport=network.transport(),
                                               clock=event_loop_clock(), relay=i < relays))
    return peers


async def natted_peer(network: EmulatedNetwork, boot: list[potluck.Peer], nat: str = "eim",
                      **transport: Any) -> potluck.Peer:
    initial = [a for p in boot for a in p.addresses]
    return await potluck.Peer.create(initial, transport=network.transport(nat=nat, **transport),
                                     clock=event_loop_clock())


async def shutdown(peers: list[potluck.Peer]) -> None:
    for peer in reversed(peers):
        await peer.ashutdown()


class OnLoop:
    """A peer for an ExpertServer built on the event loop itself: its `run` schedules the server's
    start instead of blocking on it (`potluck.Peer.run` would wait for the loop it runs on)."""

    def __init__(self, peer: potluck.Peer):
        self.transport, self.dht = peer.transport, peer.dht
        self.started: list[asyncio.Future] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> None:
        self.started.append(asyncio.ensure_future(coro))


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


@pytest.mark.timeout(120)
def test_a_swarm_with_70_percent_of_peers_behind_nat_trains_and_natted_peers_serve_each_other():
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.01, seed=7)
        peers = await public_peers(network, 3, relays=2)
        for i in range(7):
            peers.append(await natted_peer(network, peers[:3], nat="eim" if i % 2 else "edm"))
        try:
            natted = peers[3:]
            assert all(p.transport.reachability == "relayed" for p in natted), [p.reachability_summary for p in natted]
            assert all(p.transport.addresses and all(a.is_circuit for a in p.transport.addresses) for p in natted)
            assert "reachable through relay" in natted[0].reachability_summary
            assert all(p.transport.reachability == "public" for p in peers[:3])

            # A NATed peer serves an expert; another NATed peer finds it in the DHT and calls it.
            module, schema = make_expert("ffn", 8)
            server_peer = OnLoop(natted[0])
            server = ExpertServer(server_peer, {"ffn.0.0": module}, input_schema=schema)
            await asyncio.gather(*server_peer.started)
            try:
                caller = natted[1]
                location = await alocate(caller.dht, "ffn.0.0")
                x = torch.randn(4, 8)
                reply = await aforward(caller.transport, location, 1, [x], timeout=10)
                assert torch.allclose(reply.outputs[0], module(x))
                # Both NATed, one "edm": no hole punch can work, so the call went through a relay.
                links = [c for c in caller.transport.open_connections() if c.peer_id == natted[0].transport.peer_id]
                assert links and all(c.relayed for c in links)
            finally:
                await server._ashutdown()
                server._executor.shutdown(wait=True)

            # All ten train together: the NATed ones as averaging clients.
            models = []
            for _ in peers:
                torch.manual_seed(0)
                models.append(torch.nn.Linear(8, 2))
            optimizers = [Optimizer(peer, "nat", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                                    target_batch_size=160, batch_size_per_step=BATCH, load_state=False, start=False)
                          for peer, model in zip(peers, models, strict=True)]
            for opt in optimizers:
                await opt.astart()

            async def train(i: int) -> None:
                generator = torch.Generator().manual_seed(i)
                while optimizers[i].local_epoch < 2:
                    x = torch.randn(BATCH, 8, generator=generator)
                    models[i](x).pow(2).mean().backward()
                    await asyncio.sleep(0.05)
                    await optimizers[i].astep()
            try:
                await asyncio.wait_for(asyncio.gather(*(train(i) for i in range(len(peers)))), 300)
            finally:
                for opt in optimizers:
                    opt.shutdown()
            assert [o.local_epoch for o in optimizers] == [2] * 10
            assert len({digest(m) for m in models}) == 1
        finally:
            await shutdown(peers)
    run_on_shared_runner(scenario())


async def numbered(stream: Stream, ctx: CallContext) -> None:
    """Chunks `start`, `start + 1`, ... up to `n` (each CHUNK bytes of its number mod 256)."""
    for i in range(stream.request["start"], stream.request["n"]):
        await stream.send(bytes([i % 256]) * CHUNK)


CHUNK = 64 * 2**10


@pytest.mark.timeout(60)
def test_a_relay_dies_mid_transfer_and_the_transfer_resumes_through_another():
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.01, seed=3)
        peers = await public_peers(network, 3, relays=3)
        relays = {p.transport.peer_id for p in peers}
        donor = await natted_peer(network, peers, nat="edm", upload=2e6)
        peers.append(donor)
        # The reader is behind a symmetric NAT too, so no hole punch can take the transfer off the relays.
        reader = await potluck.Peer.create([str(peers[0].addresses[0])], clock=event_loop_clock(),
                                           transport=network.transport(nat="edm", client_mode=True))
        peers.append(reader)
        crashed = None
        try:
            donor.transport.add_stream_handler("numbered", numbered)
            assert len(donor.transport.circuits.reservations) == 2 and donor.transport.reachability == "relayed"
            via = donor.transport.addresses[0]
            await reader.transport.connect(via)  # the shared connection runs through this relay
            n, got, resumed = 60, [], 0  # 60 x 64 KiB at 2 MB/s: about 2 s
            while len(got) < n:
                stream = await reader.transport.open_stream(donor.transport.peer_id, "numbered",
                                                            {"start": len(got), "n": n}, timeout=10, dedicated=False)
                try:
                    while len(got) < n:
                        got.append((await stream.recv(timeout=10))[0])
                        if len(got) == n // 3 and crashed is None:
                            crashed = via.relay
                            network.crash(crashed)
                except ConnectionLost:
                    resumed += 1  # resume where it stopped: the redial goes through the other relay
            assert got == [i % 256 for i in range(n)] and resumed == 1
            assert all(c.relayed for c in reader.transport.open_connections() if c.peer_id == donor.transport.peer_id)
            # The donor noticed the death and holds a reservation on the third relay instead.
            reservations = donor.transport.circuits.reservations
            for _ in range(100):
                if crashed not in reservations and len(reservations) == 2:
                    break
                await asyncio.sleep(0.1)
            assert set(reservations) == relays - {crashed}
            assert all(a.relay != crashed for a in donor.transport.addresses)
            # ... and republished its peer record with the new circuit addresses at once.
            await asyncio.sleep(1)
            record, _ = await reader.dht.node.resolve_peer(donor.transport.peer_id, 5, thorough=True)
            assert set(record.addresses) == {a.without_peer_id() for a in donor.transport.addresses}
        finally:
            await shutdown(peers)
    run_on_shared_runner(scenario())


@pytest.mark.timeout(60)
def test_a_state_download_from_a_natted_donor_resumes_through_another_relay_when_one_dies():
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.01, seed=5)
        peers = await public_peers(network, 2, relays=2)
        donor = await natted_peer(network, peers, nat="edm", upload=2e6)
        peers.append(donor)
        reader = await potluck.Peer.create([str(peers[0].addresses[0])], clock=event_loop_clock(),
                                           transport=network.transport(nat="edm", client_mode=True))
        peers.append(reader)
        generator = torch.Generator().manual_seed(0)
        state = [torch.randn(1024, 1024, generator=generator), torch.randn(77, generator=generator)]
        StateServer(donor.transport, lambda: (3, {"epoch": 3}, state), STATE, chunk_bytes=256 * 2**10)
        via = donor.transport.addresses[0]
        await reader.transport.connect(via)  # the first address the download dials: through this relay
        crashed: list[Any] = []

        def progress(done: int, total: int) -> None:
            if not crashed and done >= total // 3:
                crashed.append(via.relay)
                network.crash(via.relay)
        try:
            version, metadata, tensors = await download_state(reader.transport, [donor.transport.peer_id], STATE,
                                                              timeout=30, progress=progress)
            assert crashed and version == 3 and metadata == {"epoch": 3}
            assert all(torch.equal(a, b) for a, b in zip(tensors, state, strict=True))
        finally:
            await shutdown(peers)
    run_on_shared_runner(scenario())


async def echo(request: Any, ctx: CallContext) -> Any:
    return request


@pytest.mark.timeout(60)
def test_a_peer_whose_only_initial_peer_cannot_dial_it_is_relayed_and_re_checks_follow_its_nat():
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.01, seed=11)
        peers = await public_peers(network, 1, relays=1)
        # Its only initial peer (the relay) is the only one to ask: one failed dial-back is enough to
        # call itself private (before, it assumed it was public and nobody could reach it).
        home = await natted_peer(network, peers, nat="eim")
        peers.append(home)
        try:
            home.transport.add_handler("echo", echo)
            assert home.transport.reachability == "relayed", home.reachability_summary
            assert "reachable through relay" in home.reachability_summary
            assert all(a.is_circuit for a in home.transport.addresses)

            home.transport.nat = None  # the user forwards the port: from now on anyone can dial in
            await asyncio.sleep(RECHECK_INTERVAL + DIALBACK_CALL_TIMEOUT)
            assert home.transport.reachability == "public", home.reachability_summary
            assert home.reachability_summary.startswith("Publicly reachable")
            assert home.transport.addresses == home.transport.listen_addresses
            assert not home.transport.circuits.reservations  # released: others dial it directly
            # A newcomer finds its (republished) record and dials it directly.
            newcomer = await potluck.Peer.create(peers[0].addresses, transport=network.transport(),
                                                 clock=event_loop_clock())
            peers.append(newcomer)
            assert await newcomer.transport.call(home.transport.peer_id, "echo", 7, timeout=10) == 7
            links = [c for c in newcomer.transport.open_connections() if c.peer_id == home.transport.peer_id]
            assert links and not any(c.relayed for c in links)

            home.transport.nat = "eim"  # the forward is gone again: the next check finds it private
            await asyncio.sleep(RECHECK_INTERVAL + DIALBACK_CALL_TIMEOUT + FIRST_RELAY_TIMEOUT)
            assert home.transport.reachability == "relayed", home.reachability_summary
            assert all(a.is_circuit for a in home.transport.addresses) and home.transport.circuits.reservations
            assert "reachable through relay" in home.reachability_summary
        finally:
            await shutdown(peers)
    run_on_shared_runner(scenario())
