"""`AllReduceRun`: one member's side of one all-reduce step.

As a sender it streams its piece of every shard to that shard's reducer and writes the averaged
chunks that come back into its result; as a reducer it runs the `ShardReducer` of its own shard
(and of shards the coordinator moves to it); it follows the coordinator's decisions (running the
`Coordinator` itself while it coordinates) and, once it holds every shard final, checks one
random block of every other reducer's work. Reducers send an early FINAL as they report (see
reducer.py): holding one of every shard over the same senders, a member checks them while the
coordinator decides, and a decision that names those senders finds it final and its checks on
their way. As reducer it tells the coordinator whose checks it answered, and the coordinator
commits once every member's are (two one-way trips after the decision instead of five: the
FINALs, the check's round trip, the word of it); a member finishes its checks before it returns
the result. It reaches the network through `RunService`, which the all-reduce service implements.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from potluck.averaging.accountability import (
    VERIFY_BLOCK,
    BanList,
    SealedBlock,
    block_digests,
    chunk_digest,
    final_message,
    piece_root,
    result_root,
    seal_message,
    sealed_block,
    shard_digest,
)
from potluck.averaging.allreduce.buffers import BufferPool
from potluck.averaging.allreduce.coordinator import Coordinator
from potluck.averaging.allreduce.group import Group
from potluck.averaging.allreduce.messages import (
    MemberState,
    Outcome,
    PartRequest,
    PieceBlock,
    PieceSeal,
    PiecesReply,
    ResultFinal,
    SignedFinal,
    SyncReply,
    VerifyRequest,
    parse_result,
)
from potluck.averaging.allreduce.reducer import ShardReducer, reduce_aside, runs_aside
from potluck.averaging.allreduce.reduction import (
    as_received,
    decode_chunk,
    encode_received,
    encodes_blocks_alone,
    reduce_chunk,
    wire_form,
)
from potluck.averaging.allreduce.transfer_stats import TransferStats, payload_bytes
from potluck.averaging.role import Role
from potluck.core import compat
from potluck.core.errors import AveragingError, NetworkError, PotluckError, RemoteError
from potluck.core.runner import retrieve_exception
from potluck.net.connection import Stream
from potluck.net.identity import PeerID

__all__ = ["CHUNK_ELEMENTS", "REGISTRATION_WAIT", "SENDER_TIMEOUT", "SYNC_CALLS", "AllReduceRun", "Pieces",
           "RunService", "chunk_elements"]

logger = logging.getLogger(__name__)

# Elements per streamed chunk: 1 MiB of float32 pipelines well and amortizes per-message cost.
CHUNK_ELEMENTS = 2**18
# On slow links a group streams smaller chunks (`chunk_elements`), down to this many (a power of two,
# a multiple of accountability.VERIFY_BLOCK): a reducer sends a chunk's result only once every
# piece of it is in, so the round's last result crawls out at a link's share of the uplink after
# the last piece came, and a chunk that takes at most CHUNK_SECONDS there keeps that tail short.
# 1 MiB at a sixth of 100 Mbit/s took 0.5 s of a 3.7 s round; 256 KiB cut the round by 0.2 s
# (benchmarks/wan.py). Not smaller everywhere: on loopback, 4x the chunks cost 35% more CPU.
MIN_CHUNK_ELEMENTS = 2**14
CHUNK_SECONDS = 0.15
# A reducer sends a chunk's result once all its pieces are in: a shard in one chunk is not
# pipelined at all. 1M floats in 8 bits over 50 ms, 100 Mbit/s links: 0.37 s a round in one
# chunk per shard, 0.33 s in four (benchmarks/wan.py).
PIPELINE_CHUNKS = 3
# A sender that sends nothing for this long is excluded (it stalled or died silently).
SENDER_TIMEOUT = 10.0
# Streams may arrive before this peer has started the same step; they wait this long for it.
REGISTRATION_WAIT = 10.0
# Calls to the coordinator a member keeps open. Its state changes several times a round trip as
# the last results and checks come in, and each change goes out at once in a new call; the answer
# to an earlier one (a decision) may be on its way: cancelling it, as members did, lost it, and
# over 50 ms WAN links decisions and commits arrived 50-110 ms late (benchmarks/wan.py).
SYNC_CALLS = 8

# A reducer's answer to a check: sender -> (weight, its chunk digests, the block digests of the
# chunk checked, the values of the blocks checked, its seal of the piece).
Pieces = dict[int, tuple[float, list[bytes], list[bytes], torch.Tensor, bytes]]


def chunk_elements(bandwidths: Sequence[tuple[float, float]], wire_bytes: float = 4.0,
                   shard: int | None = None) -> int:
    """Elements per chunk for a group whose members declared these (upload, download) bytes/s
    (`FormedGroup.bandwidths`: every member has the same, so every member picks the same): the
    largest power of two up to CHUNK_ELEMENTS whose bytes on the wire (`wire_bytes` an element:
    the group's codec's `Codec.wire_bytes`) cross the slowest member's share of its link (one of
    the 2 x (N - 1) flows of a round) within CHUNK_SECONDS, and that cuts the largest `shard` in
    at least PIPELINE_CHUNKS. Under 4 bits, up to 8x the float32 chunk: each chunk costs both
    ends CPU for its messages, digests and calls of the codec."""
    if len(bandwidths) < 2:
        return CHUNK_ELEMENTS
    share = min(min(up, down) for up, down in bandwidths) / (2 * (len(bandwidths) - 1))
    chunk = CHUNK_ELEMENTS
    while chunk > MIN_CHUNK_ELEMENTS and (wire_bytes * chunk > share * CHUNK_SECONDS
                                          or shard is not None and PIPELINE_CHUNKS * chunk > shard):
        chunk //= 2
    return chunk


class RunService(Protocol):
    """What a member's run asks of the all-reduce service: streams and calls to other members
    of its group, this peer's ban list, and its signature."""

    banned: BanList

    async def open(self, run: AllReduceRun, reducer: int, request: PartRequest) -> Stream:
        """A stream to `reducer`'s part handler (to this member itself, through the loopback)."""

    async def sync(self, run: AllReduceRun, coordinator: int) -> SyncReply:
        """Wait for `coordinator`'s next decision, telling it where this member stands."""

    async def query(self, run: AllReduceRun, member: int, timeout: float) -> MemberState | None:
        """Where `member` stands in the step (None: it has no such step)."""

    async def pieces(self, run: AllReduceRun, reducer: int, shard: int, where: tuple[int, int, int],
                     sizes: tuple[int, int], numel: int, version: int) -> Pieces:
        """`reducer`'s pieces of blocks of a chunk of `shard` (see `AllReduceService.pieces`)."""

    def sign(self, message: bytes) -> bytes:
        """This peer's signature of `message`."""

    def lapsed(self, peer: PeerID, why: str) -> None:
        """`peer` cost a step of ours time as a sender, `why` (see `averaging.lapses`)."""


