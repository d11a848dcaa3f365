"""Requests for steps that never start here (junk group ids) must not lock honest members out.

A member's piece, or its wait for the coordinator, can reach a peer just before that peer starts
the step; the all-reduce service holds such a request up to REGISTRATION_WAIT for the step to
start. Any caller can name a group id that never starts. Before, each such id took an entry of
one table of 1,000 for all callers, and an entry whose request was cancelled (its caller's
deadline under REGISTRATION_WAIT, a cancel frame, a lost connection) stayed for good: once 1,000
had piled up, every early request was refused ("too many pending groups"), and an honest member's
piece that came before the reducer's own start was lost. Now the entry goes with its last waiter,
and waiting requests are shared per origin (`allreduce.service.EARLY_REQUESTS_PER_*`)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from potluck.averaging.allreduce import AllReduceService
from potluck.averaging.allreduce.messages import METHOD_WAIT, StepRef
from potluck.averaging.allreduce.service import EARLY_REQUESTS_PER_IP
from potluck.compression import get_codec
from potluck.core.errors import NetworkError, PotluckError
from potluck.core.virtual_time import run_virtual
from potluck.net import Identity, TCPTransport
from tests.adversarial.scene import running
from tests.test_allreduce import make_group, swarm

JUNK_IDS = 1100  # more than the old table's 1,000
LATE = 1.0  # seconds the victim starts its step after the other members


async def honest_step_with_a_late_member(transports, services, late: int) -> list:
    """Three members average; member `late` starts LATE s after the others, so their pieces and
    waits reach it early. Returns each member's result (or exception)."""
    n = len(transports)
    group = make_group(transports, ["node"] * n, 3000, gid=os.urandom(16))
    vectors = [torch.full((3000,), float(i)) for i in range(n)]

    async def one(i: int):
        if i == late:
            await asyncio.sleep(LATE)
        result, _ = await services[i].run(group, vectors[i], 1.0, get_codec("none"), 60.0, sender_timeout=3.0)
        return result
    return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


def assert_exact_mean(results, n: int) -> None:
    for i, r in enumerate(results):
        assert not isinstance(r, BaseException), f"member {i}: {r!r}"
        assert torch.equal(r, torch.full((3000,), (n - 1) / 2)), f"member {i} did not get the mean of all {n}"


@pytest.mark.timeout(60)
def test_cancelled_requests_for_junk_group_ids_leave_nothing_behind():
    """One caller names 1,100 group ids that never start, each request given up after 0.2 s; then
    three honest members average, one of them starting late: every piece that came early is
    counted (before, the 1,000 stale entries refused them all, and the late member's result
    missed the others' pieces)."""
    async def main():
        _, transports, services = await swarm(4)
        attacker, victim = transports[3], transports[2]

        async def junk(k: int) -> None:
            for _ in range(k):
                try:
                    await attacker.call(victim.peer_id, METHOD_WAIT, StepRef(os.urandom(16)).to_wire(), timeout=0.2)
                except PotluckError:
                    pass
        await asyncio.gather(*(junk(JUNK_IDS // 50) for _ in range(50)))
        await asyncio.sleep(1.0)  # every junk request's handler is gone by now
        assert_exact_mean(await honest_step_with_a_late_member(transports[:3], services[:3], late=2), 3)
    run_virtual(main())


@pytest.mark.timeout(120)
def test_made_up_ids_of_one_host_waiting_on_junk_group_ids_leave_an_honest_step_room(arun):
    """Over TCP: 40 made-up ids on 127.0.0.1 each hold 32 requests for junk group ids (1,280, each
    held the full REGISTRATION_WAIT) while three honest members on another /24 (127.0.1.x) average,
    one starting late. The host holds at most its share; the honest step is exact."""
    async def main():
        honest = [TCPTransport(Identity.generate(), host=f"127.0.1.{i + 1}") for i in range(3)]
        async with running(*honest):
            for t in honest:
                for u in honest:
                    if u is not t:
                        t.add_addresses(u.peer_id, u.addresses)
            services = [AllReduceService(t) for t in honest]
            victim = honest[2]
            fakes = [TCPTransport(Identity.generate(), host="127.0.0.1") for _ in range(40)]
            outcome = {"held": 0, "refused": 0}

            async def hold(fake: TCPTransport) -> None:
                try:
                    await fake.call(victim.peer_id, METHOD_WAIT, StepRef(os.urandom(16)).to_wire(), timeout=30)
                except (NetworkError, PotluckError) as e:
                    outcome["refused" if "share" in str(e) or "too many" in str(e) else "held"] += 1
            async with running(*fakes):
                for fake in fakes:
                    await fake.connect(victim.addresses[0], timeout=10)
                attack = [asyncio.ensure_future(hold(f)) for f in fakes for _ in range(32)]
                await asyncio.sleep(0.5)  # the junk requests are all in
                results = await honest_step_with_a_late_member(honest, services, late=2)
                await asyncio.gather(*attack)
            assert_exact_mean(results, 3)
            assert outcome["refused"] >= 40 * 32 - EARLY_REQUESTS_PER_IP, outcome  # the host got its share, no more
            for s in services:
                s.close()
    arun(main(), timeout=110)
