"""Circuit relays: a public peer pipes bytes between a dialer and a peer behind NAT.

A peer behind NAT cannot be dialed, but it can dial out. It *reserves* a slot on a public relay
R (unary `relay.reserve`, over its own connection to R) and publishes circuit addresses
`<R's address>/p2p/<R>/p2p-circuit/p2p/<its id>`. A dialer D opens stream `relay.hop` {target} to
R; R checks the target's reservation and its caps, opens stream `relay.stop` {source} to the
target over the target's own connection, and pipes byte chunks between the two streams (their
windows give backpressure end to end). Over that byte pipe D and the target run an ordinary
connection: on TCP end-to-end TLS 1.3 and the usual HELLO/AUTH handshake (`net.tcp`), so the relay
can neither read nor alter what it pipes, only drop it; on the emulated network frames with the
trusted hello (`net.emulated`). A peer accepts `relay.stop` only from a relay it holds a
reservation with, and counts relayed connections in its caps under the key `relay:<relay id>`.

Circuits do not nest: reservations and hops over a relayed connection are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from potluck.core.errors import (
    AddressError,
    ConnectionLost,
    EndOfStream,
    MalformedMessage,
    NetworkError,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
)
from potluck.core.wire import list_field, number_field, wire_map
from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.connection import CallContext, Connection, Stream
from potluck.net.identity import PeerID
from potluck.net.wire import addresses_to_wire, addresses_value, peer_id_value

if TYPE_CHECKING:
    from potluck.net.transport import Transport

__all__ = [
    "RELAY_HOP", "RELAY_RESERVE", "RELAY_STOP", "RelayLimits", "RelayRefused", "RelayService", "Reservation",
    "StreamPipe", "accept_stop", "dial_circuit", "reserve", "serve_stop",
]

logger = logging.getLogger(__name__)

RELAY_RESERVE = "relay.reserve"
RELAY_HOP = "relay.hop"
RELAY_STOP = "relay.stop"

# -- The relay's caps (RelayLimits' defaults) -------------------------------------------------------
# Reservations held at once. Each is a peer's connection kept open to us (a file descriptor and a
# few KiB); 128 keeps a relay well inside net.tcp.MAX_CONNECTIONS (768) with room for its own work
# and the circuits' connections, while serving a swarm where several relays share the NATed peers.
MAX_RESERVATIONS = 128
# Circuits piped at once. A circuit holds up to a stream window (connection.STREAM_WINDOW, 16 MiB)
# per direction when one end stops reading, so 64 circuits bound what a relay can be made to buffer
# at 2 GiB in the worst case (a few MiB in practice: the pipe forwards as fast as it receives).
MAX_CIRCUITS = 64
# Circuits from one dialing peer: its shared connection, the idle bulk ones a transport keeps
# (transport.MAX_IDLE_BULK_CONNECTIONS = 4) and a few active bulk streams. More is one peer taking
# the relay's circuits from the others.
MAX_CIRCUITS_PER_PEER = 8
# Bytes one dialing peer may have piped (both directions of all its circuits) per window. 1 GiB a
# minute (~140 Mbit/s) carries calls, expert batches and a model's state download through a home
# uplink, and keeps one peer from spending a volunteer relay's whole bandwidth for long; past it the
# peer's circuits end, with an error that says so, until the window turns.
MAX_BYTES_PER_PEER = 2**30
BYTES_WINDOW_SECONDS = 60.0
# How long a reservation lasts unless renewed (the client renews before it ends). An hour, as
# libp2p's relays: long enough that renewals cost nothing, short enough that a peer that left
# without closing its connection frees its slot.
RESERVATION_TTL = 3600.0

# -- Fixed protocol constants -----------------------------------------------------------------------
# Largest byte chunk a pipe message may carry. The pipes send at most PIPE_CHUNK; the relay refuses
# more, so one message cannot fill a stream window at once.
PIPE_CHUNK = 256 * 2**10
MAX_PIPE_CHUNK = 4 * PIPE_CHUNK
# Bytes a pipe queues for writing before it pauses its protocol (TLS, frames); the stream window
# (16 MiB) is the real buffer, this only smooths the hand-over.
PIPE_HIGH_WATER = 4 * 2**20
# After closing its sending half, a pipe waits this long for the other side's end before it
# aborts the stream (so a relay or a peer that never answers cannot hold it).
PIPE_CLOSE_GRACE = 5.0
# The target must accept a relay.stop within this (it only checks its reservation and answers);
# a relay must answer a hop within a dial timeout (the dialer's own deadline).
STOP_ACCEPT_TIMEOUT = 10.0
# A reservation call's default deadline.
RESERVE_TIMEOUT = 10.0

_OK = {"ok": True}


class RelayRefused(NetworkError):
    """A relay (or the target behind it) refused a reservation, circuit or relayed connection."""


@dataclass(frozen=True)
class RelayLimits:
    """A relay's caps (see the module constants for why each default)."""

    max_reservations: int = MAX_RESERVATIONS
    max_circuits: int = MAX_CIRCUITS
    max_circuits_per_peer: int = MAX_CIRCUITS_PER_PEER
    max_bytes_per_peer: int = MAX_BYTES_PER_PEER
    bytes_window: float = BYTES_WINDOW_SECONDS
    reservation_ttl: float = RESERVATION_TTL


