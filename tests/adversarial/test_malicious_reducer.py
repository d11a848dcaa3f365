"""One malicious member among three honest ones in an averaging group, on the emulated network.

Each attack is played by patching the attacker's own all-reduce run; the honest peers' results
must stay within a stated bound, and the attacker must be identified (banned and logged)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.accountability import ban_list
from potluck.averaging.allreduce import AllReduceRun, AllReduceService, reduction
from potluck.averaging.allreduce.messages import ResultChunk, ResultFinal
from potluck.averaging.allreduce.reducer import ShardReducer
from potluck.compression import get_codec
from potluck.core.errors import AveragingError
from potluck.core.virtual_time import run_virtual
from tests.adversarial.members import N, assert_refused, group_of_four, step_together, warnings_naming

HONEST_FIRST = (0.0, 0.0, 0.0, 0.2)  # peer 3, the attacker, starts last, so it does not lead


def reducing_on(transport) -> bool:
    """Whether the caller is reducing a shard for the peer of `transport` (the attacker's reducer,
    not a member that checks its work)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, ShardReducer):
            return owner.host.service.transport is transport
        frame = frame.f_back
    return False


def attacker_runs(monkeypatch: pytest.MonkeyPatch, attacker: Averager, method: str, replacement) -> None:
    """Replace `method` of AllReduceRun for the attacker's runs only."""
    original = getattr(AllReduceRun, method)

    def patched(self, *args, **kwargs):
        if self.service.transport is attacker.transport:
            return replacement(self, original, *args, **kwargs)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(AllReduceRun, method, patched)


def reduce_to_1e6(monkeypatch: pytest.MonkeyPatch, attacker) -> None:
    """The reducer of the peer of transport `attacker` fills its shard with 1e6 (the same lie to all)."""
    honest_chunk = reduction.weighted_chunk

    def lying_chunk(pieces, weights, senders, c, out, scratch):
        honest_chunk(pieces, weights, senders, c, out, scratch)
        if reducing_on(attacker):
            out.fill_(1e6)
    monkeypatch.setattr(reduction, "weighted_chunk", lying_chunk)


