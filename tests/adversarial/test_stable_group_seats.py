"""A stranger cannot take a seat of a stable group that meets again.

A group whose members are the same as last time meets again without the DHT: its leader gathers
under a key anyone can guess (the round's) and closes once its last members are back. Only
rejoins (`again`) were limited to those members: a plain join from any peer id took a seat, and
the honest member it displaced was told "group is full" (a made-up id per stable group was enough
to split every one of them). Now the gathering takes its last members only."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from tests.emulated_swarm import make_swarm

WINDOW = 1.0


@pytest.mark.timeout(60)
def test_a_stranger_cannot_take_a_seat_of_a_group_meeting_again():
    async def main():
        net, peers = await make_swarm(4)
        members, stranger = peers[:3], peers[3]
        ids = frozenset(str(p.transport.peer_id) for p in members)
        avgs = [Averager(p, [torch.full((16,), float(i))], "seats", matchmaking_time=WINDOW)
                for i, p in enumerate(members)]
        first = await asyncio.gather(*(a.astep(group_key="e0", members=ids) for a in avgs))
        leader = next(p for p in members if str(p.transport.peer_id) == first[0].peers[0])
        request = {"key": "e1/all", "schema": avgs[0].schema, "role": "node", "bw": [1e9, 1e9], "meta": None}
        method = RunNames("seats").averager("tensors").join

        async def intrude():  # as soon as the leader gathers again
            while True:
                reply = await stranger.transport.call(leader.transport.peer_id, method, request, timeout=5)
                if "not gathering" not in reply.get("refused", ""):
                    return reply
                await asyncio.sleep(0.001)

        *results, reply = await asyncio.gather(*(a.astep(group_key="e1", members=ids) for a in avgs), intrude())
        assert "refused" in reply and "last members" in reply["refused"], reply
        assert [r.group_size for r in results] == [3, 3, 3]
        assert str(stranger.transport.peer_id) not in results[0].peers
    run_virtual(main())
