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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

__all__ = ["MemberGone", "RingAllReduce", "RingError", "RoundSkipped", "Segment", "ring_segments"]

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
# Pieces we buffer at once, whatever senders do.
MAX_BUFFERED = 4096


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


def ring_segments(layouts: Mapping[str, Sequence[tuple[str, int, int]]]) -> list[Segment]:
    """Rings from layouts {cluster id: [(peer id, start, end), ...]}, clusters in sorted order."""
    clusters = sorted(layouts)
    cuts = sorted({b for c in clusters for _, a, b in layouts[c]} | {a for c in clusters for _, a, _ in layouts[c]})
    segments = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        members = []
        for c in clusters:
            holder = [p for p, a, b in layouts[c] if a <= start and end <= b]
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

    def __init__(self, transport: Transport, run_id: str, ping_method: str, *,
                 part_bytes: int = RING_PART_BYTES, parts_in_flight: int = PARTS_IN_FLIGHT):
        self.transport = transport
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        self.method = f"{run_id}.pipe.ring"
        self.ping_method = ping_method
        self.round = 0  # the lowest round still accepted
        self._mailbox: dict[tuple, torch.Tensor] = {}
        self._arrived = asyncio.Event()
        transport.add_handler(self.method, self._receive)

    async def _receive(self, request: Any, ctx: Any) -> Any:
        if not isinstance(request, dict):
            raise RingError("ring message must be a dict")
        if request.get("status"):
            return {"round": self.round}
        key, data = request.get("key"), request.get("data")
        if not (isinstance(key, list) and len(key) == 7 and all(isinstance(k, (int, str)) for k in key)):
            raise RingError("ring message key must be [round, start, end, attempt, members, step, part]")
        if not isinstance(data, torch.Tensor) or data.dtype != torch.float32 or data.dim() != 1:
            raise RingError("ring message data must be a 1-d float32 tensor")
        if not isinstance(key[0], int) or not self.round <= key[0] <= self.round + ROUNDS_AHEAD:
            return {"ok": False}  # a stale or far-future round: nobody will read it
        if len(self._mailbox) >= MAX_BUFFERED:
            raise RingError("ring mailbox is full")
        self._mailbox[(*key, str(ctx.peer_id))] = data
        self._arrived.set()
        return {"ok": True}

    async def _alive(self, peer: PeerID) -> bool:
        try:
            await self.transport.call(peer, self.ping_method, {"op": "ping"}, timeout=PING_TIMEOUT)
            return True
        except (NetworkError, TimeoutError):
            return False

    async def _take(self, key: tuple, sender: PeerID, size: int, deadline: float) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        full = (*key, str(sender))
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
                    status = await self.transport.call(sender, self.method, {"status": True}, timeout=PING_TIMEOUT)
                except (NetworkError, TimeoutError):
                    raise MemberGone(f"ring member {sender} is not answering", str(sender)) from None
                theirs = status.get("round") if isinstance(status, dict) else None
                if isinstance(theirs, int) and theirs > key[0]:
                    raise RoundSkipped(f"{sender} is already past round {key[0]}", theirs) from None
        data = self._mailbox.pop(full)
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
            try:
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
        base = [round_id, segment.start, segment.end, attempt, ",".join(members)]
        part_values = max(1, self.part_bytes // 4)

        async def exchange(step: int, send_chunk: int, recv_chunk: int, reduce: bool) -> None:
            a, b = chunks[send_chunk]
            c, d = chunks[recv_chunk]
            sends = _chunks(b - a, max(1, -(-(b - a) // part_values)))
            recvs = _chunks(d - c, max(1, -(-(d - c) // part_values)))

            async def send_part(i: int, x: int, y: int, window: asyncio.Semaphore) -> None:
                async with window:
                    await self.transport.call(right, self.method, {"key": [*base, step, i],
                                                                   "data": data[a + x:a + y].clone()},
                                              timeout=SEND_TIMEOUT)

            async def send() -> None:
                # parts go out back to back: waiting for each reply would idle the link a round trip
                window = asyncio.Semaphore(self.parts_in_flight)
                async with compat.TaskGroup() as parts:
                    for i, (x, y) in enumerate(sends):
                        parts.create_task(send_part(i, x, y, window))

            async def receive() -> None:
                for i, (x, y) in enumerate(recvs):
                    piece = await self._take((*base, step, i), left, y - x, deadline)
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
        for key in [k for k in self._mailbox if k[0] <= round_id]:
            del self._mailbox[key]

    def close(self) -> None:
        self.transport.remove_handler(self.method)
