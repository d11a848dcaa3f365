"""One authenticated link between two peers, multiplexing unary calls and streams.

Either side may start calls on a connection, so a peer behind NAT serves requests over the
connection it dialed. A `Connection` speaks frames through a `FrameLink` (real TCP/TLS or the
emulated network) and never touches sockets itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from potluck.core import compat
from potluck.core.errors import (
    CallCancelled,
    ConnectionLost,
    DeadlineExceeded,
    EndOfStream,
    MethodNotFound,
    NetworkError,
    RemoteError,
    detached,
)
from potluck.net.address import Multiaddr
from potluck.net.frames import Frame, Kind, estimated_size
from potluck.net.identity import PeerID
from potluck.net.origins import UNKNOWN_ORIGIN, Origin, Shares

logger = logging.getLogger(__name__)

# Bytes a stream may have in flight before the receiver hands them to its consumer. 16 MiB keeps
# several 1-4 MiB chunks moving on a fast link while bounding memory per stream. The window counts
# bytes (wire size), not messages: a sender may start a message only while less than the window is
# unacknowledged, so the receiver holds at most the window plus one frame per stream, and a DATA
# frame that arrives when the window is already full is a protocol error that closes the
# connection (issue 14: a window of messages let 40 x 32 MiB frames in, +1.3 GB).
STREAM_WINDOW = 16 * 2**20

# Handler tasks one connection may run at once; more get a "busy" error instead of memory growth.
MAX_CONCURRENT_CALLS = 1024

# Bytes of requests whose handlers are still running, per connection: past this a new request gets
# a "busy" error and its bytes are dropped at once (issue 14: 60 waiting calls x 16 MiB held
# +960 MB). 256 MiB lets a peer keep 32 expert calls with 8 MiB activation batches in flight; one
# request is always served, however large (it is bounded by the max frame size). A stream's OPEN
# request counts too, for as long as its handler runs (the handler holds it as `stream.request`).
MAX_INFLIGHT_REQUEST_BYTES = 256 * 2**20

# The same two limits for one peer across all its connections with us (it may hold up to
# net.tcp.MAX_CONNECTIONS_PER_PEER = 32, which would otherwise multiply them by 32: 8 GiB of parked
# requests). Past either, a request gets the same "busy" error. An honest peer sends its calls over
# one shared connection and opens the others for one bulk stream each, so the totals are the
# per-connection limits plus what those others need: one call per other connection, and one more
# request of the largest frame (DEFAULT_MAX_FRAME_SIZE, 64 MiB) beside a full shared connection.
# One request is always served while the peer has nothing else in progress.
MAX_CALLS_PER_PEER = MAX_CONCURRENT_CALLS + 32
MAX_INFLIGHT_REQUEST_BYTES_PER_PEER = MAX_INFLIGHT_REQUEST_BYTES + 64 * 2**20

# ... and per network origin and in all (`net.origins.Shares`), since peer ids cost nothing: one
# host making up ids held 256 connections x 256 MiB of requests (64 GiB), and the answers to calls
# it did not read were counted nowhere (a DHT find of 32 keys answers 32 MiB, held until its
# deadline, 1,056 at a time per id). The bytes count a call's request and, from when its handler
# returns until it is written, its answer. Half of everything for one IP or subnet, as for
# connections; 1 GiB in all is what a volunteer's machine can spare for other peers' calls, and
# the halves still hold four full per-peer totals' worth of calls and one peer's bytes beside
# another's. A local test swarm (every peer on 127.0.0.1) stays far below them.
MAX_CALLS_IN_PROGRESS = 8192
MAX_CALLS_PER_IP = MAX_CALLS_PER_SUBNET = MAX_CALLS_IN_PROGRESS // 2
MAX_INFLIGHT_BYTES = 2**30
MAX_INFLIGHT_BYTES_PER_IP = MAX_INFLIGHT_BYTES_PER_SUBNET = MAX_INFLIGHT_BYTES // 2

# Messages a stream buffers before the window stops the sender anyway (guards tiny messages).
MAX_STREAM_QUEUE = 4096
# Control frames (pongs, window updates, refusals of calls) a link queues while a send holds its
# writer: one per ping or call of the other side, so a peer that sends them and never reads what
# we send grew the queue without end. Past this many the link is closed.
MAX_CONTROL_FRAMES = 4096

# A remote caller cannot make a handler run longer than this, whatever deadline it asks for (or
# none): the handler, and the sending of its answer, are cancelled then. Unary calls: 10 minutes,
# ten times the longest deadline potluck's own calls use (60 s: a pipeline stage's configure, a
# state manifest, a parameter server push). Streams: 1 hour, six times the default stream timeout,
# for the longest legitimate stream (a state download of a large model over a slow link). Before,
# a caller could hold a handler, and what it holds, for 24 h (issue 14).
MAX_HANDLER_SECONDS = 600.0
MAX_STREAM_HANDLER_SECONDS = 3600.0

# Default deadlines (seconds). Every wait has one; callers pass their own where they know better.
DEFAULT_CALL_TIMEOUT = 30.0
DEFAULT_STREAM_TIMEOUT = 600.0


@dataclass(frozen=True)
class RemoteInfo:
    """What a peer told us in its handshake (its id is authenticated by then)."""

    peer_id: PeerID
    addresses: tuple[Multiaddr, ...] = ()
    client_mode: bool = False
    max_frame_size: int | None = None
    bulk: bool = False  # the dialer opened this connection for one bulk stream at a time
    token: bytes | None = None  # reserved for membership tokens
    # Where we saw the peer come from (TCP: its IP and port; emulated: its name): behind NAT,
    # its router's public address. What the reachability check compares dial-back requests with.
    observed: Multiaddr | None = None
    relayed: bool = False  # the connection runs through a relay (net.relay), end to end
    # The network origin the peer's bytes come from (its IP and subnet; `Origin.relayed(relay)`
    # through a relay): what fair shares per origin count it under (`net.origins`).
    origin: Origin = UNKNOWN_ORIGIN


@dataclass
class TransportStats:
    """Bytes one transport put on and took off the wire since it started: the framed bytes of every
    connection it holds (handshakes, headers and keepalives included; not the TLS records' own
    overhead, about 22 bytes per 16 KiB record, nor the bytes of connections relayed through
    another, which count once, on the connection to the relay). Two ints: an add per frame."""

    bytes_sent: int = 0
    bytes_received: int = 0


class FrameLink(Protocol):
    """What a connection needs from the layer below: ordered frame delivery both ways."""

    async def send(self, frame: Frame) -> int:
        """Write a frame; returns once its bytes are handed to the OS. Returns its wire size."""

    def send_nowait(self, frame: Frame) -> None:
        """Queue a small control frame without waiting."""

    def close(self, reason: str | None = None) -> None:
        """Close the link; the connection's `link_lost` will be called."""


