"""A peer we follow (one we joined through, or whose state we took) is believed ahead of the
others: a run's first peer trains on alone while the peers joining it download its state. The
trust is bounded: a followed peer's lead counts up to MAX_FOLLOWED_LEAD epochs past the others',
and a peer that has neither trained nor taken a state (epoch 0, nothing done) is no evidence
either way, as our own epoch is not before we train."""

from __future__ import annotations

from typing import Any

from potluck.net.identity import Identity
from potluck.optim.progress import MAX_FOLLOWED_LEAD, PeerProgress, ProgressTracker

TARGET, SAMPLES, SPEED, NOW = 1000, 20, 100.0, 10.0


class Transport:
    def add_handler(self, *args: Any) -> None: ...

    def is_connected(self, peer: Any) -> bool:
        return False  # (no connections: leads count only when known peers back them)


def ids(count: int) -> list[str]:
    return [str(Identity.generate().peer_id) for _ in range(count)]


def report(peer: str, epoch: int, samples: int = SAMPLES) -> PeerProgress:
    return PeerProgress(peer, epoch, samples, SPEED, NOW, done=epoch)


def test_a_followed_peer_ahead_is_believed_up_to_the_bound_and_a_liar_far_ahead_is_not() -> None:
    me, leader, lagging = ids(3)
    tracker = ProgressTracker(None, Transport(), "run", me, TARGET)
    local = report(me, 20)
    ahead = {leader: report(leader, 26), lagging: report(lagging, 20)}
    assert tracker.estimate(ahead, local).epoch == 20  # not followed: two peers at 20 outvote it
    tracker.followed = frozenset({leader})
    assert tracker.estimate(ahead, local).epoch == 26
    far = {leader: report(leader, 20 + MAX_FOLLOWED_LEAD + 2), lagging: report(lagging, 20)}
    assert tracker.estimate(far, local).epoch == 20
    huge = {leader: report(leader, 10**7), lagging: report(lagging, 20)}
    assert tracker.estimate(huge, local).epoch == 20


def test_peers_that_never_trained_do_not_outvote_the_peer_that_carried_the_run() -> None:
    me, first, *newcomers = ids(4)
    tracker = ProgressTracker(None, Transport(), "run", me, TARGET)
    fresh = PeerProgress(me, 0, 0, 0.0, NOW)
    reports = {first: report(first, 14), **{p: PeerProgress(p, 0, 0, 0.0, NOW) for p in newcomers}}
    assert tracker.estimate(reports, fresh).epoch == 14
    # ... but peers that trained at epoch 0 are evidence: one peer far ahead of them is not believed.
    trained = {first: report(first, 14), **{p: report(p, 0) for p in newcomers}}
    assert tracker.estimate(trained, fresh).epoch == 0
