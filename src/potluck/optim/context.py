"""What a run's training modes share (`RunContext`): the model's state, this peer's epoch and its
own progress, the swarm's progress as this peer sees it, catching up with the swarm, round records
for monitors, and the hooks a user registers on epochs.

A training mode (`potluck.optim.modes`) decides when to average what; everything it needs of the
run goes through this object's public members, and nothing here knows which mode runs.

The run schema (`potluck.optim.schema`): records of peers with another fingerprint are read
apart and never counted; a peer that finds itself the odd one (`check_model`: no live peer of its
own kind, no round completed, and peers of another fingerprint completing rounds together) stops
publishing, and its next `step()` raises `ModelMismatch` naming the first difference.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.hooks import RemovableHandle

from potluck.averaging.allreduce.group import MAX_GROUP_SIZE
from potluck.averaging.averager import Averager
from potluck.averaging.role import Role
from potluck.averaging.state_transfer import Manifest, ManifestRequest
from potluck.core import compat
from potluck.core.bounded import drop_oldest
from potluck.core.errors import AveragingError, NetworkError, PotluckError
from potluck.core.peer_like import PeerLike
from potluck.core.runner import CallerThread, retrieve_exception, run_in_thread
from potluck.dht.key_kinds import DECLARATION_MAX_TTL
from potluck.net.identity import PeerID
from potluck.optim.progress import (
    GlobalProgress,
    PeerProgress,
    ProgressTracker,
    RoundNote,
    RoundRecord,
    confirmed_runs,
    fetch_published_rounds,
    view_digest,
)
from potluck.optim.schema import ModelMismatch, RunSchema
from potluck.optim.state import ModelState
from potluck.optim.vouching import DonorElection, witnesses_of

__all__ = ["EpochEvent", "RunContext", "RunSettings", "Tally"]

logger = logging.getLogger(__name__)

# A DiLoCo round that is not a stable group's closes once every peer that trains, as our view has
# it, has joined, when they all publish that view, or when it has named the same peers for this
# part of the matchmaking window (`expected`); else it takes the whole window. At a run's start
# the first round came 1.7 s after the view settled, and waited out the LM demo's 2 s window
# (2.3 s, against 0.5 s for the rounds after it).
ROSTER_SETTLE_FRACTION = 0.5
# How often progress is published and read (seconds): often enough that peers enter an averaging
# round within a fraction of the matchmaking window of each other.
PROGRESS_INTERVAL = 0.1
# With neighbors (the last group's members, who hear from us directly at every change), progress
# goes through the DHT only every this many intervals: it is for newcomers and for noticing them.
# While a live peer outside our neighbors trains (a newcomer, a straggler catching up), every
# interval: over slow links a DHT round trip takes a good part of an interval, and a view of it
# that many intervals old left it out of our stable group's rounds, round after round.
DHT_EVERY_WITH_NEIGHBORS = 4
# Weight of the newest measurement in the samples-per-second estimate.
SPEED_SMOOTHING = 0.3
# An inner step that needs nothing of the event loop (not its round's, DiLoCo) is counted in the
# caller's thread: a hop to the loop thread and back cost 0.28 ms a step on an idle 2-core
# machine and 1.2-1.3 ms with five processes on it (against 2.3 and 5.1 ms steps of the demo's
# CNN); more while the loop works on a round (its thread must be scheduled and get the GIL).
# Steps longer than the former bound (0.05 s: wan.py's language model's, 80-160 ms) all hopped.
# The loop sees every step that could join a round another peer is in (`others_averaging`,
# refreshed with progress: a round is joined as soon as before), and at least one this often
# (wall seconds) for its speed estimate, which others read to plan rounds; a fifth of the idle floor.
QUIET_SECONDS = 1.0
# A peer further behind than this many epochs drops its accumulated gradients when it catches up.
MAX_STALE_EPOCHS = 1
# A peer two or more epochs past a peer of its last group that still trains is ignored by it
# (MAX_EPOCH_LEAD), and ignores it, for good: two swarms of one run. With nobody within an epoch
# of its own, it keeps its update instead of stepping on alone until that peer is one epoch behind
# (it then catches up with us), unless the peer's epoch has not risen for this many of our group's
# epochs: a peer that claims to train and never advances (stuck, or lying) holds us back at most
# that long per epoch. DiLoCo's modes put off their next outer round instead (`holds_round`), and
# take inner steps meanwhile.
HOLD_PATIENCE_EPOCHS = 4
# A peer that has not called step() for this many of its own step intervals (and at least
# IDLE_FLOOR_SECONDS) reports itself idle: others stop waiting for it (e.g. it finished its work
# but stays online), and it catches up when it trains again. The floor is long: a busy machine
# can starve a training thread for a second, and a peer wrongly left out of the expected group
# size can split the swarm's round in two.
IDLE_STEP_INTERVALS = 4
IDLE_FLOOR_SECONDS = 5.0
# Epochs a downloaded state's scheduler may be moved on by replaying its steps one by one, when it
# is not a torch scheduler whose learning rate at any epoch has a closed form (those move in one
# call): about 3 us a step, so at most a tenth of a second.
MAX_REPLAYED_SCHEDULER_STEPS = 30_000
# A donor's state may be this many epochs ahead of the epoch our progress view supports. The view
# lags the donors by up to a report's life (LIVE_SECONDS), and a swarm with sub-second epochs (small
# models, the tests) moves several epochs meanwhile: honest donors at epoch view + 2 were refused,
# and the peer that needed them never caught up. The cap is against jumps of orders of magnitude
# (epoch 10^7 spins a scheduler; 10^9 moves every later epoch); a smaller one still needs most of
# the vouched donors to agree on the state.
MAX_STATE_EPOCH_LEAD = 8
# A peer that sees only peers of another fingerprint looks at the run's round records this often
# (one DHT read each; only such a peer reads them): the odd one out learns it within a few seconds.
MODEL_CHECK_INTERVAL = 1.0
# A peer we have not averaged with lately that was counted into a round's group and did not come
# (the group closed short of the count, so it waited for it) is a no-show for this long: our
# rounds' groups wait for it only matchmaking's SEAT_FRACTION of their window once everyone else is
# in (`Averager.astep(no_shows=...)`), and it is one again once it comes. A made-up id that
# publishes progress at our epoch and never joins held every round for its whole window (two
# honest sync peers: 8 rounds in 10 s against 38). Long: an honest peer that comes is cleared at
# once, and one that does not come is only waited for less.
NO_SHOW_SECONDS = 600.0
# A DiLoCo round's group gathers for at least this many of the slowest training peer's steps
# (our batch over its reported speed), if that is longer than the run's matchmaking_time: a peer
# joins a round only between two of its steps, and hears of it up to a progress interval late.
# Four Streaming DiLoCo peers, three with 0.6 s steps and one with 1.2 s (virtual time): in a 1 s
# window 9 of the 36 rounds they entered failed with one peer gathered, in 3 s none; in 0.5 s the
# slow one missed every round. Capped at 0.35 of a core each over emulated WAN links
# (benchmarks/wan.py, lm workload), most rounds of a 1 s window gathered one peer.
ROUND_WINDOW_STEPS = 2.0
# ... and for at most this many times the run's matchmaking_time: a peer that claims to crawl (and
# then does not come) stretches our windows that far at most, and a machine's ranks wait for a
# window that long (`optim.machine`).
MAX_ROUND_WINDOW_FACTOR = 8.0
# No-shows remembered (a short string and a float each): the oldest go first.
MAX_NO_SHOWS = 1024
# Asking a peer of the run for its schema (its state manifest) takes at most this.
SCHEMA_TIMEOUT = 10.0


@dataclass(frozen=True)
class RunSettings:
    """The settings every training mode of a run shares (see `Optimizer`)."""

    target_batch_size: int
    batch_size_per_step: int
    role: Role
    compression: Any
    aggregation: str
    matchmaking_time: float
    averaging_timeout: float
    fingerprint: str | None = None  # of the run schema: peers with another are never grouped
    bandwidth: float | tuple[float, float] | None = None  # this peer's link, if the user gave it

    def averaging(self) -> dict[str, Any]:
        """The options of every averager of the run (each averages tensors that exist anyway)."""
        return dict(compression=self.compression, role=self.role, matchmaking_time=self.matchmaking_time,
                    allreduce_timeout=self.averaging_timeout, copy=False, aggregation=self.aggregation,
                    fingerprint=self.fingerprint, bandwidth=self.bandwidth)


@dataclass
class Tally:
    """This peer's own progress in its current epoch, as it reports it."""

    samples: int = 0  # accumulated towards the current epoch
    round_samples: int = 0  # ours in the round step() waits for: still counted while they are frozen
    in_round: bool = False  # step() waits for a round: our samples are frozen
    part: int = 0  # short rounds of this epoch so far (see PeerProgress.part)
    ahead: bool = False  # a delayed update is averaging: new samples count towards the next epoch


