"""A malicious leader among three honest peers: it declares early, so it leads, and gives itself
every part of the vector to reduce (it would then return whatever it likes for all of it)."""

from __future__ import annotations

import logging

import pytest
import torch

from potluck.averaging import matchmaking
from potluck.averaging.accountability import ban_list
from potluck.core.virtual_time import run_virtual
from tests.adversarial.members import N, group_of_four, step_together, warnings_naming


@pytest.mark.timeout(60)
def test_a_leader_that_gives_itself_every_part_is_refused_and_the_honest_peers_average_alone(monkeypatch, caplog):
    """Bound: the honest peers average among themselves (each ends with the mean of the three
    honest vectors, exactly), and each of them has the leader on its ban list."""
    async def main():
        avgs, _ = await group_of_four("greedy-leader", matchmaking_time=2.0)
        attacker = avgs[0]
        honest_close = attacker.matchmaker._close

        def greedy_close(gathering):  # every part to the leader, the rest of the group as it should be
            with monkeypatch.context() as m:
                m.setattr(matchmaking, "balanced_parts", lambda total, roles, up, down: [total] + [0] * (len(roles) - 1))
                return honest_close(gathering)
        attacker.matchmaker._close = greedy_close

        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, (0.0, 0.5, 0.5, 0.5))  # the attacker declares first: it leads
        assert not any(isinstance(r, BaseException) for r in results[1:]), results
        for a in avgs[1:]:
            assert torch.equal(a._tensors[0], torch.full((N,), 2.0))
            assert attacker.transport.peer_id in ban_list(a.transport)
        assert results[1].group_size == 3
        assert warnings_naming(caplog, attacker.transport.peer_id, "split") == 3
    run_virtual(main())
