"""Progress tracking: who is training, how fast, and when the swarm's global batch will be full.

Each peer publishes its progress (epoch, samples accumulated in that epoch, samples per second)
under `<run_id>.progress` in the subkey `own_subkey(its peer id)`, which only it can write
(owner-signed); readers take the peer from `subkey_owner` and skip any other subkey. Every peer reads all
records and extrapolates them to now, so it knows when the collaboration reaches
`target_batch_size` without a central server.

The DHT alone is slow for this: a report is stored, then read by a poll, so others see it a
fraction of a second late, while a fast swarm fills its batch in tens of milliseconds. Peers
therefore also send each report straight to the members of their last averaging group (their
`neighbors`), and take such a report only from the peer it is about. Newcomers and peers outside
the group are still seen through the DHT.

Records come from other peers, so a reader bounds what one record can do (see docs/security.md):
a record is only its signer's; a report time in the future counts as the moment it was first
read, and ages from there; an epoch more than `MAX_EPOCH_LEAD` ahead of the second-highest
epoch reported is ignored (one record cannot move the collaboration's epoch), and so is any lead
over our own epoch that nothing backs (`_backed`: a peer of our recent groups, one we follow, or
a second network origin; a made-up identity one epoch ahead would otherwise end every round of
ours); a peer's samples and speed count at most `MAX_SPEED_RATIO` times the median peer's, and a
peer we averaged with recently at most `AVERAGED_SLACK` times what it averaged with (`averaged`):
the samples its round note gave the group, which the group's update is scaled by, over that
epoch's duration, and the samples that rate adds up to since.

Two more things ride along for monitors (`potluck monitor`): the training metrics a peer chooses
to publish (`Optimizer.report_metrics`) and its count of failed rounds in its progress record, and
after every completed averaging round a signed round record (`RoundRecord`, under
`<run_id>.rounds`) naming the group's contributors and the samples each one's round note gave the
group. A monitor credits a peer with what the other members of its groups record for it
(`potluck.monitor.ledger`), never with what the peer says of itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from potluck.core.bounded import drop_oldest
from potluck.core.errors import MalformedMessage, NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.wire import Bool, Bytes, Dict, Int, List, Message, Nested, Number, Text, Tuple, number_value
from potluck.dht.records import own_subkey, owned_entries, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.membership import MAX_TOKEN_BYTES
from potluck.net.origins import UNKNOWN_ORIGIN
from potluck.optim.schema import FINGERPRINT_CHARS

logger = logging.getLogger(__name__)

# A peer's record lives this long unless refreshed: a peer that died stops counting after it.
PROGRESS_TTL = 3.0
# Others' reports are extrapolated at their speed for at most this long: a peer that has not
# reported for longer may be blocked (averaging) or gone, and must not fill the batch alone. Peers
# report every 0.1 s (the Optimizer's PROGRESS_INTERVAL); extrapolating a view much older than
# that counts samples of a peer that has meanwhile entered the round and ends rounds short.
MAX_EXTRAPOLATION = 0.25
# A report time at most this far ahead of ours is counted from now without a warning: clocks of
# machines kept by NTP differ by milliseconds, and a record stored while we read the DHT is a
# moment ahead of the time we started reading at. Further ahead, the skew is real and said once.
CLOCK_TOLERANCE = 1.0
# Records that claim absurd values are ignored (they come from other peers).
MAX_SAMPLES_PER_SECOND = 1e9
# Bounds a round member's claim of samples (it comes from the network): more than any batch.
MAX_CLAIMED_SAMPLES = 2**40
# Longest state digest accepted in a round note (ours are 64 hex digits of SHA-256).
MAX_DIGEST_CHARS = 128
# Epochs an honest peer can be ahead of the others: one (its round ended and it applied the
# update, or its delayed round started, a moment before theirs). A report further ahead than this
# of the second-highest epoch reported is ignored: it takes two peers to move the epoch.
MAX_EPOCH_LEAD = 1
# A lead over our own epoch (a higher epoch, or more epochs applied) counts only when it is backed
# (`ProgressTracker._backed`): a peer of our recent groups or one we follow reports as much, or
# peers of at least this many network origins (the subnets of our open connections with them) do.
# Identities are free, subnets are not: made-up ids on one host are one origin.
MIN_BACKING_ORIGINS = 2
# A peer we follow (`ProgressTracker.followed`: one we joined through, or whose state we took) is
# believed up to this many epochs past the second-highest epoch. A run starts with one peer: the
# peers that join it take its state, and while their downloads run it trains on alone, an epoch or
# more per download over slow links; the lead is bounded so that even a peer we trusted once
# cannot move our epoch by orders of magnitude.
MAX_FOLLOWED_LEAD = 8
# A peer's reported speed and samples count at most this many times the median peer's. Volunteers'
# hardware differs by about an order of magnitude (a laptop CPU next to a datacenter GPU), so
# honest peers stay within it; one record claiming more would fill the global batch on its own.
MAX_SPEED_RATIO = 16
# A peer we averaged with counts at most this many times the speed (samples over the epoch's
# duration) it averaged with, and as samples this many times those it averaged with plus what
# that speed adds since (a delayed update's next samples accumulate during the round). Speeds
# vary between epochs (other work on the machine, a peer that joined mid-epoch averaged only part
# of one), and a claim cut too low only delays a round; a claim over it would start rounds before
# the samples exist.
AVERAGED_SLACK = 4.0
# Claims over a bound above are cut quietly; a peer is named in a warning (as lying) only for
# samples over this many times a positive samples bound (not counting the cut at the global
# batch). Honest peers exceed the bounds in passing: at an epoch's start, when the median peer
# holds no samples yet; by samples past the batch while a round forms; and by speed always, as a
# speed is measured over the last quick step while the averaged rate is sustained over a whole
# epoch, stalls included (100x apart in the real-time tests), so a speed alone names nobody.
NAMED_OVER_BOUND = 8.0
# A live peer republishes every fraction of a second (even while blocked in a round, from its
# event loop); one silent for this long has left or hangs, so nobody waits for it any more. A
# departed peer thus stops holding others back within one matchmaking window, long before its
# record expires (PROGRESS_TTL).
LIVE_SECONDS = 1.0
# Reports are sent straight to at most this many members of the last group (each report costs
# one call per neighbor); in bigger groups the rest are seen through the DHT.
MAX_NEIGHBORS = 32
# What peers averaged with is remembered for at most this many peers (the most recently averaged):
# the members of the last few groups (MAX_NEIGHBORS each); older ones get the relative cap again.
MAX_AVERAGED_PEERS = 4 * MAX_NEIGHBORS
# A report that does not arrive within this is dropped: the next one follows a moment later.
PUSH_TIMEOUT = 1.0
# Metrics one progress record may carry (`Optimizer.report_metrics`), and the longest name: a
# loss and a few accuracies fit; more would grow every report, which is sent ten times a second.
MAX_METRICS = 16
MAX_METRIC_NAME_CHARS = 32
# A round record lives this long: a monitor polling every second (or restarted within a minute)
# still sees it; the DHT caps it at ROUNDS_MAX_TTL (dht.key_kinds).
ROUNDS_TTL = 60.0
# A peer's round record holds its latest rounds only: at most this many, and as many as list at
# most MAX_RECORDED_MEMBERS contributors in all (512 x about 60 bytes is 30 KiB, well within one
# DHT value: 64 KiB, dht.validation.DEFAULT_MAX_VALUE_BYTES). A monitor polling every second sees
# every round of groups of up to 32 peers finishing up to 16 rounds a second, and of 256 peers up
# to 2 (a group that large takes seconds per round).
MAX_RECORDED_ROUNDS = 16
MAX_RECORDED_MEMBERS = 512
# Contributors listed per round; the members of a larger group past it are not recorded (and not
# credited).
MAX_ROUND_MEMBERS = 256
# Longest peer id string accepted in a round record (ours are about 50 characters).
MAX_PEER_ID_CHARS = 128
# Peers a round-records entry names as caught lying (verified training): the newest are kept. A
# caught peer was banned, so it takes a new identity per lie, each costing it a caught round.
MAX_CAUGHT = 64
# Longest round id accepted in a round record (ours are 16 hex digits).
MAX_ROUND_ID_CHARS = 64
# Bounds a recorded epoch, member's samples, failed-rounds counter and target (from the network).
MAX_RECORDED_COUNT = 2**40
# Hex digits of a published view's digest (`view_digest`): 64 bits tell a few peers' sets apart.
VIEW_CHARS = 16


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
    failed: int = 0  # averaging rounds that failed since the peer started (for monitors)
    target: int = 0  # the run's target batch size, as this peer was given it (0: not said)
    metrics: tuple[tuple[str, float], ...] = ()  # what it chose to publish (report_metrics)
    metrics_time: float = 0.0  # DHT time the metrics were reported
    fingerprint: str | None = None  # of its run schema (potluck.optim.schema); None: it does not say
    view: str | None = None  # digest of the peers it counts into a round now (`view_digest`); None: not said

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

    @property
    def applied(self) -> int:
        """The newest epoch whose update a peer has applied: `epoch`, or one less while that
        peer's delayed update still averages (its new samples count towards the next epoch)."""
        return max((r.done for r in self.reports), default=0)