@dataclass(frozen=True)
class Reservation:
    """A slot held on `relay` until `expires` (loop time) while our connection to it lives;
    `addresses`: our circuit addresses through it."""

    relay: PeerID
    expires: float
    addresses: list[Multiaddr]


# -- Messages ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReserveReply:
    ttl: float
    addresses: tuple[str, ...]

    def to_wire(self) -> dict:
        return {"ttl": self.ttl, "addrs": list(self.addresses)}

    @classmethod
    def from_wire(cls, msg: Any) -> ReserveReply:
        msg = wire_map(msg, "relay reservation")
        ttl = number_field(msg, "ttl", "relay reservation", positive=True)
        addrs = addresses_value(list_field(msg, "addrs", "relay reservation", MAX_ADDRESSES_PER_PEER),
                                "addrs", "relay reservation")
        return cls(ttl, addrs)


def _peer_message(msg: Any, key: str, what: str) -> PeerID:
    return peer_id_value(wire_map(msg, what).get(key), key, what, raw=True)


def _check_ok(msg: Any, what: str) -> None:
    if not isinstance(msg, Mapping) or msg.get("ok") is not True:
        raise ProtocolError(f"{what}: expected an acceptance, got {type(msg).__name__}")


# -- The relay --------------------------------------------------------------------------------------
@dataclass
class _Held:
    connection: Connection
    expires: float


@dataclass
class _Usage:
    window_start: float
    used: int = 0
    circuits: int = 0


