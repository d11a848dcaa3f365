"""Progress tracking: who is training, how fast, and when the swarm's global batch will be full.

Each peer publishes its progress (epoch, samples accumulated in that epoch, samples per second)
under `<run_id>.progress` in a subkey that only it can write (owner-signed). Every peer reads all
records and extrapolates them to now, so it knows when the collaboration reaches
`target_batch_size` without a central server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from potluck.core.errors import PotluckError
from potluck.dht.records import owner_marker

logger = logging.getLogger(__name__)

# A peer's record lives this long unless refreshed: a peer that died stops counting after it.
PROGRESS_TTL = 3.0
# Others' reports are extrapolated at their speed for at most this long: a peer that has not
# reported for longer may be blocked (averaging) or gone, and must not fill the batch alone. Peers
# report every 0.1 s (the Optimizer's PROGRESS_INTERVAL); extrapolating a view much older than
# that counts samples of a peer that has meanwhile entered the round and ends rounds short.
MAX_EXTRAPOLATION = 0.25
# Records that claim absurd values are ignored (they come from other peers).
MAX_SAMPLES_PER_SECOND = 1e9
# A live peer republishes every fraction of a second (even while blocked in a round, from its
# event loop); one silent for this long has left or hangs, so nobody waits for it any more. A
# departed peer thus stops holding others back within one matchmaking window, long before its
# record expires (PROGRESS_TTL).
LIVE_SECONDS = 1.0


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    epoch: int
    samples: int  # accumulated towards `epoch`'s global batch
    samples_per_second: float
    time: float  # DHT time of the report
    client_mode: bool = False
    done: int = 0  # epochs whose update this peer has applied (its parameters' version)
    averaging: bool = False  # in a round now: `samples` is frozen, nothing is added
    idle: bool = False  # has stopped calling step() (e.g. done training, still online)
    part: int = 0  # rounds of this epoch that ended short of the batch (their samples were moved)

    def live(self, now: float) -> bool:
        """It reported recently: still there."""
        return now - self.time <= LIVE_SECONDS

    @property
    def computing(self) -> bool:
        """Adding samples at `samples_per_second` now (not in a round, not idle)."""
        return not (self.averaging or self.idle)


@dataclass(frozen=True)
class GlobalProgress:
    """The collaboration as this peer sees it."""

    epoch: int  # the newest epoch any peer reports
    samples: float  # samples towards that epoch's batch that peers have reported (ours: exact)
    peers: int  # peers working on that epoch
    samples_per_second: float
    eta_seconds: float  # until the global batch is full (0 when it is)
    reports: tuple[PeerProgress, ...] = ()
    part: int = 0  # the newest part of `epoch` any peer reports


class ProgressTracker:
    """Publishes this peer's progress and reads everyone's (async; the Optimizer drives it)."""

    def __init__(self, dht: Any, run_id: str, peer_id: str, target_batch_size: int, client_mode: bool = False):
        self.dht = dht
        self.key = f"{run_id}.progress"
        self.subkey = f"{peer_id}{owner_marker(peer_id)}"
        self.peer_id = peer_id
        self.target = target_batch_size
        self.client_mode = client_mode

    async def report(self, epoch: int, samples: int, samples_per_second: float, done: int,
                     averaging: bool = False, idle: bool = False, part: int = 0) -> None:
        """Publish: `epoch` our samples count towards (and its `part`), `done` epochs applied
        (lower while a delayed update is still averaging), whether we are in a round or idle."""
        now = self.dht.get_time()
        record = {"epoch": epoch, "samples": samples, "sps": samples_per_second, "time": now,
                  "client": self.client_mode, "done": done, "averaging": averaging, "idle": idle, "part": part}
        try:
            await self.dht.astore(self.key, record, now + PROGRESS_TTL, subkey=self.subkey)
        except PotluckError as e:
            logger.debug("could not publish progress: %s", e)

    async def fetch(self) -> dict[str, PeerProgress] | None:
        """Every live peer's latest report (ours included, as last published); None if the DHT
        could not be read this time (keep the previous view: one failed read must not make a
        peer believe it is alone)."""
        now = self.dht.get_time()
        reports: dict[str, PeerProgress] = {}
        try:
            found = await self.dht.aget(self.key, latest=True)
        except PotluckError as e:
            logger.debug("could not read progress: %s", e)
            return None
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                report = _parse(subkey, entry.value)
                if report is not None and entry.expiration_time > now:
                    reports[report.peer_id] = report
        return reports

    def estimate(self, reports: dict[str, PeerProgress], local: PeerProgress) -> GlobalProgress:
        """The swarm's progress now: others' latest reports plus our own exact numbers. The ETA
        extrapolates each peer at its speed (not one in a round or idle: its samples are final),
        so that peers enter the round when the batch is due rather than a report interval after
        it. Only the newest part of the newest epoch counts: a report from before a short round
        still holds samples that the round moved."""
        now = local.time
        reports = {peer: r for peer, r in reports.items() if now - r.time <= PROGRESS_TTL}
        reports[local.peer_id] = local
        epoch = max(r.epoch for r in reports.values())
        part = max(r.part for r in reports.values() if r.epoch == epoch)
        current = [r for r in reports.values() if r.epoch == epoch and r.part == part]
        reported = sum(r.samples for r in current)
        expected = sum(r.samples + r.computing * r.samples_per_second * min(max(0.0, now - r.time), MAX_EXTRAPOLATION)
                       for r in current)
        speed = sum(r.samples_per_second for r in current if r.computing)
        left = max(0.0, self.target - expected)
        eta = 0.0 if left == 0 else (left / speed if speed > 0 else float("inf"))
        return GlobalProgress(epoch, reported, len(current), speed, eta, tuple(reports.values()), part)


def _parse(subkey: Any, value: Any) -> PeerProgress | None:
    """A progress record from the DHT, or None if it is malformed."""
    if not isinstance(subkey, str) or "[owner:" not in subkey or not isinstance(value, dict):
        return None
    try:
        epoch, samples = int(value["epoch"]), int(value["samples"])
        sps, time = float(value["sps"]), float(value["time"])
        done = int(value.get("done", epoch))
        part = int(value.get("part", 0))
    except (KeyError, TypeError, ValueError):
        return None
    if epoch < 0 or samples < 0 or not 0 <= sps <= MAX_SAMPLES_PER_SECOND or not 0 <= done <= epoch or part < 0:
        return None
    return PeerProgress(subkey.split("[owner:")[0], epoch, samples, sps, time, bool(value.get("client")), done,
                        bool(value.get("averaging")), bool(value.get("idle")), part)
