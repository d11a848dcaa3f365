"""A member that reports a live member dead, among three honest ones, on the emulated network.

The coordinator believed reported deaths: the victim was left out of the step (its step failed)
and its shard was repaired, possibly onto the liar. It now asks the reported member first."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import torch

from potluck.averaging.allreduce import DEATH_PROBE_TIMEOUT, AllReduceRun, AllReduceService, Group
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