@dataclass(frozen=True)
class EpochEvent:
    """This peer's epoch changed: by an update it took part in (`"update"`; `samples`: the swarm's
    samples behind it), by catching up with a swarm it fell behind (`"caught_up"`: its state was
    downloaded, or kept if none could be), or by rejoining a round that went on without it
    (`"rejoined"`, Streaming DiLoCo)."""

    epoch: int
    how: Literal["update", "caught_up", "rejoined"]
    samples: int = 0


class RunContext:
    """One peer's part in a run: see the module docstring."""

    def __init__(self, peer: PeerLike, run_id: str, state: ModelState, scheduler: Any, settings: RunSettings,
                 schema: RunSchema | None = None):
        self.peer = peer
        self.run_id = run_id
        self.state = state
        self.scheduler = scheduler
        self.settings = settings
        self.epoch = 0  # our local epoch: updates applied (or taken over from the swarm)
        self.epoch_samples = 0  # samples of the whole swarm behind the last epoch applied
        self.tally = Tally()
        self.samples_per_second = 0.0
        self.samples_processed = 0  # local samples behind every step() so far (bytes_per_sample)
        self.failed_rounds = 0  # failed averaging tries since we started (published for monitors)
        self.catch_ups = 0  # times we fell behind the swarm and downloaded its state (benchmarks read it)
        # Our state may differ from the swarm's: we moved on without it (a missed round, a failed
        # download, a round that failed here alone). Sync mode then says so in its next round, and
        # that round's members average the state after it, instead of at the next scheduled one.
        self.departed = False
        self.group_epoch_seconds = 0.0  # how long our last epoch with a group took (`holds`)
        self.held: tuple[int, float] | None = None  # holding: the highest epoch behind us, and since when
        self.schema = schema  # what peers of the run must share (None: anyone counts)
        self.rounds_completed = 0  # averaging rounds we completed and recorded
        self.mismatch: ModelMismatch | None = None  # we are not of this run: why (check_model)
        self._next_model_check = 0.0  # loop time of the next look at the run's round records
        self._checking_model = False
        self.metrics: tuple[float, dict[str, float]] | None = None  # report_metrics: (DHT time, values)
        self.stepping = False  # inside step(): never idle
        self.waited = False  # this step() waited for the network (rounds, downloads)
        self.inner_taken = False  # Optimizer.step() took this step's inner step in its caller's thread
        self.caller: CallerThread | None = None  # the thread waiting in Optimizer.step(), lent to `compute`
        self.last_step_time: float | None = None
        self.quiet_steps = 0  # steps counted in the caller's thread since the last step on the loop
        self.last_hop = float("-inf")  # wall time (monotonic) the last step on the loop ended
        self.others_averaging = False  # another live peer is in a round of our epoch (as of the last progress)
        self.others_applied = 0  # the most epochs another live peer has applied (as of the last progress)
        # loop time our current epoch (or part of it) began: the members' samples in its round
        # accumulated since about then (see ProgressTracker.averaged)
        self.epoch_began: float | None = None
        client_mode = settings.role == Role.CLIENT or peer.transport.client_mode
        self.tracker = ProgressTracker(peer.dht, peer.transport, run_id, peer.peer_id, settings.target_batch_size,
                                       client_mode, None if schema is None else schema.fingerprint)
        # We follow the epoch of the peers we joined through and of those whose state we took last
        # (progress.MAX_FOLLOWED_LEAD): a run's first peer trains on alone while we download.
        self.witnesses = witnesses_of(peer)
        self.tracker.followed = self.witnesses - {str(peer.peer_id)}
        self.reports: dict[str, PeerProgress] = {}  # others' latest reports, refreshed in the background
        # Who trains now as our view has it (`members`), and since when (loop time): a round that is
        # not a stable group's closes early only once this has held for a while (`expected`).
        self.roster: frozenset[str] = frozenset()
        self.roster_since = float("inf")
        self._no_shows: dict[str, float] = {}  # peer id -> loop time it is one until (NO_SHOW_SECONDS)
        self._progress_task: asyncio.Future | None = None
        self._background: set[asyncio.Future] = set()  # reports under way (see publish)
        # (an OrderedDict: RemovableHandle holds it by weak reference)
        self._epoch_hooks: OrderedDict[int, Callable[[EpochEvent], None]] = OrderedDict()

    # -- time and speed -----------------------------------------------------------------------------
    def now(self) -> float:
        """The peer's loop time: virtual under `potluck.core.virtual_time`, so tests are exact."""
        return asyncio.get_running_loop().time()

    def measure_speed(self) -> None:
        """A step() began: one more batch behind us (and those of the quiet steps since the
        last), at the speed since the last one measured."""
        now, steps = self.now(), 1 + self.quiet_steps
        self.quiet_steps = 0
        if self.last_step_time is not None and now > self.last_step_time:
            speed = steps * self.settings.batch_size_per_step / (now - self.last_step_time)
            weight = 1 - (1 - SPEED_SMOOTHING) ** steps  # as `steps` measurements of that speed
            self.samples_per_second = speed if not self.samples_per_second else (
                (1 - weight) * self.samples_per_second + weight * speed)
        self.last_step_time = now
        self.samples_processed += steps * self.settings.batch_size_per_step

    def quiet(self, joinable: bool) -> bool:
        """In the caller's thread: may this step skip the event loop (see QUIET_SECONDS)? Not if
        it could join a round another peer is in (`joinable`: the mode's own rule)."""
        return self.mismatch is None and not (joinable and self.others_averaging) \
            and time.monotonic() - self.last_hop < QUIET_SECONDS

    def count_quiet_step(self) -> None:
        """In the caller's thread: an inner step taken there, counted without the loop (its
        speed is measured at the next step on the loop)."""
        self.quiet_steps += 1
        self.tally.samples += self.settings.batch_size_per_step

    def idle(self) -> bool:
        """We have stopped calling step() (a peer that never stepped is still starting)."""
        last, speed = self.last_step_time, self.samples_per_second
        if self.stepping or last is None or speed <= 0:
            return False
        idle_after = max(IDLE_FLOOR_SECONDS, IDLE_STEP_INTERVALS * self.settings.batch_size_per_step / speed)
        return self.now() - last > idle_after

    # -- progress -----------------------------------------------------------------------------------
    @property
    def accumulating_epoch(self) -> int:
        """The epoch our new samples count towards: one ahead while a delayed update is running."""
        return self.epoch + self.tally.ahead

    def progress(self) -> GlobalProgress:
        """The collaboration's progress as this peer estimates it now."""
        tally = self.tally
        local = PeerProgress(self.peer.peer_id, self.accumulating_epoch, tally.samples, self.samples_per_second,
                             self.peer.dht.get_time(), self.tracker.client_mode, self.epoch, tally.in_round,
                             False, 0 if tally.ahead else tally.part)
        return self.tracker.estimate(self.tracker.merged(self.reports), local)

    async def report(self, store: bool = True) -> None:
        """Publish our progress. While step() waits for the epoch's round, the samples in it still
        count, so that a peer whose view lags still sees the batch full and joins the round
        instead of missing it. Without `store`: to our neighbors only (see ProgressTracker)."""
        tally = self.tally
        await self.tracker.report(self.accumulating_epoch, tally.samples + tally.round_samples,
                                  self.samples_per_second, self.epoch, tally.in_round, self.idle(),
                                  0 if tally.ahead else tally.part, store=store, failed=self.failed_rounds,
                                  metrics=self.metrics, view=view_digest(self.roster) if self.roster else None)

    def publish(self) -> None:
        """Report a change of state (a new epoch, a round ended) without waiting: the report
        reads our state when it runs, so it is never older than the change. Neighbors hear it
        at once; the DHT then hears it from the progress loop."""
        self.spawn(self.report(store=not self.tracker.has_neighbors))

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run `work` in the background, held until done (the loop keeps only weak references)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(retrieve_exception)

    def start_progress(self) -> None:
        self.epoch_began = self.now()
        self._progress_task = asyncio.ensure_future(self._progress_loop())
        # Dropped once it ends: a cancelled task keeps its CancelledError, whose traceback holds
        # the loop's frame and so this context (a cycle only the GC would free).
        self._progress_task.add_done_callback(self._progress_ended)

    def _progress_ended(self, task: asyncio.Future) -> None:
        if self._progress_task is task:
            self._progress_task = None

    async def _progress_loop(self) -> None:
        tick = 0
        while self.mismatch is None:  # (a peer not of this run stops publishing)
            through_dht = not self.tracker.has_neighbors or tick % DHT_EVERY_WITH_NEIGHBORS == 0 \
                or self._outsiders()
            await self.report(store=through_dht)
            if through_dht:
                reports = await self.tracker.fetch()
                if reports is not None:
                    self.reports = reports
                    if self._may_be_odd() and not self._checking_model and self.now() >= self._next_model_check:
                        self._next_model_check = self.now() + MODEL_CHECK_INTERVAL
                        self.spawn(self._check_model())
            reports = self.progress().reports
            self.others_averaging = self.another_in_round(reports)
            self.others_applied = self.applied_by_others(reports)
            roster = self.members(reports)
            if roster != self.roster:
                self.roster, self.roster_since = roster, self.now()
                self.publish()  # our view, for the others' `expected`
            tick += 1
            await asyncio.sleep(PROGRESS_INTERVAL)

    def _live_others(self, reports: Iterable[PeerProgress]) -> Iterator[PeerProgress]:
        """The reports of other peers that are live (reported within LIVE_SECONDS)."""
        now, me = self.peer.dht.get_time(), self.peer.peer_id
        return (r for r in reports if r.peer_id != me and r.live(now))

    def another_in_round(self, reports: Iterable[PeerProgress]) -> bool:
        """Another live peer has entered the outer round of our epoch."""
        return any(r.averaging and r.epoch == self.epoch for r in self._live_others(reports))

    def applied_by_others(self, reports: Iterable[PeerProgress]) -> int:
        """The most epochs another live peer has applied (in `progress()`'s reports, a lead over
        ours counts only if backed: `ProgressTracker._backed`)."""
        return max((r.done for r in self._live_others(reports)), default=0)

    def _outsiders(self) -> bool:
        """A live peer that trains, other than us, is not among our neighbors."""
        now, me = self.peer.dht.get_time(), self.peer.peer_id
        return any(p != me and not r.idle and r.live(now) and not self.tracker.is_neighbor(p)
                   for p, r in self.reports.items())

    # -- not stepping alone past our group -----------------------------------------------------------------
    def holds(self, reports: Iterable[PeerProgress], epoch: int) -> bool:
        """Whether to keep our update rather than apply it alone past `epoch` (HOLD_PATIENCE_EPOCHS):
        a peer of our last group trains (live, not idle) behind us, and its epoch rose within our
        patience."""
        behind = [r for r in self._live_others(reports)
                  if self.tracker.is_neighbor(r.peer_id) and r.epoch < epoch and not r.idle]
        if not behind:
            self.held = None
            return False
        highest, now = max(r.epoch for r in behind), self.now()
        if self.held is None or highest > self.held[0]:
            if self.held is None:
                logger.info("epoch %d: %d peer(s) of our last group train behind us (epoch %d); waiting for "
                            "them to come within one epoch", epoch, len(behind), highest)
            self.held = (highest, now)
        patience = max(self.settings.matchmaking_time, HOLD_PATIENCE_EPOCHS * self.group_epoch_seconds)
        if now - self.held[1] <= patience:
            return True
        logger.warning("epoch %d: the peer(s) behind us stayed at epoch %d for %.1f s; stepping alone",
                       epoch, highest, now - self.held[1])
        self.held = (highest, now)  # (patience again for the next epoch)
        return False

    def holds_round(self, reports: Iterable[PeerProgress]) -> bool:
        """DiLoCo's modes: whether to put off our next outer round (and keep taking inner steps):
        no other live peer trains on our epoch or past it, and `holds` says to wait for the peers
        of our last group behind us (`reports`: `progress()`'s). A round alone is over within a
        delayed round's inner steps (Streaming DiLoCo with `outer_delay`), so stepping on alone
        cost nothing: while the others spent 4 s repairing a fragment, one peer went two epochs
        ahead of them over the emulated WAN, and the run stayed two swarms to the end."""
        reports = list(reports)
        level = any(r.epoch >= self.epoch and not r.idle for r in self._live_others(reports))
        return not level and self.holds(reports, self.epoch)

    def epoch_seconds(self) -> float:
        """How long our current epoch (or part of it) has run."""
        return 0.0 if self.epoch_began is None else self.now() - self.epoch_began

    def grouped(self, seconds: float) -> None:
        """An epoch of `seconds` ended in a round with others: the group's pace (`holds`), unless
        we held back through it (that says nothing of the group's pace)."""
        if self.held is None:
            self.group_epoch_seconds = seconds
        self.held = None

    # -- the run's schema -----------------------------------------------------------------------------
    def check_model(self) -> None:
        """Raise ModelMismatch if we found that our model or settings are not the run's."""
        if self.mismatch is not None:
            raise ModelMismatch(str(self.mismatch))

    def _may_be_odd(self) -> bool:
        """Whether we might be the odd one out: peers of another fingerprint are live, none of
        ours is, and we never completed a round (a peer that trained with peers of its kind is of
        a run, whatever others publish)."""
        if self.schema is None or self.rounds_completed or not self.tracker.strangers:
            return False
        now, me = self.peer.dht.get_time(), self.peer.peer_id
        return not any(r.live(now) for p, r in self.reports.items() if p != me) \
            and any(r.live(now) for r in self.tracker.strangers.values())

    async def _check_model(self) -> None:
        """Decide whether we are the odd one out (`_may_be_odd`, and two live peers of another
        fingerprint published a round they completed together: `confirmed_runs`); if so, learn
        the run's schema from one of them and keep why in `mismatch`."""
        self._checking_model = True
        try:
            published = await fetch_published_rounds(self.peer.dht, self.run_id)
            now = self.peer.dht.get_time()
            live = {p: r.fingerprint for p, r in self.tracker.strangers.items() if r.live(now)}
            runs = {} if published is None or not self._may_be_odd() else confirmed_runs(published, live)
            if not runs or self.rounds_completed:
                return
            fingerprint, peers = min(runs.items(), key=lambda run: (-len(run[1]), run[0]))
            schema = await self._run_schema(fingerprint, sorted(peers))
            assert self.schema is not None
            difference = self.schema.difference(schema) if schema is not None else None
            self.mismatch = ModelMismatch(
                f"this peer's model or settings do not match run {self.run_id!r}: "
                + (difference or f"your schema has fingerprint {self.schema.fingerprint}, the run's {fingerprint} "
                                  "(no peer of the run gave its schema)")
                + "; train the run's model with its settings (the same code and options as its peers), "
                  "or use another run id")
            logger.error("%s", self.mismatch)
        finally:
            self._checking_model = False

    async def _run_schema(self, fingerprint: str, peers: list[str]) -> RunSchema | None:
        """The schema of fingerprint `fingerprint`, from the state manifest of one of `peers`
        (None if none of them gives one that has it)."""
        method = self.state.averager.names.manifest
        for peer in peers:
            try:
                reply = await self.peer.transport.call(PeerID.from_string(peer), method, ManifestRequest().to_wire(),
                                                       timeout=SCHEMA_TIMEOUT)
                metadata = Manifest.from_wire(reply).metadata
                schema = RunSchema.from_wire(metadata.get("schema")) if isinstance(metadata, dict) else None
            except (NetworkError, PotluckError) as e:
                logger.debug("no run schema from %s: %s", peer, e)
                continue
            if schema is not None and schema.fingerprint == fingerprint:
                return schema
        return None

    async def fresh_reports(self) -> list[PeerProgress]:
        """Everyone's progress read from the DHT now (the background view may be a moment old),
        which becomes our view: a round tried again right after must not decide from the old one
        (two peers that started apart once trained six epochs without meeting: each retry of the
        first saw "no other peer is training" in the view the failure had just found stale). As
        far as the swarm supports it (`progress`), ours included: read as claimed, one peer's
        epoch of ten million became ours after a round failed."""
        try:
            reports = await asyncio.wait_for(self.tracker.fetch(), self.settings.averaging_timeout)
        except TimeoutError:
            reports = None
        if reports is not None:
            self.reports = reports
        return list(self.progress().reports)

    def members(self, reports: Iterable[PeerProgress]) -> frozenset[str]:
        """Every peer that may take part in a round now: us and every live peer that is not
        idle, on any epoch. If they are exactly the last round's group, it meets again without
        the DHT; anyone else (a newcomer, a peer catching up) opens the round to everyone."""
        now = self.peer.dht.get_time()
        return frozenset([self.peer.peer_id, *(r.peer_id for r in reports if r.live(now) and not r.idle)])

    def expected(self) -> int | None:
        """How many peers a round without a stable group waits for, asked again while its group
        gathers: all of our view (`roster`, from `members()`), once every other peer of it
        publishes the same view, or once it has named them for ROSTER_SETTLE_FRACTION of the
        matchmaking window (a peer that has just appeared may not see everyone yet, and the view
        needs a moment to hear of a newcomer); else None: the whole window, which lets anyone we
        do not see yet come in. A peer whose view differs holds back only the shortcut."""
        if len(self.roster) < 2:
            return None  # nobody else to wait for, or to stop waiting for
        if self.now() - self.roster_since >= ROSTER_SETTLE_FRACTION * self.settings.matchmaking_time:
            return len(self.roster)
        me, digest = str(self.peer.peer_id), view_digest(self.roster)
        views = {r.peer_id: r.view for r in self.progress().reports}
        agreed = all(views.get(str(p)) == digest for p in self.roster if str(p) != me)
        return len(self.roster) if agreed else None

    def group_formed(self, peers: Iterable[str], counted: Iterable[str]) -> None:
        """A round's group formed with `peers` after we counted `counted` into it: they are our
        neighbors now, and the peers we counted but had not averaged with lately that did not
        come, while the group had room for them, are no-shows (NO_SHOW_SECONDS)."""
        peers = list(peers)
        came, now = set(peers), self.now()
        for peer in came:
            self._no_shows.pop(peer, None)
        counted = set(counted) | {str(self.peer.peer_id)}
        if len(came) < min(len(counted), MAX_GROUP_SIZE):  # (a full group had no room for the others)
            for peer in counted - came:
                if not self.tracker.in_recent_groups(peer):
                    self._no_shows.pop(peer, None)
                    self._no_shows[peer] = now + NO_SHOW_SECONDS
            drop_oldest(self._no_shows, MAX_NO_SHOWS)
        self.tracker.set_neighbors(peers)

    def no_shows(self) -> frozenset[str]:
        """The no-shows now (see `group_formed`)."""
        now = self.now()
        return frozenset(p for p, until in self._no_shows.items() if until > now)

    def round_window(self) -> float:
        """Seconds a DiLoCo round's group gathers: the run's matchmaking_time, or ROUND_WINDOW_STEPS
        of the slowest live training peer's steps, at most MAX_ROUND_WINDOW_FACTOR times as long
        and never past DECLARATION_MAX_TTL (the averager refuses a longer window)."""
        base = self.settings.matchmaking_time
        speeds = [r.samples_per_second for r in self._live_others(self.progress().reports)
                  if r.computing and r.samples_per_second > 0]
        if not speeds:
            return base
        step = self.settings.batch_size_per_step / min(speeds)
        return min(max(base, ROUND_WINDOW_STEPS * step), MAX_ROUND_WINDOW_FACTOR * base, DECLARATION_MAX_TTL)

    def anyone_else(self) -> bool:
        """Some other peer trains (a lone peer does not wait a matchmaking window for nobody)."""
        return any(r.peer_id != self.peer.peer_id and not r.idle for r in self.progress().reports)

    def round_is_over(self, epoch: int) -> bool:
        """Another peer has applied `epoch`'s update: its round ended (without us, if we are
        still looking for a group). Waiting out the matchmaking window for a group that will not
        come would also hold back the others, who count us into their next round."""
        return any(r.done > epoch for r in self.progress().reports if r.peer_id != self.peer.peer_id)

    async def wait_for_round(self, task: asyncio.Future, averager: Averager, epoch: int) -> None:
        """Wait for `epoch`'s round; cancel it if we have no group yet and the round is over."""
        while not task.done():
            await asyncio.wait([task], timeout=PROGRESS_INTERVAL)
            await self.give_up_round(task, averager, epoch)

    async def give_up_round(self, task: asyncio.Future, averager: Averager, epoch: int) -> bool:
        """Cancel `epoch`'s round `task` (and wait for it) if it has no group yet and the swarm's
        round of that epoch is over: none will come. Whether it did. Waiting out the window
        instead, a straggler opened each next round a window late while the others, counting it
        in, waited for it: every epoch took a window."""
        if task.done() or not (averager.forming and self.round_is_over(epoch)):
            return False
        task.cancel()
        await asyncio.wait([task])
        return True

    def record_round(self, epoch: int, notes: dict[str, RoundNote], contributors: list[str],
                     keeper: str | None = None) -> None:
        """Publish, for monitors, a round we completed: each contributor's samples as its note
        gave them to the group (a monitor credits a peer with what the others record for it),
        and our membership token (our name) if the run has an authority. Every member records it
        alike: under the same epoch (the lower median of the epochs in the notes, if they say
        theirs) and id (a digest of the notes: the same members may meet twice in an epoch)."""
        said = sorted(n.epoch for n in notes.values() if n.epoch is not None)
        epoch = said[(len(said) - 1) // 2] if said else epoch
        wire = json.dumps(sorted((p, notes[p].to_wire()) for p in contributors if p in notes)).encode()
        record = RoundRecord(epoch, self.tally.part, tuple((p, notes[p].samples) for p in contributors
                                                           if p in notes and not notes[p].aux),
                             keeper, self.peer.dht.get_time(), hashlib.blake2b(wire, digest_size=8).hexdigest())
        self.rounds_completed += 1
        token = getattr(self.peer, "membership", None)
        self.spawn(self.tracker.record_round(record, None if token is None else token.to_wire()))

    # -- epochs ---------------------------------------------------------------------------------------
    def register_epoch_hook(self, hook: Callable[[EpochEvent], None]) -> RemovableHandle:
        handle = RemovableHandle(self._epoch_hooks)
        self._epoch_hooks[handle.id] = hook
        return handle

    def _epoch_changed(self, how: Literal["update", "caught_up", "rejoined"]) -> None:
        event = EpochEvent(self.epoch, how, self.epoch_samples if how == "update" else 0)
        for hook in list(self._epoch_hooks.values()):
            hook(event)

    def advance_epoch(self) -> None:
        """Our update of this epoch is applied: the next epoch begins (scheduler, label, report)."""
        self.epoch += 1
        self.waited, self.tally.part = True, 0
        self.epoch_began = self.now()
        if self.scheduler is not None:
            self.scheduler.step()
        self.state.label(self.epoch)
        self.publish()
        self._epoch_changed("update")

    def move_to(self, epoch: int) -> None:
        """Take the swarm's `epoch` as ours (never an older one), the scheduler with it in one call."""
        if epoch > self.epoch:
            if self.scheduler is not None:
                _advance_scheduler(self.scheduler, epoch - self.epoch)
            self.epoch = epoch
        self.state.averager.state_metadata = self.state.metadata(self.epoch)

    def rejoin(self, epoch: int) -> None:
        """Move on to the swarm's `epoch` without its state (its next rounds repair ours)."""
        self.departed = True
        self.move_to(epoch)
        self.publish()
        self._epoch_changed("rejoined")

    async def catch_up(self, epoch: int, *, drop: Callable[[], Awaitable[None]] | None = None,
                       restart: Callable[[], Awaitable[None]] | None = None) -> None:
        """We fell behind the swarm (at `epoch`): take its state; recent work counts towards the
        next epoch unless we were more than MAX_STALE_EPOCHS behind: then `drop` clears what the
        mode accumulated. `restart`: what the mode derives from the state, redone after a download."""
        behind = epoch - self.epoch
        self.waited, self.tally.part = True, 0
        self.epoch_began = self.now()
        self.catch_ups += 1
        if behind <= MAX_STALE_EPOCHS and self.epoch > 0:
            # One round missed, with a state of the run: rejoin at once, and the next state
            # averaging repairs ours. A download (round trips, then the state) would take most of
            # an epoch over a slow link, and miss the next round too.
            logger.info("missed the swarm's round of epoch %d: rejoining at epoch %d", self.epoch, epoch)
            self.departed = True
            self.move_to(epoch)
            self._epoch_changed("caught_up")
            return
        logger.info("behind the swarm by %d epoch(s): downloading its state", behind)
        self.departed = not await self.try_load_state(self.settings.averaging_timeout, restart)
        # The swarm's epoch now, with the state we got (or ours, if none came): the next state
        # averaging repairs the difference. Waiting for a state of the very epoch instead, a peer
        # whose download takes an epoch or more (a slow link) would download forever, a round late.
        # With a state, the epoch our view supports now: the peer whose lead we followed may not
        # hold the state the download chose (it no longer leads us then), and jumping to its epoch
        # skipped the rounds between (three DiLoCo peers behind one that trained on alone). The
        # epoch applied, not the one accumulating: with delayed updates that is one past any
        # state, and a straggler moved there stood an epoch ahead of everyone.
        supported = self.progress().applied
        self.move_to(max(epoch, supported) if self.departed else supported)
        if behind > MAX_STALE_EPOCHS:
            if drop is not None:
                await drop()
            self.tally.samples = 0
        self._epoch_changed("caught_up")

    async def try_load_state(self, timeout: float, restart: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Download the swarm's state (`download_state`) and take its epoch; False if none came."""
        try:
            self.state.generation += 1  # written even if the download fails part-way
            epoch = await self.download_state(timeout)  # into our tensors
        except AveragingError as e:
            logger.info("no state downloaded (%s); starting from local parameters", e)
            return False
        self.move_to(epoch)
        if restart is not None:
            await restart()
        logger.info("downloaded the swarm's state at epoch %d", self.epoch)
        return True

    async def download_state(self, timeout: float) -> int:
        """Download the swarm's state into the state's tensors; returns its epoch. Donors count
        only if they are live peers in our progress view (identities we never heard from do not),
        and a state whose epoch or version is ahead of what the view supports
        (`MAX_STATE_EPOCH_LEAD`) is refused: one donor cannot set our parameters or our epoch.
        Where the donors disagree, each state weighs what our witnesses verified of its holders
        (`potluck.optim.vouching`), never their number or what they claim; a tie takes none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with compat.timeout_at(deadline):
                reports = await self.tracker.fetch()
        except TimeoutError:
            raise AveragingError(f"could not read the swarm's progress within {timeout} s") from None
        if reports is not None:
            self.reports = reports
        progress, now = self.progress(), self.peer.dht.get_time()
        vouched = {PeerID.from_string(r.peer_id) for r in progress.reports
                   if r.peer_id != self.peer.peer_id and r.live(now)}
        limit = progress.epoch + MAX_STATE_EPOCH_LEAD
        left = deadline - loop.time()
        if left <= 0:
            raise AveragingError(f"no time left to download the state within {timeout} s")
        fingerprint = None if self.schema is None else self.schema.fingerprint
        election = DonorElection(self.peer.dht, self.run_id, self.witnesses, self.tracker.rounds,
                                 getattr(self.peer.transport, "membership", None), self.tracker.followed)
        _, metadata = await self.state.averager.aload_state_from_peers(
            left, vouched=vouched, check=lambda manifest: _check_epoch(manifest, limit, fingerprint), elect=election)
        self.tracker.followed = self.witnesses.union(map(str, election.taken)) - {str(self.peer.peer_id)}
        return metadata["epoch"]

    def share_last_group(self, averager: Averager) -> None:
        """The state's rounds come right after `averager`'s, among the same peers: one memory of
        the last group for both, so a state round asks that round's leader directly instead of
        declaring itself in the DHT. Over loaded WAN links the DHT's 0.5 s window left every member
        of a DiLoCo repair round alone (`benchmarks/wan.py --workload wide`), and the swarm apart."""
        last = self.state.averager.matchmaker.last = averager.matchmaker.last
        last.computed = self.computes_towards_us  # a late last leader is waited for, a stalled one not

    def computes_towards_us(self, peer: Any, since: float) -> bool:
        """Whether `peer` (our last leader) has computed since DHT time `since` towards a round we
        may be in, not past our epoch: it is late for our round, not stalled or gone."""
        report = self.tracker.pushed.get(str(peer))
        return report is not None and report.epoch <= self.accumulating_epoch \
            and self.tracker.computed_since(peer, since)

    async def average_state(self, key: str, expected: int, members: frozenset[str] | None = None) -> None:
        """Average parameters and statistics in place with a group (untouched if the round fails)."""
        self.tally.in_round = True
        try:
            await self.state.averager.astep(group_key=key, target_group_size=expected, members=members)
        except AveragingError as e:
            logger.warning("averaging parameters failed (%s); keeping local ones", e)
        else:
            self.departed = False
        finally:
            self.tally.in_round = False
            self.state.generation += 1
        self.publish()  # computing again: others may extrapolate us

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A step's model-sized tensor math: in the thread waiting in `Optimizer.step()` if there
        is one (`CallerThread` says why), else in the pool."""
        caller = self.caller
        return await (run_in_thread(fn, *args) if caller is None else caller.run(fn, *args))

    async def inner_step(self) -> None:
        """The wrapped optimizer's step on the batch's gradients (local-update modes), unless the
        caller's thread took it already (`Optimizer.step()`: `inner_taken`)."""
        if self.inner_taken:
            self.inner_taken = False
        else:
            await self.compute(self.state.inner_step)
        self.tally.samples += self.settings.batch_size_per_step

    def stop(self) -> None:
        """Stop publishing progress (from any thread); the peer itself stays up."""
        task = self._progress_task  # (read once: it is dropped when it ends, in the loop's thread)
        loop = None if task is None else task.get_loop()
        if loop is not None and not loop.is_closed():  # (a closed loop cancelled it already)
            loop.call_soon_threadsafe(task.cancel)
        self.tracker.close()
        self.state.averager.shutdown()


def _check_epoch(manifest: Manifest, limit: int, fingerprint: str | None = None) -> None:
    """Refuse (ValueError) a donor's state unless it says which epoch it is, and neither that
    epoch nor its version is beyond `limit`; and one whose run schema has another fingerprint
    than ours (`fingerprint`; a state that names none, of an older potluck, is not refused)."""
    metadata = manifest.metadata
    theirs = metadata.get("fp") if isinstance(metadata, dict) else None
    if fingerprint is not None and theirs is not None and theirs != fingerprint:
        raise ValueError(f"its model or settings differ from ours (fingerprint {theirs!r:.40}, ours {fingerprint})")
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"its metadata names no epoch: {metadata!r:.100}")
    if max(epoch, manifest.version) > limit:
        raise ValueError(f"it claims epoch {epoch} (version {manifest.version}), beyond the {limit} "
                         f"that the swarm's progress supports")


def _advance_scheduler(scheduler: Any, epochs: int) -> None:
    """Move a learning-rate scheduler `epochs` epochs on, as many `step()` calls would: in one call
    for a torch scheduler with a closed form, else by replaying at most MAX_REPLAYED_SCHEDULER_STEPS
    steps (a scheduler further behind is left there, and logged)."""
    schedulers = torch.optim.lr_scheduler
    if isinstance(scheduler, schedulers.LRScheduler) and (
            hasattr(scheduler, "_get_closed_form_lr")
            or isinstance(scheduler, (schedulers.LambdaLR, schedulers.OneCycleLR, schedulers.CyclicLR))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # step(epoch) is deprecated, yet torch's only way to jump
            scheduler.step(scheduler.last_epoch + epochs)
        return
    for _ in range(min(epochs, MAX_REPLAYED_SCHEDULER_STEPS)):
        scheduler.step()
    if epochs > MAX_REPLAYED_SCHEDULER_STEPS:
        logger.warning("the learning-rate scheduler was moved on %d of the %d epochs downloaded (it has no closed "
                       "form); its rate is that of an earlier epoch", MAX_REPLAYED_SCHEDULER_STEPS, epochs)
