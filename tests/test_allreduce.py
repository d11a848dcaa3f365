"""Butterfly all-reduce on the emulated network: exact results, faults, bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
import torch

from potluck.averaging.accountability import VERIFY_BLOCK
from potluck.averaging.allreduce import AllReduceService, Group
from potluck.averaging.allreduce.coordinator import Coordinator
from potluck.averaging.allreduce.member import AllReduceRun
from potluck.averaging.allreduce.messages import (
    METHOD_PART,
    Equivocation,
    MemberState,
    Outcome,
    PartRequest,
    ResultChunk,
    ResultFinal,
    SignedFinal,
    parse_result,
)
from potluck.averaging.allreduce.reducer import ShardReducer
from potluck.averaging.load_balancing import optimal_fractions, part_sizes
from potluck.compression import get_codec
from potluck.core.errors import AveragingError, MalformedMessage
from potluck.core.serialization import pack
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity


class PlainCodec:
    """Sends tensors as they are (the averaging tests do not depend on the compression package)."""

    def encode(self, t):
        return t.contiguous()

    def decode(self, payload, numel=None):
        if not isinstance(payload, torch.Tensor):
            raise AveragingError("not a tensor")
        return payload


CODEC = PlainCodec()


async def swarm(n: int, bandwidth: float | None = 50e6, latency: float = 0.002, roles=None):
    net = EmulatedNetwork(latency=latency)
    roles = roles or ["node"] * n
    transports = [net.transport(upload=bandwidth, download=bandwidth, client_mode=(r == "client")) for r in roles]
    for t in transports:
        await t.start()
    for t in transports:
        for u in transports:
            if u is not t and u.addresses:
                t.add_addresses(u.peer_id, u.addresses)
    return net, transports, [AllReduceService(t) for t in transports]


def make_group(transports, roles, size, gid=b"g"):
    fractions = optimal_fractions(roles, [1.0] * len(roles))
    return Group(gid, tuple(t.peer_id for t in transports), tuple(roles), tuple(part_sizes(size, fractions)))


async def average(services, group, vectors, weights, crash_at=None, crash=(), net=None, **kwargs):
    kwargs.setdefault("timeout", 60.0)
    kwargs.setdefault("sender_timeout", 2.0)
    kwargs.setdefault("chunk", 1000)

    async def one(i):
        vec = None if group.roles[i] == "aux" else vectors[i]
        result, contributors = await services[i].run(group, vec, weights[i], CODEC, **kwargs)
        return result
    tasks = [asyncio.ensure_future(one(i)) for i in range(len(services))]
    if crash:
        await asyncio.sleep(crash_at)
        for i in crash:
            net.crash(group.peers[i])
            tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [None if i in crash else r for i, r in enumerate(results)]


async def average_four(size, latency=0.02, **kwargs):
    """Four nodes over links of `latency` average `size` random floats each, weighted 1 to 4:
    their services, vectors, weights and results."""
    net, transports, services = await swarm(4, latency=latency)
    group = make_group(transports, ["node"] * 4, size)
    vectors = [torch.randn(size) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    return services, vectors, weights, await average(services, group, vectors, weights, **kwargs)


def weighted_mean(vectors, weights, members):
    total = sum(weights[i] for i in members)
    return sum(vectors[i] * (weights[i] / total) for i in members)


def check_survivors_identical(results, members, expected):
    first = results[members[0]]
    assert not isinstance(first, BaseException), first
    for i in members:
        assert not isinstance(results[i], BaseException), (i, results[i])
        assert torch.equal(results[i], first), f"member {i} differs"
    torch.testing.assert_close(first, expected, rtol=0, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", range(2, 17))
def test_result_is_the_weighted_mean_and_identical_everywhere(n):
    async def main():
        net, transports, services = await swarm(n)
        group = make_group(transports, ["node"] * n, 20_011)
        g = torch.Generator().manual_seed(n)
        vectors = [torch.randn(20_011, generator=g) for _ in range(n)]
        # Random, never all equal, all within MAX_WEIGHT_OVER_MEDIAN of the median (none is bounded)
        weights = [float(w) for w in torch.rand(n, generator=g) + 1.0]
        assert len(set(weights)) == n
        results = await average(services, group, vectors, weights)
        check_survivors_identical(results, list(range(n)), weighted_mean(vectors, weights, range(n)))
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [3, 5, 7])
def test_identical_inputs_come_back_bit_identical(n):
    """Replicas that already agree must not drift apart by rounding when they average."""
    vector = torch.randn(5000) * 1e3
    weights = [float(w) for w in torch.rand(n) * 100 + 1]

    async def main():
        net, transports, services = await swarm(n)
        return await average(services, make_group(transports, ["node"] * n, 5000), [vector] * n, weights)
    for result in run_virtual(main()):
        assert torch.equal(result, vector)


@pytest.mark.timeout(60)
def test_client_and_aux_members():
    roles = ["node", "client", "aux", "node", "client"]

    async def main():
        net, transports, services = await swarm(len(roles), roles=roles)
        group = make_group(transports, roles, 9_999)
        assert group.part_sizes[1] == group.part_sizes[4] == 0 and group.part_sizes[2] > 0
        vectors = [torch.randn(9_999) for _ in roles]
        weights = [1.0, 2.0, 0.0, 3.0, 4.0]
        results = await average(services, group, vectors, weights)
        assert results[2] is None  # aux members reduce but hold no result
        receivers = [0, 1, 3, 4]
        check_survivors_identical(results, receivers, weighted_mean(vectors, weights, receivers))
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash", [[4], [1], [0], [1, 4], [0, 3]],
                         ids=["client-sender", "reducer", "coordinator", "sender+reducer", "coordinator+reducer"])
def test_members_killed_mid_step_leave_survivors_identical(crash):
    roles = ["node", "node", "node", "node", "client"]

    async def main():
        net, transports, services = await swarm(len(roles), bandwidth=10e6, roles=roles)
        group = make_group(transports, roles, 200_000)  # 800 KB per member: ~0.3 s at 10 MB/s
        vectors = [torch.randn(200_000) for _ in roles]
        weights = [1.0, 2.0, 3.0, 4.0, 5.0]
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await average(services, group, vectors, weights, crash_at=0.1, crash=crash, net=net)
        survivors = [i for i in range(len(roles)) if i not in crash]
        check_survivors_identical(results, survivors, weighted_mean(vectors, weights, survivors))
        assert loop.time() - start < 20  # within the stage deadlines, not the step's 60 s
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_decision_naming_the_early_finals_senders_commits_two_trips_later(monkeypatch):
    """Reducers send an early FINAL as they report, and members check it while the decision is
    made: a decision that names its senders finds them final and their checks on the way. The
    reducers say when they answered them, and the coordinator commits then, while the members go
    through the answers. Before, the decision was followed by the FINALs, a check's round trip and
    the word of it (five one-way trips), then by the check's round trip and the checker's word
    (three)."""
    latency = 0.05
    published: dict[str, float] = {}
    publish = Coordinator._publish

    def on_publish(self, outcome):
        published.setdefault("commit" if outcome.committed else f"v{outcome.version}", asyncio.get_running_loop().time())
        publish(self, outcome)
    monkeypatch.setattr(Coordinator, "_publish", on_publish)

    async def main():
        net, transports, services = await swarm(4, bandwidth=None, latency=latency)
        weights = [1.0, 2.0, 3.0, 4.0]
        for step in (b"first", b"second"):  # the second with the connections the first opened (checks
            published.clear()  # call members that a step's streams alone do not connect)
            group = make_group(transports, ["node"] * 4, 4_000, gid=step)
            vectors = [torch.randn(4_000) for _ in range(4)]
            results = await average(services, group, vectors, weights)
            check_survivors_identical(results, [0, 1, 2, 3], weighted_mean(vectors, weights, [0, 1, 2, 3]))
    run_virtual(main())
    # the members' checks leave as the decision does (the FINALs left with the reports); the
    # reducers' word that they answered comes back: two trips, not three (or five)
    assert published["commit"] - published["v1"] <= 2 * latency + 1e-9, published


@pytest.mark.timeout(60)
def test_the_commit_does_not_wait_for_the_decision_to_reach_the_members(monkeypatch):
    """Over loaded links the decision queued behind the last results (110 ms for a 25 ms trip),
    and the commit waited for it to reach every member and for their word that their early FINALs
    were final under it. The coordinator now counts the early FINALs a member shows as final when
    the decision names their senders, and the commit settles them there. Here the decision never
    reaches the members but the coordinator's own: the commit still comes, and every member ends
    with the same mean (before: the step ran out of its deadline)."""
    apply = AllReduceRun.apply

    def deaf_apply(self, outcome):
        if outcome.committed or self.me == self.current_coordinator():
            apply(self, outcome)
    monkeypatch.setattr(AllReduceRun, "apply", deaf_apply)

    async def main():
        _, vectors, weights, results = await average_four(8_000, timeout=10.0)
        check_survivors_identical(results, [0, 1, 2, 3], weighted_mean(vectors, weights, [0, 1, 2, 3]))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_decision_naming_fewer_senders_than_the_early_finals_is_reduced_again(monkeypatch):
    """Every reducer received member 3's piece and sent an early FINAL over all four, but member 3
    tells the coordinator it sent something else (its roots disagree with the reducers'): the
    decision leaves it out, the reducers reduce again over the other three and send FINAL under the
    decision. The honest members end with the mean of the three, identical, and ban nobody: a
    member checking an early FINAL that the decision replaced meanwhile is refused (the check names
    the FINAL's version), where the reducer used to answer with the new pieces and be caught.
    (That the second reduction goes into fresh memory is `[sender+reducer]` above: it failed
    without.)"""
    state = AllReduceRun.state

    def lying_state(self):
        s = state(self)
        if self.me == 3:
            s = dataclasses.replace(s, sent={j: b"\x01" * len(root) for j, root in s.sent.items()})
        return s
    monkeypatch.setattr(AllReduceRun, "state", lying_state)
    sealed: list[tuple[int, int]] = []
    seal = ShardReducer._seal

    def noting_seal(self, senders, version, signature=None):
        sealed.append((self.shard, version))
        seal(self, senders, version, signature)
    monkeypatch.setattr(ShardReducer, "_seal", noting_seal)

    async def main():
        services, vectors, weights, results = await average_four(40_000)
        check_survivors_identical(results, [0, 1, 2], weighted_mean(vectors, weights, [0, 1, 2]))
        assert all(len(services[i].banned) == 0 for i in range(3)), [list(services[i].banned) for i in range(3)]
    run_virtual(main())
    assert {(j, v) for j, v in sealed} == {(j, v) for j in range(4) for v in (0, 1)}, sealed  # early, then again


@pytest.mark.timeout(60)
def test_stalled_sender_is_excluded_after_its_deadline():
    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 5_000)
        vectors = [torch.randn(5_000) for _ in range(4)]
        weights = [1.0] * 4
        net.crash(group.peers[3], silent=True)  # never says anything
        results = await average(services[:3], group, vectors, weights, sender_timeout=1.0)
        check_survivors_identical(results, [0, 1, 2], weighted_mean(vectors, weights, [0, 1, 2]))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_non_finite_contribution_is_excluded_not_spread():
    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 5_000)
        vectors = [torch.randn(5_000) for _ in range(4)]
        bad = vectors[2].clone()
        bad[1234] = float("nan")
        sent = [vectors[0], vectors[1], bad, vectors[3]]
        weights = [1.0, 1.0, 1.0, 1.0]
        results = await average(services, group, sent, weights)
        # The peer with NaN receives the others' average too; its values never reach anyone.
        check_survivors_identical(results, [0, 1, 2, 3], weighted_mean(vectors, weights, [0, 1, 3]))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_member_whose_data_the_codec_refuses_abstains_without_stalling_anyone():
    """The real "none" codec refuses NaN while encoding: that member stops sending at once, the
    others average the finite contributions long before the sender timeout, and it gets an error."""
    codec = get_codec("none")

    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 50_000)
        g = torch.Generator().manual_seed(11)
        vectors = [torch.randn(50_000, generator=g) for _ in range(4)]
        bad = vectors[1].clone()
        bad[group.bounds(3)[0] + 5] = float("inf")  # only its piece of the last shard is refused
        weights = [1.0, 2.0, 3.0, 4.0]
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(i):
            return await services[i].run(group, bad if i == 1 else vectors[i], weights[i], codec, timeout=60.0,
                                         sender_timeout=10.0, chunk=1000)
        results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        assert loop.time() - start < 1.0  # not the 10 s sender timeout
        assert isinstance(results[1], AveragingError) and "could not be sent" in str(results[1]), results[1]
        good = [0, 2, 3]
        assert all(results[i][1] == tuple(good) for i in good)
        check_survivors_identical([r[0] if i in good else r for i, r in enumerate(results)], good,
                                  weighted_mean(vectors, weights, good))
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec, aggregation, most_bytes", [
    ("blockwise4", "mean", 4 * 4 * VERIFY_BLOCK // 6),  # 4 senders' blocks at 4 bits (+ digests), not 64 KiB of float32
    ({"name": "blockwise4", "block": 1000}, "mean", None),  # re-encoding a block is not exact: float32, no false alarm
    ("none", "centered_clip", 4 * 4 * VERIFY_BLOCK * 11 // 10),  # CenteredClip too: 4 blocks, not 4 chunks of 4 blocks
])
def test_a_check_fetches_the_block_in_the_codec_form_where_it_is_exact(monkeypatch, spec, aggregation, most_bytes):
    """A member that checks a reducer fetches a block of every sender's piece, whatever the
    aggregation (CenteredClip clips each block alone). Under a 4-bit code whose blocks align with
    the checked block it comes 4-bit: the check costs about what the round sent, not 4 bytes a
    value. Where the code cannot carry the block exactly it comes as float32. Either way it
    decodes to the values the digests bind: the step commits everywhere."""
    codec = get_codec(spec)
    replies = []
    honest_verify = AllReduceService._on_verify

    async def recording(self, request, ctx):
        replies.append(await honest_verify(self, request, ctx))
        return replies[-1]
    monkeypatch.setattr(AllReduceService, "_on_verify", recording)

    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 4 * 2 * VERIFY_BLOCK)
        g = torch.Generator().manual_seed(5)
        vectors = [torch.randn(group.total, generator=g) for _ in range(4)]
        results = await asyncio.gather(*(services[i].run(group, vectors[i], 1.0, codec, timeout=60.0, chunk=2**14,
                                                         aggregation=aggregation) for i in range(4)))
        assert all(torch.equal(r[0], results[0][0]) for r in results)
        torch.testing.assert_close(results[0][0], weighted_mean(vectors, [1.0] * 4, range(4)), rtol=0, atol=0.6)
    run_virtual(main())
    assert len(replies) == 4 * 3  # each member checks the three other reducers
    if most_bytes is not None:
        for reply in replies:
            packed = pack(reply)
            assert len(packed.body) + sum(b.nbytes for b in packed.buffers) < most_bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation,large", [("mean", True), ("centered_clip", True), ("centered_clip", False)])
def test_large_robust_reductions_run_off_the_event_loop_and_small_ones_on_it(monkeypatch, aggregation, large):
    """A robust reduction of a large shard costs tens of milliseconds (CenteredClip); reduced on
    the event loop, it stalled every stream of the peer meanwhile (and, with peers sharing a
    process, every peer). Reducers run it in a worker thread; the mean, about 1 ms, stays on the
    loop. So do the record of deviations (about 20 ms for 4 senders of 425,000 floats), the
    hashing of a reducer's result for its signature, and a member's check of a reducer. A small
    shard's robust work (`reducer.INLINE_ELEMENTS`) stays on the loop: in a thread, its many small
    ops wait on the GIL behind the loop's work (17-21 ms a round for 2.7 ms of work). The results
    stay identical everywhere either way."""
    import threading

    from potluck.averaging import robust
    from potluck.averaging.accountability import BanList
    from potluck.averaging.allreduce import reducer, reduction
    from potluck.averaging.suspicion import SuspicionLedger
    if large:  # 3,007 floats from 4 senders: above the limit
        monkeypatch.setattr(reducer, "INLINE_ELEMENTS", 1000)
    threads: dict[str, list] = {"reduce": [], "record": [], "sign": []}
    honest = robust.aggregate
    honest_record, honest_sign = SuspicionLedger.record, AllReduceRun.sign_final

    def recording(*args, **kwargs):
        threads["reduce"].append(threading.current_thread())
        return honest(*args, **kwargs)

    def record(*args, **kwargs):
        threads["record"].append(threading.current_thread())
        return honest_record(*args, **kwargs)

    def sign(*args, **kwargs):
        threads["sign"].append(threading.current_thread())
        return honest_sign(*args, **kwargs)
    monkeypatch.setattr(reduction, "aggregate", recording)
    monkeypatch.setattr(SuspicionLedger, "record", record)
    monkeypatch.setattr(AllReduceRun, "sign_final", sign)
    loop_threads = []

    async def main():
        loop_threads.append(threading.current_thread())
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 3 * 1000 + 7)
        g = torch.Generator().manual_seed(2)
        vectors = [torch.randn(group.total, generator=g) for _ in range(4)]
        ledgers = [None if aggregation == "mean" else SuspicionLedger(BanList(), BanList()) for _ in range(4)]
        results = await asyncio.gather(*(services[i].run(group, vectors[i], 1.0, CODEC, timeout=60.0, chunk=500,
                                                         aggregation=aggregation, suspicion=ledgers[i])
                                         for i in range(4)))
        assert all(torch.equal(r[0], results[0][0]) for r in results)
        assert all(r[1] == (0, 1, 2, 3) for r in results)
    run_virtual(main())
    if aggregation != "mean":  # every chunk of every shard (3,007 floats, chunks of 500), and 12 checks
        assert len(threads["reduce"]) >= 7 + 12
    assert len(threads["sign"]) == 4 and len(threads["record"]) == (0 if aggregation == "mean" else 4)
    on_loop = [t is loop_threads[0] for kind in threads.values() for t in kind]
    assert all(on_loop) if aggregation == "mean" or not large else not any(on_loop), aggregation


@pytest.mark.timeout(60)
def test_crash_scenario_is_deterministic_under_the_virtual_clock():
    """Same seeds, same crash: same results, contributors and virtual end time, bit for bit."""
    roles = ["node", "node", "node", "node", "client"]

    async def scenario():
        net, transports, services = await swarm(len(roles), bandwidth=10e6, roles=roles)
        group = make_group(transports, roles, 100_000)
        g = torch.Generator().manual_seed(1234)
        vectors = [torch.randn(100_000, generator=g) for _ in roles]
        weights = [float(w) for w in torch.rand(len(roles), generator=g) + 0.5]
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = [asyncio.ensure_future(services[i].run(group, vectors[i], weights[i], CODEC, timeout=60.0,
                                                       sender_timeout=2.0, chunk=1000)) for i in range(len(roles))]
        await asyncio.sleep(0.05)
        for i in (1, 4):  # a reducer and the client sender, mid-step
            net.crash(group.peers[i])
            tasks[i].cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        end = loop.time() - start
        survivors = [0, 2, 3]
        check_survivors_identical([o[0] if i in survivors else o for i, o in enumerate(outcomes)], survivors,
                                  weighted_mean(vectors, weights, survivors))
        return [outcomes[i][0] for i in survivors], [outcomes[i][1] for i in survivors], end

    first, second = run_virtual(scenario()), run_virtual(scenario())
    assert all(torch.equal(a, b) for a, b in zip(first[0], second[0], strict=True))
    assert first[1] == second[1] and first[1][0] == (0, 2, 3)
    assert first[2] == second[2], (first[2], second[2])


@pytest.mark.timeout(60)
def test_everyone_fails_together_when_no_reducer_survives():
    roles = ["node", "client", "client"]

    async def main():
        net, transports, services = await swarm(3, bandwidth=10e6, roles=roles)
        group = make_group(transports, roles, 100_000)
        vectors = [torch.randn(100_000) for _ in roles]
        results = await average(services, group, vectors, [1.0] * 3, crash_at=0.05, crash=[0], net=net,
                                timeout=30)
        for i in (1, 2):
            assert isinstance(results[i], AveragingError), results[i]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_forged_and_malformed_parts_are_refused_and_the_step_completes():
    async def main():
        net, transports, services = await swarm(3)
        group = make_group(transports, ["node"] * 3, 3_000)
        vectors = [torch.randn(3_000) for _ in range(3)]
        intruder = net.transport()
        await intruder.start()
        intruder.add_addresses(group.peers[0], transports[0].addresses)
        from potluck.core.errors import RemoteError

        async def attack(request, payloads):
            stream = await intruder.open_stream(group.peers[0], METHOD_PART, request, timeout=5)
            for p in payloads:
                await stream.send(p)
            await stream.close()
            with pytest.raises(RemoteError):
                async for _ in stream:
                    pass

        step = asyncio.ensure_future(average(services, group, vectors, [1.0] * 3))
        await asyncio.sleep(0.001)
        await attack({"g": b"g", "j": 0, "s": 1, "w": 1.0, "x": False}, [torch.zeros(1000)])  # claims to be 1
        await attack({"g": b"g", "j": 0, "s": "x", "w": 1.0, "x": False}, [])
        await attack({"g": b"g", "j": 0, "s": 0, "w": float("nan"), "x": False}, [])
        await attack("not a dict", [])
        results = await step
        check_survivors_identical(results, [0, 1, 2], weighted_mean(vectors, [1.0] * 3, [0, 1, 2]))
    run_virtual(main())


def test_load_balancing_gives_fast_peers_more_and_clients_nothing():
    assert optimal_fractions(["node"] * 4, [1e8] * 4) == pytest.approx([0.25] * 4)
    slow_first = optimal_fractions(["node"] * 3, [1e7, 1e8, 1e8])
    assert slow_first[0] == 0 and slow_first[1] == pytest.approx(0.5)
    with_aux = optimal_fractions(["node", "node", "node", "aux"], [1e8, 1e8, 1e8, 1e9])
    # the fast aux peer would take more than half, but no member takes more than twice an even share
    assert with_aux[3] == pytest.approx(0.5, abs=1e-3) and with_aux[0] == pytest.approx(with_aux[1], abs=1e-3)
    with_client = optimal_fractions(["node", "client", "node"], [1e8, 1e9, 1e8])
    assert with_client[1] == 0 and with_client[0] == pytest.approx(0.5, rel=1e-3)
    sizes = part_sizes(1001, [0.5, 0.25, 0.25])
    assert sum(sizes) == 1001 and sizes[0] > sizes[1]


def test_a_group_that_meets_again_does_not_solve_its_load_balancing_program_again(monkeypatch):
    """The leader and every member solve the group's program each round (9 ms each with a client
    among 4 members); a stable group declares the same roles and bandwidths every round."""
    import scipy.optimize

    from potluck.averaging import load_balancing
    solved = []
    honest = scipy.optimize.linprog
    monkeypatch.setattr(scipy.optimize, "linprog", lambda *a, **k: solved.append(1) or honest(*a, **k))
    roles, up, down = ["node", "node", "node", "client"], [1.1e7, 2.3e7, 1.7e7, 1e7], [3.1e7, 2e7, 1e7, 1e7]
    first = optimal_fractions(roles, up, down)
    calls = len(solved)
    assert calls > 0
    fresh = list(load_balancing._optimal_fractions.__wrapped__(tuple(roles), tuple(up), tuple(down)))  # uncached
    assert len(solved) == 2 * calls
    first[0] = -1.0  # the caller's list is its own
    for _ in range(3):  # the leader's split, and each member's check of it
        assert load_balancing.fair_split(load_balancing.balanced_parts(1000, roles, up, down), roles, up, down)
        assert optimal_fractions(roles, up, down) == fresh
    assert len(solved) == 2 * calls
    assert optimal_fractions(roles, up[::-1], down) != optimal_fractions(roles, up, down)  # other bandwidths


class OversizedCodec(PlainCodec):
    """A member that sends chunks bigger than the shard's chunk (lying about its piece)."""

    def encode(self, t):
        return torch.cat([t, torch.zeros(7)])


@pytest.mark.timeout(60)
def test_member_sending_oversized_chunks_is_excluded():
    async def main():
        net, transports, services = await swarm(4)
        group = make_group(transports, ["node"] * 4, 8_000)
        vectors = [torch.randn(8_000) for _ in range(4)]

        async def one(i):
            codec = OversizedCodec() if i == 2 else CODEC
            return (await services[i].run(group, vectors[i], 1.0, codec, timeout=30, sender_timeout=2.0, chunk=1000))[0]
        results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        # Member 2's pieces are refused everywhere, and its malformed results make the others move
        # its shard to a survivor; the liar itself may still end with the same result.
        check_survivors_identical(results, [0, 1, 3], weighted_mean(vectors, [1.0] * 4, [0, 1, 3]))
    run_virtual(main())


def test_part_request_and_member_state_refuse_malformed_fields_by_name():
    """Typed messages validate at parse time and name the field that was wrong."""
    transports = [types.SimpleNamespace(peer_id=Identity.generate().peer_id) for _ in range(3)]
    group = make_group(transports, ["node"] * 3, 30)
    good = PartRequest(b"g" * 32, 1, 2, 0.5, False)
    assert PartRequest.from_wire(good.to_wire()) == good
    for key, value, field in (("g", "x", "'g'"), ("g", b"g" * 65, "'g'"), ("w", float("nan"), "'w'"),
                              ("w", -1.0, "'w'"), ("x", 1, "'x'"), ("j", -1, "'j'"), ("s", True, "'s'")):
        with pytest.raises(MalformedMessage, match=field) as caught:
            PartRequest.from_wire({**good.to_wire(), key: value})
        assert caught.value.field
    proof = Equivocation(2, 2, 1, (0, 1), (b"a" * 32, b"b" * 32), (b"s" * 64, b"t" * 64))
    outcome = Outcome(3, (0, 1), {0: 0, 1: 1, 2: 2}, False, digests={0: b"d" * 32}, equivocation=proof)
    state = MemberState(1, (2,), {0: (0, 1)}, (0,), 3, outcome, sent={0: b"r" * 32, 1: b"q" * 32},
                        received={1: {0: b"r" * 32}}, checked=3, finals={0: SignedFinal(1, (0, 1), b"r" * 32, b"s" * 64)})
    assert MemberState.from_wire(state.to_wire(), n=len(group.peers)) == state
    for key, value, field in (("m", 3, "'m'"), ("dead", [0] * 4, "'dead'"), ("dead", [7], "'dead'"),
                              ("rep", [[0, [9]]], "'rep'"), ("rep", [[0]], "'rep'"), ("final", "0", "'final'"),
                              ("v", -1, "'v'"), ("fail", "x" * 1001, "'fail'"), ("o", {"v": 1}, "'o'"),
                              ("sent", [[0, b"r" * 31]], "'sent'"), ("sent", [[3, b"r" * 32]], "'sent'"),
                              ("recv", [[0]], "'recv'"), ("recv", [[0, [[1, "r"]]]], "'recv'"), ("chk", -1, "'chk'"),
                              ("fin", [[0, 1, [0], b"r" * 32]], "'fin'"), ("fin", [[0, 1, [0], b"r" * 32, b"s"]], "'fin'"),
                              ("o", {**outcome.to_wire(), "d": [[0, b"d"]]}, "'o'"),
                              ("o", {**outcome.to_wire(), "eq": [2, 2, 1, [0], b"a" * 32]}, "'o'")):
        with pytest.raises(MalformedMessage, match=field):
            MemberState.from_wire({**state.to_wire(), key: value}, n=len(group.peers))
    with pytest.raises(MalformedMessage, match="not a map"):
        MemberState.from_wire([1, 2], n=len(group.peers))


def test_result_messages_refuse_chunks_outside_the_shard_and_bad_finals():
    assert parse_result(ResultChunk(2, {"x": 1}).to_wire(), 3, 4) == ResultChunk(2, {"x": 1})
    assert parse_result(ResultFinal((0, 2), 5, b"s" * 64).to_wire(), 3, 4) == ResultFinal((0, 2), 5, b"s" * 64)
    for bad, field in (({"c": 3, "d": {}}, "'c'"), ({"c": -1, "d": {}}, "'c'"), ({"c": 0}, "'d'"),
                       ({"final": [4], "v": 1, "sig": b"s" * 64}, "'final'"),
                       ({"final": [], "v": "1", "sig": b"s" * 64}, "'v'"), ({"final": [], "v": 1}, "'sig'"),
                       ({"final": [], "v": 1, "sig": b"s" * 63}, "'sig'"), ([0], "not a map")):
        with pytest.raises(MalformedMessage, match=field):
            parse_result(bad, 3, 4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before-sending", "decided", "first-final", "all-final"])
def test_killed_client_member_does_not_hold_the_others_until_a_deadline(monkeypatch, when):
    """A client-mode member killed at any point of a step: it cannot be dialed, so the lost
    connections are the only sign; the survivors must finish at once, not at the sender timeout
    or the step's deadline (the demo's swarm stalled 20 s whenever its client-mode peer died)."""
    roles = ["node", "node", "client", "node"]
    crashed: list[float] = []

    async def main():
        net, transports, services = await swarm(len(roles), roles=roles)
        group = make_group(transports, roles, 50_000)

        def crash():
            if not crashed:
                crashed.append(asyncio.get_running_loop().time())
                net.crash(group.peers[2])
        publish, changed = Coordinator._publish, AllReduceRun._changed

        committed: list[tuple[int, ...]] = []

        def on_publish(self, outcome):  # the coordinator has just decided who the senders are
            publish(self, outcome)
            if outcome.committed:
                committed.append(outcome.senders)
            if when == "decided" and outcome.version == 1 and not outcome.committed:
                crash()

        def on_changed(self):  # the client has just received its first or its last FINAL (early
            # ones, before the decision), and it has not told the coordinator yet
            if self.me == 2 and len(self.finals) == {"first-final": 1, "all-final": 3}.get(when):
                crash()
            changed(self)
        monkeypatch.setattr(Coordinator, "_publish", on_publish)
        monkeypatch.setattr(AllReduceRun, "_changed", on_changed)
        vectors = [torch.randn(50_000) for _ in roles]
        weights = [1.0, 2.0, 3.0, 4.0]
        loop = asyncio.get_running_loop()
        if when == "before-sending":  # right after the group formed, before its first byte;
            # only the coordinator had a connection with it (the others learn it from there)
            await transports[2].connect(transports[group.coordinators()[0]].addresses[0])
            loop.call_soon(crash)
        results = await average(services, group, vectors, weights, timeout=60.0, sender_timeout=30.0)
        assert crashed, "the client was never killed: this test tested nothing"
        # Killed after its first FINAL, its piece is in if the coordinator decided before it heard
        # of the death (the decision's senders are the reports' intersection minus the dead): the
        # order of those two events is the network's, so the committed decision says which.
        averaged = {"before-sending": [0, 1, 3], "first-final": list(committed[-1])}.get(when, [0, 1, 2, 3])
        assert set(averaged) >= {0, 1, 3}, committed
        check_survivors_identical(results, [0, 1, 3], weighted_mean(vectors, weights, averaged))
        assert loop.time() - crashed[0] < 5.0  # not the 30 s sender timeout, nor the 60 s deadline
    run_virtual(main())


class _Host:
    """Just enough of a member for its Coordinator: member 0 of three, coordinating."""

    def __init__(self, outcome):
        peers = tuple(Identity.generate().peer_id for _ in range(3))
        self.me, self.group = 0, Group(b"g" * 16, peers, ("node",) * 3, (10, 10, 10))
        self.deadline, self.sender_timeout = asyncio.get_running_loop().time() + 60, 10.0
        self.dead: set[int] = set()
        self.outcome, self.state_changed, self.banned = outcome, asyncio.Event(), []

    def current_coordinator(self):
        return 0

    def state(self):
        return MemberState(0, (), {}, (), self.outcome.version, self.outcome)

    def spawn(self, coro):
        return asyncio.ensure_future(coro)

    def mark_dead(self, member):
        self.dead.add(member)

    def apply(self, outcome):
        self.outcome = outcome

    async def query(self, member, timeout):
        return None

    def ban(self, member, evidence):
        self.banned.append(member)


@pytest.mark.parametrize("reporter", [0, 1], ids=["own-member", "other-member"])
def test_a_failed_repair_reported_after_the_step_aborted_bans_nobody(reporter):
    """A repair moved shard 2 to member `reporter`, then the step aborted (a reducer and a sender
    it needed both died) and the shard went with it; the reducer's failure report came after the
    abort. It was judged against the aborted decision, where it holds nothing, and banned as a
    liar: over emulated WAN links a coordinator banned its own member "for the rest of the run"."""
    async def main():
        repaired = Outcome(1, (0, 1, 2), {0: 0, 1: 1, 2: reporter}, False)
        host = _Host(repaired)
        coordinator = Coordinator(host)
        coordinator.maybe_take_over()
        coordinator.outcome = host.outcome = Outcome.aborting(2, "a reducer and a sender it needed both died")
        coordinator.update(MemberState(reporter, (), {}, (), 1, repaired, failure="shard 2 lost senders [2] during repair"))
        assert host.banned == []
        coordinator.close()
    run_virtual(main())


def test_a_failed_repair_of_a_part_it_does_not_hold_is_still_a_lie():
    """The same report under a live decision that gives the reporter no repair: banned."""
    async def main():
        host = _Host(Outcome(1, (0, 1, 2), {0: 0, 1: 1, 2: 2}, False))
        coordinator = Coordinator(host)
        coordinator.maybe_take_over()
        coordinator.update(MemberState(1, (), {}, (), 1, host.outcome, failure="shard 2 lost senders [2] during repair"))
        assert host.banned == [1]
        coordinator.close()
    run_virtual(main())
