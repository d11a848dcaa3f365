"""Issue 15, "Honest progress": a member's progress record (signed, under its own subkey, so it is
only ever its own) can still claim anything. Readers bound what it does: a report time in the
future counts from when it was first read, and ages; an epoch far ahead of the others is ignored;
samples and speed count at most MAX_SPEED_RATIO times the median peer's, and a member's at most
AVERAGED_SLACK times what it averaged with in a round with the reader.

Three honest peers publish and read progress as the Optimizer does (every PROGRESS_INTERVAL), on
the emulated network in virtual time; a fourth stores one crafted record under its own subkey.
For each claim: what an honest reader's view of the collaboration ends with (a stated bound), and
that the liar is named in a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import potluck
from potluck.core.virtual_time import run_virtual
from potluck.dht.key_kinds import DECLARATION_MAX_TTL
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.optim import Optimizer
from potluck.optim.context import MAX_ROUND_WINDOW_FACTOR, PROGRESS_INTERVAL, RunContext
from potluck.optim.progress import (
    AVERAGED_SLACK,
    LIVE_SECONDS,
    MAX_SPEED_RATIO,
    PROGRESS_TTL,
    GlobalProgress,
    PeerProgress,
    ProgressTracker,
)
from tests.adversarial.members import claim_progress, join, keep_claiming, warnings_naming
from tests.emulated_swarm import SimPeer, make_swarm, run_on_shared_runner

RUN = "lies"
TARGET = 1000
EPOCH, SAMPLES, SPEED = 5, 20, 100.0  # every honest peer's report


class Scene:
    """Honest peers publishing and reading progress, and a liar that stores one record."""

    def __init__(self, peers: list[SimPeer]):
        *honest, self.liar = peers
        self.trackers = [ProgressTracker(p.dht, p.transport, RUN, str(p.transport.peer_id), TARGET) for p in honest]
        self.reader = self.trackers[0]
        self.view: dict[str, PeerProgress] = {}
        self.tasks = [asyncio.ensure_future(self._loop(t)) for t in self.trackers]

    @property
    def liar_id(self) -> str:
        return str(self.liar.transport.peer_id)

    async def _loop(self, tracker: ProgressTracker) -> None:
        while True:
            await tracker.report(EPOCH, SAMPLES, SPEED, EPOCH)
            reports = await tracker.fetch()
            if tracker is self.reader and reports is not None:
                self.view = reports
            await asyncio.sleep(PROGRESS_INTERVAL)

    async def lie(self, **claims: Any) -> None:
        """Store one record, an honest peer's but for `claims`, and wait until the reader has read it
        as claimed. It outlives every test here in the DHT, so only the reader's bounds make it age."""
        claims = {"epoch": EPOCH, "samples": SAMPLES, "sps": SPEED, "done": EPOCH, **claims}
        assert await claim_progress(self.liar, RUN, lifetime=50, **claims)
        await asyncio.sleep(2 * PROGRESS_INTERVAL)
        assert self.liar_id in self.view

    def estimate(self) -> GlobalProgress:
        local = PeerProgress(self.reader.peer_id, EPOCH, SAMPLES, SPEED, self.reader.dht.get_time(), done=EPOCH)
        return self.reader.estimate(self.reader.merged(self.view), local)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for tracker in self.trackers:
            tracker.close()


@contextlib.asynccontextmanager
async def scene() -> AsyncIterator[Scene]:
    _, peers = await make_swarm(4)
    stage = Scene(peers)
    try:
        await asyncio.sleep(1.0)  # every honest peer has published and read the others
        yield stage
    finally:
        stage.close()