class AllReduceRun:
    """One member's part in one all-reduce step."""

    def __init__(self, service: RunService, group: Group, me: int, vector: torch.Tensor | None,
                 weight: float, codec: Any, timeout: float, sender_timeout: float = SENDER_TIMEOUT,
                 chunk: int = CHUNK_ELEMENTS, stats: TransferStats | None = None, pool: BufferPool | None = None,
                 aggregation: str = "mean", suspicion: Any = None, claims: tuple[bytes, ...] | None = None,
                 sealed: dict[int, list[SealedBlock]] | None = None):
        self.service = service
        self.group = group
        self.me = me
        self.role = group.roles[me]
        self.abstain = vector is None or not math.isfinite(weight) or weight < 0
        if self.role != Role.AUX and vector is not None and vector.numel() != group.total:
            raise AveragingError(f"local vector has {vector.numel()} elements, the group expects {group.total}")
        self.vector = vector
        self.weight = 0.0 if self.abstain else float(weight)
        self.codec = codec
        self.aggregation = aggregation  # how my reducers combine pieces; the group agreed on it
        self.suspicion = suspicion  # my averager's record of members' deviations (averaging.suspicion)
        self.chunk = chunk
        self.sender_timeout = sender_timeout
        self.stats = stats if stats is not None else TransferStats()
        self.pool = pool if pool is not None else BufferPool()
        self.refused: str | None = None  # why the codec refused my own data (I then abstain)
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout
        self.result = self.pool.take(group.total)[:group.total] if self.role != Role.AUX else None
        self.final: set[int] = set()
        self.dead: set[int] = set()
        self.reports: dict[int, list[int]] = {}  # my shards' reports (sent with every update)
        # Accountability (see accountability.py): roots of the pieces I sent (shard -> root) and
        # of those my reducers received (shard -> sender -> root); chunk digests of the pieces my
        # reducers hold, for members that check my work; the outcome version whose results I
        # checked, and what I found: a reducer caught, or results I could not check.
        self.sent: dict[int, bytes] = {}
        self.received: dict[int, dict[int, bytes]] = {}
        self.checked = 0
        self._checking = 0
        self._early: bool | None = None  # the check of early FINALs: None not started, True under way, False done
        # shard -> (its reducer, the FINAL's version and senders, the digest of the senders' roots)
        # of each result I checked, so that a decision naming them needs no second check
        self._verified: dict[int, tuple[int, int, tuple[int, ...], bytes]] = {}
        self.finals: dict[int, SignedFinal] = {}
        self.checked_by: set[tuple[int, int, int]] = set()  # (member, shard, version) I answered a check of
        self.caught: str | None = None
        self.unverified: str | None = None
        # Digests of the members' metadata, which their seals cover (accountability.claim_digest),
        # and, if given, where to keep the sealed blocks this run's checks hold: sender -> blocks,
        # one of every shard (potluck.optim's verified mode checks them against a recomputation).
        self.claims = claims or (b"",) * len(group.peers)
        self.sealed = sealed
        self.reducers: dict[int, ShardReducer] = {}
        self.exchanges: dict[int, tuple[int, asyncio.Task]] = {}  # shard -> (reducer, task)
        self.outcome = Outcome.first({j: j for j in group.shards})
        self.state_changed = asyncio.Event()
        self.coordinator = Coordinator(self)
        self.repair_failed: str | None = None
        self.tasks: set[asyncio.Task] = set()
        self._reducer_waiters: dict[int, asyncio.Future[ShardReducer]] = {}
        for j in group.shards:
            if j == me:
                self.reducers[j] = self._new_reducer(j, None)

    def spawn(self, coro: Any) -> asyncio.Task:
        """Start a sub-task owned by this run; all are cancelled when the run ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _new_reducer(self, shard: int, exact: tuple[int, ...] | None) -> ShardReducer:
        return ShardReducer(self, self.group, shard, exact, codec=self.codec, aggregation=self.aggregation,
                            chunk=self.chunk, sender_timeout=self.sender_timeout, stats=self.stats, pool=self.pool,
                            suspicion=self.suspicion, claims=self.claims)

    async def reducer(self, shard: int) -> ShardReducer:
        """The reducer of `shard` here, waiting briefly if a decision is about to create it."""
        if shard in self.reducers:
            return self.reducers[shard]
        if shard not in self.group.shards:
            raise AveragingError(f"shard {shard} does not exist")
        waiter = self._reducer_waiters.setdefault(shard, asyncio.get_running_loop().create_future())
        try:
            async with compat.timeout(REGISTRATION_WAIT):
                return await asyncio.shield(waiter)
        except TimeoutError:
            raise AveragingError(f"shard {shard} is not reduced here") from None

    def _add_reducer(self, shard: int, senders: tuple[int, ...]) -> ShardReducer:
        red = self.reducers[shard] = self._new_reducer(shard, senders)
        red.reported = True  # a replacement does not report: it finalizes or declares the repair failed
        waiter = self._reducer_waiters.pop(shard, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(red)
        self.spawn(self._finalize_exact(red))
        return red

    # -- the member's side ------------------------------------------------------------------------
    async def run(self) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """Take part until commit; returns the averaged vector (None for aux members) and the
        members whose tensors it averages."""
        try:
            async with compat.timeout_at(self.deadline):
                if self.role != Role.AUX:
                    for j in self.group.shards:
                        self._start_exchange(j, j)
                self.coordinator.maybe_take_over()
                await self._follow_outcomes()
                if self.outcome.committed and self.role != Role.AUX and set(self.group.shards) <= self.final:
                    await self._finish_checks()
                if self.sealed is not None and not self.outcome.aborted:
                    self._seal_my_shards()  # before _close lets go of the pieces
        except TimeoutError:
            raise AveragingError("averaging step did not finish before its deadline") from None
        finally:
            self._close()
        if self.outcome.aborted:
            raise AveragingError(f"averaging step aborted: {self.outcome.aborted}")
        if self.role != Role.AUX and not set(self.group.shards) <= self.final:
            raise AveragingError("the group committed without this peer (it was presumed dead)")
        if self.role != Role.AUX and self.checked < self.outcome.version:
            raise AveragingError("the group committed before this peer checked the results")
        if self.refused is not None:
            raise AveragingError(f"this peer's tensors could not be sent ({self.refused}); "
                                 "the others averaged without them")
        if self.caught is not None or self.unverified is not None:
            raise AveragingError(f"not using this step's result: {self.caught or self.unverified}")
        return self.result, self.outcome.senders

    def _close(self) -> None:
        """Stop everything of this run and drop what could hold it in a cycle (tasks whose
        tracebacks reference its frames), so it is freed by reference counting once returned."""
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()
        self.exchanges.clear()
        for red in self.reducers.values():
            red.close()
        self.coordinator.close()
        for waiter in self._reducer_waiters.values():
            waiter.cancel()
        self._reducer_waiters.clear()

    def _start_exchange(self, shard: int, reducer: int) -> None:
        old = self.exchanges.get(shard)
        if old is not None:
            if old[0] == reducer:
                return
            old[1].cancel()
        self.exchanges[shard] = (reducer, self.spawn(self._exchange(shard, reducer)))

    async def _exchange(self, shard: int, reducer: int) -> None:
        """Send my piece of `shard` to its reducer and receive the averaged shard back."""
        start, end = self.group.bounds(shard)
        in_set = self.outcome.version == 0 or self.me in self.outcome.senders
        abstain = self.abstain or not in_set
        request = PartRequest(self.group.group_id, shard, self.me, self.weight, abstain)
        try:
            channel = await self.service.open(self, reducer, request)
            sender = self.spawn(self._send_piece(channel, shard, start, end, abstain))
            last = None  # when the previous result chunk arrived (for our download estimate)
            try:
                chunks = max(1, math.ceil((end - start) / self.chunk))
                async for raw in channel:
                    msg = parse_result(raw, chunks, len(self.group.peers))
                    if isinstance(msg, ResultFinal):
                        self._check_signature(shard, reducer, msg)
                        self._settle(shard)
                        if msg.version > 0:
                            break
                        continue  # an early FINAL: the decision ends the stream or replaces it
                    if shard in self.finals:  # the decision differs from the early FINAL: results again
                        self.finals.pop(shard)
                        self.final.discard(shard)
                    lo = start + msg.chunk * self.chunk
                    hi = min(end, lo + self.chunk)
                    self.result[lo:hi] = decode_chunk(self.codec, msg.payload, hi - lo)
                    last = self.stats.received(channel, last, payload_bytes(msg.payload))
            finally:
                sender.cancel()
        except (NetworkError, PotluckError) as e:
            if shard in self.final:
                return  # its stream ended once the result was settled (its run may be over)
            # Unreachable or sending malformed results: either way the shard must move elsewhere.
            logger.debug("exchange of shard %d with member %d failed: %s", shard, reducer, e)
            self.mark_dead(reducer)

    def _settle(self, shard: int) -> None:
        """A FINAL of `shard` came: final now if `_settles` (else the decision settles it, `apply`)."""
        if self._settles(self.finals[shard]):
            self.final.add(shard)
        self._changed()
        self._maybe_check()

    def _settles(self, final: SignedFinal) -> bool:
        """Whether `final` is final under the decision I follow: sent under a decision, or early
        over the senders the decision names."""
        out = self.outcome
        return final.version > 0 or out.version > 0 and final.senders == out.senders

    async def _send_piece(self, channel: Any, shard: int, start: int, end: int, abstain: bool) -> None:
        """Stream my piece of one shard, sealed with my signature of its root (what the reducer will
        have received), and note that root.
        If the codec refuses a chunk (NaN/inf, out of its range), I abstain: the stream ends
        early, so the reducer excludes me at once instead of waiting for the sender timeout,
        and nothing of the refused data is sent."""
        try:
            if not abstain:
                digests: list[bytes] | None = []
                for lo in range(start, end, self.chunk):
                    hi = min(end, lo + self.chunk)
                    try:
                        payload, received = encode_received(self.codec, self.vector[lo:hi])
                    except Exception as e:  # noqa: BLE001 - any codec failure: abstain, never hang
                        self._refuse(f"{type(e).__name__}: {e}")
                        break
                    await self.stats.send(channel, payload)
                    if received is None:
                        digests = None  # the reducer refuses this chunk as well: I send no root
                    elif digests is not None:
                        digests.append(chunk_digest(received))
                else:
                    if digests is not None:
                        root = piece_root(self.weight, digests)
                        seal = self.service.sign(seal_message(self.group.group_id, shard, self.me, root,
                                                              self.claims[self.me]))
                        await self.stats.send(channel, PieceSeal(seal).to_wire())
                        if shard not in self.sent:
                            self.sent[shard] = root
                            self._changed()
            await channel.close()
        except (NetworkError, PotluckError):
            pass  # the receiving side settles what it got

    def _refuse(self, reason: str) -> None:
        """My own data cannot be encoded: take no part as a sender from now on."""
        if self.refused is None:
            logger.warning("member %d abstains: its data was refused by the codec: %s", self.me, reason)
            self.refused = reason
        self.abstain = True

    def mark_dead(self, member: int) -> None:
        if member != self.me and member not in self.dead:
            self.dead.add(member)
            self.note_dead_senders((member,))
            self._changed()

    def on_lapse(self, member: int, why: str) -> None:
        self.service.lapsed(self.group.peers[member], why)

    def ban(self, member: int, evidence: str) -> None:
        """Put `member` on this peer's ban list (for a lie its own signatures or pieces prove)."""
        self.service.banned.ban(self.group.peers[member], evidence)

    async def query(self, member: int, timeout: float) -> MemberState | None:
        """Where `member` stands in this step (None: it has no such step)."""
        return await self.service.query(self, member, timeout)

    def note_dead_senders(self, members: tuple[int, ...]) -> None:
        """My reducers stop waiting for the pieces of members known dead: at once, not at the
        sender timeout."""
        for red in list(self.reducers.values()):
            for member in members:
                red.sender_died(member)

    def on_report(self, shard: int, complete: list[int]) -> None:
        logger.debug("member %d: shard %d complete senders %s", self.me, shard, complete)
        self.reports[shard] = complete
        red = self.reducers[shard]
        self.received[shard] = {s: piece_root(red.weights[s], self.chunk_digests(red, s)) for s in complete}
        self._changed()

    def chunk_digests(self, red: ShardReducer, sender: int) -> list[bytes]:
        """Digests of the chunks of `sender`'s piece that my reducer `red` holds (as sealed)."""
        return red.digests[sender]

    def sign(self, message: bytes) -> bytes:
        return self.service.sign(message)

    def sign_final(self, shard: int, senders: tuple[int, ...], version: int,
                   results: Mapping[int, torch.Tensor]) -> bytes:
        """My signature, as reducer of `shard`, of the result I send, given as receivers decode it."""
        digests = [chunk_digest(results[c]) for c in sorted(results)]
        message = final_message(self.group.group_id, shard, version, senders, result_root(digests))
        return self.service.sign(message)

    def _check_signature(self, shard: int, reducer: int, final: ResultFinal) -> None:
        """Keep the reducer's signature of the result I received, to show the coordinator; a
        signature that does not match what I received means the reducer sent me something else
        than it signed: I ban it, and the shard moves to another reducer."""
        start, end = self.group.bounds(shard)
        root = result_root([chunk_digest(self.result[lo:min(end, lo + self.chunk)])
                            for lo in range(start, end, self.chunk)])
        message = final_message(self.group.group_id, shard, final.version, final.senders, root)
        if not self.group.peers[reducer].verify(final.signature, message):
            self.ban(reducer, f"as reducer of shard {shard}, it signed a result other than the one it sent me")
            raise AveragingError(f"member {reducer}'s signature does not match its result of shard {shard}")
        self.finals[shard] = SignedFinal(final.version, final.senders, root, final.signature)

    async def _finish_checks(self) -> None:
        """The group commits once my checks are answered (`Coordinator`), perhaps before I have
        gone through the answers: I finish them before the result is used."""
        while self.checked < self.outcome.version:
            self.state_changed.clear()
            self._maybe_check()
            await self.state_changed.wait()

    def _maybe_check(self) -> None:
        """Once I hold every shard's final result under a decision, check the reducers' work;
        before any decision, once I hold an early FINAL of every shard over the same senders."""
        out = self.outcome
        if self.role == Role.AUX or out.aborted or self._early:
            return  # (the early check calls again once done)
        if out.version == 0:
            finals = [self.finals.get(j) for j in out.assignment]
            if self._early is None and finals and all(f is not None and f.senders == finals[0].senders
                                                      for f in finals):
                self._early = True
                self.spawn(self._check(Outcome(0, finals[0].senders, dict(out.assignment), False)))
        elif out.version > self._checking and set(out.assignment) <= self.final:
            self._checking = out.version
            self.spawn(self._check(out))

    async def _check(self, outcome: Outcome) -> None:
        """Recompute one random chunk of every other reducer's shard from the pieces it used,
        BTARD-style. The chunk is drawn here after the results came, so a reducer cannot know
        which of its chunks anyone checks; a reducer caught is banned, and I do not use the result.
        A result I checked already (its early FINAL) is not asked for again: its pieces' digest
        must be the decision's. Under version 0 (early FINALs), a check that cannot be done
        leaves it to the decision's."""
        early = outcome.version == 0

        async def one(shard: int, reducer: int) -> None:
            known, final = self._verified.get(shard), self.finals.get(shard)
            if known is not None and final is not None and known[:3] == (reducer, final.version, final.senders):
                if shard not in outcome.digests or known[3] == outcome.digests[shard]:
                    return
                problem: str | None = "answered with pieces other than those the senders sent"
            else:
                try:
                    problem = await self._check_shard(outcome, shard, reducer)
                except (NetworkError, PotluckError, TimeoutError) as e:
                    if not early:
                        self.unverified = f"member {reducer}'s result for shard {shard} could not be checked: {e}"
                    return
            if problem is not None:
                self.caught = f"member {reducer} ({self.group.peers[reducer]}) {problem}"
                self.ban(reducer, f"as reducer of shard {shard}, it {problem}")
        try:
            await asyncio.gather(*(one(j, r) for j, r in sorted(outcome.assignment.items()) if r != self.me))
        finally:
            if early:
                self._early = False
        if early:
            self._maybe_check()  # a decision may have come meanwhile
            return
        self.checked = max(self.checked, outcome.version)
        self._changed()

    async def _check_shard(self, outcome: Outcome, shard: int, reducer: int) -> str | None:
        """What is wrong with `reducer`'s result of a random block of `shard` (None: nothing)."""
        start, end = self.group.bounds(shard)
        chunks = max(1, math.ceil((end - start) / self.chunk))
        c = secrets.randbelow(chunks)
        lo, hi = start + c * self.chunk, min(end, start + (c + 1) * self.chunk)
        blocks = math.ceil((hi - lo) / VERIFY_BLOCK)
        alone = encodes_blocks_alone(self.codec)  # every aggregation reduces a block alone
        first, count = (secrets.randbelow(blocks), 1) if alone else (0, blocks)
        lo, hi = lo + first * VERIFY_BLOCK, min(hi, lo + (first + count) * VERIFY_BLOCK)
        final = self.finals.get(shard)
        if final is None:
            raise AveragingError(f"no FINAL of shard {shard} here to check")
        mine = self.result[lo:hi].clone()  # as signed (a decision may bring other results meanwhile)
        pieces = await self.service.pieces(self, reducer, shard, (c, first, count), (chunks, blocks), hi - lo,
                                           final.version)
        where = f"chunk {c}, block {first}"
        if tuple(sorted(pieces)) != outcome.senders:
            return f"answered with the pieces of members {sorted(pieces)}, not of {list(outcome.senders)}"
        sealed = {s: SealedBlock(shard, s, c, first, lo, w, tuple(digests), tuple(blocks_of_c), piece, seal)
                  for s, (w, digests, blocks_of_c, piece, seal) in pieces.items()}
        for s, block in sealed.items():
            why = sealed_block(self.group, self.claims[s], block)
            if why is not None:
                return f"answered with a piece of member {s} it cannot show member {s} sent ({where}: {why})"
        roots = {s: piece_root(w, digests) for s, (w, digests, _, _, _) in pieces.items()}
        if shard in outcome.digests and shard_digest(roots) != outcome.digests[shard]:
            return f"answered with pieces other than those the senders sent ({where})"
        if self.me in roots and shard in self.sent and roots[self.me] != self.sent[shard]:
            return f"answered with a piece of mine other than the one I sent ({where})"
        out = torch.empty(hi - lo)
        weights = {s: w for s, (w, _, _, _, _) in pieces.items()}
        values = {s: {c: p} for s, (_, _, _, p, _) in pieces.items()}
        if runs_aside(self.aggregation, (hi - lo) * len(pieces)):  # (robust reductions use no scratch)
            await reduce_aside(self.aggregation, values, weights, outcome.senders, c, out, out)
        else:
            reduce_chunk(self.aggregation, values, weights, outcome.senders, c, out, torch.empty(hi - lo))
        expected = as_received(self.codec, out)
        if not torch.equal(expected, mine):
            error = (expected - mine).abs().max().item()
            return f"sent a result that is not what its pieces reduce to ({where}: off by up to {error:.3g})"
        self._keep_sealed(sealed.values())
        self._verified[shard] = (reducer, final.version, final.senders, shard_digest(roots))
        return None

    def _keep_sealed(self, blocks: Iterable[SealedBlock]) -> None:
        if self.sealed is not None:
            for block in blocks:
                self.sealed.setdefault(block.sender, []).append(block)

    def _seal_my_shards(self) -> None:
        """Keep a random block of every sender's piece of the shards I reduced (my own checks
        fetched one of every other shard)."""
        for shard, red in self.reducers.items():
            if red.final_senders is None or self.outcome.assignment.get(shard) != self.me:
                continue
            c = secrets.randbelow(red.chunks)
            lo, hi = red.chunk_range(c)
            first = secrets.randbelow(math.ceil((hi - lo) / VERIFY_BLOCK))
            values = slice(first * VERIFY_BLOCK, min(hi - lo, (first + 1) * VERIFY_BLOCK))
            start = self.group.bounds(shard)[0] + lo + first * VERIFY_BLOCK
            self._keep_sealed(
                SealedBlock(shard, s, c, first, start, red.weights[s], tuple(red.digests[s]),
                            tuple(block_digests(red.pieces[s][c])), red.pieces[s][c][values].clone(), red.seals[s])
                for s in red.final_senders if s in red.seals)

    def answer_check(self, request: VerifyRequest) -> PiecesReply:
        """My pieces of the blocks `request` names, of a shard I finalized, with the digests that
        bind them to what their senders sent, for the member that checks my work as a reducer
        (once per result and member: a check costs me no more than it costs the checker)."""
        red = self.reducers.get(request.shard)
        c = request.chunk
        if red is None or red.final_senders is None or c >= red.chunks:
            raise AveragingError("no final result of that chunk here")
        if request.version != red.final_version:
            raise AveragingError(f"the FINAL of shard {red.shard} here is of version {red.final_version}, "
                                 f"not {request.version}")
        lo, hi = red.chunk_range(c)
        blocks = math.ceil((hi - lo) / VERIFY_BLOCK)
        first, count = request.first, request.count
        if first >= blocks:
            raise request.refuse(f"'b' must be an integer in [0, {blocks})")
        if count > blocks - first:
            raise request.refuse(f"'k' must be an integer in [1, {blocks - first + 1})")
        checked = (request.member, red.shard, red.final_version)
        if checked in self.checked_by:
            raise AveragingError("this member checked that result already")  # one check each: no amplification
        self.checked_by.add(checked)
        self._changed()  # the coordinator may commit once every check is answered
        values = slice(first * VERIFY_BLOCK, (first + count) * VERIFY_BLOCK)
        whole = red.payloads is not None and first == 0 and count == blocks  # the sender's own payload

        def form(s: int) -> tuple[Any, bool]:
            return (red.payloads[s][c], True) if whole else wire_form(self.codec, red.pieces[s][c][values])
        return PiecesReply(tuple(
            PieceBlock(s, red.weights[s], tuple(self.chunk_digests(red, s)), tuple(block_digests(red.pieces[s][c])),
                       *form(s), red.seals[s]) for s in red.final_senders))

    def on_repair_failed(self, shard: int, missing: list[int]) -> None:
        self.repair_failed = f"shard {shard} lost senders {missing} during repair"
        self._changed()

    def _changed(self) -> None:
        self.state_changed.set()
        self.coordinator.poke()

    def state(self) -> MemberState:
        """What I know, for the coordinator."""
        return MemberState(self.me, tuple(sorted(self.dead)), {j: tuple(c) for j, c in self.reports.items()},
                           tuple(sorted(self.final)), self.outcome.version, self.outcome, self.repair_failed,
                           dict(self.sent), dict(self.received), self.checked, dict(self.finals), self._answered())

    def _answered(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Whose checks of my shards' FINALs I answered: shard -> (the FINAL's version, members)."""
        return {j: (red.final_version, tuple(sorted(m for m, s, v in self.checked_by
                                                    if s == j and v == red.final_version)))
                for j, red in self.reducers.items() if red.final_senders is not None}

    async def _follow_outcomes(self) -> None:
        """Send my state to the coordinator and apply its decisions until commit or abort. A change
        of my state sends it again, without dropping the calls before it (SYNC_CALLS)."""
        calls: list[tuple[int, asyncio.Future]] = []  # (coordinator, call) under way, the newest last
        try:
            while True:
                retry = False
                for entry in [e for e in calls if e[1].done()]:
                    calls.remove(entry)
                    if not entry[1].cancelled():
                        retry = self._take_reply(*entry) or retry
                if self.outcome.committed or self.outcome.aborted:
                    return
                if retry:
                    await asyncio.sleep(0.05)  # it has not yet seen what we saw; ask again shortly
                    continue
                coordinator = self.current_coordinator()
                if coordinator is None:
                    self.outcome.aborted = "no coordinator left alive"
                    return
                keep = [e for e in calls if e[0] == coordinator != self.me][1 - SYNC_CALLS:]
                for entry in calls:
                    if entry not in keep:
                        entry[1].cancel()
                calls = keep
                self.state_changed.clear()
                if coordinator == self.me:
                    self.coordinator.update(self.state())
                    call = asyncio.ensure_future(self.coordinator.wait_newer(self.outcome.version, self.dead))
                else:
                    call = asyncio.ensure_future(self.service.sync(self, coordinator))
                call.add_done_callback(retrieve_exception)  # (one superseded and cancelled holds none)
                calls.append((coordinator, call))
                changed = asyncio.ensure_future(self.state_changed.wait())
                try:
                    await asyncio.wait([c for _, c in calls] + [changed], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
        finally:
            for _, call in calls:
                call.cancel()

    def _take_reply(self, coordinator: int, call: asyncio.Future) -> bool:
        """Apply the answer of a call to `coordinator`; True if it should be asked again shortly."""
        error = call.exception()
        if error is None:
            reply = call.result()
            if coordinator != self.me and not reply.outcome.decided_by(self.group, coordinator):
                # Its own signature on each decision is what lets a coordinator that takes
                # over carry them on; one without it cannot be shown to anyone.
                self.ban(coordinator, "as coordinator, it sent a decision it had not signed")
                self.mark_dead(coordinator)
                return False
            for member in reply.dead:
                self.mark_dead(member)
            self.apply(reply.outcome)
            return False
        if isinstance(error, RemoteError):
            return True
        if isinstance(error, NetworkError):
            self.mark_dead(coordinator)
            return False
        # A new error: raising the stored one would tie its traceback (this frame) to the call
        # that stores it, a cycle holding the whole run.
        raise AveragingError(f"coordination failed: {error}") from error

    def current_coordinator(self) -> int | None:
        for i in self.group.coordinators():
            if i not in self.dead:
                return i
        return None

    def apply(self, outcome: Outcome) -> None:
        """Adopt a newer decision: finalize my shards, and follow shards that moved."""
        terminal = outcome.committed or outcome.aborted
        if outcome.version < self.outcome.version and not terminal:
            return
        previous = self.outcome
        self.outcome = outcome
        proof = outcome.equivocation
        if proof is not None and proof.holds(self.group):
            self.ban(proof.reducer, f"as reducer of shard {proof.shard}, it signed two different results of it")
        if outcome.aborted:
            return
        if not terminal and outcome.version != previous.version:
            for shard, reducer in outcome.assignment.items():
                if reducer == self.me:
                    red = self.reducers.get(shard)
                    if red is None:
                        self._add_reducer(shard, outcome.senders)
                    elif red.exact is None:
                        red.finalize(outcome.senders, outcome.version)
                if self.role != Role.AUX and previous.assignment.get(shard) != reducer:
                    self.final.discard(shard)
                    self.finals.pop(shard, None)
                    self._start_exchange(shard, reducer)
        # The decision (or the commit, which may come first: `Coordinator`) names the early FINALs' senders.
        settled = {j for j, f in self.finals.items() if self._settles(f)}
        if not settled <= self.final:
            self.final |= settled
            self._changed()
        if not terminal:
            self._maybe_check()

    async def _finalize_exact(self, red: ShardReducer) -> None:
        """A replacement reducer: wait for every sender of S*, then reduce and send FINAL."""
        senders = red.exact
        while red.final_senders is None:
            if set(senders) <= red.complete and not red.finalizing:
                red.finalize(senders, self.outcome.version)
                if red.final_senders is None:  # reducing in a worker thread: FINAL sets `changed`
                    red.changed.clear()
                    await red.changed.wait()
            elif red.failed & set(senders):
                self.on_repair_failed(red.shard, sorted(red.failed & set(senders)))
                return
            else:
                red.changed.clear()
                await red.changed.wait()