def call_shares() -> tuple[Shares, Shares]:
    """A transport's totals of handler calls and of their bytes in progress (the limits above)."""
    return (Shares("handler calls in progress", MAX_CALLS_IN_PROGRESS, per_subnet=MAX_CALLS_PER_SUBNET,
                   per_ip=MAX_CALLS_PER_IP, per_peer=MAX_CALLS_PER_PEER),
            Shares("bytes of requests and answers in progress", MAX_INFLIGHT_BYTES,
                   per_subnet=MAX_INFLIGHT_BYTES_PER_SUBNET, per_ip=MAX_INFLIGHT_BYTES_PER_IP,
                   per_peer=MAX_INFLIGHT_REQUEST_BYTES_PER_PEER))


class Load:
    """Where a connection counts its handler calls and their bytes: the transport's totals
    (`call_shares`), under the peer's id and origin, shared by all its connections. Nothing is kept
    for a peer once nothing of it is in progress (`Shares` keeps counts only while positive)."""

    __slots__ = ("calls", "nbytes", "origin", "peer")

    def __init__(self, shares: tuple[Shares, Shares], origin: Origin, peer: object):
        self.calls, self.nbytes = shares
        self.origin, self.peer = origin, peer

    def refusal(self, calls: int, nbytes: int) -> str | None:
        """Why `calls` more calls holding `nbytes` more bytes do not fit (None: they do)."""
        return ((calls and self.calls.refusal(self.origin, self.peer, calls))
                or (nbytes and self.nbytes.refusal(self.origin, self.peer, nbytes)) or None)

    def claim(self, calls: int, nbytes: int) -> None:
        if calls:
            self.calls.claim(self.origin, self.peer, calls)
        if nbytes:
            self.nbytes.claim(self.origin, self.peer, nbytes)

    def release(self, calls: int, nbytes: int) -> None:
        if calls:
            self.calls.release(self.origin, self.peer, calls)
        if nbytes:
            self.nbytes.release(self.origin, self.peer, nbytes)