@pytest.mark.timeout(60)
def test_a_report_from_the_future_ages_like_any_other(caplog: pytest.LogCaptureFixture) -> None:
    """The liar reports once, dated a million seconds ahead, and falls silent: read as dated, it
    would look live for eleven days and hold every round back. Bound: it stops counting as live
    LIVE_SECONDS after the reader first saw it, and leaves the estimate after PROGRESS_TTL."""
    async def main() -> None:
        async with scene() as stage:
            with caplog.at_level(logging.WARNING):
                await stage.lie(time=stage.liar.dht.get_time() + 1e6)
                assert stage.liar_id in {r.peer_id for r in stage.estimate().reports}  # it is seen...
                await asyncio.sleep(LIVE_SECONDS + PROGRESS_INTERVAL)
                now = stage.reader.dht.get_time()
                assert not stage.view[stage.liar_id].live(now)  # ...no longer live...
                await asyncio.sleep(PROGRESS_TTL - LIVE_SECONDS)
                assert stage.liar_id not in {r.peer_id for r in stage.estimate().reports}  # ...and gone
            assert warnings_naming(caplog, stage.liar_id, "in the future")
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_report_of_a_huge_epoch_does_not_move_the_collaborations_epoch(caplog: pytest.LogCaptureFixture) -> None:
    """Bound: the epoch stays within MAX_EPOCH_LEAD (1) of the second-highest reported, here the
    honest one; the liar's report is left out of the view altogether (it also claimed that epoch
    applied, which would tell every peer in matchmaking that its round is over)."""
    async def main() -> None:
        async with scene() as stage:
            with caplog.at_level(logging.WARNING):
                await stage.lie(epoch=10**7, done=10**7)  # read, then bounded:
                progress = stage.estimate()
            assert progress.epoch == EPOCH and progress.peers == 3
            assert stage.liar_id not in {r.peer_id for r in progress.reports}
            assert warnings_naming(caplog, stage.liar_id, "claims epoch 10000000")
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_report_of_huge_samples_does_not_fill_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    """The liar claims 10^9 samples at 10^8 samples/s (under the absolute cap of 10^9/s): read as
    claimed, the batch of 1000 is full and every peer enters a round at once (a short round: the
    epoch goes on, but every step costs a round). Bound: it counts at most MAX_SPEED_RATIO x the
    median peer's samples and speed, so the batch is not declared full and the ETA stays positive;
    with n honest peers, a round starts once they hold at least n / (n + 16) of the batch."""
    async def main() -> None:
        async with scene() as stage:
            with caplog.at_level(logging.WARNING):
                await stage.lie(samples=10**9, sps=1e8)
                assert stage.view[stage.liar_id].samples == 10**9  # read, then bounded
                progress = stage.estimate()
            liar = next(r for r in progress.reports if r.peer_id == stage.liar_id)
            assert liar.samples <= MAX_SPEED_RATIO * SAMPLES
            assert liar.samples_per_second <= MAX_SPEED_RATIO * SPEED
            assert progress.samples <= 3 * SAMPLES + liar.samples < TARGET and progress.eta_seconds > 0
            assert warnings_naming(caplog, stage.liar_id, "claims 1000000000 samples")
    run_virtual(main())


# -- the same lies against training peers -------------------------------------------------------------
BATCH, TRAIN_TARGET, COMPUTE = 8, 256, 0.02


async def peers_on_one_network(count: int = 3) -> list[potluck.Peer]:
    """`count` potluck.Peers on one emulated network, each joining through the first."""
    network = EmulatedNetwork(latency=0.01, seed=7)
    peers: list[potluck.Peer] = []
    for _ in range(count):
        await join(network, peers)
    return peers


def trainers(peers: list[potluck.Peer], **options: Any) -> tuple[list[torch.nn.Module], list[Optimizer]]:
    """One identical small model per peer, each with an Optimizer (not started yet): sync mode
    unless `options` say otherwise."""
    models = [torch.nn.Linear(16, 4) for _ in peers]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    opts = [Optimizer(peer, RUN, model.parameters(), lambda p: torch.optim.SGD(p, 0.1), target_batch_size=TRAIN_TARGET,
                      batch_size_per_step=BATCH, load_state=False, start=False, **options)
            for peer, model in zip(peers, models, strict=True)]
    return models, opts


