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

A peer's end of all this is its `Circuits`: the transport's `CircuitDialer`, which whoever builds
the transport plugs in (`net.tcp`, `net.emulated`); it runs each relayed connection through the
transport's `link_over_stream`.

Circuits do not nest: reservations and hops over a relayed connection are refused.

Fair shares (issue 29): identities cost nothing, addresses do. Reservations and circuits are
capped per peer id, per IP and per subnet as well as in all (`net.origins.Shares`, counted under
the origin the reserving or dialing peer's connection comes from), and bytes per peer id and per
subnet, so one host's made-up identities get that host's share and no more. A circuit that
carries nothing for `circuit_idle_seconds` ends; a relay may also be *limited*
(`RelayLimits.limited()`, as libp2p's circuit relay v2): each circuit lives at most
`circuit_seconds` and carries at most `circuit_bytes` each way, enough to coordinate a hole punch.
In an authority-governed run the relay serves members only (`net.membership.require_member`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
from potluck.core.wire import Bool, Message, Number
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext, Connection, Stream
from potluck.net.identity import PeerID
from potluck.net.membership import require_member
from potluck.net.origins import Origin, Shares
from potluck.net.transport import Transport
from potluck.net.wire import AddressesField, PeerIdField, addresses_to_wire

__all__ = [
    "RELAY_HOP", "RELAY_RESERVE", "RELAY_STOP", "Accepted", "Circuits", "Hop", "RelayLimits", "RelayRefused",
    "RelayService", "Reservation", "ReserveReply", "Stop", "StreamPipe", "accept_stop", "circuits_of", "release",
    "reserve",
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
# Of those, from one subnet (/24, /48) and from one IP: libp2p's relay v2 defaults (32 per ASN,
# 8 per IP). Peer ids cost nothing (126 made-up ones filled all 128 before), addresses do: one
# host gets 8, one subnet a quarter of the relay, and at least three quarters stay for others. A lab
# of NATed peers behind one address reserves on several relays (nat.relays.WANTED_RELAYS each).
MAX_RESERVATIONS_PER_SUBNET = 32
MAX_RESERVATIONS_PER_IP = 8
# Circuits piped at once. A circuit holds up to a stream window (connection.STREAM_WINDOW, 16 MiB)
# per direction when one end stops reading, so 64 circuits bound what a relay can be made to buffer
# at 2 GiB in the worst case (a few MiB in practice: the pipe forwards as fast as it receives).
MAX_CIRCUITS = 64
# Circuits from one dialing peer: its shared connection, the idle bulk ones a transport keeps
# (transport.MAX_IDLE_BULK_CONNECTIONS = 4) and a few active bulk streams. More is one peer taking
# the relay's circuits from the others.
MAX_CIRCUITS_PER_PEER = 8
# Circuits from one subnet (and so from one IP): a quarter of the relay, two peers' worth (9 made-up
# ids took all 64 in 0.3 s before). Honest peers behind one address dial a relayed peer over one
# shared connection each, and a bulk one while they stream.
MAX_CIRCUITS_PER_SUBNET = 16
MAX_CIRCUITS_PER_IP = 16
# Bytes one dialing peer may have piped (both directions of all its circuits) per window. 1 GiB a
# minute (~140 Mbit/s) carries calls, expert batches and a model's state download through a home
# uplink, and keeps one peer from spending a volunteer relay's whole bandwidth for long; past it the
# peer's circuits end, with an error that says so, until the window turns.
MAX_BYTES_PER_PEER = 2**30
# Bytes from one subnet's dialers, all together, per window: two peers' worth, so made-up ids of
# one host do not multiply its budget (each id had a GiB of its own before).
MAX_BYTES_PER_SUBNET = 2 * MAX_BYTES_PER_PEER
BYTES_WINDOW_SECONDS = 60.0
# A circuit that pipes no byte either way for this long ends (before: it lived until the 1 h stream
# deadline, sending nothing). A live potluck connection is never that quiet: it pings after
# transport.KEEPALIVE_INTERVAL (10 s) of silence; this is twice its dead-peer timeout (30 s).
CIRCUIT_IDLE_SECONDS = 60.0
# Limited relays (`RelayLimits.limited()`), as libp2p's circuit relay v2 defaults: a circuit lives 2
# minutes and carries 128 KiB each way, enough for the handshakes and a hole punch's signalling
# (a few KiB), not for the traffic itself. A full relay (the default) has neither limit.
LIMITED_CIRCUIT_SECONDS = 120.0
LIMITED_CIRCUIT_BYTES = 128 * 2**10
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


class RelayRefused(NetworkError):
    """A relay (or the target behind it) refused a reservation, circuit or relayed connection."""


@dataclass(frozen=True)
class RelayLimits:
    """A relay's caps (see the module constants for why each default). A share larger than the one
    above it (per IP over per subnet over the total) is cut to it. `circuit_seconds` and
    `circuit_bytes` (each way): None for a full relay, set for a limited one (`limited()`)."""

    max_reservations: int = MAX_RESERVATIONS
    max_circuits: int = MAX_CIRCUITS
    max_circuits_per_peer: int = MAX_CIRCUITS_PER_PEER
    max_bytes_per_peer: int = MAX_BYTES_PER_PEER
    bytes_window: float = BYTES_WINDOW_SECONDS
    reservation_ttl: float = RESERVATION_TTL
    max_reservations_per_subnet: int = MAX_RESERVATIONS_PER_SUBNET
    max_reservations_per_ip: int = MAX_RESERVATIONS_PER_IP
    max_circuits_per_subnet: int = MAX_CIRCUITS_PER_SUBNET
    max_circuits_per_ip: int = MAX_CIRCUITS_PER_IP
    max_bytes_per_subnet: int = MAX_BYTES_PER_SUBNET
    circuit_idle_seconds: float = CIRCUIT_IDLE_SECONDS
    circuit_seconds: float | None = None
    circuit_bytes: int | None = None

    @classmethod
    def limited(cls, **overrides: Any) -> RelayLimits:
        """A limited relay: circuits for coordinating a hole punch only (see LIMITED_CIRCUIT_*)."""
        return cls(**{"circuit_seconds": LIMITED_CIRCUIT_SECONDS, "circuit_bytes": LIMITED_CIRCUIT_BYTES,
                      **overrides})


@dataclass(frozen=True)
class Reservation:
    """A slot held on `relay` until `expires` (loop time) while our connection to it lives;
    `addresses`: our circuit addresses through it."""

    relay: PeerID
    expires: float
    addresses: list[Multiaddr]


# -- Messages ---------------------------------------------------------------------------------------
class ReserveReply(Message, what="relay reservation"):
    """The relay's answer to `relay.reserve`: the slot's lifetime, and our circuit addresses through it."""

    ttl: float = Number(positive=True)
    addresses: tuple[str, ...] = AddressesField("addrs")


class Hop(Message, what="relay hop"):
    """A dialer's `relay.hop` request: pipe a connection to `peer`."""

    peer: PeerID = PeerIdField(raw=True)


class Stop(Message, what="relay stop"):
    """The relay's `relay.stop` request to the target: a connection from `source` comes through."""

    source: PeerID = PeerIdField("src", raw=True)


class Accepted(Message, what="relay acceptance"):
    """The target takes the relayed connection (on `relay.stop`), or the relay pipes it (on `relay.hop`)."""

    ok: bool = Bool()

    def validate(self, context: Any) -> None:
        if not self.ok:
            raise self.refuse("'ok' must be true")


ACCEPTED = Accepted(True).to_wire()


# -- The relay --------------------------------------------------------------------------------------
@dataclass
class _Held:
    connection: Connection
    expires: float
    origin: Origin


@dataclass
class _Usage:
    """Bytes a dialing peer (or subnet) had piped in its current window, and its circuits open."""

    window_start: float
    used: int = 0
    circuits: int = 0


class _Circuit:
    """One circuit's clock and bytes, for the idle, duration and data limits."""

    def __init__(self, now: float):
        self.started = self.last = now
        self.bytes = {True: 0, False: 0}  # towards the target, towards the dialer


@dataclass
class RelayService:
    """Serves `relay.reserve` and `relay.hop` on a public peer (`potluck peer --relay`)."""

    transport: Transport
    limits: RelayLimits = field(default_factory=RelayLimits)

    def __post_init__(self) -> None:
        limits = self.limits
        self._reservations: dict[PeerID, _Held] = {}
        self._reserved = Shares.fitted("relay reservations", limits.max_reservations,
                                       per_subnet=limits.max_reservations_per_subnet,
                                       per_ip=limits.max_reservations_per_ip, per_peer=1)
        self._circuits = Shares.fitted("relay circuits", limits.max_circuits,
                                       per_subnet=limits.max_circuits_per_subnet,
                                       per_ip=limits.max_circuits_per_ip, per_peer=limits.max_circuits_per_peer)
        # Byte budgets: an entry per peer id, and per subnet, with a circuit or a charge this window.
        self._usage: dict[PeerID, _Usage] = {}
        self._subnet_usage: dict[str, _Usage] = {}
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
        for peer in list(self._reservations):
            self._drop_reservation(peer)

    @property
    def reservations(self) -> int:
        self._prune()
        return len(self._reservations)

    @property
    def circuits(self) -> int:
        return self._circuits.held

    def _prune(self) -> None:
        now = asyncio.get_running_loop().time()
        for peer, held in list(self._reservations.items()):
            if held.connection.closed or held.expires <= now:
                self._drop_reservation(peer)

    def _drop_reservation(self, peer: PeerID) -> None:
        held = self._reservations.pop(peer)
        self._reserved.release(held.origin, peer)

    async def _reserve(self, request: Any, ctx: CallContext) -> dict:
        require_member(self.transport.membership, ctx.peer_id, ctx.remote.token, "this relay")
        if ctx.connection.remote.relayed:
            raise RelayRefused("circuits do not nest: reserve over a direct connection to the relay")
        addrs = [Multiaddr.circuit(a, ctx.peer_id) for a in self.transport.addresses if not a.is_circuit]
        if not addrs:
            raise RelayRefused("this relay has no public address to offer")
        self._prune()
        origin, peer = ctx.remote.origin, ctx.peer_id
        if peer in self._reservations:  # a renewal: counted again under where it comes from now
            self._drop_reservation(peer)
        refusal = self._reserved.refusal(origin, peer)
        if refusal is not None:
            raise RelayRefused(f"this relay refuses the reservation: {refusal}; reserve on another relay")
        self._reserved.claim(origin, peer)
        ttl = self.limits.reservation_ttl
        self._reservations[peer] = _Held(ctx.connection, asyncio.get_running_loop().time() + ttl, origin)
        return ReserveReply(ttl, addresses_to_wire(addrs)).to_wire()

    async def _hop(self, stream: Stream, ctx: CallContext) -> None:
        require_member(self.transport.membership, ctx.peer_id, ctx.remote.token, "this relay")
        source, origin = ctx.peer_id, ctx.remote.origin
        target = Hop.from_wire(stream.request).peer
        if ctx.connection.remote.relayed:
            raise RelayRefused("circuits do not nest: dial the relay directly")
        self._prune()
        held = self._reservations.get(target)
        if held is None:
            raise RelayRefused(f"{target} holds no reservation on this relay")
        refusal = self._circuits.refusal(origin, source)
        if refusal is not None:
            raise RelayRefused(f"this relay refuses the circuit: {refusal}; try again later")
        usage, subnet_usage = self._usage_of(source, origin)
        self._charge(source, origin, 0)
        self._circuits.claim(origin, source)
        usage.circuits += 1
        subnet_usage.circuits += 1
        task = asyncio.current_task()
        assert task is not None
        self._hops.add(task)
        out: Stream | None = None
        try:
            out = await held.connection.open_stream(RELAY_STOP, Stop(source).to_wire(), timeout=None)
            try:
                Accepted.from_wire(await out.recv(timeout=STOP_ACCEPT_TIMEOUT))
            except (RemoteError, ConnectionLost, EndOfStream) as e:
                raise RelayRefused(f"{target} did not accept the relayed connection: {e}") from None
            await stream.send(ACCEPTED)
            await self._pipe(stream, out, source, origin)
        finally:
            self._hops.discard(task)
            self._circuits.release(origin, source)
            usage.circuits -= 1
            subnet_usage.circuits -= 1
            if out is not None and not out.finished:
                out.abort("the circuit ended")

    async def _pipe(self, dialer: Stream, target: Stream, source: PeerID, origin: Origin) -> None:
        """Forward chunks both ways until both ends are done; the first failure ends both, and so
        do the circuit's limits (idle, and for a limited relay its duration and data)."""
        circuit = _Circuit(asyncio.get_running_loop().time())
        tasks = [asyncio.ensure_future(self._pump(dialer, target, source, origin, circuit, True)),
                 asyncio.ensure_future(self._pump(target, dialer, source, origin, circuit, False))]
        pumps = list(tasks)
        tasks.append(asyncio.ensure_future(self._watch(circuit)))
        try:
            while pumps:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                    tasks.remove(task)
                    if task in pumps:
                        pumps.remove(task)
        finally:
            for task in tasks:
                task.cancel()

    async def _watch(self, circuit: _Circuit) -> None:
        """End the circuit once it is idle too long, or (limited relay) past its duration."""
        loop, limits = asyncio.get_running_loop(), self.limits
        while True:
            ends = circuit.last + limits.circuit_idle_seconds
            if limits.circuit_seconds is not None:
                ends = min(ends, circuit.started + limits.circuit_seconds)
            now = loop.time()
            if now >= ends:
                if now >= circuit.last + limits.circuit_idle_seconds:
                    raise RelayRefused(f"the circuit carried nothing for {limits.circuit_idle_seconds:g} s; "
                                       "the relay closed it (dial again to reconnect)")
                raise RelayRefused(f"this relay is limited: a circuit lives {limits.circuit_seconds:g} s, long "
                                   "enough to coordinate a hole punch; use a full relay to carry traffic")
            await asyncio.sleep(ends - now)

    async def _pump(self, src: Stream, dst: Stream, payer: PeerID, origin: Origin, circuit: _Circuit,
                    forward: bool) -> None:
        loop, cap = asyncio.get_running_loop(), self.limits.circuit_bytes
        while True:
            try:
                chunk = await src.recv()
            except EndOfStream:
                await dst.close()
                return
            if not isinstance(chunk, bytes) or len(chunk) > MAX_PIPE_CHUNK:
                raise ProtocolError(f"a relayed message must be bytes of at most {MAX_PIPE_CHUNK}")
            circuit.last = loop.time()
            circuit.bytes[forward] += len(chunk)
            if cap is not None and circuit.bytes[forward] > cap:
                raise RelayRefused(f"this relay is limited: a circuit carries {cap} bytes each way, enough to "
                                   "coordinate a hole punch; use a full relay to carry traffic")
            self._charge(payer, origin, len(chunk))
            await dst.send(chunk)

    def _usage_of(self, peer: PeerID, origin: Origin) -> tuple[_Usage, _Usage]:
        """The byte budgets `peer` is charged to: its own and its subnet's."""
        now = asyncio.get_running_loop().time()
        for table in (self._usage, self._subnet_usage):
            for other, usage in list(table.items()):  # forget idle ones whose window is over
                if usage.circuits == 0 and now - usage.window_start >= self.limits.bytes_window:
                    del table[other]
        return self._usage.setdefault(peer, _Usage(now)), self._subnet_usage.setdefault(origin.subnet, _Usage(now))

    def _charge(self, peer: PeerID, origin: Origin, nbytes: int) -> None:
        now = asyncio.get_running_loop().time()
        for usage, cap, who in ((self._usage[peer], self.limits.max_bytes_per_peer, str(peer)),
                                (self._subnet_usage[origin.subnet], self.limits.max_bytes_per_subnet,
                                 f"the subnet {origin.subnet}")):
            if now - usage.window_start >= self.limits.bytes_window:
                usage.window_start, usage.used = now, 0
            usage.used += nbytes
            if usage.used > cap:
                raise RelayRefused(f"{who} went over this relay's budget of {cap} bytes per "
                                   f"{self.limits.bytes_window:g} s; the circuit is closed (dial again later)")


# -- A peer's end of circuits ----------------------------------------------------------------------
class Circuits:
    """A peer's end of relayed connections, plugged into its transport as `transport.circuits`:
    dials circuit addresses through their relays, and accepts `relay.stop` from the relays it
    holds a reservation with (`reserve`)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        # Relays we hold a reservation with: only they may pipe a connection to us.
        self.reservations: dict[PeerID, Reservation] = {}
        transport.add_stream_handler(RELAY_STOP, self._serve_stop)

    async def dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool) -> Connection:
        """Open a relayed connection to `expected` through the relay in the circuit `address`."""
        transport, relay = self.transport, address.relay
        assert relay is not None
        if expected is None:
            raise PeerUnreachable(f"{address}: a circuit address must end in /p2p/<peer id> to be dialed")
        if transport.peer_id in (relay, expected):
            raise PeerUnreachable(f"{address}: a circuit through or to ourselves")
        try:
            transport.add_addresses(relay, [address.relay_address])
        except AddressError as e:
            raise PeerUnreachable(f"{address}: {e}") from None
        stream = await transport.open_stream(relay, RELAY_HOP, Hop(expected).to_wire(), timeout=None, dedicated=True)
        try:
            try:
                Accepted.from_wire(await stream.recv(timeout=transport.dial_timeout))
            except (RemoteError, EndOfStream) as e:
                raise PeerUnreachable(f"relay {relay} could not connect us to {expected}: {e}") from None
            return await transport.link_over_stream(stream, relay, initiator=True, expected=expected, bulk=bulk)
        except RemoteError as e:  # the relay ended the circuit (e.g. the target refused the handshake)
            stream.abort("the relayed dial failed")
            raise PeerUnreachable(f"the connection to {expected} through relay {relay} failed: {e}") from None
        except BaseException:
            stream.abort("the relayed dial failed")
            raise

    async def _serve_stop(self, stream: Stream, ctx: CallContext) -> None:
        """`relay.stop`: accept a connection that a relay we reserved on pipes to us."""
        transport = self.transport
        held = self.reservations.get(ctx.peer_id)
        if held is None or held.expires <= asyncio.get_running_loop().time():
            raise RelayRefused(f"this peer holds no reservation with {ctx.peer_id}: relay.stop refused")
        if ctx.connection.remote.relayed:
            raise RelayRefused("circuits do not nest")
        source = Stop.from_wire(stream.request).source
        if source in (transport.peer_id, ctx.peer_id):
            raise RelayRefused("a relayed connection from ourselves or from the relay itself")
        await transport.link_over_stream(stream, ctx.peer_id, initiator=False, expected=source, bulk=False)
        await stream.done  # the relayed connection lives as long as this handler (its pipe ends the stream)


def circuits_of(transport: Transport) -> Circuits:
    """The transport's end of relayed connections (`net.tcp` and `net.emulated` plug one in)."""
    circuits = transport.circuits
    if not isinstance(circuits, Circuits):
        raise RelayRefused("this transport takes no relayed connections (it has no net.relay.Circuits)")
    return circuits


async def reserve(transport: Transport, relay: PeerID, timeout: float = RESERVE_TIMEOUT) -> Reservation:
    """Reserve (or renew) a slot on `relay`; we accept `relay.stop` from it until the reservation
    expires. Raises RelayRefused / NetworkError."""
    circuits = circuits_of(transport)
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
    circuits.reservations[relay] = reservation
    return reservation


def release(transport: Transport, relay: PeerID) -> None:
    """Give up our reservation on `relay`: it may no longer pipe connections to us."""
    circuits_of(transport).reservations.pop(relay, None)


async def accept_stop(stream: Stream) -> None:
    """Tell the relay that we take the relayed connection (once our caps allow it); the bytes of
    its handshake follow."""
    await stream.send(ACCEPTED)


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
        """Send what is queued, then end our half of the stream; the protocol is told at once after.
        Within PIPE_CLOSE_GRACE: a relay that stops taking our bytes would hold a send, and so the
        stream, its connection and the link's slot, for good."""
        if self._closing or self._lost:
            return
        self._closing = True
        self._out_event.set()
        self._loop.call_later(PIPE_CLOSE_GRACE, self._close_expired)

    def _close_expired(self) -> None:
        if not self._lost:
            self._force_close(None)

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
