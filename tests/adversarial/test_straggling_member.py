"""A seated member that trickles its pieces holds up its group's step once, not every step.

A member of a group that sent each chunk of its pieces just inside the sender timeout (or never
sent them) held every reducer up to that timeout per chunk, and nothing remembered it: it took a
seat again the next round, and every round paid (three honest members and such a follower: a
step of 0.28 s took 19.8 s). Now reducers leave out a sender still sending long after half of the
senders are in (`STRAGGLER_FACTOR` times their time plus `STRAGGLER_GRACE`; it still receives the
result), and a peer whose reducer did so does not seat it, nor its subnet, nor join it as a leader,
for a while (`averaging.lapses`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.allreduce import CHUNK_ELEMENTS, SENDER_TIMEOUT, AllReduceRun
from potluck.averaging.allreduce.reducer import STRAGGLER_GRACE
from potluck.averaging.lapses import FIRST_HOLD_SECONDS, lapses
from potluck.core.virtual_time import run_virtual
from potluck.net.identity import Identity
from potluck.net.origins import Origin
from tests.emulated_swarm import add_peer, make_swarm

HONEST = 3
# Pieces of two chunks for each of the four reducers.
ELEMENTS = 4 * 2 * CHUNK_ELEMENTS
TRICKLE = SENDER_TIMEOUT - 0.5  # seconds before each chunk: just inside the sender timeout


class _Trickling:
    """A stream that sends each message TRICKLE seconds late."""

    def __init__(self, channel):
        self._channel = channel

    def __getattr__(self, name):
        return getattr(self._channel, name)

    async def send(self, message):
        await asyncio.sleep(TRICKLE)
        await self._channel.send(message)


def _trickle_from(monkeypatch, peer_id) -> None:
    send_piece = AllReduceRun._send_piece

    async def trickling(self, channel, *args):
        if self.service.transport.peer_id == peer_id:
            channel = _Trickling(channel)
        return await send_piece(self, channel, *args)
    monkeypatch.setattr(AllReduceRun, "_send_piece", trickling)


def _silent(monkeypatch, peer_id) -> None:
    exchange = AllReduceRun._exchange

    async def silent(self, shard, reducer):
        if self.service.transport.peer_id == peer_id and reducer != self.me:
            await asyncio.sleep(3600)  # opens no stream to the others' reducers
        return await exchange(self, shard, reducer)
    monkeypatch.setattr(AllReduceRun, "_exchange", silent)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["trickles", "never-sends"])
def test_a_seated_member_that_holds_up_its_pieces_costs_one_short_step_and_then_no_seat(monkeypatch, how):
    async def main():
        net, honest = await make_swarm(HONEST)
        trickler = await add_peer(net, honest, ip="51.15.0.7")
        (_trickle_from if how == "trickles" else _silent)(monkeypatch, trickler.transport.peer_id)
        peers = [*honest, trickler]
        avgs = [Averager(p, [torch.full((ELEMENTS,), float(i))], "straggle", target_group_size=4,
                         matchmaking_time=2.0) for i, p in enumerate(peers)]
        loop = asyncio.get_running_loop()

        async def step(averager: Averager, key: str, delay: float):
            await asyncio.sleep(delay)
            started = loop.time()
            result = await averager.astep(group_key=key, timeout=60)
            return result, loop.time() - started

        # Round 1: the trickler joins last (an honest peer leads) and takes a seat.
        first = await asyncio.gather(*(step(a, "e0", 0.01 * i) for i, a in enumerate(avgs[:HONEST])),
                                     step(avgs[HONEST], "e0", 0.03), return_exceptions=True)
        assert not any(isinstance(r, BaseException) for r in first[:HONEST]), first
        ids = {str(p.transport.peer_id) for p in honest}
        bad = str(trickler.transport.peer_id)
        for result, took in first[:HONEST]:
            assert bad in result.peers  # it had a seat
            assert bad not in result.contributors and ids <= set(result.contributors), result
            # Before: 28.9 s trickling (and each honest member averaged alone), 10 s silent.
            assert took < 2 * STRAGGLER_GRACE, took
        held = [lapses(p.transport).held(trickler.transport.peer_id, p.transport.peer_origin(trickler.transport.peer_id))
                for p in honest]
        assert any(h > 0 for h in held), held
        for avg, h in zip(avgs[:HONEST], held, strict=True):  # nor joined as a leader by a peer that holds it
            assert avg.matchmaker._held_leader(trickler.transport.peer_id) == (h > 0)
        if how == "trickles":  # it got the round's result anyway (it is left out, not cut off)
            assert first[HONEST][0].group_size == 4

        # Round 2: the honest peers average together without it, as fast as honest peers do.
        second = await asyncio.gather(*(step(a, "e1", 0.01 * i) for i, a in enumerate(avgs)),
                                      return_exceptions=True)
        for outcome in second[:HONEST]:
            assert not isinstance(outcome, BaseException), second
            result, took = outcome
            assert bad not in result.peers and set(result.peers) == ids, result
            assert took < 3.0, took  # the matchmaking window and an honest all-reduce
        for a in avgs:
            a.shutdown()
    run_virtual(main())


def test_a_lapse_holds_its_subnet_for_a_minute_then_longer_if_it_lapses_again():
    async def main():
        net, peers = await make_swarm(1)
        other = await add_peer(net, peers, ip="51.15.0.7")
        record = lapses(peers[0].transport)
        origin = peers[0].transport.peer_origin(other.transport.peer_id)
        record.note(other.transport.peer_id, origin, "never connected")
        another_id = (await add_peer(net, peers, ip="51.15.0.8")).transport
        assert record.held(other.transport.peer_id, origin) == pytest.approx(FIRST_HOLD_SECONDS, abs=1)
        assert record.held(another_id.peer_id, peers[0].transport.peer_origin(another_id.peer_id)) > 0  # its subnet
        record.note(other.transport.peer_id, origin, "never connected")  # again, while held
        assert record.held(other.transport.peer_id, origin) == pytest.approx(2 * FIRST_HOLD_SECONDS, abs=1)
        await asyncio.sleep(2 * FIRST_HOLD_SECONDS + 1)
        assert record.held(other.transport.peer_id, origin) == 0
        record.note(other.transport.peer_id, origin, "never connected")  # after the hold: a first lapse again
        assert record.held(other.transport.peer_id, origin) == pytest.approx(FIRST_HOLD_SECONDS, abs=1)
    run_virtual(main())



def test_a_lapse_of_a_peer_met_through_a_relay_holds_its_id_only():
    async def main():
        _, peers = await make_swarm(1)
        record = lapses(peers[0].transport)
        lapsed, other = (Identity.generate().peer_id for _ in range(2))
        relay = Origin.relayed("some-relay")
        record.note(lapsed, relay, "never connected")
        assert record.held(lapsed, relay) > 0
        assert record.held(other, relay) == 0  # another peer behind the same relay
    run_virtual(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slower", [4, 6])
def test_an_honest_member_on_a_slower_link_still_counts(slower: int):
    """The straggler rule leaves honest links several times slower than the others' in the
    average (STRAGGLER_FACTOR): three peers at 100 Mbit/s and one at 100 / `slower`."""
    async def main():
        net, peers = await make_swarm(HONEST)
        peers.append(await add_peer(net, peers, bandwidth=100e6 / slower))
        avgs = [Averager(p, [torch.full((ELEMENTS,), float(i))], "slow", target_group_size=4,
                         matchmaking_time=2.0) for i, p in enumerate(peers)]
        results = await asyncio.gather(*(a.astep(group_key="e0", timeout=60) for a in avgs))
        everyone = {str(p.transport.peer_id) for p in peers}
        for result in results:
            assert set(result.contributors) == everyone, result
        for a in avgs:
            a.shutdown()
    run_virtual(main())
