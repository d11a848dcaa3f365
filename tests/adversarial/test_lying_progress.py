"""Issue 15, "Honest progress": a member's progress record (signed, under its own subkey, so it is
only ever its own) can still claim anything. Readers bound what it does: a report time in the
future counts from when it was first read, and ages; an epoch far ahead of the others is ignored;
samples and speed count at most MAX_SPEED_RATIO times the median peer's.

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
from typing import Any

import pytest
import torch

import potluck
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.optim import Optimizer
from potluck.optim.optimizer import PROGRESS_INTERVAL
from potluck.optim.progress import (
    LIVE_SECONDS,
    MAX_SPEED_RATIO,
    PROGRESS_TTL,
    GlobalProgress,
    PeerProgress,
    ProgressTracker,
)
from tests.adversarial.members import claim_progress, join, keep_claiming, run_on_shared_runner, warnings_naming
from tests.emulated_swarm import SimPeer, make_swarm

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


async def train_beside_a_liar(epochs: int, **claims: Any) -> list[Optimizer]:
    """Two honest Optimizers train `epochs` epochs (sync mode) while a third peer keeps publishing
    a progress record with `claims`; returns the honest ones."""
    network = EmulatedNetwork(latency=0.01, seed=7)
    peers: list[potluck.Peer] = []
    for _ in range(3):
        await join(network, peers)
    *honest, liar = peers
    models = [torch.nn.Linear(16, 4) for _ in honest]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    opts = [Optimizer(peer, RUN, model.parameters(), lambda p: torch.optim.SGD(p, 0.1), target_batch_size=TRAIN_TARGET,
                      batch_size_per_step=BATCH, load_state=False, start=False)
            for peer, model in zip(honest, models, strict=True)]
    async def train(opt: Optimizer, model: torch.nn.Module, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        while opt.local_epoch < epochs:
            x = torch.randn(BATCH, 16, generator=generator)
            model(x).square().mean().backward()
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
    assert all(torch.equal(a, b) for a, b in zip(opts[0]._params, opts[1]._params, strict=True))


def test_a_lone_peer_far_ahead_is_followed_only_if_it_averaged_with_us() -> None:
    """In a swarm of two, the other peer far ahead is either a liar or a peer we fell behind (we
    stalled while it trained alone): it is believed only if it was in our last group."""
    me, other = (str(Identity.generate().peer_id) for _ in range(2))

    class Transport:
        def add_handler(self, *args: Any) -> None: ...

    tracker = ProgressTracker(None, Transport(), RUN, me, TARGET)
    local = PeerProgress(me, EPOCH, SAMPLES, SPEED, 10.0, done=EPOCH)
    ahead = {other: PeerProgress(other, EPOCH + 5, SAMPLES, SPEED, 10.0, done=EPOCH + 5)}
    assert tracker.estimate(ahead, local).epoch == EPOCH
    tracker.set_neighbors([other])
    assert tracker.estimate(ahead, local).epoch == EPOCH + 5
