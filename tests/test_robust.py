"""Robust aggregators (`potluck.averaging.robust`) and the bounded weights of the all-reduce."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.accountability import VERIFY_BLOCK
from potluck.averaging.allreduce.member import CHUNK_ELEMENTS
from potluck.averaging.allreduce.messages import PartRequest
from potluck.averaging.allreduce.reduction import (
    MAX_WEIGHT_OVER_MEDIAN,
    NAMED_WEIGHT_OVER_MEDIAN,
    blatant_senders,
    bounded_weights,
)
from potluck.averaging.robust import MIN_PIECES_TO_NAME, aggregate, far_pieces, lower_median, trimmed_count
from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import MalformedMessage
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import run_virtual, virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from tests.emulated_swarm import make_swarm

ROBUST = ("centered_clip", "trimmed_mean")


def run(kind, pieces, weights=None):
    out = torch.empty_like(pieces[0])
    aggregate(kind, pieces, weights or [1.0] * len(pieces), out)
    return out


def honest_and_attackers(n, f, size=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    honest = [1.0 + 0.1 * torch.randn(size, generator=g) for _ in range(n - f)]
    attacks = [torch.full((size,), 1e30), torch.full((size,), -1e30), 1e3 * torch.randn(size, generator=g)]
    return honest, [attacks[i % len(attacks)] for i in range(f)]


@pytest.mark.parametrize("kind", ROBUST)
def test_identical_pieces_come_back_exactly(kind):
    x = torch.randn(5000)
    for n in (1, 2, 3, 4, 8):
        assert torch.equal(run(kind, [x.clone() for _ in range(n)], [float(i + 1) for i in range(n)]), x)


@pytest.mark.parametrize("kind", ROBUST)
def test_identical_honest_majority_is_returned_exactly_whatever_the_outlier(kind):
    x = torch.randn(3000)
    for outlier in (torch.full_like(x, 1e30), -x * 1e6, torch.randn(3000) * 1e3):
        assert torch.equal(run(kind, [x, x.clone(), outlier, x.clone()]), x)


@pytest.mark.parametrize("kind", ROBUST)
def test_a_block_reduced_alone_has_the_bits_it_has_inside_its_chunk(kind):
    """A member that checks a reducer recomputes one VERIFY_BLOCK of a chunk from that block of
    every piece: it must get the reducer's bits exactly, or it would accuse an honest reducer.
    CenteredClip clips each block alone (its radius and stopping are the block's own)."""
    g = torch.Generator().manual_seed(3)
    size = 3 * VERIFY_BLOCK + 1000  # three whole blocks and a short one
    pieces = [torch.randn(size, generator=g) * (i + 1) for i in range(4)] + [torch.full((size,), 1e30)]
    pieces[2][VERIFY_BLOCK:2 * VERIFY_BLOCK] += 50.0  # the blocks differ: their radii and iterations differ
    whole = run(kind, pieces)
    for lo in range(0, size, VERIFY_BLOCK):
        hi = min(size, lo + VERIFY_BLOCK)
        assert torch.equal(run(kind, [p[lo:hi] for p in pieces]), whole[lo:hi]), (kind, lo)


def test_centered_clip_in_groups_of_blocks_has_the_bits_of_one_group(monkeypatch):
    """CenteredClip iterates over CLIP_GROUP_ELEMENTS at a time (for the CPU's caches): a group's
    size changes neither a block's result nor the distances (blocks differ, so their radii and
    iteration counts differ)."""
    from potluck.averaging import robust
    g = torch.Generator().manual_seed(4)
    size = 7 * VERIFY_BLOCK + 1000
    pieces = [torch.randn(size, generator=g) * (i + 1) for i in range(4)] + [torch.full((size,), 1e30)]
    for b in range(7):
        pieces[b % 4][b * VERIFY_BLOCK:(b + 1) * VERIFY_BLOCK] *= 3.0 + b
    monkeypatch.setattr(robust, "CLIP_GROUP_ELEMENTS", 1 << 30)
    whole = torch.empty(size)
    distances = robust.centered_clip(pieces, whole)
    for blocks in (1, 2, 3):
        monkeypatch.setattr(robust, "CLIP_GROUP_ELEMENTS", blocks * len(pieces) * VERIFY_BLOCK)
        grouped = torch.empty(size)
        assert robust.centered_clip(pieces, grouped) == distances
        assert torch.equal(grouped, whole), blocks


@pytest.mark.parametrize("n,f", [(4, 1), (8, 1), (8, 2)])
def test_trimmed_mean_stays_within_the_honest_range_with_up_to_its_trim_count_of_outliers(n, f):
    assert f <= trimmed_count(n)
    honest, attackers = honest_and_attackers(n, f)
    result = run("trimmed_mean", honest[:2] + attackers + honest[2:])
    stacked = torch.stack(honest)
    assert (result >= stacked.min(0).values).all() and (result <= stacked.max(0).values).all()


@pytest.mark.parametrize("n,f", [(4, 1), (8, 1), (8, 2), (8, 3)])
def test_centered_clip_stays_within_the_honest_spread_of_the_honest_mean(n, f):
    """Bound: the distance to the honest mean is at most the largest honest distance to it (the
    plain mean is moved by about 1e30 / n)."""
    honest, attackers = honest_and_attackers(n, f, seed=n + f)
    result = run("centered_clip", attackers + honest)
    mean = torch.stack(honest).mean(0)
    spread = max((h - mean).norm().item() for h in honest)
    assert (result - mean).norm().item() <= spread


@pytest.mark.parametrize("kind", ROBUST)
def test_bits_do_not_depend_on_the_thread_count(kind):
    honest, attackers = honest_and_attackers(8, 2, size=300_001)
    pieces = honest + attackers
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 3, 4):
            torch.set_num_threads(count)
            results.append(run(kind, pieces, [1.0, 2.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def test_centered_clip_gives_the_bits_it_gave_before_its_rewrite_for_speed():
    """Members check a reducer by recomputing its result bit for bit, so a change of CenteredClip's
    arithmetic would have peers of two versions accuse each other. These bits (results and
    distances, from inputs exact on any CPU) were those of the version before the rewrite with
    fewer, whole-tensor ops and numpy for the radius and coefficients; since 2026-12-07 those of
    float32 sums of squares (a deliberate change of the arithmetic: peers of the versions before
    and after it cannot train together)."""
    import hashlib

    from potluck.averaging.robust import centered_clip
    digest = hashlib.sha256()
    for n, d, seed, kind in [(4, 10000, 1, "honest"), (5, 4096, 2, "far"), (3, 5000, 3, "inf"), (7, 9000, 4, "pair"),
                             (4, 12289, 5, "honest")]:
        g = torch.Generator().manual_seed(seed)

        def draw(g=g, d=d):
            return torch.randint(-2**20, 2**20, (d,), generator=g).float() / 2**18
        base = draw()
        pieces = [base + draw() / 4 for _ in range(n)]
        if kind == "far":
            pieces[0] = pieces[0] * 1e4
        if kind == "inf":
            pieces[1] = torch.full((d,), float("inf"))
        if kind == "pair":
            pieces[0], pieces[1] = pieces[0] + 3, pieces[1] + 3
        out = torch.empty(d)
        distances = centered_clip(pieces, out)
        digest.update(out.numpy().tobytes())
        digest.update(repr(distances).encode())
    assert digest.hexdigest() == "c626e3ef60bfddfed677badd1cea0e2bf2ea39b3ea1e93210a694ce61441f24b"


def test_zero_weights_take_no_part_unless_every_weight_is_zero():
    a, b, c = torch.zeros(10), torch.ones(10), torch.full((10,), 2.0)
    assert torch.equal(run("trimmed_mean", [a, b, c], [0.0, 1.0, 1.0]), torch.full((10,), 1.5))
    assert torch.equal(run("trimmed_mean", [a, b, c], [0.0, 0.0, 0.0]), b)  # all count: the median


def test_weights_are_bounded_by_a_multiple_of_the_median():
    weights = {0: 1.0, 1: 3.0, 2: 1e30, 3: 0.0, 4: 2.0}
    bounded = bounded_weights(weights, (0, 1, 2, 3, 4))
    assert bounded == {0: 1.0, 1: 3.0, 2: MAX_WEIGHT_OVER_MEDIAN * 2.0, 3: 0.0, 4: 2.0}
    # Half the senders claiming huge weights cannot raise the median: it is the lower one.
    assert bounded_weights({0: 1.0, 1: 1.0, 2: 1e30, 3: 1e30}, (0, 1, 2, 3))[2] == MAX_WEIGHT_OVER_MEDIAN
    assert bounded_weights({0: 0.0, 1: 0.0}, (0, 1)) == {0: 0.0, 1: 0.0}
    assert bounded_weights(weights, (0, 2)) == {0: 1.0, 2: MAX_WEIGHT_OVER_MEDIAN}  # over the chunk's senders


def named(kind, pieces, weights=None):
    """The indices of the pieces a reducer names (`blatant_senders`) when it aggregates them."""
    weights = weights or [1.0] * len(pieces)
    senders = tuple(range(len(pieces)))
    distances = aggregate(kind, pieces, weights, torch.empty_like(pieces[0]), measure=True)
    return sorted(blatant_senders(dict(enumerate(weights)), distances, senders))


@pytest.mark.parametrize("kind", ROBUST)
@pytest.mark.parametrize("n,f", [(4, 0), (8, 0), (16, 0), (4, 1), (8, 1), (8, 2)])
def test_blatant_outliers_are_named_and_honest_pieces_are_not(kind, n, f):
    honest, attackers = honest_and_attackers(n, f, seed=n + f)
    assert named(kind, honest[:2] + attackers + honest[2:]) == list(range(2, 2 + f))


def test_a_weight_far_above_the_median_is_named_and_honest_spreads_are_not():
    pieces = [torch.randn(100) for _ in range(4)]
    assert named("trimmed_mean", pieces, [1.0, 2.0, 50.0, 1.0]) == []  # a fast peer: bounded, not named
    assert named("trimmed_mean", pieces, [1.0, 2.0, 1.0, 1e30]) == [3]
    weights = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.01 * NAMED_WEIGHT_OVER_MEDIAN}
    assert list(blatant_senders(weights, {}, (0, 1, 2, 3))) == [3]  # the mean measures no distances
    # Two senders: a liar claiming almost nothing would be the median and name the honest one.
    assert blatant_senders({0: 1e-30, 1: 1.0}, {}, (0, 1)) == {}


def test_no_piece_is_named_without_enough_pieces_or_any_honest_spread():
    x = torch.randn(100)
    # Three pieces: a liar copying one honest piece would make the other look far.
    assert MIN_PIECES_TO_NAME > 3 and far_pieces({0: 0.0, 1: 1e-9, 2: 1.0}) == (0.0, [])
    # Most pieces on the centre: no spread to measure a piece one honest step away against.
    assert named("centered_clip", [x, x.clone(), x.clone(), x + 1e-3]) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ROBUST)
def test_an_all_honest_step_names_nobody(kind, caplog):
    """Honest peers with different data and weights (one 20 times the others' samples)."""
    caplog.set_level(logging.WARNING, logger="potluck.averaging.allreduce")

    async def main():
        net, peers = await make_swarm(5)
        g = torch.Generator().manual_seed(1)
        averagers = [Averager(p, [torch.randn(3000, generator=g) * (1 + i)], "job", target_group_size=5,
                              matchmaking_time=1.0, aggregation=kind) for i, p in enumerate(peers)]
        results = await asyncio.gather(*(a.astep(weight=w) for a, w in zip(averagers, [1, 2, 1, 20, 3], strict=True)))
        assert all(len(r.contributors) == 5 for r in results)
    run_virtual(main())
    assert not [r for r in caplog.records if "is not an honest member" in r.getMessage()]


@pytest.mark.timeout(60)
def test_honest_sparse_updates_name_nobody(caplog):
    """One member's batches touched rows of a table the others did not (an embedding, a hashed
    context): in that chunk its piece stands thousands of times the median distance from the
    centre, over its shard a few times. Honest DiLoCo peers on `benchmarks/wan.py`'s language
    model met this (173x); named chunk by chunk, the member was left out of its step."""
    caplog.set_level(logging.WARNING, logger="potluck.averaging.allreduce")
    chunk = CHUNK_ELEMENTS
    n = 8 * chunk  # 4 shards of 2 chunks each
    g = torch.Generator().manual_seed(3)
    vectors = [torch.randn(n, generator=g) * 1e-3 for _ in range(4)]  # honest spread everywhere
    sparse = slice(5 * chunk, 6 * chunk)  # shard 2's second chunk: member 0 alone touched 10 rows of it
    for v in vectors[1:]:
        v[sparse] = torch.randn(chunk, generator=g) * 1e-7
    vectors[0][sparse] = 0.0
    vectors[0][5 * chunk:5 * chunk + 960] = torch.randn(960, generator=g) * 0.05

    async def main():
        net, peers = await make_swarm(4)
        averagers = [Averager(p, [v], "job", target_group_size=4, matchmaking_time=1.0,
                              aggregation="centered_clip") for p, v in zip(peers, vectors, strict=True)]
        results = await asyncio.gather(*(a.astep() for a in averagers))
        assert all(len(r.contributors) == 4 for r in results)
    run_virtual(main())
    assert not [r for r in caplog.records if "is not an honest member" in r.getMessage()]


@pytest.mark.timeout(60)
def test_averagers_with_different_aggregations_do_not_average_together():
    async def main():
        net, peers = await make_swarm(2)
        mean = Averager(peers[0], [torch.zeros(4)], "job", matchmaking_time=0.5)
        clip = Averager(peers[1], [torch.ones(4)], "job", matchmaking_time=0.5, aggregation="centered_clip")
        assert mean.schema != clip.schema
        results = await asyncio.gather(mean.astep(timeout=5), clip.astep(timeout=5), return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results)  # each alone: below min_group_size
        with pytest.raises(ValueError, match="aggregation"):
            Averager(peers[0], [torch.zeros(4)], "job", aggregation="median")
        with pytest.raises(ValueError, match="PowerSGD"):
            Averager(peers[0], [torch.zeros(4, 4)], "job", aggregation="trimmed_mean", powersgd_rank=1)
    run_virtual(main())


@pytest.mark.parametrize("kind", ROBUST)
def test_values_whose_differences_overflow_float32_are_outvoted_not_spread(kind):
    honest = [torch.full((100,), -3e38), torch.full((100,), -3e38 + 1e32), torch.full((100,), -2.9e38)]
    result = run(kind, [*honest, torch.full((100,), 3.4e38)])
    assert torch.isfinite(result).all() and (result <= -2.9e38).all()


def test_sums_of_squares_are_float32_unless_one_overflows_it_then_float64():
    """CenteredClip's norms: float32 sums (a third of float64's cost) within float32's precision
    of the exact ones; a call where one overflows float32 (a square of 2e19 does), though its
    values do not, is summed in float64, so a far piece's norm stays finite and it is clipped,
    not left out as if its difference overflowed."""
    from potluck.averaging.robust import _row_sums_of_squares
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 5000, generator=g) * torch.tensor([[1e-3], [1.0], [1e3]])
    exact = (rows.double() ** 2).sum(dim=1)
    got = torch.tensor(_row_sums_of_squares(rows), dtype=torch.float64)
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)
    assert torch.equal(got, got.float().double())  # summed in float32
    rows[2, 0] = 2e19
    got = torch.tensor(_row_sums_of_squares(rows), dtype=torch.float64)
    assert torch.isfinite(got).all() and torch.allclose(got, (rows.double() ** 2).sum(dim=1), rtol=1e-12, atol=0)
    assert not torch.equal(got[:2], got[:2].float().double())  # the whole call in float64