@dataclass
class RelayService:
    """Serves `relay.reserve` and `relay.hop` on a public peer (`potluck peer --relay`)."""

    transport: Transport
    limits: RelayLimits = field(default_factory=RelayLimits)

    def __post_init__(self) -> None:
        self._reservations: dict[PeerID, _Held] = {}
        self._usage: dict[PeerID, _Usage] = {}  # an entry per peer with a circuit or a charge this window
        self._circuits = 0
        self._hops: set[asyncio.Task] = set()

    def start(self) -> None:
        if self.transport.forced_client:
            raise ValueError("a peer in forced client mode cannot relay (it is not reachable)")
        self.transport.add_handler(RELAY_RESERVE, self._reserve)
        self.transport.add_stream_handler(RELAY_HOP, self._hop)

    def close(self) -> None:
        for method in (RELAY_RESERVE, RELAY_HOP):
            self.transport.remove_handler(method)
        for task in list(self._hops):
            task.cancel()
        self._reservations.clear()

    @property
    def reservations(self) -> int:
        self._prune()
        return len(self._reservations)

    @property
    def circuits(self) -> int:
        return self._circuits

    def _prune(self) -> None:
        now = asyncio.get_running_loop().time()
        for peer, held in list(self._reservations.items()):
            if held.connection.closed or held.expires <= now:
                del self._reservations[peer]

    async def _reserve(self, request: Any, ctx: CallContext) -> dict:
        if ctx.connection.remote.relayed:
            raise RelayRefused("circuits do not nest: reserve over a direct connection to the relay")
        addrs = [Multiaddr.circuit(a, ctx.peer_id) for a in self.transport.addresses if not a.is_circuit]
        if not addrs:
            raise RelayRefused("this relay has no public address to offer")
        self._prune()
        if ctx.peer_id not in self._reservations and len(self._reservations) >= self.limits.max_reservations:
            raise RelayRefused(f"this relay is full ({self.limits.max_reservations} reservations)")
        ttl = self.limits.reservation_ttl
        self._reservations[ctx.peer_id] = _Held(ctx.connection, asyncio.get_running_loop().time() + ttl)
        return ReserveReply(ttl, addresses_to_wire(addrs)).to_wire()

    async def _hop(self, stream: Stream, ctx: CallContext) -> None:
        source = ctx.peer_id
        target = _peer_message(stream.request, "peer", "relay hop")
        if ctx.connection.remote.relayed:
            raise RelayRefused("circuits do not nest: dial the relay directly")
        self._prune()
        held = self._reservations.get(target)
        if held is None:
            raise RelayRefused(f"{target} holds no reservation on this relay")
        if self._circuits >= self.limits.max_circuits:
            raise RelayRefused(f"this relay pipes too many circuits (limit {self.limits.max_circuits})")
        usage = self._usage_of(source)
        if usage.circuits >= self.limits.max_circuits_per_peer:
            raise RelayRefused(f"too many circuits from {source} (limit {self.limits.max_circuits_per_peer} per peer)")
        self._charge(source, 0)
        self._circuits += 1
        usage.circuits += 1
        task = asyncio.current_task()
        assert task is not None
        self._hops.add(task)
        out: Stream | None = None
        try:
            out = await held.connection.open_stream(RELAY_STOP, {"src": source.to_bytes()}, timeout=None)
            try:
                _check_ok(await out.recv(timeout=STOP_ACCEPT_TIMEOUT), "relay.stop")
            except (RemoteError, ConnectionLost, EndOfStream) as e:
                raise RelayRefused(f"{target} did not accept the relayed connection: {e}") from None
            await stream.send(_OK)
            await self._pipe(stream, out, source)
        finally:
            self._hops.discard(task)
            self._circuits -= 1
            usage.circuits -= 1
            if out is not None and not out.finished:
                out.abort("the circuit ended")

    async def _pipe(self, dialer: Stream, target: Stream, source: PeerID) -> None:
        """Forward chunks both ways until both ends are done; the first failure ends both."""
        pumps = [asyncio.ensure_future(self._pump(dialer, target, source)),
                 asyncio.ensure_future(self._pump(target, dialer, source))]
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for pump in done:
                if pump.exception() is not None:
                    raise pump.exception()  # type: ignore[misc]
        finally:
            for pump in pumps:
                pump.cancel()

    async def _pump(self, src: Stream, dst: Stream, payer: PeerID) -> None:
        while True:
            try:
                chunk = await src.recv()
            except EndOfStream:
                await dst.close()
                return
            if not isinstance(chunk, bytes) or len(chunk) > MAX_PIPE_CHUNK:
                raise ProtocolError(f"a relayed message must be bytes of at most {MAX_PIPE_CHUNK}")
            self._charge(payer, len(chunk))
            await dst.send(chunk)

    def _usage_of(self, peer: PeerID) -> _Usage:
        now = asyncio.get_running_loop().time()
        for other, usage in list(self._usage.items()):  # forget idle peers whose window is over
            if usage.circuits == 0 and now - usage.window_start >= self.limits.bytes_window:
                del self._usage[other]
        return self._usage.setdefault(peer, _Usage(now))

    def _charge(self, peer: PeerID, nbytes: int) -> None:
        usage = self._usage[peer]
        now = asyncio.get_running_loop().time()
        if now - usage.window_start >= self.limits.bytes_window:
            usage.window_start, usage.used = now, 0
        usage.used += nbytes
        if usage.used > self.limits.max_bytes_per_peer:
            raise RelayRefused(f"{peer} went over this relay's budget of {self.limits.max_bytes_per_peer} bytes "
                               f"per {self.limits.bytes_window:g} s; the circuit is closed")


