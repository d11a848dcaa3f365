"""A malicious member of an averaging group, as a sender: three honest peers and one that lies
(issue 15), over the emulated network in virtual time.

Observed before the fix: a member stepping with weight=1e30 and tensors of 42 left every honest
peer with exactly 42.0; a member sending 1e30 left them with 2.5e29. Now a sender's weight
counts for at most MAX_WEIGHT_OVER_MEDIAN times the median weight, and robust aggregation keeps
the honest peers near the honest mean whatever the member sends; and every reducer names the
member (a warning with its peer id and the evidence), and no honest one (before: nobody was named).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.allreduce.reduction import MAX_WEIGHT_OVER_MEDIAN
from potluck.core.virtual_time import run_virtual
from tests.emulated_swarm import make_swarm

SIZE = 1000
HONEST = 3


async def one_round(attack: torch.Tensor, attack_weight: float, aggregation: str,
                    caplog: pytest.LogCaptureFixture) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of a group of HONEST honest peers (weight 1) and a member sending `attack` with
    `attack_weight`: the honest peers' tensors before (stacked) and their result (the same on all).
    Checks that the reducer of every shard names the member, once, and names no honest peer."""
    caplog.set_level(logging.WARNING, logger="potluck.averaging.allreduce")
    net, peers = await make_swarm(HONEST + 1)
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(SIZE, generator=g) + i for i in range(HONEST)]
    averagers = [Averager(p, [t], "job", target_group_size=HONEST + 1, matchmaking_time=1.0, aggregation=aggregation)
                 for p, t in zip(peers, [*honest, attack], strict=True)]
    results = await asyncio.gather(*(a.astep(weight=1.0) for a in averagers[:HONEST]),
                                   averagers[HONEST].astep(weight=attack_weight))
    after = [a._tensors[0] for a in averagers[:HONEST]]
    assert all(torch.equal(result, after[0]) for result in after)
    named = [r.getMessage() for r in caplog.records if "is not an honest member" in r.getMessage()]
    attacker = str(peers[HONEST].transport.peer_id)
    # Under a robust aggregation, a member named is left out of that very step (averaging.suspicion).
    assert all(r.group_size == HONEST + 1 for r in results)
    honest_ids = {str(p.transport.peer_id) for p in peers[:HONEST]}
    left_out = bool(named) and aggregation != "mean"
    assert all(set(r.contributors) == honest_ids if left_out else len(r.contributors) == HONEST + 1 for r in results)
    assert all(attacker in m for m in named)  # no honest peer named
    assert sorted(int(m.split()[3].rstrip(":")) for m in named) == list(range(HONEST + 1))  # each shard once
    return torch.stack(honest), after[0]


def within_honest_values(result: torch.Tensor, honest: torch.Tensor) -> bool:
    """Every coordinate between the smallest and the largest honest value of it."""
    return bool((result >= honest.min(0).values).all() and (result <= honest.max(0).values).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation", ["mean", "centered_clip", "trimmed_mean"])
def test_a_huge_weight_counts_as_a_bounded_number_of_members(aggregation, caplog):
    """Bound: the member counts for at most MAX_WEIGHT_OVER_MEDIAN honest members, so with the
    mean each honest result is at most c / (3 + c) of the way (0.4 for c = 2; was all the way)
    from the honest mean to 42. Robust aggregation: trimmed_mean stays between the smallest and
    largest honest value of every coordinate (weights play no part in it); centered_clip, where
    the member holds 2/5 of the weight, within twice the largest honest distance from the honest
    mean, whatever value the member sends."""
    async def main():
        honest, result = await one_round(torch.full((SIZE,), 42.0), 1e30, aggregation, caplog)
        mean = honest.mean(0)
        share = MAX_WEIGHT_OVER_MEDIAN / (HONEST + MAX_WEIGHT_OVER_MEDIAN)
        assert ((result - mean).abs() <= share * (42.0 - mean).abs() + 1e-4).all()
        if aggregation == "centered_clip":
            assert (result - mean).norm() <= 2 * max((h - mean).norm() for h in honest)
        if aggregation == "trimmed_mean":
            assert within_honest_values(result, honest)
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation", ["centered_clip", "trimmed_mean"])
def test_huge_finite_values_do_not_carry_robust_aggregation_away(aggregation, caplog):
    """Bound: centered_clip stays within the largest honest distance from the honest mean (in
    norm); trimmed_mean between the smallest and the largest honest value of every coordinate.
    (With the mean, the member sending 1e30 moves everyone by 1e30 / 4.)"""
    async def main():
        honest, result = await one_round(torch.full((SIZE,), 1e30), 1.0, aggregation, caplog)
        mean = honest.mean(0)
        assert (result - mean).norm() <= max((h - mean).norm() for h in honest)
        if aggregation == "trimmed_mean":
            assert within_honest_values(result, honest)
    run_virtual(main())
