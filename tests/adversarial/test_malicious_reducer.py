"""One malicious member among three honest ones in an averaging group, on the emulated network.

Each attack is played by patching the attacker's own all-reduce run; the honest peers' results
must stay within a stated bound, and the attacker must be identified (banned and logged)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.accountability import ban_list
from potluck.averaging.allreduce import AllReduceRun
from potluck.core.virtual_time import run_virtual
from tests.emulated_swarm import make_swarm

N = 400  # elements averaged: 4 shards of 100


async def four_peers(tag: str) -> tuple[list[Averager], list[torch.Tensor]]:
    """Peers 0-2 are honest, peer 3 is the attacker; peer 3 starts last, so it does not lead."""
    net, peers = await make_swarm(4)
    vectors = [torch.full((N,), float(i)) for i in range(4)]
    avgs = [Averager(p, [v], tag, target_group_size=4, matchmaking_time=1.0, sender_timeout=1.0)
            for p, v in zip(peers, vectors, strict=True)]
    return avgs, vectors


async def steps(avgs: list[Averager]) -> list:
    async def one(i: int):
        await asyncio.sleep(0.2 * (i == 3))
        return await avgs[i].astep(timeout=30)
    return await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)


def attacker_runs(monkeypatch: pytest.MonkeyPatch, attacker: Averager, method: str, replacement) -> None:
    """Replace `method` of AllReduceRun for the attacker's runs only."""
    original = getattr(AllReduceRun, method)

    def patched(self, *args, **kwargs):
        if self.service.transport is attacker.transport:
            return replacement(self, original, *args, **kwargs)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(AllReduceRun, method, patched)


@pytest.mark.timeout(60)
def test_a_failure_report_for_a_part_the_reporter_does_not_hold_fails_nobody(monkeypatch, caplog):
    """Bound: the report changes nothing; every honest peer ends with the exact mean of the four."""
    def lying_state(self, original):
        return original(self).__class__(**{**vars(original(self)), "failure": "shard 0 lost senders [1]"})

    async def main():
        avgs, vectors = await four_peers("false-failure")
        attacker_runs(monkeypatch, avgs[3], "state", lying_state)
        with caplog.at_level(logging.WARNING):
            results = await steps(avgs)
        assert not any(isinstance(r, BaseException) for r in results[:3]), results
        for a in avgs[:3]:
            assert torch.equal(a._tensors[0], torch.full((N,), 1.5))
        attacker = avgs[3].transport.peer_id
        coordinator = next(a for a in avgs if str(a.transport.peer_id) == results[0].peers[0])
        assert attacker in ban_list(coordinator.transport)
        assert any(str(attacker) in r.getMessage() and "does not hold" in r.getMessage() for r in caplog.records)
    run_virtual(main())
