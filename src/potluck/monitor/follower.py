"""The monitor's follower: a peer that trains nothing and reads a run's records from the DHT.

Every `POLL_INTERVAL` it reads the run's progress records (`ProgressTracker.fetch`: who is online,
how fast, their metrics and failed rounds) and round records (`fetch_rounds`: who averaged what
with whom), estimates the swarm now as a training peer would (`ProgressTracker.estimate`, with the
same bounds on others' claims), checks each member's membership token for its name, and hands it
all to the `Ledger` in one write, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from potluck.core.errors import IdentityError, MalformedMessage, MembershipError
from potluck.core.runner import run_in_thread
from potluck.monitor.ledger import Ledger
from potluck.monitor.views import SwarmNow
from potluck.net.identity import PeerID
from potluck.net.membership import MembershipToken
from potluck.optim.progress import PeerProgress, ProgressTracker, RoundRecord, fetch_rounds

logger = logging.getLogger(__name__)

# How often the follower reads the run (seconds): peers publish progress every few tenths of a
# second and round records live a minute (ROUNDS_TTL), so a poll a second misses nothing and costs
# two DHT reads.
POLL_INTERVAL = 1.0
# One poll's DHT reads give up after this (seconds); the next poll tries again.
POLL_TIMEOUT = 10.0


class Follower:
    """Follows `run_id` through `peer`'s DHT into `ledger`; `run()` until cancelled, or `poll()` once."""

    def __init__(self, peer: Any, run_id: str, ledger: Ledger, poll_interval: float = POLL_INTERVAL):
        self.peer = peer
        self.run_id = run_id
        self.ledger = ledger
        self.poll_interval = poll_interval
        # Target 0 until a peer says the run's: the tracker only estimates with it.
        self.tracker = ProgressTracker(peer.dht, peer.transport, run_id, peer.peer_id, 0, client_mode=True)
        self.polls = 0  # polls that read the DHT

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
                asyncio.gather(self.tracker.fetch(), fetch_rounds(self.peer.dht, self.run_id)), POLL_TIMEOUT)
        except TimeoutError:
            reports = rounds = None
        if reports is None or rounds is None:
            logger.info("monitor: could not read run %r from the DHT this time", self.run_id)
            return None
        now = self.peer.dht.get_time()
        reports = {p: r for p, r in reports.items() if p != self.peer.peer_id}
        swarm = self.swarm_now(reports, now)
        names = self._names(rounds)
        published = {p: records for p, (records, _) in rounds.items()}
        await run_in_thread(self.ledger.observe, now, reports, published, swarm, names)
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
        eta = progress.eta_seconds if target is not None and math.isfinite(progress.eta_seconds) else None
        # Speed: every training peer's (as bounded), also while it waits in a round, where the ETA
        # counts it as not computing: a chart of the swarm's speed should not drop at every round.
        speed = sum(r.samples_per_second for r in progress.reports if r.peer_id != me.peer_id and not r.idle)
        return SwarmNow(self.run_id, now, len(reports), speed, progress.epoch, int(progress.samples), target, eta)

    def _names(self, rounds: dict[str, tuple[list[RoundRecord], bytes | None]]) -> dict[str, str]:
        """The name each signer's membership token gives it, where the token admits that very
        peer to this run now (only in an authority-governed run: elsewhere nobody has a name)."""
        gate = getattr(self.peer.transport, "membership", None)
        if gate is None:
            return {}
        names = {}
        for peer, (_, token) in rounds.items():
            if token is None:
                continue
            try:
                parsed = MembershipToken.from_wire(token)
                gate.verify(PeerID.from_string(peer), parsed)
            except (MalformedMessage, MembershipError, IdentityError) as e:
                logger.debug("monitor: no name for %s: %s", peer, e)
                continue
            names[peer] = parsed.name
        return names
