"""`ShardReducer`: one shard's reduction on the member that reduces it.

It reads each sender's stream of pieces, averages a chunk as soon as every expected sender's
piece of it is in, and streams the results back on the same streams. As it reports, it sends an
early FINAL (version 0) over the senders it reports complete: the decision usually names exactly
those, and receivers then hold a final result, checked, by the time it comes. Once told the
decided senders, it confirms the early FINAL (ends the streams) or recomputes what was reduced
over others and sends FINAL under the decision. It reports to the member it runs on through
`ReducerHost`, which that member implements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from potluck.averaging.accountability import chunk_digest, piece_root, seal_message
from potluck.averaging.allreduce.buffers import BufferPool
from potluck.averaging.allreduce.group import Group
from potluck.averaging.allreduce.messages import PieceSeal, ResultChunk, ResultFinal
from potluck.averaging.allreduce.reduction import (
    as_received,
    blatant_senders,
    decode_chunk,
    encode_received,
    encodes_blocks_alone,
    reduce_chunk,
)
from potluck.averaging.allreduce.transfer_stats import TransferStats, payload_bytes
from potluck.averaging.suspicion import SuspicionLedger
from potluck.core.errors import AveragingError, DeadlineExceeded, EndOfStream, NetworkError, PotluckError
from potluck.core.runner import retrieve_exception

__all__ = ["ReducerHost", "ShardReducer", "drain_quietly"]

logger = logging.getLogger(__name__)

# One thread, shared by every reducer of the process, computes the robust reductions. It is
# enough: a reducer's chunks come one after another, and its loop serves streams meanwhile. And
# one thread keeps one malloc arena for CenteredClip's scratch: spread over the default pool's
# threads, each thread's arena kept its own freed scratch (docs/benchmarks.md, the soak).
_REDUCTIONS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="potluck-reduce")
# Robust work on at most this many elements in all (a shard's pieces from every sender, or the
# blocks of one check) stays on the event loop: a few milliseconds (for 4 x 32K floats,
# CenteredClip 1.8 ms and the record of deviations 2.5 ms). In a thread, each of its many small
# tensor ops hands the GIL to the loop, which, busy with the round's messages, keeps it for up to
# the switch interval (5 ms) before giving it back: during rounds of the demo's CNN on loopback
# (4 x 10K floats), a reducer's report came 31 ms (median) after its last piece with the
# reduction and the record in the thread, 3 ms with them on the loop (beside a busy Python
# thread, a reduction of 3 ms in another thread takes seconds). Above it, the work itself
# dominates, and the loop must keep serving streams meanwhile.
INLINE_ELEMENTS = 1 << 17


# A sender still sending once at least half of the senders are settled gets this many times as
# long as they took, plus STRAGGLER_GRACE, before it is left out of the step (it still receives
# the result, and its lapse is remembered: averaging.lapses). A seated member that trickles its
# pieces (a chunk just inside SENDER_TIMEOUT) or never connects otherwise held every step up to the
# sender timeout per chunk, round after round. Honest links up to 8x slower than the others still
# count; the grace covers members that start late (the group reaches them a trip apart) and a
# loaded host's scheduling.
STRAGGLER_FACTOR = 8.0
STRAGGLER_GRACE = 5.0


def runs_aside(aggregation: str, elements: int) -> bool:
    """Whether robust work on `elements` in all goes to the reductions' thread (INLINE_ELEMENTS)."""
    return aggregation != "mean" and elements > INLINE_ELEMENTS


async def reduce_aside(*args: Any) -> dict[int, float]:
    """`reduce_chunk(*args)` in the reductions' thread (a robust reduction: milliseconds of
    tensor ops that would otherwise hold the event loop)."""
    return await asyncio.get_running_loop().run_in_executor(_REDUCTIONS, reduce_chunk, *args)


