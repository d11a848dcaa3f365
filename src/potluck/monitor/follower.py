"""The monitor's follower: a peer that trains nothing and reads a run's records from the DHT.

Every `POLL_INTERVAL` it reads the run's progress records (`ProgressTracker.fetch`: who is online,
how fast, their metrics and failed rounds) and round records (`fetch_rounds`: who averaged what
with whom), estimates the swarm now as a training peer would (`ProgressTracker.estimate`, with the
same bounds on others' claims), checks each member's membership token for its name, and hands it
all to the `Ledger` in one write, off the event loop.

Credit is what the monitor's *witnesses* recorded (`Ledger`, `potluck.optim.vouching`): by
default the peers it joined through (`initial_peers`), which its operator trusts already; only the
rounds a witness averaged in are credited, so follow a run from a peer that trains.

A peer whose progress record names another run schema (`potluck.optim.schema`) than every schema
whose peers complete rounds together (`confirmed_runs`) is refused: it is kept out of the ledger
(never online, never counted in the swarm, never credited) and shown apart (`refused_peers`,
and `FollowedRun`, the view the dashboard and `potluck status` read).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Collection
from typing import Any

from potluck.core.runner import run_in_thread
from potluck.monitor.ledger import Ledger
from potluck.monitor.views import Contributor, EpochRow, HistoryPoint, PeerState, SwarmNow
from potluck.optim.progress import (
    PeerProgress,
    ProgressTracker,
    PublishedRounds,
    RoundRecord,
    confirmed_runs,
    fetch_published_rounds,
)
from potluck.optim.vouching import verified_names, witnesses_of

logger = logging.getLogger(__name__)

# How often the follower reads the run (seconds): peers publish progress every few tenths of a
# second and round records live a minute (ROUNDS_TTL), so a poll a second misses nothing and costs
# two DHT reads.
POLL_INTERVAL = 1.0
# One poll's DHT reads give up after this (seconds); the next poll tries again.
POLL_TIMEOUT = 10.0
# The swarm's speed is what its progress did over about this many seconds (epochs times their
# target batch, plus the samples of the current epoch): the sum of the speeds peers report counts
# only their computing, not the rounds between epochs, and overstated a run several times over.
SPEED_WINDOW = 10.0
# Progress points kept for SPEED_WINDOW at most (one a poll; a faster poll keeps the newest).
MAX_SPEED_POINTS = 64
# A refused peer stays shown this long after its last record: a wrong peer is told within
# seconds and stops, and whoever watches the dashboard should still see why it left.
REFUSED_SHOWN_SECONDS = 300.0
# Refused peers shown at most (the most recently seen): identities are free, and each record of
# another schema would otherwise hold a row of the monitor's memory.
MAX_REFUSED_PEERS = 1000


class Follower:
    """Follows `run_id` through `peer`'s DHT into `ledger`; `run()` until cancelled, or `poll()` once.
    `witnesses`: the peers whose round records are credited (default: `peer`'s initial peers; an
    empty collection: every member's records, each one vote, which identities made up at will
    can game: see docs/security.md)."""

    def __init__(self, peer: Any, run_id: str, ledger: Ledger, poll_interval: float = POLL_INTERVAL,
                 witnesses: Collection[str] | None = None):
        self.peer = peer
        self.run_id = run_id
        self.ledger = ledger
        self.poll_interval = poll_interval
        if witnesses is None:
            witnesses = witnesses_of(peer) - {str(peer.peer_id)}
        self.witnesses = frozenset(witnesses) or None
        if self.witnesses is None:
            logger.warning("monitor: no witness (it joined through no peer): every member's round records count, "
                           "and made-up identities that record each other are credited; give it initial peers "
                           "that train")
        self._witnessed = True  # a witness published round records at the last poll (warned once when not)
        # Target 0 until a peer says the run's: the tracker only estimates with it.
        self.tracker = ProgressTracker(peer.dht, peer.transport, run_id, peer.peer_id, 0, client_mode=True)
        self.polls = 0  # polls that read the DHT
        # Peers refused for another run schema: peer -> the row shown for it (see the module docstring).
        self._refused: dict[str, PeerState] = {}
        # (DHT time, samples since epoch 0 as the epochs count them) of the latest polls (SPEED_WINDOW)
        self._trail: deque[tuple[float, float]] = deque(maxlen=MAX_SPEED_POINTS)
        self._last: SwarmNow | None = None  # the last view with a peer online (shown once the run ends)

    def close(self) -> None:
        self.tracker.close()

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.poll_interval)

    async def poll(self) -> SwarmNow | None:
        """Read the run once and record it; the swarm now, or None if the DHT could not be read."""
        try:
            reports, rounds = await asyncio.wait_for(
                asyncio.gather(self.tracker.fetch(), fetch_published_rounds(self.peer.dht, self.run_id)), POLL_TIMEOUT)
        except TimeoutError:
            reports = rounds = None
        if reports is None or rounds is None:
            logger.info("monitor: could not read run %r from the DHT this time", self.run_id)
            return None
        now = self.peer.dht.get_time()
        reports = self._refuse({p: r for p, r in reports.items() if p != self.peer.peer_id}, rounds, now)
        swarm = self.swarm_now(reports, now)
        names = self._names({p: (list(entry.rounds), entry.token) for p, entry in rounds.items()})
        published = {p: list(entry.rounds) for p, entry in rounds.items()}
        self._check_witnessed(published)
        caught = {p: entry.caught for p, entry in rounds.items() if entry.caught}
        await run_in_thread(self.ledger.observe, now, reports, published, swarm, names, self.witnesses, caught)
        self.polls += 1
        return swarm

    def swarm_now(self, reports: dict[str, PeerProgress], now: float) -> SwarmNow:
        """The swarm as a training peer would estimate it from `reports` (an idle one: the
        monitor's own epoch and samples count for nothing)."""
        targets = sorted(r.target for r in reports.values() if r.target > 0)
        target = targets[(len(targets) - 1) // 2] if targets else None  # lower median: a liar's alone moves nothing
        self.tracker.target = target or 0
        me = PeerProgress(self.peer.peer_id, 0, 0, 0.0, now, client_mode=True, idle=True)
        progress = self.tracker.estimate(reports, me)
        if not reports:  # the run ended (or has not begun): its last state, nobody online
            last = self._last
            self._trail.clear()
            if last is None:
                return SwarmNow(self.run_id, now, 0, 0.0, 0, 0, target, None)
            return SwarmNow(self.run_id, now, 0, 0.0, last.epoch, last.samples, last.target_batch_size, None)
        eta = progress.eta_seconds if target is not None and math.isfinite(progress.eta_seconds) else None
        swarm = SwarmNow(self.run_id, now, len(reports), self._speed(progress, now), progress.epoch,
                         int(progress.samples), target, eta)
        self._last = swarm
        return swarm

    def _speed(self, progress: Any, now: float) -> float:
        """Samples per second as the epochs show them (see SPEED_WINDOW); before two polls, or
        without a target batch, the sum of the training peers' speeds (as bounded)."""
        reported = sum(r.samples_per_second for r in progress.reports if r.peer_id != self.peer.peer_id and not r.idle)
        if self.tracker.target <= 0:
            self._trail.clear()
            return reported
        done = progress.epoch * self.tracker.target + min(progress.samples, self.tracker.target)
        if self._trail and done < self._trail[-1][1]:
            self._trail.clear()  # the epochs went back (a new run under the same id): start over
        self._trail.append((now, done))
        while len(self._trail) > 2 and now - self._trail[1][0] >= SPEED_WINDOW:
            self._trail.popleft()
        then, before = self._trail[0]
        return (done - before) / (now - then) if now > then else reported

    def refused_peers(self) -> list[PeerState]:
        """The peers refused for another run schema, most recently seen first."""
        return sorted(self._refused.values(), key=lambda p: -p.last_seen)

    def _refuse(self, reports: dict[str, PeerProgress], rounds: dict[str, PublishedRounds],
                now: float) -> dict[str, PeerProgress]:
        """`reports` without those of peers whose schema is not one the run's peers complete
        rounds under (while there is one), which are noted as refused."""
        runs = confirmed_runs(rounds, {p: r.fingerprint for p, r in reports.items() if r.live(now)})
        refused = {p: r for p, r in reports.items() if runs and r.fingerprint is not None and r.fingerprint not in runs}
        run = ", ".join(sorted(f[:8] for f in runs))
        for peer, r in refused.items():
            first = self._refused[peer].first_seen if peer in self._refused else now
            why = f"its model or settings differ from the run's (schema {str(r.fingerprint)[:8]}, the run's {run})"
            self._refused[peer] = PeerState(peer, None, False, r.epoch, 0.0, r.client_mode, first, now, why)
        shown = sorted(self._refused.values(), key=lambda p: -p.last_seen)
        self._refused = {p.peer_id: p for p in shown[:MAX_REFUSED_PEERS] if now - p.last_seen <= REFUSED_SHOWN_SECONDS}
        return {p: r for p, r in reports.items() if p not in refused}

    def _names(self, rounds: dict[str, tuple[list[RoundRecord], bytes | None]]) -> dict[str, str]:
        """The name each signer's membership token gives it, where the token admits that very
        peer to this run now (only in an authority-governed run: elsewhere nobody has a name)."""
        return verified_names(rounds, getattr(self.peer.transport, "membership", None))

    def _check_witnessed(self, published: dict[str, list[RoundRecord]]) -> None:
        """Say once (until it changes) that no witness has published a round: nothing is credited."""
        witnessed = self.witnesses is None or any(published.get(w) for w in self.witnesses)
        if not witnessed and self._witnessed and published:
            logger.warning("monitor: none of its witnesses (%s) has published a round of run %r, so no round is "
                           "credited; follow the run from a peer that trains", ", ".join(sorted(self.witnesses)),
                           self.run_id)
        self._witnessed = witnessed


class FollowedRun:
    """What the dashboard and `potluck status` read: the ledger's view, with the peers the
    follower refused among its peers (a `MonitorView`)."""

    def __init__(self, ledger: Ledger, follower: Follower):
        self.ledger = ledger
        self.follower = follower

    def swarm_now(self) -> SwarmNow:
        return self.ledger.swarm_now()

    def peers(self) -> list[PeerState]:
        refused = self.follower.refused_peers()
        ids = {p.peer_id for p in refused}
        return [*(p for p in self.ledger.peers() if p.peer_id not in ids), *refused]

    def contributors(self) -> list[Contributor]:
        """The ledger's, but a refused peer that holds no credit (it was seen before the run's
        first confirmed round showed that its schema is not the run's) is not a contributor."""
        refused = {p.peer_id for p in self.follower.refused_peers()}
        return [c for c in self.ledger.contributors() if c.samples or c.peer_id not in refused]

    def epochs(self, limit: int = 100) -> list[EpochRow]:
        return self.ledger.epochs(limit)

    def history(self, since: float | None = None) -> list[HistoryPoint]:
        return self.ledger.history(since)
