"""Parallel multi-ring all-reduce: the nodes holding the same layers in different clusters
average those layers' parameters in a ring; every ring runs at the same time.

`ring_segments` finds the rings from the clusters' layouts: the union of all stage boundaries
cuts the layer list into segments that have exactly one holder per cluster (clusters may be
split differently, e.g. after a re-partition), and each segment's holders form one ring.

`RingAllReduce` is the classic bandwidth-optimal ring (reduce-scatter, then all-gather: each
member sends and receives 2 (N-1)/N of the vector), chunked into parts of at most
`RING_PART_BYTES` so sending, receiving and adding overlap. Each chunk's sum is computed by one
member and then copied around, so every member ends with bit-identical values. A member that
dies (send fails, or it stops answering pings while we wait for it) is dropped: the survivors
re-form the ring and redo the round (`attempt` + 1) without it.

Ring data is buffered until its round reads it, so a `RingAllReduce` given `allowed` (a stage's
`LayoutDirectory.lists`: nodes named in the run's layouts) refuses parts from anyone else: a
stranger can neither fill the mailbox nor crowd out the members' parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from potluck.core import compat
from potluck.core.errors import MalformedMessage, NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.wire import Field, Int, Message, Nested, OneOf, Text
from potluck.net.identity import PEER_ID_MAX_CHARS, PeerID
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_COUNTER, MAX_LAYER_INDEX, Ack, Ping

if TYPE_CHECKING:
    from potluck.pipeline.layout import Span

__all__ = ["MemberGone", "PartKey", "RING_MESSAGES", "RingAllReduce", "RingError", "RingPart", "RingStatus",
           "RingStatusQuery", "RoundSkipped", "Segment", "parse_ring", "ring_segments"]

logger = logging.getLogger(__name__)

# Largest message of the ring: 1 MiB parts keep several in flight on a fast link and let the
# receiver add one part while the next arrives.
RING_PART_BYTES = 2**20
# Parts one member has sent and not yet had acknowledged: enough to cover a round trip on a
# fast link, bounded so a slow receiver never holds more than this many parts of ours.
PARTS_IN_FLIGHT = 8
# While waiting for the left neighbour we ask it for its round this often: a dead member is
# noticed within about this plus PING_TIMEOUT instead of the whole round's deadline, and a
# neighbour that has moved past our round (it saw other rings) within about this.
RING_POLL_SECONDS = 0.5
PING_TIMEOUT = 2.0
# Each send of one part must finish within this (a stalled member is treated as dead).
SEND_TIMEOUT = 30.0
# Re-formations per round before giving up (each drops at least one member).
MAX_ATTEMPTS = 4
# Rounds ahead of ours whose messages we buffer (a faster ring member may start the next one).
ROUNDS_AHEAD = 2
# Pieces we buffer at once, and their bytes, whatever senders do (parts of rounds ahead of ours
# wait here until we get there, after their calls are over and no longer counted by the transport).
# When either is full, the sender holding the most bytes loses its oldest part, so one sender (a
# node named in a layout, possibly a member taken as a standby from its profile) filling the
# mailbox with far-round parts of made-up rings no longer locks out the parts of everyone else.
MAX_BUFFERED = 4096
MAX_BUFFERED_BYTES = 512 * 2**20


# The members of a ring in its messages: one peer id per cluster, comma-separated.
MAX_MEMBERS_CHARS = MAX_CLUSTERS * (PEER_ID_MAX_CHARS + 1)
# Parts per chunk: a sender cuts one member's chunk into parts of its own `part_bytes`; 2^31 parts
# of even one value is past any vector a ring carries.
MAX_PARTS = 2**31


class PartKey(Message, what="ring part key", positional=True):
    """Which piece a ring message is: round, ring (layers [start, end)), attempt and its members
    (so pieces of a re-formed ring never mix with the old one's), step and part of the step. On
    the wire a list in this order; the keys name the items in errors."""

    round: int = Int("r", 0, MAX_COUNTER)
    start: int = Int("a", 0, MAX_LAYER_INDEX)
    end: int = Int("b", 1, MAX_LAYER_INDEX + 1)
    attempt: int = Int("t", 0, MAX_ATTEMPTS)
    members: str = Text("m", MAX_MEMBERS_CHARS)
    step: int = Int("s", 0, 2 * MAX_CLUSTERS)
    part: int = Int("p", 0, MAX_PARTS)

    def validate(self, context: Mapping[str, Any]) -> None:
        if self.end <= self.start:
            raise self.refuse(f"'b' must be an integer in [{self.start + 1}, {MAX_LAYER_INDEX + 1})")


class RingData(Field):
    """A piece of the vector a ring averages: a 1-d float32 tensor."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.dim() != 1:
            raise MalformedMessage(what, f"{key!r} must be a 1-d float32 tensor")
        return value


class RingPart(Message, what="ring part", tag=("op", "part")):
    """One piece of a chunk, sent to the right-hand neighbour."""

    key: PartKey = Nested("k", PartKey)
    data: torch.Tensor = RingData("d")


class RingStatusQuery(Message, what="ring status query", tag=("op", "status")):
    """Which round are you at? (asked of a neighbour that has sent nothing for a while)."""


class RingStatus(Message, what="ring status"):
    """The lowest round a member still accepts."""

    round: int = Int("round", 0, MAX_COUNTER)


# The messages of a ring's method, told apart by their tag.
RING_MESSAGES = OneOf("ring message", RingPart, RingStatusQuery)


def parse_ring(msg: Any) -> RingPart | RingStatusQuery:
    return RING_MESSAGES.from_wire(msg)


class RingError(PotluckError):
    """A ring round could not complete (too many members failed, or bad input)."""


class MemberGone(NetworkError):
    """A ring member stopped answering: the ring re-forms without it."""

    def __init__(self, message: str, peer: str):
        super().__init__(message)
        self.peer = peer


class RoundSkipped(RingError):
    """A neighbour has already moved past this round (it saw a different ring, e.g. before a
    layout reached the DHT): this round is abandoned and the caller resumes at `round`."""

    def __init__(self, message: str, round_id: int):
        super().__init__(message)
        self.round = round_id


@dataclass(frozen=True)
class Segment:
    """Layers [start, end) and the peers (one per cluster, in cluster order) holding them."""

    start: int
    end: int
    members: tuple[str, ...]


def ring_segments(layouts: Mapping[str, Sequence[Span]]) -> list[Segment]:
    """Rings from layouts {cluster id: [Span(peer id, start, end), ...]}, clusters in sorted order."""
    clusters = sorted(layouts)
    cuts = sorted({s.end for c in clusters for s in layouts[c]} | {s.start for c in clusters for s in layouts[c]})
    segments = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        members = []
        for c in clusters:
            holder = [s.peer for s in layouts[c] if s.start <= start and end <= s.end]
            if holder:
                members.append(holder[0])
        if members:
            segments.append(Segment(start, end, tuple(members)))
    return segments


def _first_error(group: BaseException) -> BaseException:
    """The first leaf of nested task-group errors (a send part inside a step inside a round)."""
    while isinstance(group, compat.BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _chunks(length: int, parts: int) -> list[tuple[int, int]]:
    bounds = [length * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


class RingAllReduce:
    """One node's side of every ring it is in (one handler, a mailbox keyed by round and ring)."""

    def __init__(self, peer: PeerLike, run_id: str, ping_method: str, *,
                 part_bytes: int = RING_PART_BYTES, parts_in_flight: int = PARTS_IN_FLIGHT,
                 allowed: Callable[[PeerID], Awaitable[bool]] | None = None):
        """`allowed(peer id)`: whether a peer may send ring data here (None: any peer; `StageWorker`
        passes its layout directory's `lists`)."""
        self.transport = peer.transport
        self.allowed = allowed
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        self.method = RunNames(run_id).pipeline.ring
        self.ping_method = ping_method
        self.round = 0  # the lowest round still accepted
        self._mailbox: dict[tuple[PartKey, str], torch.Tensor] = {}  # (key, sender) -> data
        self._held: dict[str, int] = {}  # sender -> bytes of its parts in the mailbox
        self._arrived = asyncio.Event()
        self.transport.add_handler(self.method, self._receive)

    async def _receive(self, request: Any, ctx: Any) -> Any:
        message = parse_ring(request)
        if isinstance(message, RingStatusQuery):
            return RingStatus(self.round).to_wire()
        if self.allowed is not None and not await self.allowed(ctx.peer_id):
            raise RingError(f"ring part refused: this node takes ring data only from nodes named in the run's "
                            f"layouts, not from {ctx.peer_id}")
        if not self.round <= message.key.round <= self.round + ROUNDS_AHEAD:
            return Ack(False).to_wire()  # a stale or far-future round: nobody will read it
        sender, nbytes = str(ctx.peer_id), message.data.numel() * message.data.element_size()
        if not self._make_room(sender, nbytes):
            raise RingError("ring mailbox is full, and this node holds the most of it")
        self._put((message.key, sender), message.data)
        self._arrived.set()
        return Ack().to_wire()

    def _make_room(self, sender: str, nbytes: int) -> bool:
        """Room for a part of `nbytes` from `sender` (see MAX_BUFFERED): False if the mailbox is full
        and `sender` holds the most of it."""
        while self._mailbox and (len(self._mailbox) >= MAX_BUFFERED
                                 or sum(self._held.values()) + nbytes > MAX_BUFFERED_BYTES):
            most = max(self._held, key=self._held.__getitem__)
            if most == sender or self._held[most] <= self._held.get(sender, 0) + nbytes:
                return False
            self._drop(next(entry for entry in self._mailbox if entry[1] == most))
        return True

    def _put(self, entry: tuple[PartKey, str], data: torch.Tensor) -> None:
        self._drop(entry)  # a part sent again replaces the first
        self._mailbox[entry] = data
        self._held[entry[1]] = self._held.get(entry[1], 0) + data.numel() * data.element_size()

    def _drop(self, entry: tuple[PartKey, str]) -> torch.Tensor | None:
        data = self._mailbox.pop(entry, None)
        if data is not None:
            left = self._held[entry[1]] - data.numel() * data.element_size()
            if left > 0:
                self._held[entry[1]] = left
            else:
                del self._held[entry[1]]
        return data

    async def _alive(self, peer: PeerID) -> bool:
        try:
            await self.transport.call(peer, self.ping_method, Ping().to_wire(), timeout=PING_TIMEOUT)
            return True
        except (NetworkError, TimeoutError):
            return False

    async def _take(self, key: PartKey, sender: PeerID, size: int, deadline: float) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        full = (key, str(sender))
        while full not in self._mailbox:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no ring data from {sender}")
            self._arrived.clear()
            try:
                async with compat.timeout(min(left, RING_POLL_SECONDS)):
                    await self._arrived.wait()
            except TimeoutError:
                try:
                    status = RingStatus.from_wire(await self.transport.call(
                        sender, self.method, RingStatusQuery().to_wire(), timeout=PING_TIMEOUT))
                except (NetworkError, TimeoutError):  # a malformed answer too (MalformedMessage)
                    raise MemberGone(f"ring member {sender} is not answering", str(sender)) from None
                if status.round > key.round:
                    raise RoundSkipped(f"{sender} is already past round {key.round}", status.round) from None
        data = self._drop(full)
        assert data is not None
        if data.numel() != size:
            raise RingError(f"ring part from {sender} has {data.numel()} values, expected {size}")
        return data

    async def allreduce(self, round_id: int, segment: Segment, vector: torch.Tensor,
                        timeout: float) -> tuple[torch.Tensor, list[str]]:
        """The mean of `vector` over the ring's live members, and who they were."""
        me = str(self.transport.peer_id)
        members = list(segment.members)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for attempt in range(MAX_ATTEMPTS):
            if len(members) == 1:
                return vector.clone(), members
            try:  # the round's deadline covers the sends too (a neighbour answering each part just
                # inside SEND_TIMEOUT stretched a 60 s round to 464 s)
                async with compat.timeout_at(deadline):
                    return await self._run(round_id, segment, attempt, members, vector, deadline), members
            except RoundSkipped:
                raise
            except (NetworkError, TimeoutError, RingError) as e:
                if loop.time() >= deadline:
                    raise RingError(f"ring round {round_id} for layers {segment.start}-{segment.end} "
                                    f"ran out of time: {e}") from None
                gone = {e.peer} if isinstance(e, MemberGone) else set()
                members = [m for m in members if m not in gone]
                alive = await asyncio.gather(*(self._alive(PeerID.from_string(m)) for m in members if m != me))
                others = iter(alive)
                members = [m for m in members if m == me or next(others)]
                logger.info("ring %d-%d round %d re-forms with %d members after: %s",
                            segment.start, segment.end, round_id, len(members), e)
        raise RingError(f"ring round {round_id} failed {MAX_ATTEMPTS} times")

    async def _run(self, round_id: int, segment: Segment, attempt: int, members: list[str],
                   vector: torch.Tensor, deadline: float) -> torch.Tensor:
        me = str(self.transport.peer_id)
        n, pos = len(members), members.index(me)
        right, left = PeerID.from_string(members[(pos + 1) % n]), PeerID.from_string(members[(pos - 1) % n])
        data = vector.detach().to(torch.float32).clone().reshape(-1)
        chunks = _chunks(data.numel(), n)
        ring = ",".join(members)
        part_values = max(1, self.part_bytes // 4)

        async def exchange(step: int, send_chunk: int, recv_chunk: int, reduce: bool) -> None:
            a, b = chunks[send_chunk]
            c, d = chunks[recv_chunk]
            sends = _chunks(b - a, max(1, -(-(b - a) // part_values)))
            recvs = _chunks(d - c, max(1, -(-(d - c) // part_values)))

            async def send_part(i: int, x: int, y: int, window: asyncio.Semaphore) -> None:
                async with window:
                    key = PartKey(round_id, segment.start, segment.end, attempt, ring, step, i)
                    await self.transport.call(right, self.method, RingPart(key, data[a + x:a + y].clone()).to_wire(),
                                              timeout=SEND_TIMEOUT)

            async def send() -> None:
                # parts go out back to back: waiting for each reply would idle the link a round trip
                window = asyncio.Semaphore(self.parts_in_flight)
                async with compat.TaskGroup() as parts:
                    for i, (x, y) in enumerate(sends):
                        parts.create_task(send_part(i, x, y, window))

            async def receive() -> None:
                for i, (x, y) in enumerate(recvs):
                    key = PartKey(round_id, segment.start, segment.end, attempt, ring, step, i)
                    piece = await self._take(key, left, y - x, deadline)
                    if reduce:
                        data[c + x:c + y] += piece
                    else:
                        data[c + x:c + y] = piece

            async with compat.TaskGroup() as group:
                group.create_task(send())
                group.create_task(receive())

        try:
            for step in range(n - 1):  # reduce-scatter
                await exchange(step, (pos - step) % n, (pos - step - 1) % n, reduce=True)
            a, b = chunks[(pos + 1) % n]
            data[a:b] /= n  # this member's finished chunk: the mean, computed once
            for step in range(n - 1):  # all-gather
                await exchange(n - 1 + step, (pos + 1 - step) % n, (pos - step) % n, reduce=False)
        except compat.BaseExceptionGroup as group:
            raise _first_error(group) from None
        return data

    def finish_round(self, round_id: int) -> None:
        """Stop accepting messages of rounds up to `round_id` and drop what is left of them."""
        self.round = max(self.round, round_id + 1)
        for entry in [entry for entry in self._mailbox if entry[0].round <= round_id]:
            self._drop(entry)

    def close(self) -> None:
        self.transport.remove_handler(self.method)
