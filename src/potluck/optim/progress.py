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
epoch reported is ignored (one record cannot move the collaboration's epoch); a peer's samples
and speed count at most `MAX_SPEED_RATIO` times the median peer's, and a peer we averaged with
recently at most `AVERAGED_SLACK` times what it averaged with (`averaged`): the samples its round
note gave the group, which the group's update is scaled by, over that epoch's duration, and the
samples that rate adds up to since.

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
import logging
from dataclasses import dataclass
from typing import Any

from potluck.core.errors import MalformedMessage, NetworkError, PotluckError
from potluck.core.wire import (
    bytes_field,
    int_field,
    int_value,
    list_field,
    number_field,
    number_value,
    text_field,
    wire_map,
)
from potluck.dht.records import own_subkey, owned_entries, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.membership import MAX_TOKEN_BYTES

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
# Bounds a round member's claim of samples (it comes from the network): more than any batch.
MAX_CLAIMED_SAMPLES = 2**40
# Longest state digest accepted in a round note (ours are 64 hex digits of SHA-256).
MAX_DIGEST_CHARS = 128
# Epochs an honest peer can be ahead of the others: one (its round ended and it applied the
# update, or its delayed round started, a moment before theirs). A report further ahead than this
# of the second-highest epoch reported is ignored: it takes two peers to move the epoch.
MAX_EPOCH_LEAD = 1
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
METHOD_PROGRESS = "potluck.optim.progress"
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
# Longest round id accepted in a round record (ours are 16 hex digits).
MAX_ROUND_ID_CHARS = 64
# Bounds a recorded epoch, member's samples, failed-rounds counter and target (from the network).
MAX_RECORDED_COUNT = 2**40


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

    def __init__(self, dht: Any, transport: Any, run_id: str, peer_id: str, target_batch_size: int,
                 client_mode: bool = False):
        self.dht = dht
        self.transport = transport
        self.key = f"{run_id}.progress"
        self.rounds_key = rounds_key(run_id)
        self.subkey = own_subkey(peer_id)
        self.peer_id = peer_id
        self.target = target_batch_size
        self.client_mode = client_mode
        self.method = f"{METHOD_PROGRESS}.{run_id}"
        self._neighbors: dict[str, Any] = {}  # peer id string -> PeerID
        # Reports sent to us by neighbors, stamped with our clock on arrival; replaced, never
        # changed in place (the training thread reads it while the loop writes it).
        self.pushed: dict[str, PeerProgress] = {}
        # Peers whose report time was in the future: peer -> (that time, our time when first read).
        self._future: dict[str, tuple[float, float]] = {}
        self._ignored: set[str] = set()  # peers whose reports are ignored now (logged once each)
        self._capped: set[str] = set()  # peers whose claims are far over the bounds now (named once each)
        # peer -> (samples it averaged with, their samples per second, DHT time of the round) in our
        # last round with it, oldest first; at most MAX_AVERAGED_PEERS
        self._averaged: dict[str, tuple[int, float, float]] = {}
        self._over_averaged: set[str] = set()  # peers now far over what they averaged with (named once each)
        self._rounds: list[RoundRecord] = []  # our latest rounds, as published (record_round)
        transport.add_handler(self.method, self._on_push)

    def close(self) -> None:
        self.transport.remove_handler(self.method)

    def set_neighbors(self, peers: list[str]) -> None:
        """The members of our last averaging group (peer id strings): we send them our reports
        and take theirs."""
        chosen = {p: PeerID.from_string(p) for p in peers if p != self.peer_id}
        self._neighbors = dict(list(chosen.items())[:MAX_NEIGHBORS])
        self.pushed = {peer: r for peer, r in self.pushed.items() if peer in self._neighbors}

    async def report(self, epoch: int, samples: int, samples_per_second: float, done: int,
                     averaging: bool = False, idle: bool = False, part: int = 0, store: bool = True,
                     failed: int = 0, metrics: tuple[float, dict[str, float]] | None = None) -> None:
        """Publish: `epoch` our samples count towards (and its `part`), `done` epochs applied
        (lower while a delayed update is still averaging), whether we are in a round or idle,
        our failed rounds so far and the latest `metrics` (DHT time reported, values).
        Without `store`, only to the neighbors."""
        now = self.dht.get_time()
        record = {"epoch": epoch, "samples": samples, "sps": samples_per_second, "time": now,
                  "client": self.client_mode, "done": done, "averaging": averaging, "idle": idle, "part": part,
                  "failed": failed, "target": self.target}
        if metrics is not None:
            record["mtime"], record["metrics"] = metrics
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
        value: dict[str, Any] = {"rounds": [r.to_wire() for r in self._rounds]}
        if token is not None:
            value["token"] = token
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
        for peer in list(self._averaged)[:max(0, len(self._averaged) - MAX_AVERAGED_PEERS)]:
            del self._averaged[peer]

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
        if report is not None:
            self.pushed = {**self.pushed, sender: report}

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
                    reports[report.peer_id] = dataclasses.replace(report, time=self._clamp(report, now))
        self._future = {peer: seen for peer, seen in self._future.items() if peer in reports}
        return reports

    def _clamp(self, report: PeerProgress, now: float) -> float:
        """The report's time, or if it is in the future, our time when we first read that report
        (the sender sets it: a time always ahead of ours would never look stale)."""
        if report.time <= now:
            return report.time
        first = self._future.get(report.peer_id)
        if first is None or first[0] != report.time:
            if first is None:
                logger.warning("progress: %s reports a time %.1f s in the future; counting it from now",
                               report.peer_id, report.time - now)
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
        epochs ahead of the second-highest epoch, speeds and samples at most MAX_SPEED_RATIO
        times the median peer's (ours included). Our own epoch counts once we have trained or
        loaded a state (a newcomer's 0 is no evidence: to it a lone other peer is the swarm),
        except against a lone other peer that was in our last group (we fell behind it). Then
        each peer we averaged with recently at most what it averaged with (`_within_averaged`)."""
        lone_neighbor = len(others) == 1 and others[0].peer_id in self._neighbors
        ours = [local.epoch] if (local.samples or local.done) and not lone_neighbor else []
        epochs = sorted([*ours, *(r.epoch for r in others)], reverse=True)
        supported = epochs[min(1, len(epochs) - 1)] if epochs else 0
        kept = [r for r in others if r.epoch <= supported + MAX_EPOCH_LEAD]
        ignored = {r.peer_id: r.epoch for r in others if r.epoch > supported + MAX_EPOCH_LEAD}
        for peer in ignored.keys() - self._ignored:
            logger.warning("progress: ignoring %s, which claims epoch %d while the swarm supports %d",
                           peer, ignored[peer], supported)
        self._ignored = set(ignored)
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


@dataclass(frozen=True)
class RoundRecord:
    """A completed averaging round as one member saw it: who contributed and the samples each
    one's round note gave the group (what scaled the group's update). A short round (sync mode: it
    did not fill the batch) names the member that carries its sum on into the epoch's next part."""

    epoch: int
    part: int
    samples: tuple[tuple[str, int], ...]  # (contributor's peer id, its samples), at most MAX_ROUND_MEMBERS
    keeper: str | None = None  # a short round's keeper; None when the round closed the epoch
    time: float = 0.0  # DHT time the round ended
    round: str = ""  # an id every member of the round records alike (a digest of their notes)

    def to_wire(self) -> dict:
        msg: dict[str, Any] = {"epoch": self.epoch, "part": self.part, "time": self.time,
                               "samples": [[p, n] for p, n in self.samples[:MAX_ROUND_MEMBERS]]}
        if self.keeper is not None:
            msg["keeper"] = self.keeper
        if self.round:
            msg["round"] = self.round
        return msg

    @classmethod
    def from_wire(cls, msg: Any) -> RoundRecord:
        what = "round record"
        msg = wire_map(msg, what)

        def member(item: Any) -> tuple[str, int]:
            if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str) \
                    or len(item[0]) > MAX_PEER_ID_CHARS:
                raise MalformedMessage(what, "a member must be [peer id, samples]")
            return item[0], int_value(item[1], "samples", what, 0, MAX_RECORDED_COUNT)

        members = list_field(msg, "samples", what, MAX_ROUND_MEMBERS, each=member)
        keeper = text_field(msg, "keeper", what, MAX_PEER_ID_CHARS, optional=True)
        return cls(int_field(msg, "epoch", what, 0, MAX_RECORDED_COUNT), int_field(msg, "part", what, 0,
                   MAX_RECORDED_COUNT), tuple(dict(members).items()), keeper,
                   number_field(msg, "time", what, default=0.0),
                   text_field(msg, "round", what, MAX_ROUND_ID_CHARS, optional=True) or "")


