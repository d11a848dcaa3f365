"""`Averager` end to end on the emulated network: matchmaking, Moshpit grids, modes, state download."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from potluck.averaging import Averager, Role
from potluck.core.errors import AveragingError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht import own_subkey
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from tests.emulated_swarm import add_peer, make_swarm


def max_error(averagers, target):
    return max((a._tensors[0] - target).abs().max().item() for a in averagers)


@pytest.mark.timeout(60)
def test_eight_peers_reach_the_weighted_mean_and_share_metadata():
    async def main():
        net, peers = await make_swarm(8)
        vectors = [torch.randn(1000) for _ in peers]
        avgs = [Averager(p, [v, torch.ones(3, 3) * i], "job", matchmaking_time=1.0)
                for i, (p, v) in enumerate(zip(peers, vectors, strict=False))]
        results = await asyncio.gather(*(a.astep(weight=i + 1, gather={"i": i}) for i, a in enumerate(avgs)))
        total = sum(range(1, 9))
        expected = sum(v * (i + 1) for i, v in enumerate(vectors)) / total
        assert max_error(avgs, expected) < 1e-5
        assert all(torch.equal(a._tensors[0], avgs[0]._tensors[0]) for a in avgs)
        with avgs[3].get_tensors() as tensors:
            torch.testing.assert_close(tensors[1], torch.full((3, 3), sum(i * (i + 1) for i in range(8)) / total))
        r = results[0]
        assert r.group_size == 8 and len(r.peers) == 8 and sorted(r.contributors) == sorted(r.peers)
        assert sorted(m["i"] for m in r.gathered.values()) == list(range(8))
    run_virtual(main())


@pytest.mark.scenario
@pytest.mark.timeout(120)
def test_moshpit_100_peers_on_a_10x10_grid_reach_the_exact_mean_in_two_rounds():
    # benchmarks/moshpit.py runs the same on 1,000 peers (10x10x10), with churn
    async def main():
        net, peers = await make_swarm(100, latency=0.002)
        vectors = [torch.randn(64) for _ in peers]
        mean = sum(vectors) / len(vectors)
        avgs = [Averager(p, [v], "moshpit", target_group_size=10, grid=(10, 10), coordinates=(i // 10, i % 10),
                         matchmaking_time=1.0) for i, (p, v) in enumerate(zip(peers, vectors, strict=False))]
        errors = []
        for _ in range(2):
            results = await asyncio.gather(*(a.astep() for a in avgs))
            assert {r.group_size for r in results} == {10}
            errors.append(max_error(avgs, mean))
        assert errors[0] > 0.1  # one round mixes only within rows
        assert errors[1] < 1e-5
    run_virtual(main())


@pytest.mark.scenario
@pytest.mark.timeout(120)
def test_100_peers_with_target_group_size_8_average_in_many_groups_at_once():
    async def main():
        net, peers = await make_swarm(100)
        vectors = [torch.randn(32) for _ in peers]
        avgs = [Averager(p, [v], "many", target_group_size=8, matchmaking_time=2.0)
                for p, v in zip(peers, vectors, strict=False)]
        results = await asyncio.wait_for(asyncio.gather(*(a.astep() for a in avgs), return_exceptions=True), 60)
        sizes = [r.group_size for r in results if not isinstance(r, BaseException)]
        assert len(sizes) >= 95 and max(sizes) <= 8
        assert len({frozenset(r.peers) for r in results if not isinstance(r, BaseException)}) >= 12
    run_virtual(main())


@pytest.mark.scenario
@pytest.mark.timeout(240)  # 64 peers in virtual time: 57 s alone on a slow evening of a 2-core machine
def test_moshpit_with_peers_leaving_still_converges_geometrically():
    async def main():
        net, peers = await make_swarm(64, latency=0.002)
        vectors = [torch.randn(16) for _ in peers]
        avgs = [Averager(p, [v], "churn", target_group_size=8, grid=(8, 8), coordinates=(i // 8, i % 8),
                         matchmaking_time=1.0, sender_timeout=1.0) for i, (p, v) in enumerate(zip(peers, vectors, strict=False))]
        alive = list(range(64))
        spread = []
        for r in range(4):
            leaving = alive[r * 7 % len(alive)]  # one peer leaves before each round
            net.crash(peers[leaving].transport.peer_id)
            alive.remove(leaving)
            await asyncio.gather(*(avgs[i].astep() for i in alive), return_exceptions=True)
            values = torch.stack([avgs[i]._tensors[0] for i in alive])
            spread.append((values - values.mean(0)).abs().max().item())
        assert spread[1] < spread[0] / 5 and spread[3] < spread[1] / 5, spread
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_group_told_not_to_proceed_averages_nothing_and_sends_nothing():
    """`proceed` sees the formed group's metadata, the same on every member: a group that does
    not hold what its members need (the sync mode's rounds short of the global batch) skips the
    all-reduce instead of paying for it. The next step averages as usual."""
    async def main():
        net, peers = await make_swarm(3)
        vectors = [torch.randn(100_000) for _ in peers]  # 400 KB each
        avgs = [Averager(p, [v.clone()], "job", matchmaking_time=1.0) for p, v in zip(peers, vectors, strict=True)]
        seen = []

        def enough(gathered):
            seen.append(sorted(m["samples"] for m in gathered.values()))
            return sum(m["samples"] for m in gathered.values()) >= 100
        sent = [p.transport.stats.bytes_sent for p in peers]
        results = await asyncio.gather(*(a.astep(gather={"samples": 30}, proceed=enough) for a in avgs))
        assert all(r.skipped and r.group_size == 3 and r.contributors == [] for r in results)
        assert seen == [[30, 30, 30]] * 3
        assert all(torch.equal(a._tensors[0], v) for a, v in zip(avgs, vectors, strict=True))
        moved = [p.transport.stats.bytes_sent - before for p, before in zip(peers, sent, strict=True)]
        assert max(moved) < 50_000, moved  # matchmaking only: not the vectors
        results = await asyncio.gather(*(a.astep(gather={"samples": 40}, proceed=enough) for a in avgs))
        assert not any(r.skipped for r in results)
        assert max_error(avgs, sum(vectors) / 3) < 1e-5
    run_virtual(main())


@pytest.mark.timeout(60)
def test_failed_step_leaves_tensors_untouched():
    async def main():
        net, peers = await make_swarm(2)
        lonely = Averager(peers[0], [torch.arange(4.0)], "alone", min_group_size=3, matchmaking_time=0.5)
        with pytest.raises(AveragingError, match="min_group_size"):
            await lonely.astep(timeout=10)
        assert torch.equal(lonely._tensors[0], torch.arange(4.0))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_averaging_in_place_writes_the_given_tensors_and_a_failed_step_leaves_them():
    """copy=False: no private copy; the caller's tensors themselves are averaged (atomically)."""
    async def main():
        net, peers = await make_swarm(3)
        mine = [[torch.full((5,), float(i)), torch.full((2, 2), 10.0 * i)] for i in range(3)]
        avgs = [Averager(p, tensors, "in-place", matchmaking_time=1.0, copy=False)
                for p, tensors in zip(peers, mine, strict=True)]
        await asyncio.gather(*(a.astep() for a in avgs))
        for tensors in mine:
            assert torch.equal(tensors[0], torch.ones(5)) and torch.equal(tensors[1], torch.full((2, 2), 10.0))
        lonely = Averager(peers[0], [mine[0][0]], "in-place-alone", min_group_size=2, matchmaking_time=0.5,
                          copy=False)
        mine[0][0].copy_(torch.arange(5.0))
        with pytest.raises(AveragingError, match="min_group_size"):
            await lonely.astep(timeout=10)
        assert torch.equal(mine[0][0], torch.arange(5.0))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peers_with_a_different_schema_do_not_average_together():
    async def main():
        net, peers = await make_swarm(4)
        same = [Averager(p, [torch.full((4,), float(i))], "schema", matchmaking_time=0.5) for i, p in enumerate(peers[:3])]
        other = Averager(peers[3], [torch.zeros(5)], "schema", matchmaking_time=0.5)
        results = await asyncio.gather(*(a.astep(timeout=10) for a in [*same, other]), return_exceptions=True)
        assert all(r.group_size == 3 for r in results[:3])
        assert isinstance(results[3], AveragingError)
        assert torch.equal(other._tensors[0], torch.zeros(5))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peers_whose_versions_compute_the_reduction_differently_do_not_average_together(monkeypatch):
    """Members check each other's reductions bit for bit and must cut the same chunks: a peer of a
    version that computes either differently (`allreduce.ARITHMETIC`) would fail its group's
    checks and be banned. Its schema differs instead, so the two never meet in a group."""
    from potluck.averaging import averager
    async def main():
        net, peers = await make_swarm(4)
        same = [Averager(p, [torch.full((4,), float(i))], "versions", matchmaking_time=0.5)
                for i, p in enumerate(peers[:3])]
        monkeypatch.setattr(averager, "ARITHMETIC", averager.ARITHMETIC - 1)
        older = Averager(peers[3], [torch.zeros(4)], "versions", matchmaking_time=0.5)
        assert older.schema != same[0].schema
        results = await asyncio.gather(*(a.astep(timeout=10) for a in [*same, older]), return_exceptions=True)
        assert all(r.group_size == 3 for r in results[:3])
        assert isinstance(results[3], AveragingError)
        assert torch.equal(older._tensors[0], torch.zeros(4))
    run_virtual(main())


@pytest.mark.timeout(60)
def test_client_and_aux_averagers_take_part():
    async def main():
        net, peers = await make_swarm(4, client_mode=(2,))
        roles = [Role.NODE, "node", Role.CLIENT, "aux"]  # a Role or its value
        vectors = [torch.randn(100) for _ in peers]
        avgs = [Averager(p, [v], "roles", role=r, matchmaking_time=0.5) for p, v, r in zip(peers, vectors, roles, strict=True)]
        assert [a.role for a in avgs] == [Role.NODE, Role.NODE, Role.CLIENT, Role.AUX]
        assert all(isinstance(a.role, Role) and a.run_id == "roles" for a in avgs)
        results = await asyncio.gather(*(a.astep() for a in avgs))
        expected = sum(vectors[:3]) / 3
        for a in avgs[:3]:
            torch.testing.assert_close(a._tensors[0], expected)
        assert results[0].group_size == 4 and len(results[0].contributors) == 3
    run_virtual(main())


def test_a_stateful_codec_is_refused_with_where_to_use_it():
    """Top-k keeps a residual; one instance encodes every chunk of a step, so one chunk's
    leftover would be added to the next: the Averager (and so Optimizer) refuses it."""
    async def main():
        net, peers = await make_swarm(1)
        with pytest.raises(ValueError, match="outer_compression"):
            Averager(peers[0], [torch.zeros(3)], "topk", compression={"name": "topk", "ratio": 0.5})
        with pytest.raises(ValueError, match="outer_compression"):
            Optimizer(peers[0], "topk-opt", [torch.nn.Parameter(torch.zeros(3))], lambda p: torch.optim.SGD(p, 0.1),
                      batch_size_per_step=1, target_batch_size=2, compression="topk", start=False)
    run_virtual(main())


def test_unknown_role_is_refused_with_the_choices():
    async def main():
        net, peers = await make_swarm(1)
        with pytest.raises(ValueError, match=r"role must be one of \['node', 'client', 'aux'\], not 'server'"):
            Averager(peers[0], [torch.zeros(3)], "bad-role", role="server")
    run_virtual(main())


def record_groups(averager):
    """Wrap the averager's matchmaking so that the test sees every group it formed."""
    groups = []
    form_group = averager.matchmaker.form_group

    async def recording(*args, **kwargs):
        formed = await form_group(*args, **kwargs)
        groups.append(formed.group)
        return formed
    averager.matchmaker.form_group = recording
    return groups


def reduced_bound(codec, pieces):
    """Max error of one shard's average: each piece is rounded by the codec, then the average."""
    decoded = [codec.decode(codec.encode(p)) for p in pieces]
    mean = sum(decoded) / len(decoded)
    return max(codec.error_bound(p) for p in pieces) + codec.error_bound(mean)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", ["fp16", "scaled_fp16", "uniform8", "quantile8", "blockwise8"])
def test_compressed_averaging_stays_within_the_codec_bound(compression):
    async def main():
        net, peers = await make_swarm(4)
        g = torch.Generator().manual_seed(7)
        vectors = [torch.randn(3000, generator=g) * (i + 1) + i for i in range(4)]
        avgs = [Averager(p, [v], "codecjob", compression=compression, target_group_size=4, matchmaking_time=0.5)
                for p, v in zip(peers, vectors, strict=True)]
        groups = record_groups(avgs[0])
        await asyncio.gather(*(a.astep() for a in avgs))
        group, codec = groups[0], avgs[0].codec
        order = [next(i for i, a in enumerate(avgs) if a.transport.peer_id == p) for p in group.peers]
        exact = sum(vectors) / 4
        assert all(torch.equal(a._tensors[0], avgs[0]._tensors[0]) for a in avgs)
        result = avgs[0]._tensors[0]
        assert not torch.equal(result, exact)  # the codec is lossy: the bound is what is tested
        for j in group.shards:  # each shard is one chunk here, encoded as a whole
            lo, hi = group.bounds(j)
            bound = reduced_bound(codec, [vectors[i][lo:hi] for i in order])
            error = (result[lo:hi] - exact[lo:hi]).abs().max().item()
            assert bound > 0, bound
            assert error <= bound * (1 + 1e-3) + 1e-6, (j, error, bound)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peer_with_nan_tensors_fails_at_once_and_the_others_finish_promptly():
    """The real "none" codec: the bad peer never joins; nothing waits for a sender timeout."""
    async def main():
        net, peers = await make_swarm(4)
        g = torch.Generator().manual_seed(3)
        vectors = [torch.randn(50_000, generator=g) for _ in peers]
        bad = vectors[2].clone()
        bad[4321] = float("nan")
        extra = [torch.ones(2, 2), torch.ones(2, 2), torch.tensor([[1.0, float("inf")], [0.0, 0.0]]), torch.ones(2, 2)]
        avgs = [Averager(p, [v, e], "nanjob", matchmaking_time=0.5, sender_timeout=10.0)
                for p, v, e in zip(peers, [vectors[0], vectors[1], bad, vectors[3]], extra, strict=True)]
        loop = asyncio.get_running_loop()
        start = loop.time()
        finished = {}

        async def one(i):
            try:
                return await avgs[i].astep(weight=i + 1.0)
            finally:
                finished[i] = loop.time() - start
        results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        assert isinstance(results[2], AveragingError) and "NaN" in str(results[2]), results[2]
        assert finished[2] < 0.1  # at once: before the matchmaking window even settles
        assert max(finished[i] for i in (0, 1, 3)) < 2.0  # the sender timeout is 10 s
        good = [0, 1, 3]
        expected = sum(vectors[i] * (i + 1.0) for i in good) / sum(i + 1.0 for i in good)
        for i in good:
            assert results[i].group_size == 3 and str(peers[2].transport.peer_id) not in results[i].peers
            assert torch.equal(avgs[i]._tensors[0], avgs[0]._tensors[0])
            assert torch.equal(avgs[i]._tensors[1], torch.ones(2, 2))
        torch.testing.assert_close(avgs[0]._tensors[0], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(avgs[2]._tensors[0], bad, rtol=0, atol=0, equal_nan=True)  # untouched
        assert avgs[2]._tensors[1][0, 1].item() == float("inf")
    run_virtual(main())


async def three_steps_with_one_slow_link(upload: float, download: float,
                                        compression: str = "none") -> tuple[list, list[float], list[float]]:
    """4 peers average 16 MB three times on the emulated network, peer 0 with the given link and
    the others with 100 MB/s each way; the averagers, peer 0's share of each step's split (as
    peer 1 saw the group) and each step's virtual seconds."""
    net = EmulatedNetwork(latency=0.005)
    peers = []
    for i in range(4):
        peers.append(await add_peer(net, peers, bandwidth=upload if i == 0 else 100e6,
                                    download=download if i == 0 else None))
    avgs = [Averager(p, [torch.randn(4_000_000)], "bwjob", target_group_size=4, matchmaking_time=0.5,
                     compression=compression) for p in peers]
    groups = record_groups(avgs[1])
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(3):
        start = loop.time()
        await asyncio.gather(*(a.astep() for a in avgs))
        times.append(loop.time() - start)
    slow_id = peers[0].transport.peer_id
    return avgs, [g.part_sizes[g.peers.index(slow_id)] / g.total for g in groups], times


@pytest.mark.timeout(60)
def test_slow_peer_measures_itself_slow_and_gets_a_smaller_shard():
    """Bandwidth is measured per peer: the slow one gets little or nothing to reduce next time."""
    async def main():
        avgs, shares, times = await three_steps_with_one_slow_link(upload=10e6, download=10e6)
        estimates = [a.bandwidth for a in avgs]
        assert estimates[0] == pytest.approx(10e6, rel=0.2), estimates
        assert all(e == pytest.approx(100e6, rel=0.2) for e in estimates[1:]), estimates
        assert shares[0] == pytest.approx(0.25, abs=0.01)  # first step: nothing measured, even split
        assert shares[1] < 0.05 and shares[2] < 0.05, shares
        assert times[1] < 0.8 * times[0] and times[2] < 0.8 * times[0], times
    run_virtual(main())


@pytest.mark.timeout(60)
def test_peer_with_a_slow_download_measures_it_and_gets_a_smaller_shard():
    """Download is measured on its own: a peer that uploads fast but downloads slowly (a home
    line) reduces less, where an estimate from its upload alone would give it an even share."""
    async def main():
        avgs, shares, times = await three_steps_with_one_slow_link(upload=100e6, download=10e6)
        assert shares[0] == pytest.approx(0.25, abs=0.01)  # first step: nothing measured, even split
        assert shares[1] < 0.1 and shares[2] < 0.1, shares
        assert times[2] < 0.8 * times[0], times
        assert avgs[0].download_bandwidth == pytest.approx(10e6, rel=0.2), avgs[0].download_bandwidth
        assert avgs[0].bandwidth > 50e6, avgs[0].bandwidth  # its upload is not the slow part
        assert all(a.download_bandwidth > 50e6 for a in avgs[1:]), [a.download_bandwidth for a in avgs]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_bandwidth_estimates_count_the_bytes_on_the_wire_under_a_codec():
    """Under 8-bit compression a peer's download estimate is its link's rate in the bytes that
    cross it, as its upload estimate is (the load split compares the two); counted in float32
    sizes it read 4x the link."""
    async def main():
        avgs, _, _ = await three_steps_with_one_slow_link(upload=100e6, download=10e6, compression="blockwise8")
        assert avgs[0].download_bandwidth == pytest.approx(10e6, rel=0.2), avgs[0].download_bandwidth
        assert all(a.bandwidth == pytest.approx(100e6, rel=0.2) for a in avgs[1:]), [a.bandwidth for a in avgs]
    run_virtual(main())


@pytest.mark.timeout(60)
def test_step_failing_during_the_allreduce_leaves_tensors_untouched():
    """Both reducers die after the group formed: the client cannot finish and must not change."""
    async def main():
        net, peers = await make_swarm(3, bandwidth=10e6, client_mode=(2,))
        g = torch.Generator().manual_seed(5)
        tensors = [[torch.randn(100_000, generator=g), torch.randn(7, generator=g).to(torch.bfloat16)]
                   for _ in peers]
        avgs = [Averager(p, t, "doomed", target_group_size=3, matchmaking_time=0.5, sender_timeout=1.0,
                         allreduce_timeout=20.0) for p, t in zip(peers, tensors, strict=True)]
        before = [t.clone() for t in avgs[2]._tensors]
        groups = record_groups(avgs[2])
        tasks = [asyncio.ensure_future(a.astep()) for a in avgs]
        while not groups:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)  # mid-transfer: 400 KB per peer at 10 MB/s takes ~0.06 s
        assert not tasks[2].done()
        for i in (0, 1):
            net.crash(peers[i].transport.peer_id)
            tasks[i].cancel()
        with pytest.raises(AveragingError, match="reducer|coordinator|deadline"):
            await tasks[2]
        await asyncio.gather(*tasks[:2], return_exceptions=True)
        for mine, copy in zip(avgs[2]._tensors, before, strict=True):
            assert torch.equal(mine, copy)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_newcomer_downloads_the_averaged_state():
    async def main():
        net, peers = await make_swarm(3)
        avgs = [Averager(p, [torch.randn(5000), torch.randn(7).to(torch.bfloat16)], "state", matchmaking_time=0.5)
                for p in peers]
        await asyncio.gather(*(a.astep() for a in avgs))
        newcomer = Averager(await add_peer(net, peers), [torch.zeros(5000), torch.zeros(7, dtype=torch.bfloat16)],
                            "state")
        version, _ = await newcomer.aload_state_from_peers(timeout=20)
        assert version == 1
        for mine, theirs in zip(newcomer._tensors, avgs[0]._tensors, strict=False):
            assert torch.equal(mine, theirs)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_malformed_donor_records_are_ignored_and_the_newcomer_gets_the_state(caplog):
    """A record claiming a newer version in a malformed shape is skipped (not tried first)."""
    async def main():
        net, peers = await make_swarm(3)
        avgs = [Averager(p, [torch.randn(100)], "records", matchmaking_time=0.5) for p in peers[:2]]
        await asyncio.gather(*(a.astep() for a in avgs))
        rogue = peers[2]
        assert await rogue.dht.astore(RunNames("records").averager("tensors").donors, {"version": "99"}, rogue.dht.get_time() + 60,
                                      subkey=own_subkey(rogue.transport.peer_id))
        newcomer = Averager(await add_peer(net, peers), [torch.zeros(100)], "records")
        with caplog.at_level(logging.DEBUG, logger="potluck.averaging.state_transfer"):
            version, _ = await newcomer.aload_state_from_peers(timeout=20)
        assert version == 1 and torch.equal(newcomer._tensors[0], avgs[0]._tensors[0])
        assert any("ignoring a state record" in r.getMessage() and "'version'" in r.getMessage()
                   for r in caplog.records)
    run_virtual(main())


@pytest.mark.timeout(60)
def test_powersgd_averagers_agree_and_error_feedback_catches_up_with_the_true_mean():
    """Rank-2 PowerSGD through `Averager`: every step leaves all peers bit-identical, and with
    error feedback the sum of the estimates approaches the sum of the true means; a peer with a
    different rank does not average with them."""
    async def main():
        net, peers = await make_swarm(5)
        torch.manual_seed(0)
        shapes = [(24, 16), (16,)]
        avgs = [Averager(p, [torch.zeros(s) for s in shapes], "psgd", min_group_size=4, target_group_size=4,
                         matchmaking_time=1.0, powersgd_rank=2) for p in peers[:4]]
        odd = Averager(peers[4], [torch.zeros(s) for s in shapes], "psgd", matchmaking_time=1.0, powersgd_rank=3)
        base = [torch.randn(s) for s in shapes]  # a shared full-rank signal, plus per-peer noise
        true_sum = [torch.zeros(s) for s in shapes]
        estimated_sum = [torch.zeros(s) for s in shapes]
        first_error = None
        for _ in range(24):
            grads = [[b + 0.3 * torch.randn(b.shape) for b in base] for _ in avgs]
            for a, g in zip(avgs, grads, strict=True):
                with a.get_tensors() as tensors:
                    for t, x in zip(tensors, g, strict=True):
                        t.copy_(x)
            results = await asyncio.gather(*(a.astep(weight=1.0) for a in avgs))
            assert all(r.group_size == 4 for r in results)
            for i in range(len(shapes)):
                assert all(torch.equal(a._tensors[i], avgs[0]._tensors[i]) for a in avgs)
                true_sum[i] += sum(g[i] for g in grads) / 4
                estimated_sum[i] += avgs[0]._tensors[i]
            error = (estimated_sum[0] - true_sum[0]).norm() / true_sum[0].norm()
            first_error = error if first_error is None else first_error
        torch.testing.assert_close(estimated_sum[1], true_sum[1])  # 1-D: averaged exactly
        assert first_error > 0.5  # rank 2 of a full-rank 24x16 signal loses much at first...
        assert error < first_error / 3  # ...which error feedback delivers later (without: ~0.9x)
        with pytest.raises(AveragingError):
            await odd.astep(timeout=3.0)
    run_virtual(main())



def test_moshpit_grid_keeps_groups_small_with_few_rounds():
    from potluck.averaging import moshpit_grid
    assert moshpit_grid(1) == (1,) and moshpit_grid(3) == (3,)  # too few to split: one group
    assert moshpit_grid(4) == (2, 2) and moshpit_grid(9) == (3, 3) and moshpit_grid(100) == (10, 10)
    assert moshpit_grid(256) == (16, 16) and moshpit_grid(257) == (7, 7, 7)
    for n in range(4, 5000, 37):
        grid = moshpit_grid(n)
        assert len(grid) >= 2 and max(grid) <= 16 and len(set(grid)) == 1
        assert grid[0] ** len(grid) >= n > (grid[0] - 1) ** len(grid)  # every peer has a cell, few empty


def test_a_matchmaking_time_longer_than_the_dht_keeps_declarations_is_refused_at_once():
    from potluck.dht.key_kinds import DECLARATION_MAX_TTL

    with pytest.raises(ValueError, match="matchmaking_time must be in"):
        Averager(None, [torch.zeros(2)], "long", matchmaking_time=DECLARATION_MAX_TTL + 1)


@pytest.mark.timeout(120)
def test_an_8_bit_all_reduce_sends_about_a_quarter_of_a_float32_one_checks_included():
    """Bytes each peer sent for one step of 4 peers over 2^19 floats (one chunk per shard), every
    member checking every reducer. blockwise8: a check fetches one 4096-value block, so the step
    costs about a quarter of float32's. uniform8 scales a whole chunk, so a check needs the whole
    chunk of every sender: it travels as the payload the reducer received (before, re-encoding
    failed and it went as float32: 1.8x float32's bytes in all)."""
    async def one(compression):
        net, peers = await make_swarm(4)
        generator = torch.Generator().manual_seed(11)
        avgs = [Averager(p, [torch.randn(1 << 19, generator=generator)], "bytes", compression=compression,
                         target_group_size=4, matchmaking_time=1.0) for p in peers]
        await asyncio.sleep(1)
        before = [p.transport.stats.bytes_sent for p in peers]
        await asyncio.gather(*(a.astep() for a in avgs))
        sent = sum(p.transport.stats.bytes_sent - b for p, b in zip(peers, before, strict=True)) / 4
        for a in avgs:
            a.shutdown()
        return sent

    sent = {c: run_virtual(one(c)) for c in ("none", "blockwise8", "uniform8")}
    assert sent["none"] > 2 * 4 * (1 << 19) * 3 / 4, sent  # each peer sends 3/4 of its vector twice
    assert sent["blockwise8"] < 0.3 * sent["none"], sent
    assert sent["uniform8"] < 0.8 * sent["none"], sent


def test_a_step_announces_the_state_again_without_waiting_for_the_dht(monkeypatch):
    """The first step's state record is stored before the step returns (newcomers then find the
    peer); later steps store it in the background, one store at a time, the next with the round
    it was asked at (a DHT store over a WAN: round trips the step need not wait for). Shutting
    down stops a store under way: it would announce a state nobody serves."""
    async def main():
        net, peers = await make_swarm(2)
        avgs = [Averager(p, [torch.full((8,), float(i))], "announce", target_group_size=2, matchmaking_time=0.5)
                for i, p in enumerate(peers)]
        await asyncio.gather(*(a.astep() for a in avgs))
        found = await peers[0].dht.aget(avgs[0].names.donors, latest=True)
        assert found is not None and len(found.value) == 2  # both stored before their first step returned
        stored, done, release, real = [], [], asyncio.Event(), Averager.announce_state

        async def held(self):
            asked = self.round
            stored.append(asked)
            await release.wait()
            await real(self)
            done.append(asked)
        monkeypatch.setattr(Averager, "announce_state", held)
        await asyncio.gather(*(a.astep() for a in avgs))  # returns with both stores held
        await asyncio.gather(*(a.astep() for a in avgs))
        assert stored == [2, 2]  # the third step's store waits for the second's, not beside it
        release.set()
        await asyncio.sleep(1)
        assert stored == [2, 2, 3, 3] and done == [2, 2, 3, 3]
        release.clear()
        await asyncio.gather(*(a.astep() for a in avgs))  # the fourth step's stores, held
        for a in avgs:
            a.shutdown()
        release.set()
        await asyncio.sleep(1)
        assert stored == [2, 2, 3, 3, 4, 4] and done == [2, 2, 3, 3]
    run_virtual(main())
