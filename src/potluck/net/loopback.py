"""Calls and streams from a peer to itself: two `Connection`s joined in memory.

A member that reduces its own shard, a controller that configures its own stage, a worker that
serves a shard itself: all call their own peer id through the same `Transport.call` and
`open_stream` as any other peer, so there is one code path and one set of semantics (the handler
sees the caller's id, deadlines, errors, CANCEL, stream windows). Only the link differs: a
`LoopbackLink` hands the `Frame` objects themselves to the other connection, on the next loop
iteration, never encoding them. A message sent to oneself is therefore the very object sent, as
in a function call: a sender that will modify a tensor after sending it sends a copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from potluck.core.errors import ConnectionLost, MessageTooLarge
from potluck.net.connection import MAX_STREAM_QUEUE, STREAM_WINDOW, Connection
from potluck.net.frames import Frame, Kind, estimated_size

logger = logging.getLogger(__name__)

# A loopback DATA frame is charged at least this, so the window stops a sender of tiny messages
# before the receiver's queue limit (MAX_STREAM_QUEUE) would count it as a protocol violation.
MIN_DATA_CHARGE = STREAM_WINDOW // MAX_STREAM_QUEUE


class LoopbackLink:
    """One end of an in-memory `FrameLink`; frames it sends arrive at `peer`'s connection."""

    def __init__(self, max_frame_size: int):
        self.max_frame_size = max_frame_size
        self.peer: LoopbackLink | None = None  # set once both ends exist; dropped when lost
        self.connection: Connection | None = None
        self.lost = False
        self._reason = ""
        self._loop = asyncio.get_running_loop()
        self._arrivals: deque[Frame] = deque()
        self._scheduled: asyncio.Handle | None = None

    @staticmethod
    def pair(a: Connection, b: Connection, max_frame_size: int) -> None:
        """Join two connections (marked `loopback`) by a pair of links."""
        ends = LoopbackLink(max_frame_size), LoopbackLink(max_frame_size)
        ends[0].peer, ends[1].peer = ends[1], ends[0]
        for end, conn in zip(ends, (a, b), strict=True):
            conn.loopback = True
            end.connection = conn
            conn.attach(end)

    # -- FrameLink -------------------------------------------------------------------------------
    async def send(self, frame: Frame) -> int:
        """Hand `frame` over (it arrives on the next loop iteration); returns its charged size."""
        if self.lost:
            raise ConnectionLost(f"the loopback connection is closed: {self._reason}")
        self.send_nowait(frame)
        return frame.size

    def send_nowait(self, frame: Frame) -> None:
        """Hand `frame` over; dropped if the link is already closed (as on a wire)."""
        if self.lost or self.peer is None:
            return
        frame.size = estimated_size(frame.body)
        if frame.size > self.max_frame_size:
            raise MessageTooLarge(
                f"a {frame.size}-byte frame exceeds the max frame size of {self.max_frame_size} bytes; "
                "send large data as a stream of smaller chunks")
        if frame.kind is Kind.DATA:
            frame.size = max(frame.size, MIN_DATA_CHARGE)
        self.peer._arrive(frame)

    def close(self, reason: str | None = None) -> None:
        """Close both ends now (there is nobody in between to delay the news)."""
        peer = self.peer
        self._lose(reason or "closed")
        if peer is not None:
            peer._lose(reason or "closed")

    # -- delivery --------------------------------------------------------------------------------
    def _arrive(self, frame: Frame) -> None:
        if self.lost:
            return
        self._arrivals.append(frame)
        if self._scheduled is None:
            # On the next iteration, as from a socket: a handler never runs inside its caller's send.
            self._scheduled = self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = None
        batch, self._arrivals = self._arrivals, deque()  # frames sent meanwhile: the next round
        for frame in batch:
            if self.lost:
                return
            try:
                self.connection.frame_received(frame)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - a broken link must not wedge the loop
                logger.exception("the loopback connection failed on a frame")
                self.close("internal error while handling a frame")
                return

    def _lose(self, reason: str) -> None:
        if self.lost:
            return
        self.lost = True
        self._reason = reason
        self._arrivals.clear()
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        connection, self.connection, self.peer = self.connection, None, None  # no cycles once closed
        if connection is not None:
            connection.link_lost(reason)
