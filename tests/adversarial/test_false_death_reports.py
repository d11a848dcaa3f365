"""A member that reports a live member dead, among three honest ones, on the emulated network.

The coordinator believed reported deaths: the victim was left out of the step (its step failed)
and its shard was repaired, possibly onto the liar. It now asks the reported member first."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import torch

from potluck.averaging.allreduce import AllReduceRun, AllReduceService, Group
from potluck.averaging.allreduce.coordinator import DEATH_PROBE_TIMEOUT
from potluck.core.errors import AveragingError, PeerUnreachable
from potluck.core.virtual_time import run_virtual
from tests.adversarial.members import N, group_of_four, step_together, warnings_naming
from tests.test_allreduce import CODEC, swarm


@pytest.mark.timeout(60)
def test_a_member_reported_dead_that_answers_stays_in_the_step(monkeypatch, caplog):
    """The attacker (otherwise honest) tells the coordinator, in every state it sends, that the
    member just before it is dead: that member's shard would be repaired onto the attacker.
    Bound: nobody honest is left out; every member ends with the exact mean of all four."""
    async def main():
        avgs, _ = await group_of_four("false-death", matchmaking_time=1.0)
        attacker = avgs[3].transport
        victims = []
        honest_state = AllReduceRun.state

        def lying_state(self):
            state = honest_state(self)
            if self.service.transport is not attacker:
                return state
            victim = (self.me - 1) % len(self.group.peers)
            if victim == self.group.coordinators()[0]:  # the coordinator ignores news of its own death
                victim = (self.me + 1) % len(self.group.peers)
            victims.append(self.group.peers[victim])
            return dataclasses.replace(state, dead=tuple(sorted({*state.dead, victim})))
        monkeypatch.setattr(AllReduceRun, "state", lying_state)

        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, (0.0, 0.0, 0.0, 0.2))  # the attacker starts last: it does not lead
        assert victims
        assert not any(isinstance(r, BaseException) for r in results), results
        for a in avgs:
            assert torch.equal(a._tensors[0], torch.full((N,), 1.5))
        assert all(len(r.contributors) == 4 for r in results)
        assert warnings_naming(caplog, attacker.peer_id, "but it answered") >= 1
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_member_that_cannot_reach_a_live_reducer_fails_alone_and_soon(monkeypatch):
    """An honest member (the reporter) cannot open its stream to one live reducer (the victim),
    and reports it dead; the victim's reducer never hears from the reporter, and reports it dead
    too. Both answer the coordinator, so both stay in; the reporter never gets the victim's shard,
    so the coordinator stops waiting for it. Bound: the others commit long before the step's
    deadline (30 s), each with the exact mean of the contributors, the reporter not among them
    (nor the victim, whose piece of its shard the reporter, believing it dead, did not take);
    only the reporter's step fails."""
    async def main():
        avgs, _ = await group_of_four("lost-link", matchmaking_time=1.0)
        reporter = avgs[3].transport
        honest_open = AllReduceService.open
        cut = []

        async def open_but_one(self, run, reducer, request):
            me = run.group.peers.index(reporter.peer_id)
            victim = next(i for i in run.group.shards if i not in (me, run.group.coordinators()[0]))
            if self.transport is reporter and reducer == victim:
                cut.append(victim)
                raise PeerUnreachable("the link to this reducer is down")
            return await honest_open(self, run, reducer, request)
        monkeypatch.setattr(AllReduceService, "open", open_but_one)
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await step_together(avgs, (0.0, 0.0, 0.0, 0.2))
        assert cut
        assert loop.time() - start < 15.0
        assert isinstance(results[3], AveragingError), results
        index = {str(a.transport.peer_id): i for i, a in enumerate(avgs)}
        contributors = sorted(index[c] for c in results[0].contributors)
        assert 3 not in contributors and len(contributors) >= 2
        for a, r in zip(avgs[:3], results[:3], strict=True):
            assert sorted(index[c] for c in r.contributors) == contributors
            assert torch.equal(a._tensors[0], torch.full((N,), sum(contributors) / len(contributors)))
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent", [False, True])
def test_a_member_reported_dead_that_does_not_answer_is_left_out_soon(silent):
    """Crash faults still count: member 3 (a sender only) dies before the step, and the
    coordinator (member 0, which reduces nothing) hears of it only from the reducers' reports.
    The others commit without it once the coordinator's probe fails, within the reducers' sender
    timeout plus the probe's deadline (the step's own deadline is 60 s)."""
    async def main():
        net, transports, services = await swarm(4)
        group = Group(b"g", tuple(t.peer_id for t in transports), ("node",) * 4, (0, N // 2, N // 2, 0))
        net.crash(group.peers[3], silent=silent)
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(service: AllReduceService, i: int):
            return await service.run(group, torch.full((N,), float(i)), 1.0, CODEC, timeout=60.0, sender_timeout=1.0)
        results = await asyncio.gather(*(one(s, i) for i, s in enumerate(services[:3])))
        assert loop.time() - start < 1.0 + DEATH_PROBE_TIMEOUT + 1.0
        for result, contributors in results:
            assert torch.equal(result, torch.full((N,), 1.0))
            assert contributors == (0, 1, 2)
    run_virtual(main())
