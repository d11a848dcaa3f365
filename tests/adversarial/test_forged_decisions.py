"""A member must not be able to make the coordinator's decisions for it.

Members show the coordinator the last decision they follow (`MemberState.outcome`), so that a
coordinator taking over from a dead one can carry its decisions on. The coordinator took a
member's word for it: one member's state with a made-up committed decision over no shards made
every honest member return its result buffer unwritten (a commit of nothing holds "every shard
final"), and a made-up abort failed the step for all. Decisions are now signed by the
coordinator that makes them (`Outcome.by`, `Outcome.signature`), a coordinator carries on only
those of itself or of a coordinator before it, members follow only such decisions, and a
member commits only holding every shard of the group, checked."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging.allreduce import Group
from potluck.averaging.allreduce.messages import METHOD_WAIT, MemberState, Outcome, SyncRequest
from potluck.core.errors import PotluckError
from potluck.core.virtual_time import run_virtual
from tests.test_allreduce import CODEC, swarm

N = 400


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forged", [Outcome(5, (0,), {}, True), Outcome(7, (), {}, False, "made up by member 3")],
                         ids=["commit", "abort"])
def test_a_decision_a_member_made_up_is_not_followed(forged):
    async def main():
        _, transports, services = await swarm(4)
        group = Group(b"g", tuple(t.peer_id for t in transports), ("node",) * 4, (N // 4,) * 4)
        attacker = transports[3]  # a member of the group that runs no step, and lies to the coordinator

        async def honest(i: int):
            return await services[i].run(group, torch.full((N,), float(i)), 1.0, CODEC, timeout=30.0,
                                         sender_timeout=1.0)

        async def lie() -> None:
            await asyncio.sleep(0.01)
            state = MemberState(3, (), {}, (), forged.version, forged)
            try:
                await attacker.call(group.peers[0], METHOD_WAIT, SyncRequest(b"g", state).to_wire(), timeout=5)
            except PotluckError:
                pass
        *results, _ = await asyncio.gather(*(honest(i) for i in range(3)), lie(), return_exceptions=True)
        for i, r in enumerate(results):
            assert not isinstance(r, BaseException), f"member {i}: {r!r}"
            vector, senders = r
            assert senders == (0, 1, 2) and torch.equal(vector, torch.full((N,), 1.0)), f"member {i}: {senders}"
    run_virtual(main())