class ProgressTracker:
    """Publishes this peer's progress and reads everyone's (async; the Optimizer drives it)."""

    def __init__(self, dht: Any, transport: Any, run_id: str, peer_id: str, target_batch_size: int,
                 client_mode: bool = False, fingerprint: str | None = None):
        self.dht = dht
        self.transport = transport
        names = RunNames(run_id)
        self.key = names.progress
        self.rounds_key = names.rounds
        self.subkey = own_subkey(peer_id)
        self.peer_id = peer_id
        self.target = target_batch_size
        self.client_mode = client_mode
        # Our run schema's fingerprint: records that name another are read apart (`strangers`),
        # never counted. None (a monitor): every record counts.
        self.fingerprint = fingerprint
        self.caught: Iterable[str] = ()  # verified training: whom we caught lying (published with our rounds)
        # Peers whose latest record (in the last read of the DHT) names another fingerprint.
        self.strangers: dict[str, PeerProgress] = {}
        self.method = names.progress_push
        self._neighbors: dict[str, Any] = {}  # peer id string -> PeerID
        # Peers whose epoch counts up to MAX_FOLLOWED_LEAD past the others' (see `_bounded`): the
        # Optimizer's witnesses (the peers its user joined through) and the donors of its state.
        self.followed: frozenset[str] = frozenset()
        # Whether a lead over our epoch must be backed (`_backed`). A mode whose peers meet whatever
        # their epochs and never take the swarm's (Moshpit) turns it off: a lead ends nothing there.
        self.backed_leads = True
        # Members of our recent groups (at most MAX_AVERAGED_PEERS, the newest last): their leads
        # count (`_backed`). A dict as an ordered set.
        self._grouped: dict[str, None] = {}
        # Peers named for an unbacked lead (`_backed`): once each, though such a lead comes and goes
        # with every epoch of ours; forgotten all at once past MAX_AVERAGED_PEERS.
        self._unbacked: set[str] = set()
        # Reports sent to us by neighbors, stamped with our clock on arrival; replaced, never
        # changed in place (the training thread reads it while the loop writes it).
        self.pushed: dict[str, PeerProgress] = {}
        # Peers whose report time was in the future: peer -> (that time, our time when first read).
        self._future: dict[str, tuple[float, float]] = {}
        self._skewed: set[str] = set()  # peers of `_future` further ahead than CLOCK_TOLERANCE (warned once each)
        self._ignored: set[str] = set()  # peers whose reports are ignored now (logged once each)
        self._capped: set[str] = set()  # peers whose claims are far over the bounds now (named once each)
        # peer -> (samples it averaged with, their samples per second, DHT time of the round) in our
        # last round with it, oldest first; at most MAX_AVERAGED_PEERS
        self._averaged: dict[str, tuple[int, float, float]] = {}
        self._over_averaged: set[str] = set()  # peers now far over what they averaged with (named once each)
        self._rounds: list[RoundRecord] = []  # our latest rounds, as published (record_round)
        self._moved: dict[str, float] = {}  # neighbor -> DHT time its pushed progress last moved
        transport.add_handler(self.method, self._on_push)

    def close(self) -> None:
        self.transport.remove_handler(self.method)

    def set_neighbors(self, peers: list[str]) -> None:
        """The members of our last averaging group (peer id strings): we send them our reports
        and take theirs."""
        chosen = {p: PeerID.from_string(p) for p in peers if p != self.peer_id}
        self._neighbors = dict(list(chosen.items())[:MAX_NEIGHBORS])
        for peer in chosen:
            self._grouped.pop(peer, None)  # re-inserted as the newest
            self._grouped[peer] = None
        drop_oldest(self._grouped, MAX_AVERAGED_PEERS)
        self.pushed = {peer: r for peer, r in self.pushed.items() if peer in self._neighbors}

    def in_recent_groups(self, peer: str) -> bool:
        """Whether `peer` was a member of one of our recent groups (at most MAX_AVERAGED_PEERS)."""
        return peer in self._grouped

    async def report(self, epoch: int, samples: int, samples_per_second: float, done: int,
                     averaging: bool = False, idle: bool = False, part: int = 0, store: bool = True,
                     failed: int = 0, metrics: tuple[float, dict[str, float]] | None = None,
                     view: str | None = None) -> None:
        """Publish: `epoch` our samples count towards (and its `part`), `done` epochs applied
        (lower while a delayed update is still averaging), whether we are in a round or idle,
        our failed rounds so far, the latest `metrics` (DHT time reported, values) and our `view`.
        Without `store`, only to the neighbors."""
        now = self.dht.get_time()
        record = ProgressRecord(epoch, samples, samples_per_second, now, self.client_mode, done, averaging, idle,
                                part, failed, self.target, *(metrics or (None, None)), self.fingerprint,
                                view).to_wire()
        sends = [self._send(name, peer, record) for name, peer in self._neighbors.items()]
        if store:
            sends.append(self.dht.astore(self.key, record, now + PROGRESS_TTL, subkey=self.subkey))
        try:
            await asyncio.gather(*sends)
        except PotluckError as e:
            logger.debug("could not publish progress: %s", e)

    async def record_round(self, record: RoundRecord, token: bytes | None = None) -> None:
        """Publish a round we completed (with our latest ones: MAX_RECORDED_ROUNDS) for monitors,
        with our membership `token` (its name) in an authority-governed run."""
        rounds = [*self._rounds, record][-MAX_RECORDED_ROUNDS:]
        while len(rounds) > 1 and sum(len(r.samples) for r in rounds) > MAX_RECORDED_MEMBERS:
            rounds.pop(0)
        self._rounds = rounds
        value = PublishedRounds(tuple(self._rounds), token, self.fingerprint,
                                tuple(list(self.caught)[-MAX_CAUGHT:])).to_wire()
        now = self.dht.get_time()
        try:
            await self.dht.astore(self.rounds_key, value, now + ROUNDS_TTL, subkey=self.subkey)
        except PotluckError as e:
            logger.debug("could not publish a round record: %s", e)

    def averaged(self, samples: dict[str, int], duration: float, now: float) -> None:
        """A round we took part in (ending at DHT time `now`): the samples each other member
        averaged with (its note, which scaled the group's update), accumulated over the epoch's
        `duration` seconds. Their later claims count at most AVERAGED_SLACK times that."""
        if duration <= 0:
            return
        for peer, n in samples.items():
            if peer != self.peer_id:
                self._averaged.pop(peer, None)  # re-inserted as the newest
                self._averaged[peer] = (n, n / duration, now)
        drop_oldest(self._averaged, MAX_AVERAGED_PEERS)

    @property
    def rounds(self) -> tuple[RoundRecord, ...]:
        """Our latest rounds, as published (`record_round`)."""
        return tuple(self._rounds)

    def is_neighbor(self, peer: str) -> bool:
        return peer in self._neighbors

    @property
    def has_neighbors(self) -> bool:
        return bool(self._neighbors)

    async def _send(self, name: str, peer: Any, record: dict) -> None:
        try:
            await self.transport.call(peer, self.method, record, timeout=PUSH_TIMEOUT)
        except (NetworkError, PotluckError) as e:
            logger.debug("could not send progress to %s: %s", peer, e)
            # A neighbor that does not answer (crashed, gone) would hold each of our reports up
            # for PUSH_TIMEOUT, as long as LIVE_SECONDS: others would take us for gone. It hears
            # of us through the DHT until our next group.
            self._neighbors = {p: i for p, i in self._neighbors.items() if p != name}

    async def _on_push(self, request: Any, ctx: Any) -> None:
        """A neighbor's report: about the sender itself, and only from a neighbor (a bounded set)."""
        sender = str(ctx.peer_id)
        if sender not in self._neighbors:
            return
        report = _parse(sender, request, self.dht.get_time())
        if report is not None and self.counts(report):
            old = self.pushed.get(sender)
            if old is None or (old.epoch, old.samples, old.done) != (report.epoch, report.samples, report.done):
                self._moved.pop(sender, None)  # re-inserted as the newest
                self._moved[sender] = self.dht.get_time()
                drop_oldest(self._moved, MAX_NEIGHBORS)
            self.pushed = {**self.pushed, sender: report}

    def computed_since(self, peer: Any, since: float) -> bool:
        """Whether neighbor `peer` reported progress (a step, an epoch) after DHT time `since`: it
        is computing, not stalled (`LastGroup.computed`)."""
        return self._moved.get(str(peer), float("-inf")) > since

    def counts(self, report: PeerProgress) -> bool:
        """Whether `report` counts in our view: it names our fingerprint, or none (a record of an
        older potluck, or ours is not known: a monitor)."""
        return self.fingerprint is None or report.fingerprint is None or report.fingerprint == self.fingerprint

    def merged(self, reports: dict[str, PeerProgress]) -> dict[str, PeerProgress]:
        """`reports` read from the DHT, with the neighbors' newer ones sent to us instead."""
        pushed = self.pushed
        if not pushed:
            return reports
        merged = dict(reports)
        for peer, report in pushed.items():
            old = merged.get(peer)
            if old is None or report.time >= old.time:
                merged[peer] = report
        return merged

    async def fetch(self) -> dict[str, PeerProgress] | None:
        """Every live peer's latest report (ours included, as last published); None if the DHT
        could not be read this time (keep the previous view: one failed read must not make a
        peer believe it is alone)."""
        now = self.dht.get_time()
        reports: dict[str, PeerProgress] = {}
        strangers: dict[str, PeerProgress] = {}
        try:
            found = await self.dht.aget(self.key, latest=True)
        except PotluckError as e:
            logger.debug("could not read progress: %s", e)
            return None
        if found is not None and isinstance(found.value, dict):
            for subkey, entry in found.value.items():
                owner = subkey_owner(subkey)  # the signer: a record is only ever its signer's progress
                report = None if owner is None else _parse(str(owner), entry.value)
                if report is not None and entry.expiration_time > now:
                    report = dataclasses.replace(report, time=self._clamp(report, now))
                    (reports if self.counts(report) else strangers)[report.peer_id] = report
        self._future = {peer: seen for peer, seen in self._future.items() if peer in reports or peer in strangers}
        self._skewed &= self._future.keys()
        self.strangers = strangers
        return reports

    def _clamp(self, report: PeerProgress, now: float) -> float:
        """The report's time, or if it is in the future, our time when we first read that report
        (the sender sets it: a time always ahead of ours would never look stale)."""
        if report.time <= now:
            return report.time
        first = self._future.get(report.peer_id)
        if first is None or first[0] != report.time:
            if report.time - now > CLOCK_TOLERANCE and report.peer_id not in self._skewed:
                self._skewed.add(report.peer_id)
                logger.warning("progress: %s reports a time %.1f s in the future (its clock is ahead of ours); "
                               "counting it from now", report.peer_id, report.time - now)
            first = self._future[report.peer_id] = (report.time, now)
        return first[1]

    def estimate(self, reports: dict[str, PeerProgress], local: PeerProgress) -> GlobalProgress:
        """The swarm's progress now: others' latest reports plus our own exact numbers. The ETA
        extrapolates each peer at its speed (not one in a round or idle: its samples are final),
        so that peers enter the round when the batch is due rather than a report interval after
        it. Only the newest part of the newest epoch counts: a report from before a short round
        still holds samples that the round moved."""
        now = local.time
        others = [r for peer, r in reports.items() if peer != local.peer_id and now - r.time <= PROGRESS_TTL]
        reports = {r.peer_id: r for r in self._bounded(others, local)}
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

    def _bounded(self, others: list[PeerProgress], local: PeerProgress) -> list[PeerProgress]:
        """Others' reports as far as the swarm supports them: none more than MAX_EPOCH_LEAD
        epochs ahead of the second-highest epoch (or of a peer we follow, if that is higher: at
        most MAX_FOLLOWED_LEAD past it), speeds and samples at most MAX_SPEED_RATIO times the
        median peer's (ours included). An epoch counts once its peer has trained or loaded a
        state (a newcomer's 0 is no evidence: to it a lone other peer is the swarm), ours except
        against a lone other peer that was in our last group (we fell behind it); a lead over ours
        only if backed (`_backed`). Then each peer we averaged with recently at most what it
        averaged with (`_within_averaged`)."""
        lone_neighbor = len(others) == 1 and others[0].peer_id in self._neighbors
        ours = [local.epoch] if _started(local) and not lone_neighbor else []
        epochs = sorted([*ours, *(r.epoch for r in others if _started(r))], reverse=True)
        supported = epochs[min(1, len(epochs) - 1)] if epochs else 0
        followed = [r.epoch for r in others if r.peer_id in self.followed]
        if followed:
            supported = max(supported, min(max(followed), supported + MAX_FOLLOWED_LEAD))
        kept = [r for r in others if r.epoch <= supported + MAX_EPOCH_LEAD]
        ignored = {r.peer_id: r.epoch for r in others if r.epoch > supported + MAX_EPOCH_LEAD}
        for peer in ignored.keys() - self._ignored:
            logger.warning("progress: ignoring %s, which claims epoch %d while the swarm supports %d",
                           peer, ignored[peer], supported)
        self._ignored = set(ignored)
        kept = self._backed(kept, local)
        everyone = [local, *kept]
        median_speed = _lower_median([r.samples_per_second for r in everyone])
        if median_speed <= 0:
            return self._within_averaged(kept, kept)  # nobody has measured a speed yet: no median to compare with
        max_speed = MAX_SPEED_RATIO * median_speed
        # (early in an epoch this counts others' first samples late: that delays a round, never
        # starts one short)
        relative_samples = MAX_SPEED_RATIO * _lower_median([r.samples for r in everyone])
        max_samples = min(self.target, int(relative_samples))
        capped = {r.peer_id for r in kept if r.samples_per_second > max_speed or r.samples > max_samples}
        named = {r.peer_id for r in kept if _far_over(r, relative_samples)}
        for r in kept:
            if r.peer_id in named - self._capped:
                logger.warning("progress: %s claims %d samples at %.0f/s, over %dx the median peer's; counting "
                               "at most %d at %.0f/s", r.peer_id, r.samples, r.samples_per_second, MAX_SPEED_RATIO,
                               max_samples, max_speed)
        self._capped = named
        cut = [dataclasses.replace(r, samples_per_second=min(r.samples_per_second, max_speed),
                                   samples=min(r.samples, max_samples)) if r.peer_id in capped else r for r in kept]
        return self._within_averaged(kept, cut)

    def _backed(self, reports: list[PeerProgress], local: PeerProgress) -> list[PeerProgress]:
        """`reports` less those ahead of us (`local`: a higher epoch, or more epochs applied) that
        nothing backs. A lead is backed when a peer of our recent groups or one we follow reports
        at least as much (that peer included), or peers of MIN_BACKING_ORIGINS network origins
        do. Read as claimed, one made-up identity a single epoch ahead (within MAX_EPOCH_LEAD)
        ended each of our rounds: we took its epoch (catching up) instead of averaging, every
        epoch. Until we have trained or taken a state our epoch is no evidence, and nothing is
        left out (a newcomer takes a lone run's epoch, as `_bounded` says)."""
        if not self.backed_leads or not _started(local):
            return reports
        ahead = [r for r in reports if r.epoch > local.epoch or r.done > local.done]
        known = self._grouped.keys() | self.followed
        origins = {r.peer_id: self._origin(r.peer_id) for r in ahead if r.peer_id not in known}
        # Only these can back a claim: peers we know, and peers we hold a connection with (a few
        # hundred at most, however many made-up ids publish), so the check stays linear in those.
        witnesses = [r for r in ahead if r.peer_id in known or origins[r.peer_id] is not None]

        def backed(claim: PeerProgress) -> bool:
            as_much = [r for r in witnesses if r.epoch >= claim.epoch and r.done >= claim.done]
            return any(r.peer_id in known for r in as_much) \
                or len({origins[r.peer_id] for r in as_much if r.peer_id not in known}) >= MIN_BACKING_ORIGINS

        unbacked = {r.peer_id: r for r in ahead if not backed(r)}
        for peer in unbacked.keys() - self._unbacked:
            claim = unbacked[peer]
            logger.warning("progress: ignoring %s, which claims epoch %d (%d applied) past our %d (%d applied), "
                           "with no peer of our recent groups or that we follow, and no second network origin, "
                           "saying as much", peer, claim.epoch, claim.done, local.epoch, local.done)
            if len(self._unbacked) >= MAX_AVERAGED_PEERS:
                self._unbacked.clear()
            self._unbacked.add(peer)
        return [r for r in reports if r.peer_id not in unbacked] if unbacked else reports

    def _origin(self, peer: str) -> str | None:
        """The subnet of our open connection with `peer`, or None (none open, or its origin is
        unknown). Only an observed address counts: the addresses a peer states itself are free."""
        try:
            peer_id = PeerID.from_string(peer)
        except PotluckError:
            return None
        if not self.transport.is_connected(peer_id):
            return None
        origin = self.transport.peer_origin(peer_id)
        return None if origin == UNKNOWN_ORIGIN else origin.subnet

    def _within_averaged(self, claimed: list[PeerProgress], reports: list[PeerProgress]) -> list[PeerProgress]:
        """`reports` (the `claimed` ones, maybe cut already), each of a peer we averaged with
        recently cut to AVERAGED_SLACK times the speed it averaged with, and the samples it
        averaged with plus those at that speed since (the others as they are)."""
        bounded, over = [], set()
        for claim, r in zip(claimed, reports, strict=True):
            samples, speed, then = self._averaged.get(r.peer_id, (r.samples, r.samples_per_second, r.time))
            max_speed = AVERAGED_SLACK * speed
            max_samples = int(AVERAGED_SLACK * (samples + speed * max(0.0, r.time - then)))
            if r.samples > max_samples or r.samples_per_second > max_speed:
                if r.peer_id in self._averaged and _far_over(claim, max_samples):
                    over.add(r.peer_id)
                if r.peer_id in over - self._over_averaged:
                    logger.warning("progress: %s claims %d samples at %.0f/s, but averaged %d samples (%.0f/s) "
                                   "with us; counting at most %d at %.0f/s", r.peer_id, claim.samples,
                                   claim.samples_per_second, samples, speed, max_samples, max_speed)
                r = dataclasses.replace(r, samples=min(r.samples, max_samples),
                                        samples_per_second=min(r.samples_per_second, max_speed))
            bounded.append(r)
        self._over_averaged = over
        return bounded