def rounds_key(run_id: str) -> str:
    """The DHT key of a run's round records (one owner-signed entry per peer)."""
    return f"{run_id}.rounds"


async def fetch_rounds(dht: Any, run_id: str) -> dict[str, tuple[list[RoundRecord], bytes | None]] | None:
    """Every peer's published round records and membership token bytes, by signer (a malformed
    round is skipped, a malformed token read as none); None if the DHT could not be read."""
    try:
        found = await dht.aget(rounds_key(run_id), latest=True)
    except PotluckError as e:
        logger.debug("could not read round records: %s", e)
        return None
    published: dict[str, tuple[list[RoundRecord], bytes | None]] = {}
    for owner, value in owned_entries(found):
        if not isinstance(value, dict) or not isinstance(value.get("rounds"), list):
            continue
        rounds = []
        for msg in value["rounds"][:MAX_RECORDED_ROUNDS]:
            try:
                rounds.append(RoundRecord.from_wire(msg))
            except MalformedMessage:
                continue
        try:
            token = bytes_field(value, "token", "round record", MAX_TOKEN_BYTES) if "token" in value else None
        except MalformedMessage:
            token = None
        published[str(owner)] = (rounds, token)
    return published


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


def _lower_median(values: list[float]) -> float:
    """The median, or the lower of the two middle values: a minority's high claims cannot raise it."""
    return sorted(values)[(len(values) - 1) // 2]


def _parse(peer: str, value: Any, received: float | None = None) -> PeerProgress | None:
    """`peer`'s progress record from the DHT (`peer`: the signer of its subkey) or sent to us by
    `peer` at `received` (our clock), or None if it is malformed."""
    if not isinstance(value, dict):
        return None
    try:
        epoch, samples = int(value["epoch"]), int(value["samples"])
        sps = float(value["sps"])
        time = float(value["time"]) if received is None else received
        done = int(value.get("done", epoch))
        part = int(value.get("part", 0))
        failed = int(value.get("failed", 0))
        target = int(value.get("target", 0))
    except (KeyError, TypeError, ValueError):
        return None
    if epoch < 0 or samples < 0 or not 0 <= sps <= MAX_SAMPLES_PER_SECOND or not 0 <= done <= epoch or part < 0 \
            or not 0 <= failed < MAX_RECORDED_COUNT or not 0 <= target < MAX_RECORDED_COUNT:
        return None
    metrics, metrics_time = _parse_metrics(value)
    return PeerProgress(peer, epoch, samples, sps, time, bool(value.get("client")), done,
                        bool(value.get("averaging")), bool(value.get("idle")), part, failed, target,
                        metrics, metrics_time)


def _parse_metrics(value: dict) -> tuple[tuple[tuple[str, float], ...], float]:
    """A progress record's metrics and their time, or none if they are malformed (the progress
    itself still counts)."""
    if "metrics" not in value:
        return (), 0.0
    try:
        metrics = checked_metrics(wire_map(value["metrics"], "metrics"))
        mtime = number_field(value, "mtime", "metrics")
    except (ValueError, MalformedMessage):
        return (), 0.0
    return tuple(metrics.items()), mtime


@dataclass(frozen=True)
class RoundNote:
    """What a member tells its group in a round: the samples behind its gradients or change, its
    speed (sync), and the digest of the state it averages from (`state`, sync; `outer`, diloco
    and each fragment of Streaming DiLoCo). Members record each other's samples for monitors.
    An aux peer says `aux`: it holds no state. Moshpit members say their `epoch` (they meet
    whatever their epochs): the round is recorded under the group's median (see _record_round)."""

    samples: int = 0
    speed: float = 0.0
    state: str | None = None
    aux: bool = False
    outer: str | None = None
    epoch: int | None = None

    def to_wire(self) -> dict:
        msg: dict[str, Any] = {"samples": self.samples, "sps": self.speed}
        if self.epoch is not None:
            msg["epoch"] = self.epoch
        if self.state is not None:
            msg["state"] = self.state
        if self.outer is not None:
            msg["outer"] = self.outer
        if self.aux:
            msg["aux"] = True
        return msg

    @classmethod
    def from_wire(cls, msg: Any) -> RoundNote:
        what = "round note"
        msg = wire_map(msg, what)
        return cls(int_field(msg, "samples", what, 0, MAX_CLAIMED_SAMPLES + 1),
                   min(number_field(msg, "sps", what, default=0.0), MAX_SAMPLES_PER_SECOND),
                   text_field(msg, "state", what, MAX_DIGEST_CHARS, optional=True),
                   msg.get("aux") is True,
                   text_field(msg, "outer", what, MAX_DIGEST_CHARS, optional=True),
                   None if msg.get("epoch") is None else int_value(msg["epoch"], "epoch", what, 0, MAX_CLAIMED_SAMPLES))

    @classmethod
    def read(cls, msg: Any) -> RoundNote:
        """A member's note, or an empty one if it is malformed: such a member is counted as
        saying nothing (no samples, an unknown state), not allowed to fail the round for all."""
        try:
            return cls.from_wire(msg)
        except MalformedMessage as e:
            logger.debug("ignoring a malformed round note: %s", e)
            return cls()
