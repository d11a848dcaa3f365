"""A stream-like pipe inside one process, so a peer can be its own reducer through the same code."""

from __future__ import annotations

import asyncio
from typing import Any

from potluck.core import compat
from potluck.core.errors import CallCancelled, DeadlineExceeded, EndOfStream, detached
from potluck.net.connection import Stream

_END = object()


class LocalChannel:
    """One end of an in-process duplex pipe with the send/recv/close/abort API of `net.Stream`."""

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, peer_id: Any):
        self._inbox, self._outbox = inbox, outbox
        self.peer_id = peer_id
        self._closed = False
        self._ended = False
        self._aborted = False

    @classmethod
    def pair(cls, peer_id: Any) -> tuple[LocalChannel, LocalChannel]:
        a, b = asyncio.Queue(), asyncio.Queue()
        return cls(a, b, peer_id), cls(b, a, peer_id)

    async def send(self, message: Any, timeout: float | None = None) -> None:
        if self._aborted:
            raise CallCancelled("local channel aborted")
        self._outbox.put_nowait(message)

    async def recv(self, timeout: float | None = None) -> Any:
        if self._ended:
            raise EndOfStream("local channel ended")
        try:
            async with compat.timeout(timeout):
                item = await self._inbox.get()
        except TimeoutError:
            raise DeadlineExceeded("no message on local channel in time") from None
        if item is _END:
            self._ended = True
            raise EndOfStream("local channel ended")
        if isinstance(item, BaseException):
            raise detached(item)
        return item

    # Iteration is Stream's own: it only needs recv() and EndOfStream.
    __aiter__ = Stream.__aiter__
    _iterate = Stream._iterate

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(_END)

    def abort(self, reason: str = "aborted") -> None:
        if not self._aborted:
            self._aborted = True
            self._outbox.put_nowait(CallCancelled(f"local channel: {reason}"))
            self._inbox.put_nowait(CallCancelled(f"local channel: {reason}"))
