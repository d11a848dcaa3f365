"""Made-up ids of one subnet cannot take the seats of every group.

A leader's gathering seated joiners first come and closed the moment it was full. Made-up ids
that read the declarations and joined every honest leader at once (before honest followers, who
let declarations spread first) took every seat: each honest follower was told "group is full",
and no two honest peers averaged together. Now a full gathering that one subnet crowds (more than
half of its followers' seats, and more than one) stays open for a moment, and a joiner from a
subnet holding fewer seats takes the seat of that subnet's latest joiner."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.matchmaking import SEAT_FRACTION
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from tests.emulated_swarm import SimPeer, add_peer, make_swarm

WINDOW = 2.0
HONEST = 4


async def _intruders(net: EmulatedNetwork, peers: list[SimPeer], count: int) -> list[SimPeer]:
    """`count` made-up ids on one host of 51.15.0.0/24."""
    made_up = []
    for _ in range(count):
        transport = net.transport(ip="51.15.0.7")
        await transport.start()
        made_up.append(SimPeer(transport, peers[0].dht))
    return made_up


async def _take_seats(intruder: SimPeer, leader: SimPeer, request: dict, method: str) -> dict:
    """Join `leader` as soon as it gathers (and never average)."""
    intruder.transport.add_addresses(leader.transport.peer_id, leader.transport.addresses)
    while True:
        reply = await intruder.transport.call(leader.transport.peer_id, method, request, timeout=10)
        if "not gathering" not in reply.get("refused", ""):
            return reply
        await asyncio.sleep(0.001)


@pytest.mark.timeout(60)
def test_made_up_ids_of_one_subnet_cannot_fill_every_honest_gathering():
    async def main():
        net, honest = await make_swarm(HONEST)
        made_up = await _intruders(net, honest, (HONEST - 1) * HONEST)
        avgs = [Averager(p, [torch.full((16,), float(i))], "seats", target_group_size=HONEST,
                         matchmaking_time=WINDOW, sender_timeout=1.0) for i, p in enumerate(honest)]
        request = {"key": "e0/all", "schema": avgs[0].schema, "role": "node", "bw": [1e9, 1e9], "meta": None}
        method = RunNames("seats").averager("tensors").join
        seats = [_take_seats(made_up[i * (HONEST - 1) + k], leader, request, method)
                 for i, leader in enumerate(honest) for k in range(HONEST - 1)]

        async def step(averager: Averager, delay: float):
            await asyncio.sleep(delay)
            return await averager.astep(group_key="e0", timeout=30)
        *results, = await asyncio.gather(*(step(a, 0.01 * i) for i, a in enumerate(avgs)), *seats,
                                         return_exceptions=True)
        steps = results[:HONEST]
        ids = {str(p.transport.peer_id) for p in honest}
        intruders = {str(p.transport.peer_id) for p in made_up}
        groups = [r.peers for r in steps if not isinstance(r, BaseException)]
        assert groups, steps  # (before: every honest step failed, "every reducer died")
        # The first leader's group: the intruders' subnet keeps at most half of its followers'
        # seats, and the honest peers who asked in time hold the rest and average together.
        together = max(groups, key=lambda g: len(ids & set(g)))
        assert len(ids & set(together)) >= HONEST - 1, steps
        assert len(intruders & set(together)) <= (HONEST - 1) // 2, steps
        contributors = {c for r in steps if not isinstance(r, BaseException) for c in r.contributors}
        assert len(ids & contributors) >= HONEST - 1, steps
    run_virtual(main())


async def _group_time(ips: list[str | None]) -> tuple[list[int], float]:
    """Peers seen at `ips` (None: a host of its own; the first leads) step together: the group
    sizes, and the (virtual) seconds until the last step ended."""
    net = EmulatedNetwork(latency=0.005)
    peers: list[SimPeer] = []
    for ip in ips:
        peers.append(await add_peer(net, peers, ip=ip))
    avgs = [Averager(p, [torch.full((16,), float(i))], "lab", target_group_size=len(ips), matchmaking_time=WINDOW)
            for i, p in enumerate(peers)]
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def step(averager: Averager, delay: float):
        await asyncio.sleep(delay)
        return await averager.astep(group_key="e0", timeout=30)
    results = await asyncio.gather(*(step(a, 0.01 * i) for i, a in enumerate(avgs)))
    return [r.group_size for r in results], loop.time() - start


@pytest.mark.timeout(60)
def test_a_group_on_our_own_network_closes_as_soon_as_it_is_full():
    """A lab or a swarm on one host (private or loopback addresses) is one subnet, but ours."""
    sizes, seconds = run_virtual(_group_time(["10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"]))
    assert sizes == [4] * 4 and seconds < WINDOW * SEAT_FRACTION, seconds


@pytest.mark.timeout(60)
def test_a_group_that_one_public_subnet_crowds_closes_after_the_seat_time_not_the_window():
    """Three machines of one public /24 and a leader elsewhere: honest, and indistinguishable
    from made-up ids; the gathering stays open for other subnets' joiners for a moment only."""
    sizes, seconds = run_virtual(_group_time([None, "51.15.0.1", "51.15.0.2", "51.15.0.3"]))
    assert sizes == [4] * 4 and WINDOW * SEAT_FRACTION <= seconds < WINDOW * SEAT_FRACTION + 0.5, seconds