async def train_beside_a_liar(epochs: int, stall: float = 0.0, honest: int = 2, options: dict | None = None,
                              **claims: Any) -> list[Optimizer]:
    """`honest` Optimizers train `epochs` epochs (sync mode, or as `options` say) while one more
    peer keeps publishing a progress record with `claims`; returns the honest ones. `stall`: one
    batch of the second in epoch 1 takes this long (the first's round of that epoch fails)."""
    peers = await peers_on_one_network(honest + 1)
    *honest_peers, liar = peers
    models, opts = trainers(honest_peers, **(options or {}))
    async def train(opt: Optimizer, model: torch.nn.Module, seed: int) -> None:
        generator, stalled = torch.Generator().manual_seed(seed), seed != 1
        while opt.local_epoch < epochs:
            x = torch.randn(BATCH, 16, generator=generator)
            model(x).square().mean().backward()
            if not stalled and opt.local_epoch == 1:
                stalled = True
                await asyncio.sleep(stall)
            await asyncio.sleep(COMPUTE)
            await opt.astep()

    liar_task = asyncio.ensure_future(keep_claiming(liar, RUN, **claims))
    try:
        for opt in opts:
            await opt.astart()
        await asyncio.wait_for(asyncio.gather(*(train(o, m, i) for i, (o, m) in enumerate(zip(opts, models)))), 120)
        return opts
    finally:
        liar_task.cancel()
        for opt in opts:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


@pytest.mark.timeout(120)
def test_training_peers_keep_their_epochs_beside_a_peer_claiming_epoch_ten_million() -> None:
    """Read as claimed, the liar's epoch sends both honest peers to catch up with it: they take epoch
    10^7 at once. Bound: they train epoch by epoch, together, as without it."""
    opts = run_on_shared_runner(train_beside_a_liar(3, epoch=10**7, done=10**7, sps=50.0), timeout=120)
    assert [o.local_epoch for o in opts] == [3, 3]
    assert all(TRAIN_TARGET <= o.epoch_samples for o in opts)  # the last epoch was a whole batch
    assert all(torch.equal(a, b) for a, b in zip(opts[0].context.state.params, opts[1].context.state.params, strict=True))


@pytest.mark.timeout(120)
def test_a_failed_round_beside_a_peer_claiming_epoch_ten_million_keeps_the_epochs() -> None:
    """A round that fails asks the DHT what happened meanwhile: that fresh read was taken as
    claimed, so the liar's epoch had ended the round ("missed the swarm's round"), and both
    honest peers took epoch 10^7. Bound: the fresh read is bounded as the view is; they go on
    together, epoch by epoch."""
    opts = run_on_shared_runner(train_beside_a_liar(4, stall=3.0, epoch=10**7, done=10**7, sps=50.0), timeout=120)
    assert [o.local_epoch for o in opts] == [4, 4]
    assert all(torch.equal(a, b) for a, b in zip(opts[0].context.state.params, opts[1].context.state.params, strict=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{"mode": "diloco", "local_steps": 4},
                                     {"mode": "diloco", "local_steps": 8, "fragments": 2}], ids=["diloco", "streaming"])
def test_diloco_peers_beside_a_peer_claiming_epoch_ten_million_keep_their_epochs(options: dict) -> None:
    """A DiLoCo (or Streaming DiLoCo) round that the others ended without us moved us to the
    highest epoch any report claimed, as claimed: three honest peers, one of them a moment late
    (0.3 s), all took epoch 10^7. Bound: the epoch the swarm supports; they go on epoch by epoch."""
    opts = run_on_shared_runner(train_beside_a_liar(4, stall=0.3, honest=3, options=options, epoch=10**7,
                                                    done=10**7, sps=50.0), timeout=120)
    assert [o.local_epoch for o in opts] == [4, 4, 4]