class ReducerHost(Protocol):
    """What a reducer tells the member it runs on."""

    def mark_dead(self, member: int) -> None:
        """`member` failed as a sender here in a way that shows it is gone (or never came)."""

    def on_lapse(self, member: int, why: str) -> None:
        """`member` cost this shard time as a sender (never came, stalled, trickled): see `averaging.lapses`."""

    def on_report(self, shard: int, complete: list[int]) -> None:
        """Every expected sender of `shard` is settled: these delivered their whole piece."""

    def on_repair_failed(self, shard: int, missing: list[int]) -> None:
        """`shard` cannot be reduced over the decided senders: these did not deliver."""

    def sign_final(self, shard: int, senders: tuple[int, ...], version: int,
                   results: Mapping[int, torch.Tensor]) -> bytes:
        """The member's signature of this result of `shard` (see accountability.final_message),
        given each chunk as its receivers decode it."""


class ShardReducer:
    """Reduces one shard: collects pieces, averages chunks, streams results back to senders.

    It is owned by its member's run and reaches back to it (`host`) through a weak reference (it
    only reports to it), so a finished run is freed by reference counting, never left in a cycle
    for the GC. `exact`: set for a replacement reducer, which reduces over exactly these senders.
    `suspicion`: the averager's record of its members' deviations over steps (robust aggregations):
    once every piece is in, the reducer adds them to it and reports the members it suspects,
    excluded or caught lying as not delivered, so the step averages the others (see `potluck.averaging.suspicion`).
    """

    def __init__(self, host: ReducerHost, group: Group, shard: int, exact: tuple[int, ...] | None, *, codec: Any,
                 aggregation: str, chunk: int, sender_timeout: float, stats: TransferStats, pool: BufferPool,
                 suspicion: SuspicionLedger | None = None, claims: tuple[bytes, ...] | None = None):
        self._host = weakref.ref(host)
        self.group = group
        self.shard = shard
        self.codec = codec
        self.aggregation = aggregation
        self.chunk = chunk
        self.sender_timeout = sender_timeout
        self.stats = stats
        self.pool = pool
        start, end = group.bounds(shard)
        self.size = end - start
        self.chunks = max(1, math.ceil(self.size / chunk))
        self.exact = exact
        self.expected = set(exact) if exact is not None else set(group.receivers)
        self.pieces: dict[int, list[torch.Tensor]] = {}  # sender -> its chunks, as received
        # sender -> its chunks' payloads as they came, kept where the codec scales a whole chunk
        # (uniform8, quantile8, scaled_fp16): a member that checks us needs the whole chunk, and
        # re-encoding the decoded values does not give them back exactly, so it would get them as
        # float32: 4x what the sender sent, from every sender (an 8-bit all-reduce sent 1.9x the
        # bytes of a float32 one). A payload is a quarter of the decoded chunk under 8 bits.
        self.payloads: dict[int, list[Any]] | None = \
            None if getattr(codec, "name", None) == "none" or encodes_blocks_alone(codec) \
            or getattr(codec, "stateful", False) else {}
        self.weights: dict[int, float] = {}
        self.received: dict[int, int] = {}  # sender -> chunks received
        self.digests: dict[int, list[bytes]] = {}  # sender -> its chunks' digests, once it sealed them
        self.seals: dict[int, bytes] = {}  # sender -> its signature of its piece's root
        self.claims = claims or (b"",) * len(group.peers)  # member -> digest of its metadata (its seals cover it)
        self.complete: set[int] = set()
        self.failed: set[int] = set()
        self.reduced_with: dict[int, tuple[int, ...]] = {}
        self.distances: dict[int, dict[int, float]] = {}  # chunk -> sender -> distance from its robust centre
        self.named: dict[int, str] = {}  # sender -> why it is blatantly not honest (warned once per step)
        self.suspicion = suspicion
        self.left_out: dict[int, str] = {}  # complete senders reported as not delivered, and why
        # chunk -> its result as sent, and as its receivers decode it (what FINAL signs)
        self.published: dict[int, tuple[ResultChunk, torch.Tensor | None]] = {}
        self.outboxes: dict[int, asyncio.Queue] = {}
        self.reported = False
        self.final_senders: tuple[int, ...] | None = None
        self.final_version = 0
        self.final_signature = b""
        self.confirmed = False  # a decision named the early FINAL's senders: the streams are ended
        self._decided: tuple[tuple[int, ...], int] | None = None  # a decision that came during the early FINAL
        self.closed = False
        self.changed = asyncio.Event()
        # A robust aggregation of a large shard takes tens of milliseconds (CenteredClip: 19 ms for
        # 2^18 floats from 4 senders): it runs in a worker thread, so that this peer's loop keeps
        # serving every stream meanwhile. The mean (about 1 ms a chunk), and a small shard's robust
        # aggregation (see INLINE_ELEMENTS), stay on the loop.
        self._aside = runs_aside(aggregation, self.size * len(self.expected))
        self._reducing: dict[int, asyncio.Future] = {}  # chunk -> its provisional reduction in a thread
        self._finishing: asyncio.Future | None = None  # finalize's recomputation in a thread
        self._judging: asyncio.Future | None = None  # the record of deviations' judgement in a thread
        self._serving: dict[int, tuple[Any, asyncio.Task]] = {}  # sender -> (channel, writer)
        # Pooled memory: the reduced shard (results are slices of it) and one chunk of scratch.
        self._buffers = [pool.take(self.size), pool.take(chunk)]
        self.reduced, self.scratch = self._buffers[0][:self.size], self._buffers[1]
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        self._absent_timer: asyncio.TimerHandle | None = loop.call_later(sender_timeout, self._expire_absent)
        self._straggler_timer: asyncio.TimerHandle | None = None  # see STRAGGLER_FACTOR

    @property
    def host(self) -> ReducerHost | None:
        """The member this reducer reports to (None once its run is freed)."""
        return self._host()

    def _mark_dead(self, member: int) -> None:
        host = self._host()
        if host is not None:
            host.mark_dead(member)

    def _expire_absent(self) -> None:
        """Senders that never connected are excluded like stalled ones."""
        self._absent_timer = None  # a fired handle still holds this bound method: drop the cycle
        for s in sorted(self.expected - set(self.received) - self.failed - self.complete):
            self._lapse(s, "never connected")
            self._mark_dead(s)

    def _arm_stragglers(self) -> None:
        """Once at least half of the senders are settled, give those still sending until
        STRAGGLER_FACTOR times the time the settled took, plus STRAGGLER_GRACE (later settles
        push it later)."""
        if self.exact is not None or self.reported or not self.complete \
                or 2 * len(self.complete | self.failed) < len(self.expected):
            return  # a replacement reducer waits for exactly the decided senders
        if not self.expected - self.complete - self.failed:
            self._stop_straggler_timer()
            return
        loop = asyncio.get_running_loop()
        self._stop_straggler_timer()
        took = loop.time() - self._started
        self._straggler_timer = loop.call_at(self._started + STRAGGLER_FACTOR * took + STRAGGLER_GRACE,
                                             self._cut_stragglers, took)

    def _cut_stragglers(self, took: float) -> None:
        self._straggler_timer = None  # (a fired handle holds this bound method: drop the cycle)
        late = sorted(self.expected - self.failed - self.complete)
        waited = asyncio.get_running_loop().time() - self._started
        for s in late:
            self._lapse(s, f"had not sent its piece after {waited:.1f} s, while half the senders took {took:.2f} s")
            if s not in self.received:
                self._mark_dead(s)  # no stream: it cannot take this shard's result either (as `_expire_absent`)
        self._stop_straggler_timer()  # (re-armed as each of them settled)

    def _lapse(self, sender: int, why: str) -> None:
        """Leave `sender` out of the step for costing it time (it still receives the result), and
        tell the member, which remembers it (`averaging.lapses`)."""
        host = self._host()
        if host is not None and sender not in self.failed and sender not in self.complete:
            host.on_lapse(sender, why)
        self._fail(sender, why)

    def _stop_straggler_timer(self) -> None:
        if self._straggler_timer is not None:
            self._straggler_timer.cancel()
            self._straggler_timer = None

    def _stop_timer(self) -> None:
        if self._absent_timer is not None:
            self._absent_timer.cancel()
            self._absent_timer = None
        self._stop_straggler_timer()

    def close(self) -> None:
        """The run is over: stop serving and let go of every buffer."""
        self.closed = True
        self._stop_timer()
        for task in [*self._reducing.values(), *(t for t in (self._finishing, self._judging) if t is not None)]:
            task.cancel()  # the thread itself runs on into its own buffer, which nobody reads
        self._reducing.clear()
        for channel, writer in list(self._serving.values()):
            writer.cancel()
            channel.abort("the averaging step is over here")
        self._serving.clear()
        self.outboxes.clear()
        self.pieces.clear()
        if self.payloads is not None:
            self.payloads.clear()
        self.published.clear()
        for buffer in self._buffers:
            self.pool.give(buffer)
        self._buffers.clear()

    def _live(self) -> list[int]:
        return sorted(self.expected - self.failed)

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Where chunk `c` lies in the shard."""
        return c * self.chunk, min(self.size, (c + 1) * self.chunk)

    async def serve(self, sender: int, weight: float, abstain: bool, channel: Any) -> None:
        """Handle one sender's stream: read its pieces, and send it results until FINAL."""
        if self.closed:
            raise AveragingError("the averaging step is over here")
        outbox: asyncio.Queue = asyncio.Queue()
        self.outboxes[sender] = outbox
        for c in sorted(self.published):  # a late receiver gets what was already reduced
            outbox.put_nowait(self.published[c][0])
        if self.final_senders is not None:
            outbox.put_nowait(ResultFinal(self.final_senders, self.final_version, self.final_signature))
            if self.confirmed:
                outbox.put_nowait(None)
        writer = asyncio.ensure_future(self._write(outbox, channel))
        self._serving[sender] = (channel, writer)
        try:
            if abstain or sender not in self.expected or sender in self.received or sender in self.failed:
                if sender not in self.received and sender not in self.failed:
                    self._fail(sender, "abstains" if abstain else "not expected")
                await drain_quietly(channel)
            else:
                await self._read(sender, weight, channel)
            await writer
        finally:
            writer.cancel()
            self._serving.pop(sender, None)
            self.outboxes.pop(sender, None)
            if sender in self.expected and sender not in self.complete and sender not in self.failed:
                self._fail(sender, "its connection was closed")  # the handler task was cancelled
            if not (self.closed or writer.done() and not writer.cancelled() and writer.result()):
                self._mark_dead(sender)  # it never got FINAL: the coordinator must not wait for it

    async def _read(self, sender: int, weight: float, channel: Any) -> None:
        self.weights[sender] = weight
        self.pieces[sender] = []
        if self.payloads is not None:
            self.payloads[sender] = []
        self.received[sender] = 0
        last = None  # when its previous chunk arrived (for our download estimate)
        try:
            while True:
                msg = await channel.recv(timeout=self.sender_timeout)
                if self.closed:
                    return
                if sender in self.failed:  # left out meanwhile (a straggler): its results still go out
                    await drain_quietly(channel)
                    return
                c = self.received[sender]
                if c == self.chunks and sender not in self.seals:
                    self._check_seal(sender, PieceSeal.from_wire(msg).signature)
                    continue
                if c >= self.chunks:
                    raise AveragingError("sent more than its piece and its seal")
                lo, hi = self.chunk_range(c)
                self.pieces[sender].append(decode_chunk(self.codec, msg, hi - lo))
                if self.payloads is not None:
                    self.payloads[sender].append(msg)
                last = self.stats.received(channel, last, payload_bytes(msg))
                self.received[sender] = c + 1
                self._try_reduce(c)
        except EndOfStream:
            if sender in self.failed:
                return  # left out as a straggler while its last messages came
            if sender in self.seals:
                self.complete.add(sender)
                self._progress()
            elif self.received[sender] == self.chunks:
                self._fail(sender, "ended its piece without sealing it")
            else:
                self._fail(sender, f"ended after {self.received[sender]} of {self.chunks} chunks")
        except (NetworkError, PotluckError) as e:
            if isinstance(e, DeadlineExceeded):
                self._lapse(sender, f"sent nothing for {self.sender_timeout:g} s")
            else:
                self._fail(sender, str(e))
            if isinstance(e, NetworkError):
                self._mark_dead(sender)

    def _check_seal(self, sender: int, signature: bytes) -> None:
        """Keep `sender`'s seal of the piece it sent, if it is its signature of what came."""
        digests = [chunk_digest(p) for p in self.pieces[sender]]
        root = piece_root(self.weights[sender], digests)
        message = seal_message(self.group.group_id, self.shard, sender, root, self.claims[sender])
        if not self.group.peers[sender].verify(signature, message):
            raise AveragingError("its seal does not match the piece it sent")
        self.digests[sender] = digests
        self.seals[sender] = signature

    async def _write(self, outbox: asyncio.Queue, channel: Any) -> bool:
        """Send results to one receiver; True once its FINAL under a decision is sent (or an early
        one confirmed: None in the outbox), and the stream ended."""
        try:
            while True:
                msg = await outbox.get()
                if msg is None or isinstance(msg, ResultFinal) and msg.version > 0:
                    if msg is not None:
                        await self.stats.send(channel, msg.to_wire())
                    await channel.close()
                    return True
                await self.stats.send(channel, msg.to_wire())
        except (NetworkError, PotluckError):
            return False

    def sender_died(self, sender: int) -> None:
        if sender in self.expected and sender not in self.complete:
            self._fail(sender, "it died")

    def _fail(self, sender: int, reason: str) -> None:
        if sender in self.failed or sender in self.complete or self.closed:
            return
        logger.debug("shard %d excludes sender %d: %s", self.shard, sender, reason)
        self.failed.add(sender)
        for c in range(self.chunks):
            self._try_reduce(c)
        self._progress()

    def _try_reduce(self, c: int) -> None:
        """Provisionally average chunk `c` once every live sender's piece of it is in."""
        if self.exact is not None or c in self.reduced_with or self.final_senders is not None \
                or c in self._reducing or self._finishing is not None:
            return  # a replacement reducer only ever reduces over the decided senders
        live = tuple(self._live())
        if not all(self.received.get(s, 0) > c for s in live):
            return
        if not self._aside:
            lo, hi = self.chunk_range(c)
            self._reduce(live, c, self.reduced[lo:hi])
            self._publish(c, live)
            return
        task = asyncio.ensure_future(self._reduce_aside(live, c))
        task.add_done_callback(retrieve_exception)
        self._reducing[c] = task

    async def _reduce_aside(self, senders: tuple[int, ...], c: int) -> bool:
        """Reduce chunk `c` over `senders` in a worker thread into a buffer of its own, then
        publish it (unless the step ended meanwhile); True if published."""
        if self.closed:
            return False
        lo, hi = self.chunk_range(c)
        pieces = {s: {c: self.pieces[s][c]} for s in senders}  # what the thread reads, fixed now
        out = torch.empty(hi - lo)
        try:
            # (robust aggregations use no scratch: `out` stands in for it)
            distances = await reduce_aside(self.aggregation, pieces, dict(self.weights), senders, c, out, out, True)
        finally:
            if self._reducing.get(c) is asyncio.current_task():
                del self._reducing[c]
        if self.closed or self.final_senders is not None:
            return False
        self.reduced[lo:hi].copy_(out)
        self._measured(c, distances)
        self._publish(c, senders)
        return True

    def _publish(self, c: int, senders: tuple[int, ...]) -> None:
        """Chunk `c`, reduced over `senders` into `self.reduced`, goes to every receiver."""
        lo, hi = self.chunk_range(c)
        self.reduced_with[c] = senders
        encoded, received = encode_received(self.codec, self.reduced[lo:hi])
        payload = ResultChunk(c, encoded)
        self.published[c] = (payload, received)
        for box in self.outboxes.values():
            box.put_nowait(payload)

    def _reduce(self, senders: tuple[int, ...], c: int, out: torch.Tensor) -> None:
        """Write chunk `c` reduced over `senders` into `out` (see `reduce_chunk`) on the loop,
        and keep the senders' distances from its robust centre (`_name` judges them)."""
        distances = reduce_chunk(self.aggregation, self.pieces, self.weights, senders, c, out, self.scratch,
                                 measure=True)
        self._measured(c, distances)

    def _measured(self, c: int, distances: dict[int, float]) -> None:
        if distances:  # (the mean measures none) the last reduction of chunk `c` counts
            self.distances[c] = distances

    def _name(self) -> None:
        """Name the senders whose contribution to this shard is blatantly not honest
        (`blatant_senders`), by their distances from the robust centre over the whole shard (every
        chunk reduced over them all). Not chunk by chunk: honest sparse updates (the rows of an
        embedding table that one peer's batches touched) put one piece hundreds of times the median
        distance from a chunk's centre (173x for an honest DiLoCo peer, `benchmarks/diloco_settings.py
        --task wan_lm`), and over the shard within a small factor (1.15x). A liar's blatant chunk
        still dominates its shard's sum. Named, not banned: a ban is for a lie proven by a member's
        own signatures; this is a statistic, and an honest peer that is broken or far behind (stale
        parameters) could meet it. The result already bounds what the sender does (bounded
        weights, robust aggregation). Without a record of deviations to judge with, chunks still
        being reduced aside are not waited for (the name is only said in the log)."""
        if self.closed:
            return
        senders = tuple(sorted(s for s in self.complete if self.weights.get(s, 0) > 0))
        covered = [d for d in self.distances.values() if all(s in d for s in senders)]
        totals = {s: math.sqrt(sum(d[s] ** 2 for d in covered)) for s in senders} if covered else {}
        named = blatant_senders(self.weights, totals, senders)
        for s in sorted(named.keys() - self.named.keys()):
            self.named[s] = named[s]
            logger.warning("reducer of shard %d: sender %d (%s) is not an honest member: %s (over the shard; "
                           "its contribution is bounded)", self.shard, s, self.group.peers[s], named[s])

    def _progress(self) -> None:
        """Report to the member once every expected sender is settled (under a robust
        aggregation, once the record of deviations has judged them, in the reductions' thread)."""
        self.changed.set()
        self._arm_stragglers()
        if not self.reported and self.expected <= (self.complete | self.failed):
            self.reported = True
            if self._aside and self.suspicion is not None:
                self._judging = asyncio.ensure_future(self._judge_aside())
                self._judging.add_done_callback(retrieve_exception)
                return
            self._name()
            case = self._case()
            if case is not None:
                self._leave_out(case[0], self._judged(*case))
            self._report()

    def _report(self) -> None:
        host = self._host()
        if host is None:
            return
        complete = sorted(self.complete - self.left_out.keys())
        host.on_report(self.shard, complete)
        if complete and self.exact is None:
            self.finalize(tuple(complete), 0)  # the early FINAL (module docstring)

    async def _judge_aside(self) -> None:
        while self._reducing:  # the senders they name are evidence for the record
            await asyncio.gather(*self._reducing.values(), return_exceptions=True)
        self._name()
        case = self._case()
        if case is not None:
            left = await asyncio.get_running_loop().run_in_executor(_REDUCTIONS, self._judged, *case)
            if self.closed:
                return
            self._leave_out(case[0], left)
        self._report()

    def _case(self) -> tuple[list[int], list[Any], list[list[torch.Tensor]], list[Any]] | None:
        """What the record of deviations judges: the senders with a say, their peers, their
        pieces' chunks and the peers named not honest (None: nothing to judge). A weight of 0
        means "leave me out" (a peer with nothing to add this step): its piece counts for
        nothing, so it is no evidence either way."""
        if self.suspicion is None or self.closed or not self.complete:
            return None
        senders = sorted(s for s in self.complete if self.weights.get(s, 0) > 0)
        if not senders:
            return None
        peers = [self.group.peers[s] for s in senders]
        return senders, peers, [list(self.pieces[s]) for s in senders], [self.group.peers[s] for s in self.named]

    def _judged(self, senders: list[int], peers: list[Any], chunks: list[list[torch.Tensor]],
                named: list[Any]) -> dict[Any, str]:
        """Add this step's pieces to the averager's record of deviations; the peers it leaves
        out, and why (in any thread: the reductions' one under a robust aggregation)."""
        pieces = [torch.cat(c) if len(c) > 1 else c[0] for c in chunks]
        start, _ = self.group.bounds(self.shard)
        self.suspicion.record(start, peers, pieces, [p for p in peers if p in named])
        return self.suspicion.left_out(peers)

    def _leave_out(self, senders: list[int], left: dict[Any, str]) -> None:
        """Leave out the senders the record suspects or excluded: never half of them or more
        (with fewer than half the senders lying, more suspects means a broken record, not a step
        to throw away)."""
        if 2 * len(left) < len(senders):
            self.left_out = {s: left[p] for s, p in ((s, self.group.peers[s]) for s in senders) if p in left}
        for s, why in self.left_out.items():
            logger.info("reducer of shard %d leaves sender %d (%s) out of this step: %s",
                        self.shard, s, self.group.peers[s], why)

    def finalize(self, senders: tuple[int, ...], version: int) -> None:
        """Recompute chunks not reduced over exactly `senders`, then send FINAL (under a robust
        aggregation in a worker thread, after the provisional reductions under way: `changed` is
        set once FINAL is out). Version 0 is the early FINAL, over the senders reported complete;
        a decision then confirms it (same senders: the streams end) or replaces it."""
        if self.closed or self.final_version > 0 or self.confirmed:
            return
        if self.finalizing:  # a FINAL (the early one) is being computed: this decision follows it
            self._decided = (senders, version)
            return
        if self.final_senders is not None:
            if senders == self.final_senders:
                self.confirmed = True
                for box in self.outboxes.values():
                    box.put_nowait(None)
                return
            self.final_senders, self._finishing = None, None  # the decision differs: reduce again,
            self._fresh_results()  # into other memory: the early results may still wait to be sent
        missing = [s for s in senders if s not in self.complete]
        if missing:
            host = self._host()
            if host is not None:
                host.on_repair_failed(self.shard, missing)
            return
        if self._aside:
            self._finishing = asyncio.ensure_future(self._finalize_aside(senders, version))
            self._finishing.add_done_callback(retrieve_exception)
            return
        for c in range(self.chunks):
            if self.reduced_with.get(c) != senders:
                lo, hi = self.chunk_range(c)
                self._reduce(senders, c, self.reduced[lo:hi])
                self._publish(c, senders)
        self._seal(senders, version)

    def _fresh_results(self) -> None:
        """Move the reduced shard to a buffer of its own. Results wait in the outboxes as views of
        it (the codec may not copy them), so reducing again in place would send some receivers
        values other than those the early FINAL signed."""
        fresh = self.pool.take(self.size)
        self._buffers.append(fresh)
        fresh[:self.size].copy_(self.reduced)
        self.reduced = fresh[:self.size]

    @property
    def finalizing(self) -> bool:
        """FINAL is being computed in a worker thread (`changed` is set once it is out)."""
        return self._finishing is not None and self.final_senders is None

    async def _finalize_aside(self, senders: tuple[int, ...], version: int) -> None:
        try:
            while self._reducing:  # their results may be over exactly `senders`: no need to redo them
                await asyncio.gather(*self._reducing.values(), return_exceptions=True)
            for c in range(self.chunks):
                if self.reduced_with.get(c) != senders and not await self._reduce_aside(senders, c):
                    return  # the step ended here meanwhile
            host = self._host()
            if host is None or self.closed:
                return
            signature = await asyncio.get_running_loop().run_in_executor(  # hashes the shard: off the loop
                _REDUCTIONS, host.sign_final, self.shard, senders, version, self._received())
            if not self.closed:
                self._seal(senders, version, signature)
        finally:
            self.changed.set()
        decided, self._decided = self._decided, None
        if decided is not None:
            self.finalize(*decided)

    def _received(self) -> dict[int, torch.Tensor]:
        """Each chunk's result as its receivers decode it (a codec whose results they refuse
        raises here, as they would)."""
        return {c: as_received(self.codec, self.reduced[slice(*self.chunk_range(c))]) if received is None
                else received for c, (_, received) in self.published.items()}

    def _seal(self, senders: tuple[int, ...], version: int, signature: bytes | None = None) -> None:
        """Sign the result over `senders` (unless signed already) and send FINAL to every receiver."""
        host = self._host()
        if signature is not None:
            self.final_signature = signature
        elif host is not None:
            self.final_signature = host.sign_final(self.shard, senders, version, self._received())
        self.final_senders, self.final_version = senders, version
        for box in self.outboxes.values():
            box.put_nowait(ResultFinal(senders, version, self.final_signature))
        self._stop_timer()


async def drain_quietly(channel: Any) -> None:
    """Read a stream to its end, ignoring what comes and how it ends."""
    try:
        async for _ in channel:
            pass
    except (NetworkError, PotluckError):
        pass
