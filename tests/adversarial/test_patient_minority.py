"""A patient member of an averaging group: one of four peers sends, every step, a piece one honest
spread below the honest mean on every coordinate ("a little is enough": never named far, within
the bounds of robust aggregation at each step), over the emulated network in virtual time.

Observed before: each step moved the honest result by about a quarter of the honest spread, in the
same direction; nothing followed from it, so after 8 steps the honest peers had drifted about
two spreads (linearly in the steps), and the member averaged with them for ever. Now every
honest reducer keeps a record of the pieces over steps (averaging.suspicion): the member is left
out of the step that gives it away (the second) and banned, so the drift stops after one step.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.accountability import ban_list
from potluck.core.errors import AveragingError
from potluck.core.virtual_time import run_virtual
from tests.emulated_swarm import make_swarm

SIZE = 2048
HONEST = 3
STEPS = 8


@pytest.mark.timeout(60)
def test_a_patient_minority_is_left_out_and_banned_and_the_drift_stops():
    async def main():
        net, peers = await make_swarm(HONEST + 1)
        averagers = [Averager(p, [torch.zeros(SIZE)], "job", target_group_size=HONEST + 1, min_group_size=HONEST,
                              matchmaking_time=1.0, aggregation="centered_clip") for p in peers]
        attacker = peers[HONEST].transport.peer_id
        g = torch.Generator().manual_seed(0)
        mu = torch.randn(SIZE, generator=g)
        drift = torch.zeros(SIZE)
        drifts, contributors = [], []
        for step in range(STEPS):
            honest = mu + torch.randn(HONEST, SIZE, generator=g)
            sent = [*honest, honest.mean(0) - honest.std(0)]
            for a, t in zip(averagers, sent, strict=True):
                with a.get_tensors() as tensors:
                    tensors[0].copy_(t)
            results = await asyncio.gather(*(a.astep(group_key=f"step{step}") for a in averagers),
                                           return_exceptions=True)
            assert not any(isinstance(r, BaseException) for r in results[:HONEST])
            assert isinstance(results[HONEST], AveragingError) or step < 2  # nobody takes it once banned
            contributors.append(set(results[0].contributors))
            after = averagers[0]._tensors[0]
            assert all(torch.equal(a._tensors[0], after) for a in averagers[:HONEST])
            drift += after - honest.mean(0)
            drifts.append((drift.norm() / SIZE ** 0.5).item())
        # Banned by the honest peers whose reducers found it out first; the others no longer meet it.
        assert any(attacker in ban_list(p.transport) for p in peers[:HONEST])
        assert not any(p.transport.peer_id in ban_list(q.transport) for p in peers[:HONEST] for q in peers[:HONEST])
        assert all(str(attacker) not in c for c in contributors[1:])  # out from the step that gave it away
        assert drifts[-1] == pytest.approx(drifts[0], rel=1e-5) and drifts[-1] < 0.5  # one step's bias, no more
        for a in averagers:
            a.shutdown()
    run_virtual(main())