class _Held:
    """The bytes one call holds in its connection's and peer's totals: its request's, then its
    answer's (a box, so that the call's task and its done-callback see the same number)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


@dataclass(frozen=True)
class _Failed:
    """A call's failure, passed as the future's result rather than set as its exception: the
    caller raises `detached(error)` (see there) instead of the stored object."""

    error: BaseException


@dataclass
class CallContext:
    """Handed to every handler: who is calling and until when."""

    peer_id: PeerID
    method: str
    deadline: float | None  # loop time
    connection: Connection
    remote: RemoteInfo = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def loopback(self) -> bool:
        """Whether this peer is calling itself (see `net.loopback`)."""
        return self.connection.loopback

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - asyncio.get_running_loop().time())


UnaryHandler = Callable[[Any, CallContext], Awaitable[Any]]
StreamHandler = Callable[["Stream", CallContext], Awaitable[None]]


class Handlers:
    """Method name -> handler, shared by all connections of a transport."""

    def __init__(self) -> None:
        self.unary: dict[str, UnaryHandler] = {}
        self.stream: dict[str, StreamHandler] = {}
        # A method's own longest deadline, below MAX_HANDLER_SECONDS / MAX_STREAM_HANDLER_SECONDS
        # (e.g. a DHT lookup step has no business running for minutes).
        self.unary_seconds: dict[str, float] = {}
        self.stream_seconds: dict[str, float] = {}


class Stream:
    """A two-way message stream with per-stream flow control (a byte window)."""

    def __init__(self, conn: Connection, call_id: int, method: str, deadline: float | None):
        self.connection = conn
        self.call_id = call_id
        self.method = method
        self.deadline = deadline
        self._inbox: deque[Frame] = deque()
        self._inbox_event = asyncio.Event()
        self._credit = STREAM_WINDOW
        self._credit_event = asyncio.Event()
        self._unacked = 0  # bytes handed to our consumer and not yet acknowledged to the sender
        self._outstanding = 0  # bytes received and not yet acknowledged (what the sender counts)
        self._sent_end = False
        self._received_end = False
        self._error: BaseException | None = None
        self.handler_task: asyncio.Task | None = None
        self.request: Any = None  # the body of the OPEN frame, for the handler
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def peer_id(self) -> PeerID:
        return self.connection.remote.peer_id

    @property
    def loopback(self) -> bool:
        """Whether this stream joins a peer to itself: its messages never leave the process."""
        return self.connection.loopback

    def _timeout(self, timeout: float | None) -> float | None:
        if self.deadline is None:
            return timeout
        left = self.deadline - asyncio.get_running_loop().time()
        return left if timeout is None else min(left, timeout)

    async def send(self, message: Any, timeout: float | None = None) -> None:
        """Send one message; waits while the receiver's window is full (backpressure)."""
        if self._sent_end:
            raise NetworkError("send() after close() on this stream")
        try:
            async with compat.timeout(self._timeout(timeout)):
                while self._credit <= 0 and self._error is None:
                    self._credit_event.clear()
                    await self._credit_event.wait()
                if self._error is not None:
                    raise detached(self._error)
                size = await self.connection.link.send(Frame(Kind.DATA, self.call_id, body=message))
        except TimeoutError:
            self.abort("deadline exceeded")
            raise DeadlineExceeded(f"stream {self.method!r} to {self.peer_id}: send timed out") from None
        self._credit -= size

    async def recv(self, timeout: float | None = None) -> Any:
        """The next message; raises EndOfStream when the other side is done sending."""
        try:
            async with compat.timeout(self._timeout(timeout)):
                while not self._inbox:
                    if self._error is not None:
                        raise detached(self._error)
                    if self._received_end:
                        raise EndOfStream(f"stream {self.method!r} from {self.peer_id} ended")
                    self._inbox_event.clear()
                    await self._inbox_event.wait()
        except TimeoutError:
            self.abort("deadline exceeded")
            raise DeadlineExceeded(f"stream {self.method!r} with {self.peer_id}: no message in time") from None
        frame = self._inbox.popleft()
        self.connection._unhold(0, frame.size)
        self._unacked += frame.size
        if self._unacked >= STREAM_WINDOW // 4 and not self._received_end and self._error is None:
            self.connection.link.send_nowait(Frame(Kind.WINDOW, self.call_id, {"n": self._unacked}))
            self._outstanding -= self._unacked
            self._unacked = 0
        if not self._inbox:
            # The last message of a stream already ended both ways: the connection lets go of it
            # now (END came while this message waited, so nothing else would: a stream per
            # all-reduce part stayed on the connection for its whole life).
            self.connection._maybe_forget(self)
        return frame.body

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.recv()
            except EndOfStream:
                return

    async def close(self) -> None:
        """Half-close: tell the other side we are done sending (it may still send to us)."""
        if not self._sent_end and self._error is None:
            self._sent_end = True
            self.connection.link.send_nowait(Frame(Kind.END, self.call_id))
            self.connection._maybe_forget(self)

    def abort(self, reason: str = "aborted") -> None:
        """Cancel the stream both ways; the remote handler is cancelled too."""
        if self._error is None:
            self._fail(CallCancelled(f"stream {self.method!r}: {reason}"))
            if not self.connection.closed:
                self.connection.link.send_nowait(Frame(Kind.CANCEL, self.call_id))
        # Nothing more is read from it (nor from one the other side ended with an error first), and
        # the other side may never answer the cancel: the connection lets go of it and of what it
        # holds now (aborted streams stayed for the connection's life, their messages counted).
        self._drop_inbox()
        self.connection._maybe_forget(self)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.abort(f"{exc_type.__name__} in the caller")
        else:
            await self.close()

    # -- called by the connection ---------------------------------------------------------------
    def _deliver(self, frame: Frame) -> None:
        if frame.kind is Kind.DATA:
            if self._error is not None:
                return  # the stream is over: nobody reads what still comes
            if len(self._inbox) >= MAX_STREAM_QUEUE:
                self.connection._protocol_violation("stream queue overflow: peer ignored flow control")
                return
            if self._outstanding >= STREAM_WINDOW:
                self.connection._protocol_violation(
                    f"stream window overrun: {self._outstanding} unacknowledged bytes on stream "
                    f"{self.method!r} (window {STREAM_WINDOW}); the peer ignored flow control")
                return
            busy = self.connection._busy(frame.size, calls=0)
            if busy is not None:  # messages waiting to be read count like requests
                self._fail(CallCancelled(f"stream {self.method!r}: {busy}"))
                self.connection.link.send_nowait(_error_frame(self.call_id, "Busy", f"{busy}; the stream is ended"))
                self._drop_inbox()
                self.connection._maybe_forget(self)
                return
            self.connection._hold(0, frame.size)
            self._outstanding += frame.size
            self._inbox.append(frame)
        elif frame.kind is Kind.END:
            self._received_end = True
        elif frame.kind is Kind.WINDOW:
            n = (frame.meta or {}).get("n")
            if isinstance(n, int) and n > 0:
                self._credit += n
                self._credit_event.set()
            return
        elif frame.kind is Kind.ERROR:
            self._fail(_remote_error(frame.meta))
        elif frame.kind is Kind.CANCEL:
            self._fail(CallCancelled(f"stream {self.method!r} was cancelled by {self.peer_id}"))
            if self.handler_task is not None:
                self.handler_task.cancel()
                self.handler_task = None  # its traceback will hold this stream: no way back
        self._inbox_event.set()
        self.connection._maybe_forget(self)

    def _drop_inbox(self) -> None:
        """Forget the messages nobody will read (they no longer count against the sender)."""
        self.connection._unhold(0, sum(frame.size for frame in self._inbox))
        self._inbox.clear()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._inbox_event.set()
        self._credit_event.set()
        self._check_done()

    def _check_done(self) -> None:
        if self.finished and not self.done.done():
            self.done.set_result(None)

    @property
    def finished(self) -> bool:
        return self._error is not None or (self._sent_end and self._received_end)


