"""`Averager` end to end on the emulated network: matchmaking, Moshpit grids, modes, state download."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.core.errors import AveragingError
from potluck.core.virtual_time import run_virtual
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


@pytest.mark.timeout(180)
def test_moshpit_256_peers_on_a_16x16_grid_reach_the_exact_mean_in_two_rounds():
    async def main():
        net, peers = await make_swarm(256, latency=0.002)
        vectors = [torch.randn(64) for _ in peers]
        mean = sum(vectors) / len(vectors)
        avgs = [Averager(p, [v], "moshpit", target_group_size=16, grid=(16, 16), coordinates=(i // 16, i % 16),
                         matchmaking_time=1.0) for i, (p, v) in enumerate(zip(peers, vectors, strict=False))]
        errors = []
        for _ in range(2):
            results = await asyncio.gather(*(a.astep() for a in avgs))
            assert {r.group_size for r in results} == {16}
            errors.append(max_error(avgs, mean))
        assert errors[0] > 0.1  # one round mixes only within rows
        assert errors[1] < 1e-5
    run_virtual(main())


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


@pytest.mark.timeout(60)
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
def test_failed_step_leaves_tensors_untouched():
    async def main():
        net, peers = await make_swarm(2)
        lonely = Averager(peers[0], [torch.arange(4.0)], "alone", min_group_size=3, matchmaking_time=0.5)
        with pytest.raises(AveragingError, match="min_group_size"):
            await lonely.astep(timeout=10)
        assert torch.equal(lonely._tensors[0], torch.arange(4.0))
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
def test_client_and_aux_averagers_take_part():
    async def main():
        net, peers = await make_swarm(4, client_mode=(2,))
        modes = ["node", "node", "client", "aux"]
        vectors = [torch.randn(100) for _ in peers]
        avgs = [Averager(p, [v], "modes", mode=m, matchmaking_time=0.5) for p, v, m in zip(peers, vectors, modes, strict=False)]
        results = await asyncio.gather(*(a.astep() for a in avgs))
        expected = sum(vectors[:3]) / 3
        for a in avgs[:3]:
            torch.testing.assert_close(a._tensors[0], expected)
        assert results[0].group_size == 4 and len(results[0].contributors) == 3
    run_virtual(main())


@pytest.mark.timeout(60)
def test_compressed_averaging_stays_within_the_codec_bound():
    async def main():
        net, peers = await make_swarm(4)
        vectors = [torch.randn(1000) for _ in peers]
        avgs = [Averager(p, [v], "fp16job", compression="fp16", matchmaking_time=0.5) for p, v in zip(peers, vectors, strict=False)]
        await asyncio.gather(*(a.astep() for a in avgs))
        assert max_error(avgs, sum(vectors) / 4) < 1e-2
        assert all(torch.equal(a._tensors[0], avgs[0]._tensors[0]) for a in avgs)
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