@pytest.mark.timeout(60)
def test_a_failure_report_for_a_part_the_reporter_does_not_hold_fails_nobody(monkeypatch, caplog):
    """Bound: the report changes nothing; every honest peer ends with the exact mean of the four."""
    def lying_state(self, original):
        return original(self).__class__(**{**vars(original(self)), "failure": "shard 0 lost senders [1]"})

    async def main():
        avgs, _ = await group_of_four("false-failure", matchmaking_time=1.0)
        attacker_runs(monkeypatch, avgs[3], "state", lying_state)
        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, HONEST_FIRST)
        assert not any(isinstance(r, BaseException) for r in results[:3]), results
        for a in avgs[:3]:
            assert torch.equal(a._tensors[0], torch.full((N,), 1.5))
        attacker = avgs[3].transport.peer_id
        coordinator = next(a for a in avgs if str(a.transport.peer_id) == results[0].peers[0])
        assert attacker in ban_list(coordinator.transport)
        assert warnings_naming(caplog, attacker, "does not hold")
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_reducer_that_returns_a_wrong_aggregate_is_caught_by_every_honest_peer(monkeypatch, caplog):
    """The attacker reduces its shard to 1e6 for everyone (the same wrong result to all, so no
    comparison of results shows it). Bound: every honest peer keeps its own tensors (the step
    fails there), and every honest peer has the attacker on its ban list."""

    async def main():
        avgs, vectors = await group_of_four("wrong-aggregate", matchmaking_time=1.0)
        attacker = avgs[3].transport
        reduce_to_1e6(monkeypatch, attacker)
        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, HONEST_FIRST)
        assert_refused(results, avgs[:3], vectors, avgs[3])
        assert warnings_naming(caplog, attacker.peer_id, "not what its pieces reduce to") == 3
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", ["blockwise4", "uniform8"])
def test_a_reducer_that_forges_the_coded_pieces_a_check_fetches_is_caught_by_every_honest_peer(
        monkeypatch, caplog, compression):
    """Under a lossy codec a check fetches each sender's block in the codec's form (a check then
    costs what the round sent, issue 19): a block of a blockwise code, or, where the codec scales
    a whole chunk (uniform8), the sender's payload of that chunk as the reducer received it (before,
    float32: an 8-bit all-reduce sent 1.8x a float32 one's bytes). The attacker reduces its shard
    to 1e6 and answers every check with well-formed coded pieces that say 1e6 too (a constant
    encodes exactly), so that they reduce to its lie. Bound: they do not decode to the values the
    senders' digests bind: every honest peer keeps its tensors and bans the attacker."""
    honest_verify = AllReduceService._on_verify
    codec = get_codec(compression)
    attacker, coded = None, []

    async def forging_verify(self, request, ctx):
        reply = await honest_verify(self, request, ctx)
        if self.transport is attacker:
            for entry in reply["p"]:
                coded.append(entry[5])  # whether the check's answer travels in the codec's form
                if entry[5]:
                    entry[4] = codec.encode(torch.full_like(codec.decode(entry[4]), 1e6))
        return reply
    monkeypatch.setattr(AllReduceService, "_on_verify", forging_verify)  # before the services bind it

    async def main():
        nonlocal attacker
        avgs, vectors = await group_of_four("forged-pieces", matchmaking_time=1.0, spread=True, compression=compression)
        attacker = avgs[3].transport
        reduce_to_1e6(monkeypatch, attacker)
        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, HONEST_FIRST)
        assert_refused(results, avgs[:3], vectors, avgs[3])
        assert warnings_naming(caplog, attacker.peer_id, "it cannot show member") == 3
        assert coded and all(coded), coded
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_reducer_that_sends_one_member_another_result_is_caught_by_its_own_signatures(monkeypatch, caplog):
    """The attacker sends one honest member (the victim) its shard plus one, signed as properly
    as the others' (it signs what each receives). Bound: no honest peer uses the result (each
    keeps its tensors), and every honest peer bans the attacker: the coordinator holds two of its
    signatures on different results and aborts the step with them as proof."""
    honest_write = ShardReducer._write

    async def main():
        avgs, vectors = await group_of_four("equivocation", matchmaking_time=1.0)
        attacker, victim = avgs[3].transport, avgs[1].transport

        async def equivocating_write(self, outbox, channel):
            run = self.host
            if run is None or run.service.transport is not attacker or channel.peer_id != victim.peer_id:
                return await honest_write(self, outbox, channel)
            sent = {}
            while True:
                msg = await outbox.get()
                if isinstance(msg, ResultChunk):
                    wrong = reduction.decode_chunk(self.codec, msg.payload, self.size) + 1.0
                    sent[msg.chunk] = wrong
                    msg = ResultChunk(msg.chunk, reduction.encode_chunk(self.codec, wrong))
                elif hasattr(msg, "signature"):  # sign what the victim receives
                    msg = dataclasses.replace(msg, signature=run.sign_final(self.shard, msg.senders, msg.version, sent))
                await self.stats.send(channel, msg.to_wire())
                if isinstance(msg, ResultFinal):
                    await channel.close()
                    return True
        monkeypatch.setattr(ShardReducer, "_write", equivocating_write)
        with caplog.at_level(logging.WARNING):
            results = await step_together(avgs, HONEST_FIRST)
        assert_refused(results, avgs[:3], vectors, avgs[3])
        assert all("different results" in str(r) for r in results[:3] if r is not results[1])
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_reducer_that_says_it_answered_checks_it_refused_has_its_result_used_by_nobody(monkeypatch):
    """The coordinator commits once every member's checks are answered, on the reducers' word,
    while the members go through the answers. The attacker reduces its shard to 1e6, refuses
    every check of it, and says from the start that it answered everyone's. Bound: the step ends
    at once rather than at a deadline, and every honest peer, which finishes its checks before
    it uses a result, keeps its own tensors."""
    claimed = []

    def claiming_state(self, original):
        state = original(self)
        claimed.append(state.outcome.committed)
        return dataclasses.replace(state, answered={j: (0, tuple(range(len(self.group.peers)))) for j in self.reducers})

    def refusing_check(self, original, request):
        raise AveragingError("not answering")

    async def main():
        avgs, vectors = await group_of_four("claimed-answers", matchmaking_time=1.0)
        reduce_to_1e6(monkeypatch, avgs[3].transport)
        attacker_runs(monkeypatch, avgs[3], "state", claiming_state)
        attacker_runs(monkeypatch, avgs[3], "answer_check", refusing_check)
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await step_together(avgs, HONEST_FIRST)
        assert loop.time() - start < 5.0  # (matchmaking 1 s; the step's timeout is 30 s)
        assert claimed
        for result, averager, vector in zip(results[:3], avgs[:3], vectors, strict=False):
            assert isinstance(result, AveragingError) and "could not be checked" in str(result), result
            assert torch.equal(averager._tensors[0], vector)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_reducer_that_reports_the_leaders_piece_missing_does_not_make_the_others_shun_the_leader(monkeypatch):
    """The attacker's reducer reports the leader's piece as not delivered, so the step goes on
    without it. Each member that saw the leader take no part in its own group used to refuse it
    and its subnet for an hour (`hold_against`, for silent leaders): one lie per round split a
    swarm from its honest leaders. A member now holds a leader to that only on its own reducers'
    word. Bound: the step ends for every honest member, and none of them shuns the leader."""
    original = ShardReducer._report
    attackers = []

    def framing(self):
        if self.host.service.transport in attackers:
            self.left_out = {**self.left_out, 0: "made up"}  # member 0 leads (an honest one: HONEST_FIRST)
        return original(self)

    async def main():
        avgs, _ = await group_of_four("framed-leader", matchmaking_time=1.0)
        attackers.append(avgs[3].transport)
        monkeypatch.setattr(ShardReducer, "_report", framing)
        results = await step_together(avgs, HONEST_FIRST)
        assert not any(isinstance(r, BaseException) for r in results[:3]), results
        leader = next(a.transport.peer_id for a in avgs[:3] if str(a.transport.peer_id) == results[0].peers[0])
        assert str(leader) not in results[0].contributors  # the lie took it out of the step
        followers = [a for a in avgs[:3] if a.transport.peer_id != leader]
        assert len(followers) == 2 and not any(a.matchmaker._held_leader(leader) for a in followers)
    run_virtual(main())