class Connection:
    """Multiplexes calls and streams over one link; fails everything pending when the link dies."""

    def __init__(self, handlers: Handlers, remote: RemoteInfo, initiator: bool,
                 keepalive_interval: float | None = None, keepalive_timeout: float | None = None,
                 on_close: Callable[[Connection], None] | None = None, load: Load | None = None):
        self.handlers = handlers
        self.remote = remote
        self.initiator = initiator
        self.link: FrameLink = None  # type: ignore[assignment] - set by attach()
        self.closed = False
        self.closed_here = False  # close() was called on this side
        self.close_reason: str | None = None
        self._next_id = 1 if initiator else 2  # odd ids for the dialer, even for the acceptor
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, Stream] = {}
        self._serving: dict[int, asyncio.Task] = {}
        self._inflight_bytes = 0  # sizes of the requests whose handlers are running, and their answers
        # The transport's totals (per peer, origin and in all); totals of its own where no transport
        # keeps them (the emulated network, calls to oneself: the per-connection limits bound it).
        self._load = load if load is not None else Load(call_shares(), remote.origin, remote.peer_id)
        self._on_close = on_close
        self._keepalive_interval = keepalive_interval
        self._keepalive_timeout = keepalive_timeout
        self._keepalive_task: asyncio.Task | None = None
        self.last_received = asyncio.get_running_loop().time()
        self.in_use = 0  # active bulk streams (for pooling dedicated connections)
        self.loopback = False  # joins this peer to itself in memory (net.loopback)

    def attach(self, link: FrameLink) -> None:
        self.link = link
        if self._keepalive_interval:
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())

    @property
    def peer_id(self) -> PeerID:
        return self.remote.peer_id

    @property
    def relayed(self) -> bool:
        """Whether this connection runs through a relay (`net.relay`)."""
        return self.remote.relayed

    @property
    def idle(self) -> bool:
        """No call or stream in progress either way (it can be closed without cutting one)."""
        return not (self._pending or self._streams or self._serving)

    def _new_id(self) -> int:
        call_id = self._next_id
        self._next_id += 2
        return call_id

    # -- outgoing -------------------------------------------------------------------------------
    async def call(self, method: str, body: Any = None, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> Any:
        """Send a request and wait for its response, at most `timeout` seconds."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.peer_id} is closed: {self.close_reason}")
        call_id = self._new_id()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[call_id] = future
        cancelling = _cancel_requests()
        # The deadline is one timer (see `_expire`), not a timeout context: this is every call's
        # path, and a timeout context (compat.timeout) costs about three times as much. (No local
        # names the task: a raised error's traceback would hold this frame, and the task the error.)
        timer = None if timeout is None else loop.call_later(timeout, _expire, future, asyncio.current_task())
        try:
            await self.link.send(Frame(Kind.REQUEST, call_id, {"m": method, "t": timeout}, body))
            reply = await future
        except asyncio.CancelledError:
            if not self.closed:
                self.link.send_nowait(Frame(Kind.CANCEL, call_id))
            if not _expired(future, cancelling):
                raise
            reply = _EXPIRED
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(call_id, None)
        if reply is _EXPIRED:
            raise DeadlineExceeded(f"call {method!r} to {self.peer_id} got no answer within {timeout} s")
        if isinstance(reply, _Failed):
            raise detached(reply.error)
        return reply

    async def open_stream(self, method: str, body: Any = None,
                          timeout: float | None = DEFAULT_STREAM_TIMEOUT) -> Stream:
        """Open a stream to `method`; `timeout` bounds the stream's whole life."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.peer_id} is closed: {self.close_reason}")
        call_id = self._new_id()
        loop = asyncio.get_running_loop()
        stream = Stream(self, call_id, method, None if timeout is None else loop.time() + timeout)
        self._streams[call_id] = stream
        await self.link.send(Frame(Kind.OPEN, call_id, {"m": method, "t": timeout}, body))
        return stream

    # -- incoming -------------------------------------------------------------------------------
    def frame_received(self, frame: Frame) -> None:
        if self.closed:  # the rest of a batch read before the link closed: nothing is served now
            return
        self.last_received = asyncio.get_running_loop().time()
        kind = frame.kind
        if kind is Kind.RESPONSE or (kind is Kind.ERROR and frame.call_id in self._pending):
            future = self._pending.get(frame.call_id)
            if future is not None and not future.done():
                future.set_result(frame.body if kind is Kind.RESPONSE else _Failed(_remote_error(frame.meta)))
            return  # else: the answer to a call that timed out or was cancelled; drop it
        if kind is Kind.REQUEST:
            self._serve_request(frame)
        elif kind is Kind.OPEN:
            self._serve_stream(frame)
        elif kind is Kind.CANCEL:
            # Forget the task now: one cancelled before it started never runs its own cleanup.
            task = self._serving.pop(frame.call_id, None)
            if task is not None:
                task.cancel()
            stream = self._streams.get(frame.call_id)
            if stream is not None:
                stream._deliver(frame)
        elif kind in (Kind.DATA, Kind.END, Kind.WINDOW, Kind.ERROR):
            stream = self._streams.get(frame.call_id)
            if stream is not None:
                stream._deliver(frame)
            # else: a late frame for a finished stream; dropping it is correct
        elif kind is Kind.PING:
            self.link.send_nowait(Frame(Kind.PONG))
        elif kind is Kind.PONG:
            pass
        elif kind is Kind.GOAWAY:
            reason = (frame.meta or {}).get("reason", "no reason given")
            self.link.close(f"{self.peer_id} closed the connection: {reason}")
        else:
            self._protocol_violation(f"unexpected {kind.name} frame after the handshake")

    def _protocol_violation(self, reason: str) -> None:
        logger.warning("closing connection to %s: %s", self.peer_id, reason)
        if not self.closed:
            self.link.send_nowait(Frame(Kind.GOAWAY, meta={"reason": reason}))
            self.link.close(reason)

    def _deadline(self, meta: dict, stream: bool = False) -> tuple[str, float | None] | None:
        method, timeout = meta.get("m"), meta.get("t")
        if not isinstance(method, str) or not (timeout is None or isinstance(timeout, (int, float))):
            return None
        if stream:
            longest = self.handlers.stream_seconds.get(method, MAX_STREAM_HANDLER_SECONDS)
        else:
            longest = self.handlers.unary_seconds.get(method, MAX_HANDLER_SECONDS)
        loop = asyncio.get_running_loop()
        seconds = longest if timeout is None else float(timeout)
        if not 0.0 <= seconds <= longest:  # also refuses NaN
            seconds = longest if seconds > 0 else 0.0
        return method, loop.time() + seconds

    def _serve_request(self, frame: Frame) -> None:
        parsed = self._deadline(frame.meta or {})
        if parsed is None or frame.call_id in self._serving:
            self.link.send_nowait(_error_frame(frame.call_id, "ProtocolError", "malformed request"))
            return
        method, deadline = parsed
        handler = self.handlers.unary.get(method)
        if handler is None:
            self.link.send_nowait(_error_frame(frame.call_id, "MethodNotFound",
                                               f"{method!r} is not served by this peer"))
            return
        busy = self._busy(frame.size)
        if busy is not None:
            self.link.send_nowait(_error_frame(frame.call_id, "Busy", busy))
            return
        ctx = CallContext(self.peer_id, method, deadline, self, self.remote)
        loop = asyncio.get_running_loop()
        held = _Held(frame.size)
        task = loop.create_task(self._run_unary(handler, frame, ctx, held))
        # One timer cancels the handler at its deadline, the answer's sending included: cheaper
        # than a timeout context in the task (every DHT request comes here).
        self._request_started(task, frame.call_id, held, loop.call_at(deadline, task.cancel))
        self._serving[frame.call_id] = task

    def _busy(self, size: int, calls: int = 1) -> str | None:
        """Why `calls` more calls holding `size` more bytes cannot be served now (the limits above)."""
        if calls and len(self._serving) >= MAX_CONCURRENT_CALLS:
            return "too many concurrent calls"
        if self._inflight_bytes and self._inflight_bytes + size > MAX_INFLIGHT_REQUEST_BYTES:
            return f"over {MAX_INFLIGHT_REQUEST_BYTES} bytes of requests and answers in progress"
        return self._load.refusal(calls, size)

    def _hold(self, calls: int, size: int) -> None:
        self._inflight_bytes += size
        self._load.claim(calls, size)

    def _unhold(self, calls: int, size: int) -> None:
        self._inflight_bytes -= size
        self._load.release(calls, size)

    def _request_started(self, task: asyncio.Task, call_id: int, held: _Held,
                         timer: asyncio.TimerHandle | None = None) -> None:
        self._hold(1, held.nbytes)
        # A callback, not the task's own cleanup: a task cancelled before it starts never runs that.
        task.add_done_callback(lambda done: self._request_done(done, call_id, held, timer))

    async def _run_unary(self, handler: UnaryHandler, frame: Frame, ctx: CallContext, held: _Held) -> None:
        """Run a request's handler and send its answer; the deadline's timer (`_serve_request`)
        cancels it, the answer's sending included. Once the handler returns, the call holds its
        answer instead of its request until the answer is written: a caller that does not read
        what it asked for is held to its shares like one that sends."""
        call_id = frame.call_id
        try:
            result = await handler(frame.body, ctx)
            frame.body = None
            self._unhold(0, held.nbytes)
            held.nbytes = size = estimated_size(result)
            busy = self._busy(size, calls=0)
            if busy is not None:
                held.nbytes, result = 0, None
                await self.link.send(_error_frame(call_id, "Busy", f"{busy}; the {size}-byte answer is dropped"))
                return
            self._hold(0, size)
            await self.link.send(Frame(Kind.RESPONSE, call_id, body=result))
        except asyncio.CancelledError:
            pass  # the deadline passed, or cancelled by the caller or by shutdown: nobody waits
        except Exception as e:  # noqa: BLE001 - report the handler's failure to the caller
            if not isinstance(e, (NetworkError,)):
                logger.debug("handler %r failed", ctx.method, exc_info=True)
            if not self.closed:
                try:
                    await self.link.send(_error_frame(call_id, type(e).__name__, str(e)))
                except Exception:  # noqa: BLE001 - e.g. the error text itself is unsendable
                    logger.debug("could not report handler error", exc_info=True)
        finally:
            frame.body = None  # the request's bytes go now, not when the task object does

    def _request_done(self, task: asyncio.Task, call_id: int, held: _Held, timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()
        if self._serving.get(call_id) is task:
            del self._serving[call_id]
        self._unhold(1, held.nbytes)

    def _serve_stream(self, frame: Frame) -> None:
        parsed = self._deadline(frame.meta or {}, stream=True)
        if parsed is None or frame.call_id in self._streams:
            self.link.send_nowait(_error_frame(frame.call_id, "ProtocolError", "malformed stream open"))
            return
        method, deadline = parsed
        handler = self.handlers.stream.get(method)
        if handler is None:
            self.link.send_nowait(_error_frame(frame.call_id, "MethodNotFound",
                                               f"stream {method!r} is not served by this peer"))
            return
        busy = self._busy(frame.size)  # the OPEN request is held while the handler runs
        if busy is not None:
            self.link.send_nowait(_error_frame(frame.call_id, "Busy", busy))
            return
        stream = Stream(self, frame.call_id, method, deadline)
        stream.request = frame.body
        self._streams[frame.call_id] = stream
        ctx = CallContext(self.peer_id, method, deadline, self, self.remote)
        task = asyncio.get_running_loop().create_task(self._run_stream(handler, stream, ctx))
        self._request_started(task, frame.call_id, _Held(frame.size))
        stream.handler_task = task
        self._serving[frame.call_id] = task

    async def _run_stream(self, handler: StreamHandler, stream: Stream, ctx: CallContext) -> None:
        try:
            async with compat.timeout_at(ctx.deadline):
                await handler(stream, ctx)
            await stream.close()
        except (asyncio.CancelledError, TimeoutError, CallCancelled):
            stream.abort("handler stopped")
        except Exception as e:  # noqa: BLE001 - report the handler's failure to the caller
            logger.debug("stream handler %r failed", ctx.method, exc_info=True)
            if not self.closed and stream._error is None:
                self.link.send_nowait(_error_frame(stream.call_id, type(e).__name__, str(e)))
            stream._fail(e)
        finally:
            self._serving.pop(stream.call_id, None)
            stream._fail(CallCancelled("stream handler finished"))
            self._streams.pop(stream.call_id, None)
            stream.handler_task = None  # the finished task's error would hold this frame: a cycle
            stream.request = None  # its bytes go now (they are no longer counted)
            stream._drop_inbox()  # what the handler left unread

    def _maybe_forget(self, stream: Stream) -> None:
        stream._check_done()
        if stream.finished and stream.handler_task is None and not stream._inbox:
            self._streams.pop(stream.call_id, None)

    # -- liveness and teardown -------------------------------------------------------------------
    async def _keepalive(self) -> None:
        interval, timeout = self._keepalive_interval, self._keepalive_timeout or 3 * self._keepalive_interval
        while not self.closed:
            await asyncio.sleep(interval)
            silent = asyncio.get_running_loop().time() - self.last_received
            if silent >= timeout:
                self.link.close(f"no data from {self.peer_id} for {silent:.1f} s (keepalive timeout)")
                return
            if silent >= interval:
                self.link.send_nowait(Frame(Kind.PING))

    def link_lost(self, reason: str | None) -> None:
        """Called by the link once it is closed, whatever the cause."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason or "closed"
        error = ConnectionLost(f"connection to {self.peer_id} lost: {self.close_reason}")
        for future in self._pending.values():
            if not future.done():
                future.set_result(_Failed(error))
        # Streams and handler tasks point back here (tasks through their tracebacks once
        # cancelled): the closed connection lets go of them, so nothing is left in a cycle.
        for stream in list(self._streams.values()):
            stream._fail(error)
            stream._drop_inbox()
            stream.handler_task = None
        self._streams.clear()
        for task in list(self._serving.values()):
            task.cancel()
        self._serving.clear()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            self._keepalive_task = None  # once cancelled, its traceback would hold this connection
        if self._on_close is not None:
            self._on_close(self)

    def close(self, reason: str = "closed by this peer") -> None:
        if not self.closed:
            self.closed_here = True
            self.link.close(reason)

    @property
    def lost(self) -> bool:
        """Closed by the other side or the network (a reset, end of file, keepalive expired)."""
        return self.closed and not self.closed_here


# What a call's future holds once its deadline passed first (see `_expire`).
_EXPIRED = object()
# Python 3.11+ tasks count cancellation requests, so a call can tell its own deadline's from
# another one that came as well; 3.10's do not (there, the deadline's is taken as the only one).
_CANCELS_COUNTED = hasattr(asyncio.Task, "uncancel")


def _expire(future: asyncio.Future, task: asyncio.Task) -> None:
    """A call's deadline, unless it has its answer: mark the answer `_EXPIRED` and cancel the
    call's task, whether it is still sending the request or waiting (as compat.timeout does)."""
    if not future.done():
        future.set_result(_EXPIRED)
        task.cancel()


def _cancel_requests() -> int:
    """The current task's pending cancellation requests (0 on 3.10, which does not count them)."""
    return asyncio.current_task().cancelling() if _CANCELS_COUNTED else 0


def _expired(future: asyncio.Future, cancelling: int) -> bool:
    """Whether the current task's cancellation was its call's deadline alone (then it is
    withdrawn); `cancelling`: its requests before the call."""
    if not future.done() or future.cancelled() or future.result() is not _EXPIRED:
        return False
    return asyncio.current_task().uncancel() <= cancelling if _CANCELS_COUNTED else True


def _error_frame(call_id: int, type_name: str, message: str) -> Frame:
    return Frame(Kind.ERROR, call_id, {"type": type_name, "msg": message[:4096]})


def _remote_error(meta: dict | None) -> RemoteError:
    meta = meta or {}
    type_name = str(meta.get("type", "Exception"))
    message = str(meta.get("msg", ""))
    cls = MethodNotFound if type_name == "MethodNotFound" else RemoteError
    return cls(f"remote {type_name}: {message}", remote_type=type_name)
