"""`potluck.Averager`: average a set of tensors with whoever else averages them in the same run.

One `step()` = matchmaking through the DHT (optionally on a Moshpit grid), one fault-tolerant
butterfly all-reduce in the group, and an atomic update of the local tensors (or an
`AveragingError` that leaves them untouched).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from potluck.averaging.accountability import SealedBlock, ban_list, claim_digest, exclusions
from potluck.averaging.allreduce import (
    ARITHMETIC,
    CHUNK_ELEMENTS,
    SENDER_TIMEOUT,
    AllReduceService,
    Group,
    TransferStats,
    chunk_elements,
)
from potluck.averaging.lowrank import powersgd_allreduce
from potluck.averaging.matchmaking import Matchmaker, Target
from potluck.averaging.robust import AGGREGATIONS
from potluck.averaging.role import Role
from potluck.averaging.state_transfer import (
    DonorRecord,
    Election,
    ManifestCheck,
    StateServer,
    download_state,
    read_donors,
)
from potluck.averaging.suspicion import SuspicionLedger
from potluck.compression import PowerSGD, get_codec
from potluck.core import compat
from potluck.core.errors import AveragingError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.runner import retrieve_exception, run_in_thread
from potluck.core.staging import gather_into, scatter_from, wants_pinned
from potluck.core.tensors import all_finite
from potluck.dht.key_kinds import DECLARATION_MAX_TTL
from potluck.dht.records import own_subkey
from potluck.metrics import peer_metrics, stopwatch
from potluck.net.identity import PeerID

logger = logging.getLogger(__name__)

# Until a peer has measured its bandwidth in a real step, it assumes this (bytes/s) for the
# load split; every peer assuming the same gives an even split.
DEFAULT_BANDWIDTH = 100e6
# Largest group a chosen Moshpit grid aims for: a group's all-reduce costs each member about
# twice its tensors whatever the size, but a member's death fails more peers in a larger group,
# and the Moshpit paper's experiments used groups of this order.
MOSHPIT_MAX_GROUP = 16
# Weight of the newest measurement in the bandwidth estimate (exponential moving average).
BANDWIDTH_SMOOTHING = 0.5
# A step that sent less than this to other peers says little about the bandwidth (transport
# buffers absorb small sends at once): the estimate is left as it was.
MIN_MEASURED_BYTES = 256 * 1024
# How long a donor's "I can share my state" record lives in the DHT; refreshed at every step.
STATE_RECORD_TTL = 600.0


@dataclass
class StepResult:
    """What one averaging step did."""

    group_size: int
    peers: list[str]
    gathered: dict[str, Any] = field(default_factory=dict)  # peer id -> the metadata it sent
    group_key: str = ""
    contributors: list[str] = field(default_factory=list)  # peers whose tensors are in the average
    skipped: bool = False  # the group formed, and `proceed` said not to average (tensors untouched)
    # With `keep_sealed`: the group, and blocks of the contributors' pieces with their seals (peer
    # id -> blocks, about one per shard), each proof of what that peer sent (accountability).
    group: Group | None = None
    sealed: dict[str, list[SealedBlock]] = field(default_factory=dict)


def _service(transport: Any) -> AllReduceService:
    """One all-reduce service per transport: every averager of every run shares its handlers."""
    service = transport.services.get("allreduce")
    if service is None:
        service = transport.services["allreduce"] = AllReduceService(transport)
    return service



def stateless_codec(compression: Any) -> Any:
    """The codec `compression` names, or ValueError if it keeps state: a step encodes every chunk,
    result and check with one instance, so a residual would leak from one chunk into the next (or
    fail on a chunk of another size)."""
    codec = get_codec(compression)
    if codec.stateful:
        raise ValueError(f"the Averager cannot carry {codec.name!r}'s state (its error feedback) between "
                         "chunks: for top-k pseudo-gradients use Optimizer(mode='diloco', outer_compression="
                         "{'name': 'topk', ...}) (Streaming DiLoCo keeps error feedback per fragment), or a "
                         "stateless codec such as 'sparse' or 'blockwise4'")
    return codec

class Averager:
    """Averages `tensors` with other peers under `run_id`; see DESIGN.md section 3.

    Args:
        peer: a `potluck.Peer`; the async API (`astep`, ...) takes any `PeerLike`.
        tensors: float tensors of any float dtype, on any device; the averager keeps its own
            copies (`get_tensors()`, on the same devices), unless `copy=False`. They are averaged
            as float32 in host memory: each step copies them into a pooled host buffer (pinned
            when they are on a CUDA device: the copies are queued together, asynchronously) and
            the result back, rounded to their dtype.
        run_id: the run (`potluck.core.names.RunNames`): peers average together whose averagers
            have the same run_id and `name`.
        target_group_size: close a group once it has this many members (None: whoever shows up).
        min_group_size: fail the step when fewer peers are found.
        compression: a codec name or spec (`potluck.compression.known_codecs()`); stateless only
            (top-k's error feedback: Streaming DiLoCo's `outer_compression`).
        role: a `Role` (or its value): NODE "node" (sends and reduces), CLIENT "client" (behind
            NAT: only sends and receives), AUX "aux" (reduces for others, holds no result; its
            tensors only define the shapes). A NODE on a client-mode transport becomes a CLIENT.
        grid: Moshpit grid sizes, e.g. (16, 16): peers group by all coordinates but one, which
            turns each round; with N = prod(grid) peers the exact mean takes len(grid) rounds.
        coordinates: this peer's starting place on the grid (random if omitted).
        matchmaking_time: seconds a leader gathers peers before it closes the group.
        allreduce_timeout: deadline of the all-reduce part of a step.
        bandwidth: this peer's bandwidth in bytes/s for the load split: one number for up and
            down, or (up, down). Default: both measured at every step (bytes this peer uploaded /
            time its uploads were in flight; bytes it received / time chunks were arriving;
            smoothed), starting from DEFAULT_BANDWIDTH; a given value is used as is, never
            re-measured, and over TCP (Linux) the all-reduce paces its sends to the upload given,
            which keeps a long link's queue short (`TransferStats`: 1.26x -> 1.03x the bound for
            plain TCP on emulated 100 Mbit/s, 50 ms links). Give the link's real rate: a smaller
            one slows the all-reduce down to it.
        powersgd_rank: average rank-r PowerSGD approximations (with error feedback) instead of
            the tensors themselves: two all-reduces of r * (rows + cols) numbers per matrix
            instead of rows * cols. Meant for gradients; `compression` then applies to P and Q.
        aggregation: how reducers combine the members' tensors: "mean" (the weighted mean),
            "centered_clip" or "trimmed_mean" (robust to a minority of malicious members, at some
            cost in CPU; see `potluck.averaging.robust` and docs/security.md). Part of the
            schema: peers average only with peers that chose the same. Not with powersgd_rank.
        deviations: under a robust aggregation, keep the record of members' deviations over
            steps (`potluck.averaging.suspicion`: members whose pieces keep deviating the same
            way are left out, then excluded). It costs two vectors of the averaged size in memory
            while a group stays the same. False for rounds too rare and irregular to accumulate
            evidence (the Optimizer's state averaging outside the moshpit mode); blatantly far
            pieces are named and excluded either way.
        name: which of the run's averagers this is (a word: letters, digits, '_', '-'); the
            Optimizer's own are "state", "grads", "delta" and "delta<i>"/"outer<i>".
        copy: False: average `tensors` themselves, in place (no private copy: saves one model
            of memory). The caller then changes them only inside `get_tensors()`, so that a step
            or a newcomer's snapshot never sees them half-written.
        fingerprint: what else peers must share to average together (the Optimizer's run schema,
            `potluck.optim.schema`: parameter names, settings); part of the schema.
        keep_sealed: return with each step the blocks of the members' pieces that the step's
            checks fetched, with their senders' seals (`StepResult.sealed`): proof of what each
            sent, to check against a recomputation (the Optimizer's verified mode).
    """

    def __init__(self, peer: PeerLike, tensors: Sequence[torch.Tensor], run_id: str,
                 target_group_size: int | None = None, min_group_size: int = 2,
                 compression: Any = "none", role: Role | str = Role.NODE, *, grid: Sequence[int] | None = None,
                 coordinates: Sequence[int] | None = None, matchmaking_time: float = 3.0,
                 allreduce_timeout: float = 60.0, sender_timeout: float = SENDER_TIMEOUT,
                 bandwidth: float | tuple[float, float] | None = None, allow_state_sharing: bool = True,
                 powersgd_rank: int | None = None, copy: bool = True, aggregation: str = "mean",
                 deviations: bool = True, name: str = "tensors", fingerprint: str | None = None,
                 keep_sealed: bool = False):
        role = Role(role)
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")
        if aggregation != "mean" and powersgd_rank is not None:
            raise ValueError("robust aggregation of PowerSGD's factors is not supported: use aggregation='mean'")
        if not tensors or any(not t.is_floating_point() for t in tensors):
            raise ValueError("Averager needs a non-empty list of floating-point tensors")
        if min_group_size < 1 or (target_group_size is not None and target_group_size < min_group_size):
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        _check_window(matchmaking_time)
        self.peer = peer
        self.transport = peer.transport
        self.run_id = run_id
        self.names = RunNames(run_id).averager(name)
        self.role = Role.CLIENT if self.transport.client_mode and role == Role.NODE else role
        self._tensors = [t.detach().clone() if copy else t.detach() for t in tensors]
        self._lock = threading.Lock()
        self.codec = stateless_codec(compression)
        self.total = sum(t.numel() for t in self._tensors)
        self.powersgd = None if powersgd_rank is None else \
            [PowerSGD(t.shape, powersgd_rank, seed=k) for k, t in enumerate(self._tensors)]
        self.aggregation = aggregation
        self.keep_sealed = keep_sealed
        # Robust aggregations also remember how members deviated over steps, and leave out or ban
        # the persistent ones (potluck.averaging.suspicion); the mean has no robust centre to keep.
        self.suspicion = None if aggregation == "mean" else SuspicionLedger(exclusions(self.transport),
                                                                             ban_list(self.transport), track=deviations)
        settings = {**self.codec.spec, "powersgd": powersgd_rank, "aggregation": aggregation,
                    "arithmetic": ARITHMETIC}
        if fingerprint is not None:  # (left out otherwise: the schema of an Averager of the user's is unchanged)
            settings["fingerprint"] = fingerprint
        self.schema = _schema(self._tensors, settings)
        self.matchmaking_time = matchmaking_time
        self.allreduce_timeout = allreduce_timeout
        self.sender_timeout = sender_timeout
        self.grid: tuple[int, ...] | None = None
        self.round = 0
        self._phase = "matchmaking"  # of the step under way: where a failure is counted (potluck.metrics)
        if grid:
            self.set_grid(grid, coordinates)
        # In matchmaking now, with no group yet: a step may be cancelled without harm to anyone's
        # round (the Optimizer does when its epoch's round ended without it).
        self.forming = False
        up, down = tuple(bandwidth) if isinstance(bandwidth, (tuple, list)) and len(bandwidth) == 2 \
            else (bandwidth, bandwidth)
        if bandwidth is not None and not (_positive(up) and _positive(down)):
            raise ValueError(f"bandwidth must be bytes/s above 0, or (up, down) of them, got {bandwidth!r}")
        self.bandwidth = up or DEFAULT_BANDWIDTH  # upload
        self.download_bandwidth = down or DEFAULT_BANDWIDTH
        self._configured = self._measured = self._measured_download = bandwidth is not None
        self.matchmaker = Matchmaker(self.transport, peer.dht, self.names, self.schema, self.total, self.role.value,
                                     target_group_size, min_group_size)
        self.service = _service(self.transport)
        if wants_pinned(self._tensors):
            self.service.pool.pin_memory = True
        import scipy.optimize  # noqa: F401 - load it now, not on the event loop when we first lead a group
        self.state_metadata: Any = None  # shared with newcomers alongside the tensors
        # What newcomers download in place of the averaged tensors, if set: tensors alike to them
        # in shape and dtype, written only under this averager's lock (DiLoCo's outer parameters
        # in place of the local ones: `ModelState.serve`).
        self.served_tensors: list[torch.Tensor] | None = None
        self.state_server = None
        self._announced = False  # after a step of ours (see _announce_after_step)
        self._announcing: asyncio.Future | None = None  # the store of our state record under way
        self._announce_asked = False
        if allow_state_sharing and self.role != Role.AUX:  # a client behind a relay can donate too
            # The round alone does not name the state: the Optimizer relabels it with the epoch
            # (sync: the round that averaged epoch e's state is e + 1, and so is the label of the
            # step after it), so a snapshot from before that step was offered as current after it.
            self.state_server = StateServer(self.transport, self._get_state, self.names, lock=self._lock,
                                            current_version=lambda: (self.round, self.state_metadata))

    # -- the user's side ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked against a concurrent update while in the block."""
        with self._lock:
            yield self._tensors

    def adopt_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Take `tensors` as the averaged tensors in place of ours, which are dropped (each alike
        in shape, dtype and device; the caller gives them up): a copy saved where the caller's
        buffers are new every time, as a batch's gradients are. Not during a step."""
        with self._lock:
            if len(tensors) != len(self._tensors) or any(
                    (t.shape, t.dtype, t.device) != (o.shape, o.dtype, o.device)
                    for t, o in zip(tensors, self._tensors, strict=True)):
                raise ValueError("adopt_tensors needs tensors alike in shape, dtype and device to the averaged ones")
            self._tensors[:] = [t.detach() for t in tensors]

    def step(self, weight: float = 1.0, timeout: float | None = None, gather: Any = None, *,
             group_key: str | None = None, target_group_size: Target = None,
             members: Collection[str] | None = None, no_shows: Collection[str] = (),
             proceed: Callable[[dict[str, Any]], bool] | None = None) -> StepResult:
        """Average once with a group of peers; raises AveragingError (tensors untouched) on failure.

        `weight` (e.g. the number of samples behind these tensors) weighs this peer's
        contribution; `gather` is small metadata handed to every member (see StepResult).
        `group_key` restricts this step to peers using the same key (e.g. the same epoch), and
        `target_group_size` overrides the averager's for this step (a function: asked again
        while a group gathers). `members` (peer ids): every peer that takes part, if the caller
        knows them; if they were our last group, it meets again without the DHT (see
        `potluck.averaging.matchmaking`). `no_shows` (peer ids): peers counted into the target that
        did not come to a recent round: once everyone else is in, the group waits for them only
        `SEAT_FRACTION` of its window (a made-up id that publishes progress and never joins held
        every round for the whole window). `proceed`: called with the
        formed group's gathered metadata (peer id -> what it sent); if it says False, nothing is
        averaged and the result says `skipped`. Every member gets the same metadata, so a
        function of it alone decides alike everywhere (a member that decides otherwise averages
        with whoever came).
        """
        budget = timeout or (self.matchmaking_time + self.allreduce_timeout + 10)
        return self.peer.run(self.astep(weight, timeout, gather, group_key=group_key,
                                        target_group_size=target_group_size, members=members,
                                        no_shows=no_shows, proceed=proceed),
                             budget + 5)

    async def astep(self, weight: float = 1.0, timeout: float | None = None, gather: Any = None, *,
                    group_key: str | None = None, target_group_size: Target = None,
                    members: Collection[str] | None = None, no_shows: Collection[str] = (),
                    proceed: Callable[[dict[str, Any]], bool] | None = None,
                    matchmaking_time: float | None = None) -> StepResult:
        """The async twin of `step`; `matchmaking_time`: this round's window, if not the
        averager's (in (0, DECLARATION_MAX_TTL])."""
        window = self.matchmaking_time if matchmaking_time is None else _check_window(matchmaking_time)
        budget = timeout or (window + self.allreduce_timeout + 10)
        metrics = peer_metrics(self.transport)
        elapsed = stopwatch()
        self._phase = "matchmaking"  # what failed, for metrics; _step moves it on
        try:
            async with compat.timeout(budget):
                known = None if members is None else frozenset(PeerID.from_string(p) for p in members)
                doubtful = frozenset(PeerID.from_string(p) for p in no_shows)
                result = await self._step(weight, gather, group_key, target_group_size, known, proceed, doubtful,
                                          window=window)
        except TimeoutError:
            metrics.round_failures.inc(run=self.run_id, averager=self.names.name, kind="timeout")
            raise AveragingError(f"averaging step did not finish within {budget:.1f} s") from None
        except Exception:
            metrics.round_failures.inc(run=self.run_id, averager=self.names.name, kind=self._phase)
            raise
        metrics.round_seconds.observe(elapsed(), run=self.run_id, averager=self.names.name)
        metrics.group_size.observe(result.group_size, run=self.run_id, averager=self.names.name)
        return result

    async def _step(self, weight: float, gather: Any, group_key: str | None, target: Target,
                    members: frozenset[PeerID] | None,
                    proceed: Callable[[dict[str, Any]], bool] | None = None,
                    no_shows: frozenset[PeerID] = frozenset(), *, window: float) -> StepResult:
        key = self._group_key() if group_key is None else f"{group_key}/{self._group_key()}"
        # Snapshot (and check) the local tensors while matchmaking talks to the DHT; a peer whose
        # tensors hold NaN/inf fails here, before it joins any group.
        pool = self.service.pool  # used on this loop only
        buffer = None if self.role == Role.AUX else pool.take(self.total)[:self.total]
        snapshot = None if buffer is None else asyncio.ensure_future(run_in_thread(self._flatten, buffer))
        self.forming = True
        try:
            formed = await self.matchmaker.form_group(key, window,
                                                      (self.bandwidth, self.download_bandwidth), metadata=gather,
                                                      target=target, ready=snapshot, members=members,
                                                      no_shows=no_shows)
        finally:
            self.forming = False
            _discard(snapshot)
        group = formed.group
        gathered = {str(p): m for p, m in zip(group.peers, formed.metadata, strict=True)}
        if proceed is not None and not proceed(gathered):
            if buffer is not None and snapshot is not None and snapshot.done():
                pool.give(buffer)  # (one still being written by its thread is left to the GC)
            return StepResult(len(group.peers), [str(p) for p in group.peers], gathered, key, skipped=True)
        self._phase = "allreduce"
        me = group.peers.index(self.transport.peer_id)
        vector = None if snapshot is None or group.roles[me] == Role.AUX else snapshot.result()
        sealed: dict[int, list[SealedBlock]] | None = {} if self.keep_sealed else None
        if self.powersgd is None:
            stats = TransferStats(pace=self.bandwidth if self._configured else None)
            claims = tuple(claim_digest(m) for m in formed.metadata)
            # (verified training's accusations locate blocks by the default chunk: it keeps that)
            chunk = CHUNK_ELEMENTS if self.keep_sealed else \
                chunk_elements(formed.bandwidths, self.codec.wire_bytes, max(group.part_sizes))
            try:
                result, contributors = await self.service.run(
                    group, vector, weight, self.codec, self.allreduce_timeout, sender_timeout=self.sender_timeout,
                    stats=stats, aggregation=self.aggregation, suspicion=self.suspicion, claims=claims, sealed=sealed,
                    chunk=chunk)
            finally:
                stats.unpace()
            self._measure(stats)
            if result is not None:
                await run_in_thread(self._assign, result)
                pool.give(result)
            if vector is not None and me in contributors:
                pool.give(vector)  # every reducer used all of it: no write of it is still queued
        else:
            grads = None if vector is None else self._split(vector)
            parts, contributors = await powersgd_allreduce(self.service, group, self.powersgd, grads, weight,
                                                           self.codec, self.allreduce_timeout,
                                                           sender_timeout=self.sender_timeout)
            if parts is not None:
                await run_in_thread(self._assign, torch.cat([p.reshape(-1) for p in parts]))
        if me != 0 and 0 not in contributors and group.roles[0] != Role.AUX and not self._reached_us(group, 0):
            self.matchmaker.hold_against(group.peers[0], "formed a group it took no part in")
        self._advance(me, group.group_id)
        await self._announce_after_step()
        return StepResult(len(group.peers), [str(p) for p in group.peers], gathered, key,
                          [str(group.peers[i]) for i in contributors], group=group if sealed is not None else None,
                          sealed={str(group.peers[i]): blocks for i, blocks in (sealed or {}).items()})

    def _reached_us(self, group: Group, sender: int) -> bool:
        """Whether `sender`'s piece reached one of our reducers whole in `group`'s step, just
        finished: then it took part, whatever other reducers reported (one that reported it
        missing, a lie or not, would otherwise make us shun an honest leader for an hour)."""
        tombstone = self.service.finished.get(group.group_id)
        return tombstone is not None and any(sender in got for got in tombstone.state.received.values())

    # -- state for newcomers ------------------------------------------------------------------------
    def _get_state(self) -> tuple[int, Any, list[torch.Tensor]]:
        served = self._tensors if self.served_tensors is None else self.served_tensors
        return self.round, self.state_metadata, served  # called under self._lock

    async def _announce_after_step(self) -> None:
        """Announce our state after a step: the first time before the step returns (newcomers then
        find us), later without holding the step up, as a DHT store takes round trips (0.1 s of a
        3.7 s round over 50 ms links) and the record of the step before stands meanwhile. One store
        at a time; one asked for meanwhile follows it, with the round of then."""
        if self.state_server is None:
            return
        if not self._announced:
            self._announced = True
            await self.announce_state()
            return
        self._announce_asked = True
        if self._announcing is None or self._announcing.done():
            self._announcing = asyncio.ensure_future(self._announce_while_asked())

    async def _announce_while_asked(self) -> None:
        while self._announce_asked:
            self._announce_asked = False
            await self.announce_state()

    async def announce_state(self) -> None:
        """Tell the DHT that newcomers can download our state (done after every step)."""
        if self.state_server is None or not self.transport.addresses:
            return  # nobody could dial us for it (client mode without a relay)
        record = DonorRecord(self.round)
        try:
            await self.peer.dht.astore(self.names.donors, record.to_wire(),
                                       self.peer.dht.get_time() + STATE_RECORD_TTL,
                                       subkey=own_subkey(self.transport.peer_id))
        except Exception as e:  # noqa: BLE001 - announcing is best effort; the next step retries
            logger.debug("could not announce state: %s", e)

    def load_state_from_peers(self, timeout: float | None = None, *, vouched: Collection[PeerID] | None = None,
                              check: ManifestCheck | None = None, elect: Election | None = None) -> tuple[int, Any]:
        """Download the state most donors agree on (in parallel, verified by hash) into this
        averager's tensors; returns (version, metadata). Raises AveragingError if none can."""
        timeout = timeout or self.allreduce_timeout
        return self.peer.run(self.aload_state_from_peers(timeout, vouched=vouched, check=check, elect=elect),
                             timeout + 5)

    async def aload_state_from_peers(self, timeout: float | None = None, *,
                                     vouched: Collection[PeerID] | None = None,
                                     check: ManifestCheck | None = None,
                                     elect: Election | None = None) -> tuple[int, Any]:
        """The async twin of `load_state_from_peers`. `timeout` covers reading the donors from the
        DHT and the download. Donors may lie (docs/security.md): `vouched`, if given, are the only
        donors counted (e.g. the live peers of a progress view), `check` refuses a donor's
        manifest by raising ValueError (e.g. an epoch beyond what that view supports), and `elect`
        chooses among donors that disagree (or refuses to: the download then fails), e.g. by what
        the caller can verify they contributed; without it, the state the most donors agree on."""
        timeout = timeout or self.allreduce_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with compat.timeout_at(deadline):
                found = await self.peer.dht.aget(self.names.donors, latest=True)
        except TimeoutError:
            raise AveragingError(f"could not read the donors of {self.names.donors!r} within {timeout} s") from None
        donors = read_donors(found, self.transport.peer_id)
        if not donors:
            raise AveragingError(f"no peer offers the state of {self.names.donors!r} yet")
        left = deadline - loop.time()
        if left <= 0:
            raise AveragingError(f"no time left to download the state within {timeout} s")
        # Straight into our tensors, chunk by chunk once verified: no second copy of the state.
        # A failed download leaves them partly overwritten, so meanwhile we offer them to nobody.
        with self.state_server.replacing() if self.state_server is not None else contextlib.nullcontext():
            newest_first = sorted(donors, key=lambda p: (-donors[p], str(p)))
            version, metadata, _ = await download_state(self.transport, newest_first, self.names, left,
                                                        into=self._tensors, lock=self._lock,
                                                        vouched=vouched, check=check, elect=elect)
            for state in self.powersgd or ():
                state.reset()  # its residual belonged to the tensors just replaced
            self.round, self.state_metadata = version, metadata
        return version, metadata

    def set_grid(self, grid: Sequence[int], coordinates: Sequence[int] | None = None, round: int = 0) -> None:
        """Average on a Moshpit grid from now on (see the class docstring), at `round` (its
        dimension is round % len(grid)); random coordinates (from the peer id) unless given."""
        self.grid = tuple(int(m) for m in grid)
        if not self.grid or min(self.grid) < 1:
            raise ValueError(f"a grid needs at least one dimension, each of size 1 or more, not {grid}")
        rng = random.Random(self.transport.peer_id.to_bytes() + repr(self.grid).encode())
        self.coordinates = list(coordinates) if coordinates is not None else [rng.randrange(m) for m in self.grid]
        if len(self.coordinates) != len(self.grid):
            raise ValueError("coordinates must have one entry per grid dimension")
        self.round = round

    # -- helpers ------------------------------------------------------------------------------------
    def _group_key(self) -> str:
        if self.grid is None:
            return "all"
        dim = self.round % len(self.grid)
        fixed = ".".join(str(c) for i, c in enumerate(self.coordinates) if i != dim)
        shape = "x".join(str(m) for m in self.grid)  # peers on another grid never meet ours
        return f"{shape}.d{dim}:{fixed}"

    def _advance(self, my_index: int, group_id: bytes) -> None:
        """Moshpit: take a new coordinate along this round's dimension: my place in the group,
        rotated by an offset drawn from the group id, so that groups smaller than the grid leave
        their gaps in different cells instead of always the last ones."""
        if self.grid is not None:
            dim = self.round % len(self.grid)
            offset = int.from_bytes(hashlib.sha256(group_id).digest()[:4], "little")
            self.coordinates[dim] = (my_index + offset) % self.grid[dim]
        self.round += 1

    def _flatten(self, vector: torch.Tensor) -> torch.Tensor:
        """The local tensors as one float32 host vector, written into `vector` (from any device,
        any float dtype); AveragingError if any holds NaN or infinity (a non-finite contribution
        would be refused by every codec; better not to join at all)."""
        with self._lock:
            gather_into(self._tensors, vector)
            # One pass: a finite sum proves every value finite; only a non-finite sum (NaN, inf,
            # or an overflow of huge finite values) needs the exact check.
            if not torch.isfinite(vector.sum()):
                for i, part in enumerate(self._split(vector)):
                    if not all_finite(part):
                        raise AveragingError(f"local tensor {i} holds NaN or infinity (or values beyond "
                                             f"float32); not averaging it")
        return vector

    def _split(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector shaped like the tensors."""
        views, offset = [], 0
        for t in self._tensors:
            views.append(vector[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        return views

    def _assign(self, vector: torch.Tensor) -> None:
        """Copy the averaged host vector into the tensors (on their device, in their dtype);
        returns once `vector` may be reused."""
        with self._lock:
            scatter_from(vector, self._tensors)

    def _measure(self, stats: TransferStats) -> None:
        """Update this peer's upload and download estimates from the step just done.

        Upload: bytes other peers received from us over the time ours were on their way
        (`TransferStats.upload`: over TCP, the bytes they acknowledged). Download: bytes
        received from other peers over the time at least one of their chunks was arriving
        (`TransferStats.download`). Time spent waiting for slower peers is not counted, so each
        peer measures its own link, and the load split can tell slow peers from fast ones, and
        a slow download from a slow upload. A configured bandwidth stands for both and is never
        changed.
        """
        if self._configured:
            return
        if stats.delivered_bytes >= MIN_MEASURED_BYTES and stats.upload is not None:
            self.bandwidth = _smoothed(self.bandwidth, stats.upload, self._measured)
            self._measured = True
        if stats.received_bytes >= MIN_MEASURED_BYTES and stats.download is not None:
            self.download_bandwidth = _smoothed(self.download_bandwidth, stats.download, self._measured_download)
            self._measured_download = True

    def shutdown(self) -> None:
        """Stop serving this averager's matchmaking and state."""
        self.matchmaker.close()
        self._announce_asked = False
        _discard(self._announcing)  # (it would announce a state nobody serves any more)
        if self.state_server is not None:
            self.state_server.close()
            self.state_server = None  # (it calls back into us: a cycle only the GC would free)


def _smoothed(estimate: float, measured: float, seen: bool) -> float:
    """The new estimate: the first measurement as it is, later ones blended in."""
    return (1 - BANDWIDTH_SMOOTHING) * estimate + BANDWIDTH_SMOOTHING * measured if seen else measured


def _discard(task: asyncio.Future | None) -> None:
    """Cancel an unused helper task and mark its outcome as seen."""
    if task is not None and not task.done():
        task.cancel()
    if task is not None:
        task.add_done_callback(retrieve_exception)


def _schema(tensors: list[torch.Tensor], settings: dict) -> str:
    """Peers average together only if shapes, dtypes, compression and aggregation agree."""
    description = repr(([(str(t.dtype), tuple(t.shape)) for t in tensors], sorted(settings.items())))
    return hashlib.sha256(description.encode()).hexdigest()[:32]


def moshpit_grid(peers: int, max_group: int = MOSHPIT_MAX_GROUP) -> tuple[int, ...]:
    """A Moshpit grid for a swarm of `peers`: the fewest dimensions (two at least, from four
    peers on) whose groups stay within `max_group`; d rounds of groups of about peers^(1/d) then
    reach the exact mean. Below four peers, one dimension: the whole swarm is one group."""
    if peers < 4:
        return (max(1, peers),)
    dims = max(2, math.ceil(math.log(peers) / math.log(max_group) - 1e-9))
    side = math.ceil(peers ** (1 / dims) - 1e-9)
    return (side,) * dims


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_window(matchmaking_time: float) -> float:
    """`matchmaking_time`, if DHT nodes keep a declaration that long; else ValueError."""
    if not 0 < matchmaking_time <= DECLARATION_MAX_TTL:
        raise ValueError(f"matchmaking_time must be in (0, {DECLARATION_MAX_TTL:.0f}] seconds (DHT nodes refuse "
                         f"declarations that live longer), got {matchmaking_time}")
    return matchmaking_time
