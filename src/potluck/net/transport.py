"""The transport interface every layer above uses, shared by real TCP and the emulated network.

A `Transport` is one peer's presence on the network: its handlers, its address book and its
connections. Subclasses only know how to dial an address and how to accept; everything else
(connection reuse, dedicated connections for bulk streams, client mode) lives here once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from potluck.core import compat
from potluck.core.errors import ConnectionLost, NetworkError, PeerUnreachable, detached
from potluck.net.address import Multiaddr
from potluck.net.connection import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_STREAM_TIMEOUT,
    Connection,
    Handlers,
    RemoteInfo,
    Stream,
    StreamHandler,
    UnaryHandler,
)
from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE
from potluck.net.identity import Identity, PeerID
from potluck.net.loopback import LoopbackLink

logger = logging.getLogger(__name__)

# Idle dedicated (bulk) connections kept per peer for the next stream, and for how long.
MAX_IDLE_BULK_CONNECTIONS = 4
IDLE_BULK_SECONDS = 30.0

# Keepalive: ping after this much silence; declare the peer dead after the timeout. A killed
# process is noticed at once (TCP reset); these catch a frozen or unplugged one.
KEEPALIVE_INTERVAL = 10.0
KEEPALIVE_TIMEOUT = 30.0

# Addresses remembered per peer; a peer that advertises more is trimmed (it gains nothing).
MAX_ADDRESSES_PER_PEER = 8


class Transport:
    """Base class: handlers, address book, connection pool, calls and streams."""

    def __init__(self, identity: Identity, *, client_mode: bool = False,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 dial_timeout: float = 10.0,
                 keepalive_interval: float | None = KEEPALIVE_INTERVAL,
                 keepalive_timeout: float | None = KEEPALIVE_TIMEOUT):
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.client_mode = client_mode
        self.max_frame_size = max_frame_size
        self.dial_timeout = dial_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.handlers = Handlers()
        self._address_book: dict[PeerID, list[Multiaddr]] = {}
        self._shared: dict[PeerID, list[Connection]] = {}
        self._bulk_idle: dict[PeerID, list[Connection]] = {}
        self._all: dict[Connection, None] = {}  # ordered, so shutdown order is repeatable
        self._dialing: dict[PeerID, asyncio.Future] = {}
        self._idle_timers: dict[Connection, asyncio.TimerHandle] = {}
        self._loopback: Connection | None = None  # the calling side of calls to ourselves
        self._closed = False
        # Protocol services that exist once per transport (they own a set of handlers); kept
        # here so they live exactly as long as the transport.
        self.services: dict[str, Any] = {}

    # -- to be provided by subclasses -----------------------------------------------------------
    @property
    def addresses(self) -> list[Multiaddr]:
        """Where others can reach this peer (empty in client mode)."""
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def _dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool) -> Connection:
        """Open, handshake and attach a connection; raise PeerUnreachable / HandshakeError."""
        raise NotImplementedError

    async def _stop_listening(self) -> None:
        raise NotImplementedError

    # -- handlers -------------------------------------------------------------------------------
    def add_handler(self, method: str, handler: UnaryHandler) -> None:
        """Serve `method`: `async def handler(request, ctx) -> response`."""
        self.handlers.unary[method] = handler

    def add_stream_handler(self, method: str, handler: StreamHandler) -> None:
        """Serve streams of `method`: `async def handler(stream, ctx) -> None`."""
        self.handlers.stream[method] = handler

    def remove_handler(self, method: str) -> None:
        self.handlers.unary.pop(method, None)
        self.handlers.stream.pop(method, None)

    # -- address book ---------------------------------------------------------------------------
    def add_addresses(self, peer_id: PeerID, addresses: Iterable[Multiaddr | str]) -> None:
        """Remember where `peer_id` can be dialed (e.g. learned from the DHT)."""
        if peer_id == self.peer_id:
            return
        known = self._address_book.setdefault(peer_id, [])
        for addr in addresses:
            addr = Multiaddr.parse(addr) if isinstance(addr, str) else addr
            if addr.peer_id is not None:
                addr = addr.without_peer_id()
            if addr not in known:
                known.insert(0, addr)  # newest first: the most likely to be current
        del known[MAX_ADDRESSES_PER_PEER:]

    def addresses_of(self, peer_id: PeerID) -> list[Multiaddr]:
        return list(self._address_book.get(peer_id, ()))

    def is_connected(self, peer_id: PeerID) -> bool:
        return any(not c.closed for c in self._shared.get(peer_id, ()))

    def connected_peers(self) -> list[PeerID]:
        return [p for p, conns in self._shared.items() if any(not c.closed for c in conns)]

    # -- connections ----------------------------------------------------------------------------
    async def connect(self, address: Multiaddr | str, timeout: float | None = None) -> PeerID:
        """Dial an address, authenticate the peer there and return its id.

        If the address ends in /p2p/<id>, the peer must prove it holds that id's key.
        """
        addr = Multiaddr.parse(address) if isinstance(address, str) else address
        timeout = self.dial_timeout if timeout is None else timeout
        try:
            async with compat.timeout(timeout):
                conn = await self._dial(addr.without_peer_id(), addr.peer_id, bulk=False)
        except TimeoutError:
            raise PeerUnreachable(f"could not reach {addr} within {timeout} s") from None
        self.add_addresses(conn.peer_id, [addr])
        return conn.peer_id

    def _register(self, conn: Connection) -> None:
        """Called by subclasses once a connection is authenticated (either direction)."""
        if self._closed:
            conn.close("transport is shutting down")
            return
        if conn.closed:
            return
        self._all[conn] = None
        if conn.remote.addresses:
            self.add_addresses(conn.peer_id, conn.remote.addresses)
        if not conn.remote.bulk:
            self._shared.setdefault(conn.peer_id, []).append(conn)

    def _unregister(self, conn: Connection) -> None:
        self._all.pop(conn, None)
        timer = self._idle_timers.pop(conn, None)
        if timer is not None:
            timer.cancel()
        for pool in (self._shared, self._bulk_idle):
            conns = pool.get(conn.peer_id)
            if conns and conn in conns:
                conns.remove(conn)
                if not conns:
                    del pool[conn.peer_id]

    async def _shared_connection(self, peer_id: PeerID, timeout: float | None) -> Connection:
        for conn in self._shared.get(peer_id, ()):
            if not conn.closed:
                return conn
        # One dial per peer at a time: concurrent callers wait for the same attempt.
        pending = self._dialing.get(peer_id)
        if pending is None:
            pending = asyncio.ensure_future(self._dial_known(peer_id, bulk=False))
            self._dialing[peer_id] = pending
            pending.add_done_callback(lambda f: (self._dialing.pop(peer_id, None), f.cancelled() or f.exception()))
        try:
            async with compat.timeout(timeout):
                await asyncio.wait([pending])  # our deadline or cancellation leaves the dial going
        except TimeoutError:
            raise PeerUnreachable(f"could not connect to {peer_id} within {timeout} s") from None
        if not pending.cancelled() and pending.exception() is not None:
            raise detached(pending.exception())  # shared by every waiter: raise a copy of it
        return pending.result()

    async def _dial_known(self, peer_id: PeerID, bulk: bool) -> Connection:
        addresses = self._address_book.get(peer_id)
        if not addresses:
            raise PeerUnreachable(f"no known address for {peer_id} (it may be in client mode, or "
                                  "was never announced); add one with add_addresses()")
        errors = []
        for addr in list(addresses):
            try:
                async with compat.timeout(self.dial_timeout):
                    return await self._dial(addr, peer_id, bulk=bulk)
            except (NetworkError, OSError, TimeoutError) as e:
                errors.append(f"{addr}: {str(e) or type(e).__name__}")
        raise PeerUnreachable(f"could not connect to {peer_id}: " + "; ".join(errors))

    def _loopback_connection(self) -> Connection:
        """The in-memory connection to ourselves (see `net.loopback`), made on first use."""
        if self._closed:
            raise ConnectionLost("this peer is shut down")
        conn = self._loopback
        if conn is None or conn.closed:
            remote = RemoteInfo(self.peer_id, tuple(a.without_peer_id() for a in self.addresses),
                                self.client_mode, self.max_frame_size)
            conn = Connection(self.handlers, remote, True, on_close=self._loopback_lost)
            served = Connection(self.handlers, remote, False, on_close=self._loopback_lost)
            LoopbackLink.pair(conn, served, self.max_frame_size)
            self._loopback = conn
        return conn

    def _loopback_lost(self, conn: Connection) -> None:
        if self._loopback is conn:
            self._loopback = None

    def _close_loopback(self, reason: str) -> None:
        if self._loopback is not None:
            self._loopback.close(reason)

    async def call(self, peer_id: PeerID, method: str, request: Any = None, *,
                   timeout: float | None = DEFAULT_CALL_TIMEOUT) -> Any:
        """Call `method` on `peer_id` and return its response, within `timeout` seconds overall.
        A call to our own id is served by our own handlers in memory (`net.loopback`)."""
        if peer_id == self.peer_id:
            return await self._loopback_connection().call(method, request, timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        conn = await self._shared_connection(peer_id, timeout)
        left = None if deadline is None else max(0.0, deadline - loop.time())
        return await conn.call(method, request, left)

    async def open_stream(self, peer_id: PeerID, method: str, request: Any = None, *,
                          timeout: float | None = DEFAULT_STREAM_TIMEOUT,
                          dedicated: bool | None = None) -> Stream:
        """Open a stream to `peer_id`. Bulk streams get a connection of their own (TCP does the
        flow control and small calls are not stuck behind them); `dedicated=None` does that
        whenever the peer can be dialed, and reuses the shared connection otherwise. A stream to
        our own id runs in memory (`net.loopback`); `stream.loopback` tells so."""
        if peer_id == self.peer_id:
            return await self._loopback_connection().open_stream(method, request, timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if dedicated is None:
            dedicated = bool(self._address_book.get(peer_id)) or bool(self._bulk_idle.get(peer_id))
        if dedicated:
            conn = await self._bulk_connection(peer_id, timeout)
        else:
            conn = await self._shared_connection(peer_id, timeout)
        left = None if deadline is None else max(0.0, deadline - loop.time())
        stream = await conn.open_stream(method, request, left)
        if dedicated:
            conn.in_use += 1
            stream.done.add_done_callback(lambda _: self._recycle(conn))
        return stream

    async def _bulk_connection(self, peer_id: PeerID, timeout: float | None) -> Connection:
        idle = self._bulk_idle.get(peer_id, [])
        while idle:
            conn = idle.pop()
            timer = self._idle_timers.pop(conn, None)
            if timer is not None:
                timer.cancel()
            if not conn.closed:
                return conn
        try:
            async with compat.timeout(timeout):
                conn = await self._dial_known(peer_id, bulk=True)
        except TimeoutError:
            raise PeerUnreachable(f"could not connect to {peer_id} within {timeout} s") from None
        return conn

    def _recycle(self, conn: Connection) -> None:
        """Return a dedicated connection to the idle pool once its stream is over."""
        conn.in_use -= 1
        if conn.closed or self._closed or conn.in_use:
            return
        idle = self._bulk_idle.setdefault(conn.peer_id, [])
        if len(idle) >= MAX_IDLE_BULK_CONNECTIONS:
            conn.close("too many idle bulk connections")
            return
        idle.append(conn)
        self._idle_timers[conn] = asyncio.get_running_loop().call_later(
            IDLE_BULK_SECONDS, self._expire_idle, conn)

    def _expire_idle(self, conn: Connection) -> None:
        self._idle_timers.pop(conn, None)
        idle = self._bulk_idle.get(conn.peer_id, [])
        if conn in idle and conn.in_use == 0:
            idle.remove(conn)
            conn.close("idle bulk connection expired")

    async def close(self) -> None:
        """Stop listening and close every connection; pending calls fail with ConnectionLost."""
        if self._closed:
            return
        self._closed = True
        await self._stop_listening()
        self._close_loopback("peer is shutting down")
        for conn in list(self._all):
            conn.close("peer is shutting down")
        for fut in list(self._dialing.values()):
            fut.cancel()
        await asyncio.sleep(0)
