"""The monitor's figures against what the run did: the swarm's speed is the one its epochs show,
a finished run keeps showing its last state, and records a moment ahead of our clock (one host,
or NTP-kept machines) raise no warning while a real skew is said once."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from potluck.dht.records import own_subkey
from potluck.monitor.follower import Follower
from potluck.monitor.ledger import Ledger
from potluck.net.identity import Identity
from potluck.optim.progress import PeerProgress, ProgressRecord, ProgressTracker

RUN = "figures"
TARGET = 512


def follower() -> Follower:
    transport = SimpleNamespace(add_handler=lambda *_: None, remove_handler=lambda *_: None)
    return Follower(SimpleNamespace(dht=None, transport=transport, peer_id="monitor"), RUN, Ledger(":memory:"))


def reports(epoch: int, samples: int, now: float) -> dict[str, PeerProgress]:
    """Three peers that each say they compute 20,000 samples/s (they also spend time in rounds),
    each having applied every epoch's update so far (peers that never trained have no vote)."""
    return {p: PeerProgress(p, epoch, samples // 3, 20_000.0, now, target=TARGET, done=epoch) for p in ("a", "b", "c")}


def test_the_swarms_speed_is_what_its_epochs_show_not_the_sum_of_claimed_speeds() -> None:
    watch = follower()
    # The epochs advance by 25 every second: 12,800 samples/s, while the peers claim 60,000.
    views = [watch.swarm_now(reports(10 + 25 * t, 0, 100.0 + t), 100.0 + t) for t in range(4)]
    assert [v.epoch for v in views] == [10, 35, 60, 85]
    assert all(v.samples_per_second == pytest.approx(25 * TARGET) for v in views[1:])


def test_a_finished_run_shows_its_last_state() -> None:
    watch = follower()
    watch.swarm_now(reports(40, 300, 100.0), 100.0)
    last = watch.swarm_now(reports(41, 150, 101.0), 101.0)
    ended = watch.swarm_now({}, 105.0)  # every peer left: no record is live
    assert (ended.peers_online, ended.samples_per_second, ended.eta_seconds) == (0, 0.0, None)
    assert (ended.epoch, ended.samples, ended.target_batch_size) == (41, last.samples, TARGET) != (0, 0, None)


class OneRecordDHT:
    """A DHT that holds one progress record (written `ahead` seconds ahead of this reader's clock)."""

    def __init__(self, peer: object, ahead: float):
        self.peer, self.ahead, self.time = peer, ahead, 1000.0

    def get_time(self) -> float:
        return self.time

    async def aget(self, key: object, latest: bool = False) -> object:
        record = ProgressRecord(3, 10, 100.0, self.time + self.ahead, target=TARGET).to_wire()
        return SimpleNamespace(value={own_subkey(self.peer): SimpleNamespace(value=record,
                                                                             expiration_time=self.time + 3)})


@pytest.mark.parametrize("ahead, warnings", [(0.02, 0), (30.0, 1)])
def test_a_time_ahead_is_said_once_and_only_when_the_clocks_really_differ(
        ahead: float, warnings: int, caplog: pytest.LogCaptureFixture) -> None:
    peer = Identity.generate().peer_id
    dht = OneRecordDHT(peer, ahead)
    transport = SimpleNamespace(add_handler=lambda *_: None, remove_handler=lambda *_: None)
    tracker = ProgressTracker(dht, transport, RUN, "monitor", TARGET, client_mode=True)

    async def read_often() -> None:
        for _ in range(5):
            dht.time += 0.1
            found = await tracker.fetch()
            assert found is not None and found[str(peer)].time <= dht.time  # counted from now
    with caplog.at_level(logging.WARNING, logger="potluck.optim.progress"):
        asyncio.run(read_often())
    assert len([r for r in caplog.records if "in the future" in r.getMessage()]) == warnings