def test_a_lone_peer_far_ahead_is_followed_only_if_it_averaged_with_us() -> None:
    """In a swarm of two, the other peer far ahead is either a liar or a peer we fell behind (we
    stalled while it trained alone): it is believed only if it was in our last group."""
    me, other = (str(Identity.generate().peer_id) for _ in range(2))

    class Transport:
        def add_handler(self, *args: Any) -> None: ...

        def is_connected(self, peer: Any) -> bool:
            return False  # (no connections: leads count only when known peers back them)

    tracker = ProgressTracker(None, Transport(), RUN, me, TARGET)
    local = PeerProgress(me, EPOCH, SAMPLES, SPEED, 10.0, done=EPOCH)
    ahead = {other: PeerProgress(other, EPOCH + 5, SAMPLES, SPEED, 10.0, done=EPOCH + 5)}
    assert tracker.estimate(ahead, local).epoch == EPOCH
    tracker.set_neighbors([other])
    assert tracker.estimate(ahead, local).epoch == EPOCH + 5


# -- a claim beyond what the member averaged with -----------------------------------------------------
SLOW_COMPUTE = 10 * COMPUTE  # the member that will lie computes a tenth as fast as the honest ones
SLOW_RATE = BATCH / SLOW_COMPUTE  # its samples per second (40)


async def averaged_then_claimed(caplog: pytest.LogCaptureFixture, **claims: Any) -> tuple[GlobalProgress, str]:
    """Three Optimizers train two epochs (sync mode), the third at SLOW_RATE; no honest peer's claim
    is cut meanwhile. Then the third stops its Optimizer and publishes `claims` (at the epoch
    reached) instead, until the reader (the first) has read them; returns the reader's view then
    and the third's id."""
    peers = await peers_on_one_network()
    models, opts = trainers(peers)
    async def train(opt: Optimizer, model: torch.nn.Module, compute: float) -> None:
        generator = torch.Generator().manual_seed(int(compute * 1000))
        while opt.local_epoch < 2:
            model(torch.randn(BATCH, 16, generator=generator)).square().mean().backward()
            await asyncio.sleep(compute)
            await opt.astep()

    reader, liar = opts[0], opts[2]
    liar_id = str(peers[2].transport.peer_id)
    claiming = None
    try:
        for opt in opts:
            await opt.astart()
        with caplog.at_level(logging.WARNING):
            computes = (COMPUTE, COMPUTE, SLOW_COMPUTE)
            await asyncio.wait_for(asyncio.gather(*(train(o, m, c) for o, m, c in zip(opts, models, computes))), 60)
            assert not [r for r in caplog.records if "averaged" in r.getMessage()]  # honest: nobody cut
            liar.shutdown()
            claiming = asyncio.ensure_future(keep_claiming(peers[2], RUN, epoch=liar.local_epoch,
                                                           done=liar.local_epoch, **claims))
            for _ in range(100):
                await asyncio.sleep(PROGRESS_INTERVAL)
                # (as the reader merges them: the liar's last honest report, pushed to it as a
                # neighbor, wins until a claim is newer)
                seen = reader.context.tracker.merged(reader.context.reports).get(liar_id)
                if seen is not None and seen.samples_per_second == claims["sps"]:
                    break
            else:
                raise AssertionError("the reader never read the claim")
            return reader.progress(), liar_id
    finally:
        if claiming is not None:
            claiming.cancel()
        for opt in opts:
            opt.shutdown()
        for peer in peers:
            await peer.ashutdown()


@pytest.mark.timeout(120)
def test_a_member_counts_at_most_what_it_averaged_with(caplog: pytest.LogCaptureFixture) -> None:
    """The slow member averaged about SLOW_RATE samples/s, then claims 100x that: 10x an honest
    peer's speed, within the relative cap of MAX_SPEED_RATIO x the median, which alone lets it count
    and shortens the ETA. Bound: the reader counts it at most AVERAGED_SLACK x 2 x SLOW_RATE (2: its
    averaged samples come in whole batches), so the swarm's speed (and the ETA) moves by no more. It
    also claims 100 batches' samples, and for those it is named (a speed alone is only cut)."""
    claimed = 100 * SLOW_RATE
    progress, liar_id = run_on_shared_runner(averaged_then_claimed(caplog, sps=claimed, samples=100 * TRAIN_TARGET),
                                             timeout=120)
    liar = next(r for r in progress.reports if r.peer_id == liar_id)
    max_speed = AVERAGED_SLACK * 2 * SLOW_RATE
    assert liar.samples_per_second <= max_speed < claimed / 10
    honest = sum(r.samples_per_second for r in progress.reports if r.peer_id != liar_id and r.computing)
    assert progress.samples_per_second <= honest + max_speed
    assert warnings_naming(caplog, liar_id, f"claims {100 * TRAIN_TARGET} samples at {claimed:.0f}/s, but averaged")


