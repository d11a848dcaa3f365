"""A malicious leader among three honest peers: it declares early, so it leads, and gives itself
every part of the vector to reduce (it would then return whatever it likes for all of it)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from potluck.averaging import Averager, matchmaking
from potluck.averaging.accountability import ban_list
from potluck.core.virtual_time import run_virtual
from tests.emulated_swarm import make_swarm

N = 400


@pytest.mark.timeout(60)
def test_a_leader_that_gives_itself_every_part_is_refused_and_the_honest_peers_average_alone(monkeypatch, caplog):
    """Bound: the honest peers average among themselves (each ends with the mean of the three
    honest vectors, exactly), and each of them has the leader on its ban list."""
    async def main():
        net, peers = await make_swarm(4)
        avgs = [Averager(p, [torch.full((N,), float(i))], "greedy-leader", target_group_size=4,
                         matchmaking_time=2.0, sender_timeout=1.0) for i, p in enumerate(peers)]
        attacker = avgs[0]
        honest_close = attacker.matchmaker._close

        def greedy_close(gathering):  # every part to the leader, the rest of the group as it should be
            with monkeypatch.context() as m:
                m.setattr(matchmaking, "balanced_parts", lambda total, modes, up, down: [total] + [0] * (len(modes) - 1))
                return honest_close(gathering)
        attacker.matchmaker._close = greedy_close

        async def one(i: int):
            await asyncio.sleep(0.5 * (i > 0))  # the attacker declares first: it leads
            return await avgs[i].astep(timeout=30)
        with caplog.at_level(logging.WARNING):
            results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        assert not any(isinstance(r, BaseException) for r in results[1:]), results
        for a in avgs[1:]:
            assert torch.equal(a._tensors[0], torch.full((N,), 2.0))
            assert attacker.transport.peer_id in ban_list(a.transport)
        assert results[1].group_size == 3
        assert sum(str(attacker.transport.peer_id) in r.getMessage() and "split" in r.getMessage()
                   for r in caplog.records) == 3
    run_virtual(main())