def _started(report: PeerProgress) -> bool:
    """Whether the peer has trained or taken a state: only then is its epoch evidence of the run's."""
    return bool(report.samples or report.done)


class RoundRecord(Message, what="round record"):
    """A completed averaging round as one member saw it: who contributed and the samples each
    one's round note gave the group (what scaled the group's update). A short round (sync mode: it
    did not fill the batch) names the member that carries its sum on into the epoch's next part."""

    epoch: int = Int("epoch", 0, MAX_RECORDED_COUNT)
    part: int = Int("part", 0, MAX_RECORDED_COUNT)
    # (contributor's peer id, its samples), at most MAX_ROUND_MEMBERS
    samples: tuple[tuple[str, int], ...] = List("samples", Tuple(items=(Text(max_chars=MAX_PEER_ID_CHARS),
                                                                       Int(None, 0, MAX_RECORDED_COUNT))),
                                                MAX_ROUND_MEMBERS)
    keeper: str | None = Text("keeper", MAX_PEER_ID_CHARS, default=None)  # a short round's; None: it closed the epoch
    time: float = Number("time", default=0.0)  # DHT time the round ended
    round: str = Text("round", MAX_ROUND_ID_CHARS, default="")  # an id every member records alike (digest of notes)


class PublishedRounds(Message, what="round records"):
    """A peer's entry under the run's round records key: its latest rounds, in an
    authority-governed run its membership token, its run schema's fingerprint, and the peers it
    caught lying in verified training."""

    rounds: tuple[RoundRecord, ...] = List("rounds", Nested(message=RoundRecord), MAX_RECORDED_ROUNDS)
    token: bytes | None = Bytes("token", MAX_TOKEN_BYTES, default=None)
    fingerprint: str | None = Text("fp", FINGERPRINT_CHARS, default=None)
    # verified training: peers it caught sending gradients not of their batches, or whose lie it
    # checked itself (potluck.optim.verified); a monitor credits them nothing (its witnesses' word)
    caught: tuple[str, ...] = List("caught", Text(max_chars=MAX_PEER_ID_CHARS), MAX_CAUGHT, default=())