# -- The reserving peer -----------------------------------------------------------------------------
async def reserve(transport: Transport, relay: PeerID, timeout: float = RESERVE_TIMEOUT) -> Reservation:
    """Reserve (or renew) a slot on `relay`; we accept `relay.stop` from it until the reservation
    expires. Raises RelayRefused / NetworkError."""
    loop = asyncio.get_running_loop()
    try:
        reply = ReserveReply.from_wire(await transport.call(relay, RELAY_RESERVE, None, timeout=timeout))
    except RemoteError as e:
        raise RelayRefused(f"relay {relay} refused the reservation: {e}") from None
    addresses = []
    for text in reply.addresses:
        addr = Multiaddr.parse(text)
        if addr.relay != relay or addr.peer_id != transport.peer_id:
            raise MalformedMessage("relay reservation", f"{text} is not a circuit to us through {relay}")
        addresses.append(addr)
    reservation = Reservation(relay, loop.time() + reply.ttl, addresses)
    transport.relay_reservations[relay] = reservation
    return reservation


async def serve_stop(transport: Transport, stream: Stream, ctx: CallContext) -> None:
    """`relay.stop`: accept a connection that a relay we reserved on pipes to us."""
    held = transport.relay_reservations.get(ctx.peer_id)
    if held is None or held.expires <= asyncio.get_running_loop().time():
        raise RelayRefused(f"this peer holds no reservation with {ctx.peer_id}: relay.stop refused")
    if ctx.connection.remote.relayed:
        raise RelayRefused("circuits do not nest")
    source = _peer_message(stream.request, "src", "relay stop")
    if source in (transport.peer_id, ctx.peer_id):
        raise RelayRefused("a relayed connection from ourselves or from the relay itself")
    await transport._link_over_stream(stream, ctx.peer_id, initiator=False, expected=source, bulk=False)
    await stream.done  # the relayed connection lives as long as this handler (its pipe ends the stream)


async def accept_stop(stream: Stream) -> None:
    """Tell the relay that we take the relayed connection (once our caps allow it); the bytes of
    its handshake follow."""
    await stream.send(_OK)


# -- The dialer -------------------------------------------------------------------------------------
async def dial_circuit(transport: Transport, address: Multiaddr, expected: PeerID | None, bulk: bool) -> Connection:
    """Open a relayed connection to `expected` through the relay in the circuit `address`."""
    relay = address.relay
    assert relay is not None
    if expected is None:
        raise PeerUnreachable(f"{address}: a circuit address must end in /p2p/<peer id> to be dialed")
    if transport.peer_id in (relay, expected):
        raise PeerUnreachable(f"{address}: a circuit through or to ourselves")
    try:
        transport.add_addresses(relay, [address.relay_address])
    except AddressError as e:
        raise PeerUnreachable(f"{address}: {e}") from None
    stream = await transport.open_stream(relay, RELAY_HOP, {"peer": expected.to_bytes()}, timeout=None, dedicated=True)
    try:
        try:
            _check_ok(await stream.recv(timeout=transport.dial_timeout), "relay.hop")
        except (RemoteError, EndOfStream) as e:
            raise PeerUnreachable(f"relay {relay} could not connect us to {expected}: {e}") from None
        return await transport._link_over_stream(stream, relay, initiator=True, expected=expected, bulk=bulk)
    except RemoteError as e:  # the relay ended the circuit (e.g. the target refused the handshake)
        stream.abort("the relayed dial failed")
        raise PeerUnreachable(f"the connection to {expected} through relay {relay} failed: {e}") from None
    except BaseException:
        stream.abort("the relayed dial failed")
        raise


