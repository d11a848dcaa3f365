"""A made-up id declared as a key's earliest peer, that gives the joins it gets nothing usable.

Leaders are chosen by their declarations (the earliest to close leads), and anyone can declare.
A silent one held every follower's join until its deadline, and their own followers waited
behind them: one made-up id wrecked every round (a step of three honest averagers took 17 s and
two of them failed). One that answered at once did as much: a "failed" ended every follower's
round; a refusal naming the honest peers as its members made each skip them all; and a group of
itself and the joiner, in which it then took no part, averaged nothing, and was asked again first
the next round. Such a leader is now not joined again for an hour, nor is any peer of its
subnet: the subnet costs one round, not every round."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.allreduce.group import Group
from potluck.averaging.load_balancing import balanced_parts
from potluck.averaging.matchmaking import Declaration, FormedGroup, JoinAccepted, JoinFailed, JoinRefused, JoinRequest
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht import own_subkey
from potluck.net.emulated import EmulatedNetwork
from tests.emulated_swarm import SimPeer, add_peer, make_swarm

WINDOW = 2.0


async def _silent_leader(net: EmulatedNetwork, peers: list[SimPeer], ip: str, key: str, schema: str,
                         answer=lambda request, ctx, me: asyncio.sleep(3600)) -> asyncio.Task:
    """A new made-up id at `ip` that declares under `key` as its earliest peer (its record always
    closing a moment from now) and answers every join it gets with `answer` (default: never)."""
    liar = await add_peer(net, list(peers), ip=ip)
    me = liar.transport.peer_id
    liar.transport.add_handler(RunNames("silent").averager("tensors").join,
                               lambda request, ctx: answer(request, ctx, me))

    async def declare() -> None:
        while True:
            await liar.dht.astore(key, Declaration(schema).to_wire(), liar.dht.get_time() + 0.3,
                                  subkey=own_subkey(liar.transport.peer_id))
            await asyncio.sleep(0.1)
    return asyncio.ensure_future(declare())


@pytest.mark.timeout(60)
def test_a_silent_leader_costs_its_subnet_one_round_not_every_round(caplog):
    async def main():
        net, honest = await make_swarm(3)
        avgs = [Averager(p, [torch.full((16,), float(i))], "silent", target_group_size=3, matchmaking_time=WINDOW)
                for i, p in enumerate(honest)]
        names = RunNames("silent").averager("tensors")
        loop = asyncio.get_running_loop()
        rounds = []
        for key, ip in (("e0", "51.15.0.7"), ("e1", "51.15.0.8")):  # another id and address of the subnet
            liar = await _silent_leader(net, honest, ip, names.declarations(f"{key}/all"), avgs[0].schema)
            await asyncio.sleep(0.2)
            start = loop.time()
            results = await asyncio.gather(*(a.astep(group_key=key, timeout=30) for a in avgs), return_exceptions=True)
            rounds.append((loop.time() - start, [getattr(r, "group_size", r) for r in results]))
            liar.cancel()
        seconds, sizes = rounds[1]
        assert sizes == [3, 3, 3] and seconds < WINDOW, rounds
        assert "held our join request" in caplog.text
    with caplog.at_level(logging.WARNING):
        run_virtual(main())


@pytest.mark.timeout(60)
def test_followers_of_a_leader_held_by_a_silent_one_still_get_their_group():
    """Three peers know the silent subnet (a round cost them); a newcomer that leads them does
    not, and is held in turn. It gives up on the silent one in time to close its own gathering
    (before, it gave up at its own deadline, and its followers failed with it), and it is not
    taken for a silent leader by them."""
    async def main():
        net, honest = await make_swarm(4)
        avgs = [Averager(p, [torch.full((16,), float(i))], "silent", target_group_size=4, matchmaking_time=WINDOW)
                for i, p in enumerate(honest)]
        names = RunNames("silent").averager("tensors")
        newcomer, others = avgs[0], avgs[1:]
        liar = await _silent_leader(net, honest, "51.15.0.7", names.declarations("e0/all"), avgs[0].schema)
        await asyncio.sleep(0.2)
        await asyncio.gather(*(a.astep(group_key="e0", timeout=30) for a in others), return_exceptions=True)
        liar.cancel()
        liar = await _silent_leader(net, honest, "51.15.0.8", names.declarations("e1/all"), avgs[0].schema)
        await asyncio.sleep(0.2)

        async def step(averager: Averager, delay: float):
            await asyncio.sleep(delay)
            return await averager.astep(group_key="e1", timeout=30)
        results = await asyncio.gather(*(step(a, 0.0 if a is newcomer else 0.05) for a in avgs),
                                       return_exceptions=True)
        liar.cancel()
        assert [getattr(r, "group_size", r) for r in results] == [4, 4, 4, 4], results
        for a in others:
            assert not a.matchmaker._held_leader(newcomer.transport.peer_id)
    run_virtual(main())


async def _failed(request, ctx, me):
    return JoinFailed("no group today").to_wire()


async def _refused(request, ctx, me, honest=()):
    return JoinRefused("full", tuple(honest)).to_wire()


async def _alone_with_you(request, ctx, me):
    """A group of the liar and the joiner, as fair as any: then it takes no part."""
    join = JoinRequest.from_wire(request)
    roles, bandwidths = ("node", join.role), (join.bandwidth, join.bandwidth)
    parts = balanced_parts(16, list(roles), [b[0] for b in bandwidths], [b[1] for b in bandwidths])
    group = Group(os.urandom(16), (me, ctx.peer_id), roles, tuple(parts))
    return JoinAccepted(FormedGroup(group, (None, join.metadata), bandwidths)).to_wire()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", ["failed", "refused", "alone_with_you"])
def test_a_leader_that_answers_at_once_with_nothing_usable_costs_its_subnet_one_round(answer):
    async def main():
        net, honest = await make_swarm(3)
        avgs = [Averager(p, [torch.full((16,), float(i))], "silent", target_group_size=3, matchmaking_time=WINDOW,
                         sender_timeout=1.0) for i, p in enumerate(honest)]
        names = RunNames("silent").averager("tensors")
        ids = [p.transport.peer_id for p in honest]
        reply = {"failed": _failed, "alone_with_you": _alone_with_you,
                 "refused": lambda request, ctx, me: _refused(request, ctx, me, ids)}[answer]
        rounds = []
        for key, ip in (("e0", "51.15.0.7"), ("e1", "51.15.0.8"), ("e2", None)):
            liar = None if ip is None else \
                await _silent_leader(net, honest, ip, names.declarations(f"{key}/all"), avgs[0].schema, reply)
            await asyncio.sleep(0.2)
            results = await asyncio.gather(*(a.astep(group_key=key, timeout=30) for a in avgs), return_exceptions=True)
            rounds.append([getattr(r, "group_size", r) for r in results])
            if liar is not None:
                liar.cancel()
        assert rounds[1] == [3, 3, 3] and rounds[2] == [3, 3, 3], rounds  # (e2: no liar, the last group again)
        for a in avgs:
            assert torch.equal(a._tensors[0], torch.full((16,), 1.0))
    run_virtual(main())