async def fetch_rounds(dht: Any, run_id: str) -> dict[str, tuple[list[RoundRecord], bytes | None]] | None:
    """Every peer's published round records and membership token bytes, by signer (a malformed
    entry is skipped: it is its signer's only); None if the DHT could not be read."""
    published = await fetch_published_rounds(dht, run_id)
    return None if published is None else {p: (list(e.rounds), e.token) for p, e in published.items()}


async def fetch_published_rounds(dht: Any, run_id: str) -> dict[str, PublishedRounds] | None:
    """Every peer's entry under the run's round records, by signer (malformed ones skipped);
    None if the DHT could not be read."""
    try:
        found = await dht.aget(RunNames(run_id).rounds, latest=True)
    except PotluckError as e:
        logger.debug("could not read round records: %s", e)
        return None
    published: dict[str, PublishedRounds] = {}
    for owner, value in owned_entries(found):
        try:
            published[str(owner)] = PublishedRounds.from_wire(value)
        except MalformedMessage as e:
            logger.debug("ignoring the round records of %s: %s", owner, e)
    return published


def confirmed_runs(published: dict[str, PublishedRounds], live: dict[str, str | None]) -> dict[str, set[str]]:
    """The fingerprints that peers completed rounds under, and those peers: a round counts when
    two of its members each publish it (the same epoch, part and id, each listing the other as a
    contributor) under the same fingerprint, and both are live (`live`: peer -> the fingerprint
    of its progress record) under that one too. Records are their signers' own, so it takes two
    identities that ran, or pretend to have run, a round together: never a count of records."""
    seen: dict[tuple[str, int, int, str], dict[str, frozenset[str]]] = {}
    for peer, entry in published.items():
        fingerprint = entry.fingerprint
        if fingerprint is None or live.get(peer) != fingerprint:
            continue
        for record in entry.rounds:
            members = frozenset(p for p, _ in record.samples)
            if peer in members:
                seen.setdefault((fingerprint, record.epoch, record.part, record.round), {})[peer] = members
    runs: dict[str, set[str]] = {}
    for (fingerprint, *_), recorders in seen.items():
        for peer, members in recorders.items():
            partners = [other for other, theirs in recorders.items() if other != peer and other in members
                        and peer in theirs]
            if partners:
                runs.setdefault(fingerprint, set()).update([peer, *partners])
    return runs