def test_claimed_samples_count_at_most_what_was_averaged_with(caplog: pytest.LogCaptureFixture) -> None:
    """A member that averaged 20 samples over a 1 s epoch with us claims, in a report as of that
    round's end, 10^4 samples at 2000/s, within the relative caps (the median peer holds 500
    samples at 400/s). Bound: it counts at most AVERAGED_SLACK x 20 samples at AVERAGED_SLACK x
    20/s, and is named; a peer we never
    averaged with is counted as it claims (the relative caps only)."""
    me, liar, stranger, other = (str(Identity.generate().peer_id) for _ in range(4))

    class Transport:
        def add_handler(self, *args: Any) -> None: ...

        def is_connected(self, peer: Any) -> bool:
            return False  # (no connections: leads count only when known peers back them)

    tracker = ProgressTracker(None, Transport(), RUN, me, 10**5)
    tracker.averaged({liar: 20, me: 20}, duration=1.0, now=10.0)
    local = PeerProgress(me, EPOCH, 500, 400.0, 10.0, done=EPOCH)
    reports = {liar: PeerProgress(liar, EPOCH, 10**4, 2000.0, 10.0, done=EPOCH),
               stranger: PeerProgress(stranger, EPOCH, 2000, 1000.0, 10.0, done=EPOCH),
               other: PeerProgress(other, EPOCH, 500, 400.0, 10.0, done=EPOCH)}
    with caplog.at_level(logging.WARNING):
        progress = tracker.estimate(reports, local)
    counted = {r.peer_id: r for r in progress.reports}
    assert counted[liar].samples <= AVERAGED_SLACK * 20 and counted[liar].samples_per_second <= AVERAGED_SLACK * 20
    assert counted[stranger] == reports[stranger]
    assert progress.samples <= 2000 + 2 * 500 + AVERAGED_SLACK * 20
    assert warnings_naming(caplog, liar, "but averaged 20 samples")
    assert not warnings_naming(caplog, stranger, "")


def test_a_peer_claiming_to_crawl_stretches_a_diloco_rounds_window_at_most_the_factor() -> None:
    """A DiLoCo round's window covers two of the slowest training peer's steps as its report claims
    them (a slow peer joins only between its steps): a made-up id that claims a crawl, and then
    does not come, stretches our rounds' windows at most MAX_ROUND_WINDOW_FACTOR times the run's
    matchmaking_time, and never past what DHT nodes keep a declaration for (a longer window was a
    ValueError mid-run). Idle peers and peers in a round are not waited for."""
    def window(*reports: PeerProgress, base: float = 1.0) -> float:
        context = SimpleNamespace(settings=SimpleNamespace(matchmaking_time=base, batch_size_per_step=256),
                                  progress=lambda: SimpleNamespace(reports=reports), _live_others=iter)
        return RunContext.round_window(context)  # type: ignore[arg-type]

    def peer(name: str, speed: float, **kwargs: Any) -> PeerProgress:
        return PeerProgress(name, epoch=3, samples=0, samples_per_second=speed, time=0.0, **kwargs)

    assert window() == 1.0  # nobody else: the run's window
    assert window(peer("a", 1024.0)) == 1.0  # steps of 0.25 s
    assert window(peer("a", 1024.0), peer("b", 256 / 1.2)) == pytest.approx(2.4)  # a step of 1.2 s
    assert window(peer("a", 1024.0), peer("liar", 1e-9)) == MAX_ROUND_WINDOW_FACTOR * 1.0
    assert window(peer("a", 1024.0), peer("idle", 1e-9, idle=True), peer("in", 1e-9, averaging=True)) == 1.0
    assert window(peer("liar", 1e-9), base=100.0) == DECLARATION_MAX_TTL  # not 8 x 100 s