@pytest.mark.timeout(60)
def test_the_optimizer_hands_its_aggregation_to_every_averager():
    async def main():
        peer = await potluck.Peer.create([], transport=EmulatedNetwork().transport(), clock=event_loop_clock())
        model = torch.nn.Linear(4, 2)
        opt = Optimizer(peer, "robust-run", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                        target_batch_size=8, batch_size_per_step=2, load_state=False, start=False,
                        aggregation="trimmed_mean")
        try:
            await opt.astart()
            assert opt.state_averager.aggregation == opt.training.grad_averager.aggregation == "trimmed_mean"
        finally:
            opt.shutdown()
            await peer.ashutdown()
    runner = acquire_runner(virtual_time_loop)
    try:
        runner.run(main(), timeout=60)
    finally:
        release_runner()


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0])
def test_a_part_request_with_a_non_finite_or_negative_weight_is_refused(weight):
    with pytest.raises(MalformedMessage, match="'w'"):
        PartRequest.from_wire({"g": b"group", "j": 0, "s": 1, "w": weight, "x": False})


def test_the_trimmed_mean_by_sorting_network_is_the_mean_of_torchs_sorted_middle_rows():
    """The trimmed mean orders each coordinate's values by a sorting network (45x faster than
    torch's sort for 4 rows): the same values as the sort, with ties, up to and past NETWORK_ROWS."""
    g = torch.Generator().manual_seed(2)
    for n in range(1, 21):
        k = trimmed_count(n)
        for x in (torch.randint(-3, 4, (n, 300), generator=g).float(), torch.randn(n, 300, generator=g)):
            middle = x.sort(dim=0, stable=True).values[k:n - k] if k else x  # (none dropped: in their order)
            expected = middle[0].clone()
            for seen, row in enumerate(middle[1:], start=1):  # the running mean, in the rows' order
                expected += (row - expected) / (seen + 1)
            assert torch.equal(run("trimmed_mean", list(x.unbind(0))), expected), n


def test_the_lower_median_by_sorting_network_is_torchs_lower_median():
    g = torch.Generator().manual_seed(1)
    for n in range(1, 20):
        for x in (torch.randint(-3, 4, (n, 7, 50), generator=g).float(), torch.randn(n, 3, 40, generator=g)):
            assert torch.equal(lower_median(x), x.median(dim=0).values), n