def checked_metrics(values: dict[str, Any]) -> dict[str, float]:
    """`values` as metrics a progress record carries: at most MAX_METRICS names of at most
    MAX_METRIC_NAME_CHARS characters, finite numbers (ValueError otherwise)."""
    if len(values) > MAX_METRICS:
        raise ValueError(f"at most {MAX_METRICS} metrics can be published, not {len(values)}")
    checked = {}
    for name, value in values.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME_CHARS:
            raise ValueError(f"a metric's name is a string of 1 to {MAX_METRIC_NAME_CHARS} characters: {name!r:.50}")
        try:
            checked[name] = number_value(float(value), name, "metric", signed=True)
        except (TypeError, ValueError, MalformedMessage):
            raise ValueError(f"metric {name!r} must be a finite number, not {value!r:.50}") from None
    return checked


def _far_over(report: PeerProgress, max_samples: float) -> bool:
    """Whether `report` claims over NAMED_OVER_BOUND times a positive samples bound: a lie."""
    return 0 < max_samples * NAMED_OVER_BOUND < report.samples


def view_digest(peers: Iterable[Any]) -> str:
    """A short digest of a set of peer ids: peers that publish the same one count the same
    peers into a round."""
    return hashlib.blake2b(",".join(sorted(str(p) for p in peers)).encode(), digest_size=VIEW_CHARS // 2).hexdigest()


def _lower_median(values: list[float]) -> float:
    """The median, or the lower of the two middle values: a minority's high claims cannot raise it."""
    return sorted(values)[(len(values) - 1) // 2]


class ProgressRecord(Message, what="progress record"):
    """A peer's progress as it publishes it (`ProgressTracker.report`): under its own subkey in
    the DHT, and straight to its neighbors. See `PeerProgress` for the fields."""

    epoch: int = Int("epoch", 0, MAX_RECORDED_COUNT)
    samples: int = Int("samples", 0, MAX_RECORDED_COUNT)
    samples_per_second: float = Number("sps")
    time: float = Number("time", signed=True)
    client_mode: bool = Bool("client", default=False)
    done: int | None = Int("done", 0, MAX_RECORDED_COUNT, default=None)  # None: the epoch
    averaging: bool = Bool("averaging", default=False)
    idle: bool = Bool("idle", default=False)
    part: int = Int("part", 0, MAX_RECORDED_COUNT, default=0)
    failed: int = Int("failed", 0, MAX_RECORDED_COUNT, default=0)
    target: int = Int("target", 0, MAX_RECORDED_COUNT, default=0)
    metrics_time: float | None = Number("mtime", default=None)
    metrics: dict[str, float] | None = Dict("metrics", Text(max_chars=MAX_METRIC_NAME_CHARS), Number(signed=True),
                                            MAX_METRICS, pairs=False, default=None, default_factory=None)
    fingerprint: str | None = Text("fp", FINGERPRINT_CHARS, default=None)  # of its run schema
    view: str | None = Text("view", VIEW_CHARS, default=None)

    def validate(self, context: dict[str, Any]) -> None:
        if self.samples_per_second > MAX_SAMPLES_PER_SECOND:
            raise self.refuse(f"'sps' must be at most {MAX_SAMPLES_PER_SECOND:g}")
        if self.done is not None and self.done > self.epoch:
            raise self.refuse("'done' must be at most 'epoch'")


def _parse(peer: str, value: Any, received: float | None = None) -> PeerProgress | None:
    """`peer`'s progress record from the DHT (`peer`: the signer of its subkey) or sent to us by
    `peer` at `received` (our clock), or None if it is malformed."""
    try:
        record = ProgressRecord.from_wire(value)
    except MalformedMessage:
        return None
    return PeerProgress(peer, record.epoch, record.samples, record.samples_per_second,
                        record.time if received is None else received, record.client_mode,
                        record.epoch if record.done is None else record.done, record.averaging, record.idle,
                        record.part, record.failed, record.target,
                        *(((), 0.0) if record.metrics is None or record.metrics_time is None
                          else (tuple(record.metrics.items()), record.metrics_time)), record.fingerprint,
                        record.view)


class RoundNote(Message, what="round note"):
    """What a member tells its group in a round: the samples behind its gradients or change, its
    speed (sync), and the digest of the state it averages from (`state`, sync; `outer`, diloco
    and each fragment of Streaming DiLoCo; `params`, the parameters behind its gradients in
    verified training, `potluck.optim.verified`). Members record each other's samples for monitors.
    An aux peer says `aux`: it holds no state. Moshpit members say their `epoch` (they meet
    whatever their epochs): the round is recorded under the group's median (see record_round)."""

    samples: int = Int("samples", 0, MAX_CLAIMED_SAMPLES + 1, default=0)
    speed: float = Number("sps", most=MAX_SAMPLES_PER_SECOND, default=0.0)
    state: str | None = Text("state", MAX_DIGEST_CHARS, default=None)
    aux: bool = Bool("aux", default=False)
    outer: str | None = Text("outer", MAX_DIGEST_CHARS, default=None)
    epoch: int | None = Int("epoch", 0, MAX_CLAIMED_SAMPLES, default=None)
    params: str | None = Text("params", MAX_DIGEST_CHARS, default=None)  # verified training: what it computed at

    @classmethod
    def read(cls, msg: Any) -> RoundNote:
        """A member's note, or an empty one if it is malformed: such a member is counted as
        saying nothing (no samples, an unknown state), not allowed to fail the round for all."""
        try:
            return cls.from_wire(msg)
        except MalformedMessage as e:
            logger.debug("ignoring a malformed round note: %s", e)
            return cls()
