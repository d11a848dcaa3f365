"""A stable group meets again without the DHT, and anything else sends its members back to it.

Matchmaking's fast path (`potluck.averaging.matchmaking`) and the Optimizer's direct progress
reports to the last group's members (`potluck.optim.progress`), on the emulated network.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.matchmaking import BEGIN_SLACK
from potluck.core.errors import AveragingError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.optim.progress import ProgressTracker
from tests.emulated_swarm import add_peer, make_swarm

WINDOW = 1.0


def count_group_reads(peers) -> list[int]:
    """Count each peer's DHT reads of matchmaking keys (the slow path)."""
    reads = [0] * len(peers)
    for i, peer in enumerate(peers):
        original = peer.dht.aget

        async def counting(key, *args, _i=i, _original=original, **kwargs):
            if ".match." in key:
                reads[_i] += 1
            return await _original(key, *args, **kwargs)
        peer.dht.aget = counting
    return reads


def averagers(peers, run_id="regroup"):
    return [Averager(p, [torch.full((64,), float(i))], run_id, matchmaking_time=WINDOW) for i, p in enumerate(peers)]


def ids(peers) -> frozenset[str]:
    return frozenset(str(p.transport.peer_id) for p in peers)


@pytest.mark.timeout(60)
def test_a_stable_group_meets_again_without_the_dht_and_averages_exactly():
    async def main():
        net, peers = await make_swarm(4)
        avgs = averagers(peers)
        first = await asyncio.gather(*(a.astep(group_key="e0", members=ids(peers)) for a in avgs))
        assert all(r.group_size == 4 for r in first)
        reads = count_group_reads(peers)
        loop = asyncio.get_running_loop()
        for epoch in range(1, 4):
            for i, a in enumerate(avgs):
                with a.get_tensors() as tensors:
                    tensors[0].fill_(float(i * epoch))
            started = loop.time()
            results = await asyncio.gather(*(a.astep(group_key=f"e{epoch}", members=ids(peers)) for a in avgs))
            assert all(r.group_size == 4 for r in results)
            for a in avgs:
                torch.testing.assert_close(a._tensors[0], torch.full((64,), 1.5 * epoch))
            # no settling, no polling: the group is back within a few network round trips
            assert loop.time() - started < WINDOW / 4
        assert reads == [0, 0, 0, 0]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_newcomer_opens_the_group_and_is_averaged_in():
    async def main():
        net, peers = await make_swarm(4)
        avgs = averagers(peers)
        await asyncio.gather(*(a.astep(group_key="e0", members=ids(peers)) for a in avgs))
        peers.append(await add_peer(net, peers))
        avgs += averagers(peers[4:])
        with avgs[4].get_tensors() as tensors:
            tensors[0].fill_(10.0)
        reads = count_group_reads(peers)
        results = await asyncio.gather(*(a.astep(group_key="e1", members=ids(peers)) for a in avgs))
        assert [r.group_size for r in results] == [5] * 5
        for a in avgs:
            torch.testing.assert_close(a._tensors[0], torch.full((64,), (0 + 1 + 2 + 3 + 10) / 5))
        assert sum(reads) > 0  # found through the DHT
        # the next round is stable again: the five meet without the DHT
        reads[:] = [0] * 5
        results = await asyncio.gather(*(a.astep(group_key="e2", members=ids(peers)) for a in avgs))
        assert [r.group_size for r in results] == [5] * 5 and reads == [0] * 5
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leader_fate", ["left", "silent"])
def test_members_whose_leader_left_or_stays_away_form_a_group_without_it(leader_fate):
    async def main():
        net, peers = await make_swarm(4)
        avgs = averagers(peers)
        first = await asyncio.gather(*(a.astep(group_key="e0", members=ids(peers)) for a in avgs))
        leader = first[0].peers[0]
        gone = next(i for i, p in enumerate(peers) if str(p.transport.peer_id) == leader)
        if leader_fate == "left":
            avgs[gone].shutdown()
            await peers[gone].transport.close()
        rest = [a for i, a in enumerate(avgs) if i != gone]
        staying = ids([p for i, p in enumerate(peers) if i != gone])
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await asyncio.gather(*(a.astep(group_key="e1", members=staying) for a in rest))
        assert [r.group_size for r in results] == [3] * 3
        assert leader not in results[0].peers
        assert loop.time() - started < 2 * WINDOW  # at most half a window lost asking the old leader
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("computing", [True, False])
def test_a_member_before_its_late_leader_waits_for_it_only_while_it_computes(computing):
    """A member begins 0.6 windows before its last leader, past its first wait (half its window).
    A leader that computed meanwhile (the optimizer's progress view says so) is late, not gone:
    the member asks again and all four meet. Before, it went to the DHT and gathered alone while
    the leader, gathering its last members without the DHT, waited out its window for it. A
    leader that computed nothing (stalled) is not waited for past the first wait, as before."""
    async def main():
        net, peers = await make_swarm(4)
        avgs = averagers(peers)
        first = await asyncio.gather(*(a.astep(group_key="e0", members=ids(peers)) for a in avgs))
        lead = next(i for i, p in enumerate(peers) if str(p.transport.peer_id) == first[0].peers[0])
        early = (lead + 1) % 4
        asked = []
        avgs[early].matchmaker.last.computed = lambda peer, since: asked.append(str(peer)) or computing

        async def step(i: int):
            if i != early:
                await asyncio.sleep(0.6 * WINDOW)
            return await avgs[i].astep(group_key="e1", members=ids(peers))
        results = await asyncio.gather(*(step(i) for i in range(4)), return_exceptions=True)
        sizes = [getattr(r, "group_size", "failed") for r in results]
        assert asked and set(asked) == {first[0].peers[0]}, asked  # about its last leader only
        if computing:
            assert sizes == [4] * 4, results
        else:
            assert sizes[early] == "failed" and sorted(sizes[:early] + sizes[early + 1:]) == [3] * 3, results
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_leader_that_says_it_computes_and_never_gathers_costs_its_member_one_window():
    """A last leader whose progress keeps moving but that never begins the round (stuck, or
    lying) is asked again only until LATE_LEADER_FRACTION of the member's window: the member then
    looks in the DHT and its round ends with its window, not BEGIN_SLACK later."""
    async def main():
        net, peers = await make_swarm(4)
        avgs = averagers(peers)
        first = await asyncio.gather(*(a.astep(group_key="e0", members=ids(peers)) for a in avgs))
        lead = next(i for i, p in enumerate(peers) if str(p.transport.peer_id) == first[0].peers[0])
        member = avgs[(lead + 1) % 4]
        asked = []
        member.matchmaker.last.computed = lambda peer, since: asked.append(since) or True
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(AveragingError):
            await member.astep(group_key="e1", members=ids(peers))
        assert len(asked) >= 2 and loop.time() - began < WINDOW + BEGIN_SLACK / 2, (asked, loop.time() - began)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_only_members_of_the_last_group_may_ask_to_be_held_by_its_leader():
    async def main():
        net, peers = await make_swarm(3)
        avgs = averagers(peers[:2])
        first = await asyncio.gather(*(a.astep(group_key="e0") for a in avgs))
        leader = next(p for p in peers if str(p.transport.peer_id) == first[0].peers[0])
        stranger = peers[2]
        request = {"key": "e1/all", "schema": avgs[0].schema, "role": "node", "bw": [1e6, 1e6], "meta": None,
                   "again": 60.0}
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await stranger.transport.call(leader.transport.peer_id, RunNames("regroup").averager("tensors").join, request)
        assert "refused" in reply and "last group" in reply["refused"]
        assert loop.time() - started < 1.0  # answered at once, not held
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_leader_gathering_another_key_turns_its_last_members_away_at_once():
    """A Moshpit member's next key is another row's or column's: its last leader, gathering its
    own next key, sends it to the DHT at once instead of holding it for its wait (half a window
    lost on every round after the first)."""
    async def main():
        net, peers = await make_swarm(2)
        avgs = averagers(peers)
        first = await asyncio.gather(*(a.astep(group_key="e0") for a in avgs))
        lead = next(i for i, p in enumerate(peers) if str(p.transport.peer_id) == first[0].peers[0])
        member = peers[1 - lead]
        gathering = asyncio.ensure_future(avgs[lead].astep(group_key="column3"))
        await asyncio.sleep(0.1 * WINDOW)  # it gathers under its own next key now
        request = {"key": "row5/all", "schema": avgs[0].schema, "role": "node", "bw": [1e6, 1e6], "meta": None,
                   "again": 60.0}
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await member.transport.call(peers[lead].transport.peer_id, RunNames("regroup").averager("tensors").join, request)
        assert "refused" in reply and "not gathering" in reply["refused"]
        assert loop.time() - started < 0.1 * WINDOW  # answered at once, not held
        await asyncio.gather(gathering, return_exceptions=True)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_progress_is_taken_only_from_neighbors_and_only_about_themselves():
    async def main():
        net, peers = await make_swarm(3)
        trackers = [ProgressTracker(p.dht, p.transport, "run", str(p.transport.peer_id), 256) for p in peers]
        a, b, stranger = trackers
        a.set_neighbors([b.peer_id])
        b.set_neighbors([a.peer_id])
        stranger.set_neighbors([a.peer_id])  # it pushes to a, but a does not count it as a neighbor
        await b.report(3, 96, 100.0, 3, store=False)
        await stranger.report(3, 10**6, 1e6, 3, store=False)
        await asyncio.sleep(0.1)
        assert set(a.pushed) == {b.peer_id}
        report = a.pushed[b.peer_id]
        assert (report.epoch, report.samples, report.samples_per_second) == (3, 96, 100.0)
        # stamped with a's clock on arrival, whatever time the sender claims
        assert abs(report.time - a.dht.get_time()) < 0.2
        merged = a.merged({})
        assert set(merged) == {b.peer_id}
        # A neighbor computes while its progress moves; the same numbers again are no step.
        since = a.dht.get_time()
        await asyncio.sleep(0.1)
        await b.report(3, 96, 100.0, 3, store=False)
        await asyncio.sleep(0.1)
        assert not a.computed_since(b.peer_id, since)
        await b.report(3, 104, 100.0, 3, store=False)
        await asyncio.sleep(0.1)
        assert a.computed_since(b.peer_id, since) and not a.computed_since(stranger.peer_id, 0.0)
        for t in trackers:
            t.close()
    run_virtual(main())
