"""A ring neighbour that answers each part just inside its send timeout must not stretch a round.

A pipeline stage's ring all-reduce waited for each part's answer up to SEND_TIMEOUT (30 s), and
the round's deadline (`ring_timeout`) bounded only the receiving: a right-hand neighbour that
answered every part after 29 s made a 60 s round of an 8 MB vector take 464 s, holding the
stage's averaging (no new round starts meanwhile). The deadline now covers the sends."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.pipeline.ring import RingAllReduce, RingError, Segment

RING_TIMEOUT = 60.0


@pytest.mark.timeout(60)
def test_a_slow_neighbour_cannot_stretch_a_ring_round_past_its_deadline():
    async def main():
        net = EmulatedNetwork(latency=0.005)
        mine, theirs = net.transport(), net.transport()
        for t in (mine, theirs):
            await t.start()
        mine.add_addresses(theirs.peer_id, theirs.addresses)
        theirs.add_addresses(mine.peer_id, mine.addresses)
        me = RingAllReduce(types.SimpleNamespace(transport=mine), "r", "ping", part_bytes=2**18, parts_in_flight=2)
        slow = RingAllReduce(types.SimpleNamespace(transport=theirs), "r", "ping", part_bytes=2**18,
                             parts_in_flight=2)
        receive = slow._receive

        async def answer_late(request, ctx):  # each part answered just inside SEND_TIMEOUT (30 s)
            reply = await receive(request, ctx)
            await asyncio.sleep(29)
            return reply
        theirs.add_handler(slow.method, answer_late)
        segment = Segment(0, 1, tuple(sorted([str(mine.peer_id), str(theirs.peer_id)])))
        loop = asyncio.get_running_loop()
        start = loop.time()
        other = asyncio.ensure_future(slow.allreduce(0, segment, torch.ones(2_000_000), timeout=10**6))
        with pytest.raises(RingError):
            await me.allreduce(0, segment, torch.ones(2_000_000), timeout=RING_TIMEOUT)
        assert loop.time() - start < RING_TIMEOUT + 5, f"the round took {loop.time() - start:.0f} s"
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        for t in (mine, theirs):
            await t.close()
    run_virtual(main())