# -- A byte pipe over a stream ----------------------------------------------------------------------
class StreamPipe(asyncio.Transport):
    """An asyncio transport whose bytes travel as chunks of a stream (through a relay): what
    `loop.start_tls` and a protocol (TLS, `net.tcp.TCPLink`) run on. Writes are queued and sent
    in order (the stream's window is the backpressure: the protocol is paused above
    PIPE_HIGH_WATER); received chunks go to the protocol unless reading is paused."""

    _start_tls_compatible = True

    def __init__(self, stream: Stream, relay: PeerID):
        super().__init__({"peername": f"/p2p/{relay}/p2p-circuit", "relay": relay})
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._protocol: asyncio.BaseProtocol | None = None
        self._out: deque[bytes] = deque()
        self._out_bytes = 0
        self._out_event = asyncio.Event()
        self._reading = asyncio.Event()
        self._reading.set()
        self._high, self._low = PIPE_HIGH_WATER, PIPE_HIGH_WATER // 4
        self._writing_paused = False
        self._closing = False
        self._lost = False
        self._tasks: list[asyncio.Task] = []

    def begin(self, protocol: asyncio.BaseProtocol) -> None:
        """Start moving bytes for `protocol` (whose connection_made the caller calls)."""
        self._protocol = protocol
        self._tasks = [self._loop.create_task(self._read()), self._loop.create_task(self._write())]

    # -- asyncio.Transport --------------------------------------------------------------------------
    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[return-value]

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def is_reading(self) -> bool:
        return self._reading.is_set()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = PIPE_HIGH_WATER if high is None else high
        self._low = self._high // 4 if low is None else low

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return self._out_bytes

    def can_write_eof(self) -> bool:
        return False

    def write(self, data: Any) -> None:
        if self.is_closing():
            return
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, PIPE_CHUNK):
            self._out.append(bytes(view[start:start + PIPE_CHUNK]))
        self._out_bytes += view.nbytes
        self._out_event.set()
        if self._out_bytes > self._high and not self._writing_paused:
            self._writing_paused = True
            self._protocol.pause_writing()  # type: ignore[union-attr]

    def close(self) -> None:
        """Send what is queued, then end our half of the stream; the protocol is told at once after."""
        self._closing = True
        self._out_event.set()

    def abort(self) -> None:
        self._force_close(None)

    def _force_close(self, exc: BaseException | None) -> None:
        self._stream.abort("the relayed connection was aborted")
        self._connection_lost(exc)

    # -- moving bytes -------------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while not self._lost:
                await self._reading.wait()
                chunk = await self._stream.recv()
                if not isinstance(chunk, bytes):
                    raise ProtocolError("a relayed message must be bytes")
                await self._reading.wait()
                if not self._lost:
                    self._feed(chunk)
        except EndOfStream:
            if not self._lost:
                self._protocol.eof_received()  # type: ignore[union-attr]
                self._connection_lost(None)
        except NetworkError as e:
            self._connection_lost(e)

    def _feed(self, data: bytes) -> None:
        protocol = self._protocol
        if isinstance(protocol, asyncio.BufferedProtocol):
            view = memoryview(data)
            while view.nbytes:
                buf = protocol.get_buffer(view.nbytes)
                n = min(len(buf), view.nbytes)
                buf[:n] = view[:n]
                protocol.buffer_updated(n)
                view = view[n:]
        else:
            protocol.data_received(data)  # type: ignore[union-attr]

    async def _write(self) -> None:
        try:
            while True:
                while not self._out:
                    if self._closing:
                        await self._finish()
                        return
                    self._out_event.clear()
                    await self._out_event.wait()
                chunk = self._out.popleft()
                await self._stream.send(chunk)
                self._out_bytes -= len(chunk)
                if self._writing_paused and self._out_bytes <= self._low:
                    self._writing_paused = False
                    self._protocol.resume_writing()  # type: ignore[union-attr]
        except NetworkError as e:
            self._stream.abort("sending failed")
            self._connection_lost(e)

    async def _finish(self) -> None:
        """Everything is sent: end our half, and abort if the other side never ends its own."""
        await self._stream.close()
        grace = self._loop.call_later(PIPE_CLOSE_GRACE, self._stream.abort, "no end from the other side")
        self._stream.done.add_done_callback(lambda _: grace.cancel())
        self._connection_lost(None)

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._out.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []  # a cancelled task's traceback holds its frame, which holds this pipe
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            self._loop.call_soon(protocol.connection_lost, exc)
