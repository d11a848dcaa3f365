"""The transport interface every layer above uses, shared by real TCP and the emulated network.

A `Transport` is one peer's presence on the network: its handlers, its address book and its
connections. Subclasses only know how to dial an address and how to accept; everything else
(connection reuse, dedicated connections for bulk streams, client mode) lives here once.

Callers name peers by id. A dial tries the address book (`net.address_book`: what the peer itself
vouched for first, third-party hints after); when that has nothing that works, it asks the
registered `PeerResolver` (the DHT) for the peer's signed record (`net.peer_record`) and dials what
the record says. Concurrent dials share one lookup; results are cached until the record expires.
Addresses are dialed in that order but staggered (Happy Eyeballs): the next one starts once those
in flight went `DIAL_STAGGER_SECONDS` without an answer, so a dead address costs that, not the
dial timeout; the first connection made wins.

Relays and hole punching plug in through interfaces declared here, which whoever builds the
transport wires in (`net.tcp`, `net.emulated`): a `CircuitDialer` (`net.relay.Circuits`) dials
circuit addresses, and a `Punching` (`net.holepunch.HolePuncher`) turns relayed connections into
direct ones, one `PunchEndpoint` try at a time. This module imports neither.

What subclasses, their links and the plug-ins need from the transport is public and marked so:
`add_connection` / `connection_closed` (a link's connection is authenticated / closed),
`close_loopback`, `link_over_stream` (a connection over a relayed stream), `prefer` and
`is_connected_directly` (hole punching), `dial` (a fresh connection to one address).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from potluck.core import compat
from potluck.core.bounded import drop_oldest
from potluck.core.errors import ConnectionLost, NetworkError, PeerUnreachable, detached
from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER, AddressBook
from potluck.net.connection import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_STREAM_TIMEOUT,
    MAX_HANDLER_SECONDS,
    MAX_STREAM_HANDLER_SECONDS,
    Connection,
    Handlers,
    RemoteInfo,
    Stream,
    StreamHandler,
    TransportStats,
    UnaryHandler,
)
from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE
from potluck.net.identity import Identity, PeerID
from potluck.net.loopback import LoopbackLink
from potluck.net.origins import UNKNOWN_ORIGIN, Origin, origin_of
from potluck.net.peer_record import PeerRecord, PeerResolver

__all__ = ["BULK_WAIT_SECONDS", "DIAL_STAGGER_SECONDS", "MAX_ADDRESSES_PER_PEER", "MAX_PARALLEL_DIALS",
           "RESOLVE_RETRY_SECONDS", "RESOLVE_TIMEOUT", "CircuitDialer", "PunchEndpoint", "Punching", "Reachability",
           "Transport"]

logger = logging.getLogger(__name__)

Reachability = Literal["public", "relayed", "private"]

# Idle dedicated (bulk) connections kept per peer for the next stream, and for how long.
MAX_IDLE_BULK_CONNECTIONS = 4
IDLE_BULK_SECONDS = 30.0

# Keepalive: ping after this much silence; declare the peer dead after the timeout. A killed
# process is noticed at once (TCP reset); these catch a frozen or unplugged one.
KEEPALIVE_INTERVAL = 10.0
KEEPALIVE_TIMEOUT = 30.0

# Looking up a peer's signed record: a DHT get is a few RPC rounds (well under a second on a live
# network); past this the dial fails with PeerUnreachable rather than wait for a mostly dead DHT.
RESOLVE_TIMEOUT = 10.0
# A peer whose record was not found, or whose recorded addresses did not answer, is looked up
# again at most this often: each lookup costs RPCs to ~20 peers, and a restarted peer republishes
# its record at once, so a retry this much later finds it.
RESOLVE_RETRY_SECONDS = 10.0
# Resolved records cached per transport (oldest dropped first): far more peers than one peer
# talks to, and a bound on what a flood of distinct ids can make us keep.
MAX_CACHED_RECORDS = 4096
# How long a bulk stream to a peer reached only through relays waits for a hole punch in flight
# before taking a relayed connection of its own: a punch that works is done within a few round
# trips through the relay and a handshake (well under a second); a relayed bulk connection runs
# at ~0.3x the direct throughput for the whole transfer, and a punch still going after this is
# likely failing (a failed try takes `net.holepunch.PUNCH_TIMEOUT`).
BULK_WAIT_SECONDS = 3.0
# Dialing a peer's addresses is staggered, as in Happy Eyeballs (RFC 8305): an attempt that has
# neither connected nor failed after this long is joined by one to the next address, so a dead
# first address (a stale one, a relay that never answers `relay.hop`) costs this, not the dial
# timeout. 0.5 s: above TCP + TLS + handshake to a healthy address over a 50 ms RTT link (~0.15 s),
# so a live first address rarely costs a second connection; libp2p delays relay addresses as much.
DIAL_STAGGER_SECONDS = 0.5
# Dial attempts to one peer in flight at once (each still within the dial timeout): two dead
# addresses in a row still leave a third tried, without a socket per address of a peer that lists 8.
MAX_PARALLEL_DIALS = 3


class CircuitDialer(Protocol):
    """How the transport dials a circuit address (`.../p2p-circuit/p2p/<id>`): `net.relay.Circuits`."""

    async def dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool) -> Connection:
        """A relayed connection with `expected` through the relay `address` names, registered in the
        transport; raises PeerUnreachable (or another NetworkError)."""


class Punching(Protocol):
    """How the transport drives hole punching: `net.holepunch.HolePuncher`."""

    def start(self, relayed: Connection) -> None:
        """Try, in the background, to replace `relayed` (a relayed connection we accepted) by a direct one."""

    async def outcome(self, peer: PeerID, within: float) -> None:
        """Wait, at most `within` seconds, until a punch with `peer` in flight has ended (at once if none)."""

    def close(self) -> None:
        """Stop every punch (the transport is closing)."""


class PunchEndpoint(Protocol):
    """One hole punch try, as a transport provides it (`Transport.punch_endpoint`): our candidate
    addresses (bound before they are sent), and the dial to the other side's. `client`: we are the
    TLS client (we dialed the relayed connection)."""

    candidates: list[Multiaddr]

    async def connect(self, remote: list[Multiaddr], expected: PeerID, client: bool) -> Connection:
        """The authenticated direct connection with `expected`, registered in the transport;
        raises NetworkError or OSError (the caller's deadline bounds it)."""

    def close(self) -> None:
        """Release the try's sockets (the connection made, if any, stays)."""


class Transport:
    """Base class: handlers, address book, connection pool, calls and streams."""

    def __init__(self, identity: Identity, *, client_mode: bool = False,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 dial_timeout: float = 10.0,
                 keepalive_interval: float | None = KEEPALIVE_INTERVAL,
                 keepalive_timeout: float | None = KEEPALIVE_TIMEOUT):
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        # The user asked for client mode: never listen, never relay, never found public.
        self.forced_client = client_mode
        self._public = not client_mode  # until a reachability check says otherwise
        self._relayed: list[Multiaddr] = []  # our circuit addresses through relays
        self._address_watchers: list[Callable[[], None]] = []
        # Our public hosts as others saw us (the reachability check's answers; hole punching's candidates).
        self.observed_hosts: list[str] = []
        self.max_frame_size = max_frame_size
        self.dial_timeout = dial_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.handlers = Handlers()
        # Bytes on the wire (what bytes-per-sample figures are made of); links add to it per frame.
        self.stats = TransportStats()
        self._book = AddressBook()
        self._resolver: PeerResolver | None = None
        self._disconnect_watchers: list[Callable[[PeerID], None]] = []
        self._resolving: dict[PeerID, asyncio.Future] = {}  # one lookup per peer at a time
        # peer -> (addresses from its record, loop time until which they are used without a lookup,
        # whether they failed to answer: the next lookup then searches thoroughly)
        self._resolved: dict[PeerID, tuple[tuple[Multiaddr, ...], float, bool]] = {}
        self._shared: dict[PeerID, list[Connection]] = {}
        self._bulk_idle: dict[PeerID, list[Connection]] = {}
        self._all: dict[Connection, None] = {}  # ordered, so shutdown order is repeatable
        # Dials in progress, by (peer, whether it may resolve the peer's record in the DHT). The
        # two kinds never wait for each other: the DHT's own calls do not resolve, and resolving a
        # peer's record is a lookup that ends by calling that very peer (it holds its record), so a
        # call waiting for the resolving dial would wait for itself until the lookup gave up on it.
        self._dialing: dict[tuple[PeerID, bool], asyncio.Future] = {}
        self._idle_timers: dict[Connection, asyncio.TimerHandle] = {}
        self._loopback: Connection | None = None  # the calling side of calls to ourselves
        self._closed = False
        # Protocol services that exist once per transport (they own a set of handlers); kept
        # here so they live exactly as long as the transport.
        self.services: dict[str, Any] = {}
        # The plug-ins (see the module docstring); None: no circuits, no hole punching.
        self.circuits: CircuitDialer | None = None
        self.puncher: Punching | None = None
        # The run's membership check (`net.membership.MembershipGate`) in an authority-governed
        # run, which the handshakes of subclasses apply; None: anyone who proves a peer id is admitted.
        self.membership: Any = None

    # -- reachability ---------------------------------------------------------------------------
    @property
    def reachability(self) -> Reachability:
        """"public": dialed directly at `listen_addresses`; "relayed": only through relays (our
        circuit addresses); "private": not at all (forced client mode, or behind NAT and no relay)."""
        if self._public:
            return "public"
        return "relayed" if self._relayed else "private"

    @property
    def client_mode(self) -> bool:
        """What our handshake says: a relayed peer is still a client to others (kept out of DHT
        routing tables, a client in averaging) though it publishes a record and can serve."""
        return self.reachability != "public"

    @property
    def addresses(self) -> list[Multiaddr]:
        """Where others can reach this peer: direct when public, circuits when relayed, else none.
        Code that must know whether this peer can be dialed checks this, not client_mode."""
        reach = self.reachability
        if reach == "public":
            return self.listen_addresses
        return list(self._relayed) if reach == "relayed" else []

    def set_public(self, public: bool) -> None:
        """Record what the reachability check found (a forced client is never public)."""
        if public and self.forced_client:
            raise ValueError("a transport in forced client mode cannot be public")
        self._update(lambda: setattr(self, "_public", public))

    def set_relayed_addresses(self, addresses: Iterable[Multiaddr]) -> None:
        """Our circuit addresses through the relays we hold reservations with (empty: none)."""
        relayed = list(addresses)
        self._update(lambda: setattr(self, "_relayed", relayed))

    def watch_addresses(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever `addresses` changes (the DHT republishes our record at once)."""
        self._address_watchers.append(callback)

    def unwatch_addresses(self, callback: Callable[[], None]) -> None:
        if callback in self._address_watchers:
            self._address_watchers.remove(callback)

    def _update(self, change: Callable[[], None]) -> None:
        before = self.addresses
        change()
        if self.addresses != before:
            for callback in list(self._address_watchers):
                callback()

    # -- to be provided by subclasses -----------------------------------------------------------
    @property
    def listen_addresses(self) -> list[Multiaddr]:
        """Where this peer listens or announces (with its /p2p/ id): what it is reached at if
        public, and what a reachability check asks others to dial back (empty if not listening)."""
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def _dial_direct(self, address: Multiaddr, expected: PeerID | None, bulk: bool,
                           answer_within: float | None = None) -> Connection:
        """Open, handshake and register a connection to `address` (not a circuit); raise
        PeerUnreachable / HandshakeError. `answer_within`: see `dial`."""
        raise NotImplementedError

    async def link_over_stream(self, stream: Stream, relay: PeerID, initiator: bool,
                               expected: PeerID, bulk: bool) -> Connection:
        """Run a connection with `expected` over a relayed byte stream (for `net.relay`): handshake,
        attach and register it, and return it once authenticated. The accepting side first checks
        its caps and then tells the relay it accepts (`net.relay.accept_stop`)."""
        raise NotImplementedError

    def punch_endpoint(self) -> PunchEndpoint:
        """One hole punch try (for `net.holepunch`): our candidates, and the dial to the other side's."""
        raise NotImplementedError

    async def _stop_listening(self) -> None:
        raise NotImplementedError

    # -- handlers -------------------------------------------------------------------------------
    def add_handler(self, method: str, handler: UnaryHandler, max_seconds: float | None = None) -> None:
        """Serve `method`: `async def handler(request, ctx) -> response`. `max_seconds`: the longest
        a call may run whatever its caller asks (default and upper bound `MAX_HANDLER_SECONDS`)."""
        self.handlers.unary[method] = handler
        _set_limit(self.handlers.unary_seconds, method, max_seconds, MAX_HANDLER_SECONDS)

    def add_stream_handler(self, method: str, handler: StreamHandler, max_seconds: float | None = None) -> None:
        """Serve streams of `method`: `async def handler(stream, ctx) -> None` (`max_seconds`: as
        for `add_handler`, up to `MAX_STREAM_HANDLER_SECONDS`)."""
        self.handlers.stream[method] = handler
        _set_limit(self.handlers.stream_seconds, method, max_seconds, MAX_STREAM_HANDLER_SECONDS)

    def remove_handler(self, method: str) -> None:
        for table in (self.handlers.unary, self.handlers.stream, self.handlers.unary_seconds,
                      self.handlers.stream_seconds):
            table.pop(method, None)

    # -- address book ---------------------------------------------------------------------------
    def add_addresses(self, peer_id: PeerID, addresses: Iterable[Multiaddr | str]) -> None:
        """Remember third-party hints of where `peer_id` can be dialed (e.g. a DHT find answer).
        They are tried after what the peer vouched for itself and can never displace it. Most
        callers need none of this: a dial to an unknown id looks up the peer's signed record."""
        if peer_id != self.peer_id:
            self._book.add_hints(peer_id, addresses)

    def _vouch(self, peer_id: PeerID, addresses: Iterable[Multiaddr | str]) -> None:
        """Addresses the peer itself stated: its handshake, an address where it proved its id,
        or its signed record."""
        if peer_id != self.peer_id:
            self._book.add_vouched(peer_id, addresses)

    def addresses_of(self, peer_id: PeerID) -> list[Multiaddr]:
        """Known addresses in dial order: the peer's own first, then hints."""
        return self._book.dial_order(peer_id)

    def vouched_addresses_of(self, peer_id: PeerID) -> list[Multiaddr]:
        """Only the addresses the peer stated itself (what is safe to pass on to others)."""
        return self._book.vouched(peer_id)

    @property
    def resolver(self) -> PeerResolver | None:
        return self._resolver

    def set_resolver(self, resolver: PeerResolver | None) -> None:
        """Who finds the signed record of a peer we cannot otherwise dial (the DHT sets itself)."""
        self._resolver = resolver

    def watch_disconnects(self, callback: Callable[[PeerID], None]) -> None:
        """Call `callback(peer_id)` when the last open connection with a peer is lost (not closed
        by us): how a protocol learns at once that a member it cannot dial (client mode) died."""
        self._disconnect_watchers.append(callback)

    def unwatch_disconnects(self, callback: Callable[[PeerID], None]) -> None:
        if callback in self._disconnect_watchers:
            self._disconnect_watchers.remove(callback)

    def is_connected(self, peer_id: PeerID) -> bool:
        return any(not c.closed for c in self._shared.get(peer_id, ()))

    def peer_origin(self, peer_id: PeerID) -> Origin:
        """Where `peer_id` is on the network, as best we know: the origin of an open connection
        with it, else of the first address it vouched for (a circuit: its relay's), else unknown."""
        for conn in self._shared.get(peer_id, ()):
            if not conn.closed:
                return conn.remote.origin
        for address in self._book.vouched(peer_id):
            if address.is_circuit and address.relay is not None:
                return Origin.relayed(str(address.relay))
            if address.kind in ("ip4", "ip6", "emu"):
                return origin_of(address)
        return UNKNOWN_ORIGIN

    def is_connected_directly(self, peer_id: PeerID) -> bool:
        """Whether we share an open connection with `peer_id` that no relay carries."""
        return any(not c.closed and not c.relayed for c in self._shared.get(peer_id, ()))

    def connected_peers(self) -> list[PeerID]:
        return [p for p, conns in self._shared.items() if any(not c.closed for c in conns)]

    def open_connections(self) -> list[Connection]:
        """Every open connection, shared and bulk, both directions (e.g. to re-check members)."""
        return [c for c in self._all if not c.closed]

    # -- connections ----------------------------------------------------------------------------
    async def connect(self, address: Multiaddr | str, timeout: float | None = None) -> PeerID:
        """Dial an address, authenticate the peer there and return its id.

        If the address ends in /p2p/<id>, the peer must prove it holds that id's key.
        """
        addr = Multiaddr.parse(address) if isinstance(address, str) else address
        timeout = self.dial_timeout if timeout is None else timeout
        try:
            async with compat.timeout(timeout):
                conn = await self.dial(addr.without_peer_id(), addr.peer_id, bulk=False)
        except TimeoutError:
            raise PeerUnreachable(f"could not reach {addr} within {timeout} s") from None
        self._vouch(conn.peer_id, [addr])  # the peer proved its id at this address
        return conn.peer_id

    async def dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool,
                   answer_within: float | None = None) -> Connection:
        """A new connection to `address` (a circuit goes through its relay), authenticated as
        `expected` if given; `bulk`: a dedicated one, not pooled for calls (the caller closes it).
        `answer_within`: a direct dial fails unless the other end answers (TCP and TLS, before the
        identity handshake) within this many seconds: a listener that accepts and then says
        nothing is given up on early."""
        if not address.is_circuit:
            if answer_within is None:
                return await self._dial_direct(address, expected, bulk)
            return await self._dial_direct(address, expected, bulk, answer_within)
        if self.circuits is None:
            raise PeerUnreachable(f"{address}: this transport dials no circuit addresses")
        return await self.circuits.dial(address, expected, bulk)

    def add_connection(self, conn: Connection) -> None:
        """A link's connection is authenticated (either direction): pool it (for subclasses' links)."""
        if self._closed:
            conn.close("transport is shutting down")
            return
        if conn.closed:
            return
        self._all[conn] = None
        if conn.remote.addresses:
            self._vouch(conn.peer_id, conn.remote.addresses)
        if not conn.remote.bulk:
            self._shared.setdefault(conn.peer_id, []).append(conn)
            # We accepted a relayed connection, so we are the NATed side: it punches, as in DCUtR.
            if conn.relayed and not conn.initiator and self.puncher is not None:
                self.puncher.start(conn)

    def prefer(self, conn: Connection) -> None:
        """Put `conn` first in its peer's shared pool: calls take it (a punched direct connection
        over the relayed one it replaces)."""
        pool = self._shared.get(conn.peer_id, [])
        if conn in pool:
            pool.remove(conn)
            pool.insert(0, conn)

    def _punched(self, peer_id: PeerID) -> bool:
        """Whether our preferred connection with `peer_id` is a hole-punched direct one while the peer
        can be dialed only through relays: bulk streams share it (a connection of their own would be
        relayed again)."""
        conns = self._shared.get(peer_id)
        return bool(conns) and not conns[0].closed and not conns[0].relayed and self._relayed_only(peer_id)

    def _relayed_only(self, peer_id: PeerID) -> bool:
        """Whether `peer_id` can be dialed only through relays (every known address a circuit)."""
        return all(a.is_circuit for a in self._book.dial_order(peer_id))

    def connection_closed(self, conn: Connection) -> None:
        """A connection's `on_close`: forget it, and tell the disconnect watchers if it was lost."""
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
        if conn.lost and self._disconnect_watchers \
                and not any(c.peer_id == conn.peer_id and not c.closed for c in self._all):
            for callback in list(self._disconnect_watchers):
                callback(conn.peer_id)

    async def _shared_connection(self, peer_id: PeerID, timeout: float | None, resolve: bool = True) -> Connection:
        for conn in self._shared.get(peer_id, ()):
            if not conn.closed:
                return conn
        # One dial per peer (and kind, see `_dialing`) at a time: concurrent callers wait for the same attempt.
        key = (peer_id, resolve)
        pending = self._dialing.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._dial_known(peer_id, bulk=False, resolve=resolve))
            self._dialing[key] = pending
            pending.add_done_callback(lambda f: (self._dialing.pop(key, None), f.cancelled() or f.exception()))
        try:
            async with compat.timeout(timeout):
                await asyncio.wait([pending])  # our deadline or cancellation leaves the dial going
        except TimeoutError:
            raise PeerUnreachable(f"could not connect to {peer_id} within {timeout} s") from None
        if not pending.cancelled() and pending.exception() is not None:
            raise detached(pending.exception())  # shared by every waiter: raise a copy of it
        return pending.result()

    async def _dial_known(self, peer_id: PeerID, bulk: bool, resolve: bool = True) -> Connection:
        """Dial the book's addresses in order; if none works, the peer's signed record's."""
        errors: list[str] = []
        tried = self._book.dial_order(peer_id)
        conn = await self._dial_first(peer_id, tried, bulk, errors)
        if conn is not None:
            return conn
        if resolve and self._resolver is not None:
            try:
                recorded = await self._resolve(peer_id)
            except PeerUnreachable as e:
                errors.append(str(e))
            else:
                if not bulk:  # the lookup itself may have connected to it (see `_dialing`)
                    for conn in self._shared.get(peer_id, ()):
                        if not conn.closed:
                            return conn
                conn = await self._dial_first(peer_id, [a for a in recorded if a not in tried], bulk, errors)
                if conn is not None:
                    return conn
                self._retry_resolve_soon(peer_id)  # the record is stale, or the peer is down
        if not errors:
            raise PeerUnreachable(f"no known address for {peer_id} (it may be in client mode, or was never "
                                  "announced) and no DHT to look up its signed peer record")
        raise PeerUnreachable(f"could not connect to {peer_id}: " + "; ".join(errors))

    async def _dial_first(self, peer_id: PeerID, addresses: list[Multiaddr], bulk: bool,
                          errors: list[str]) -> Connection | None:
        """The first connection any of `addresses` gives, dialed staggered (`DIAL_STAGGER_SECONDS`):
        in order, the next address started once the attempts in flight went the stagger without an
        answer, or at once when one failed; at most `MAX_PARALLEL_DIALS` at a time, each within the
        dial timeout. The first connection made wins (the earlier address if two come at once); the
        other attempts are cancelled, and a connection one of them made all the same is closed.
        None if every address failed, each failure added to `errors` in address order. No attempt
        outlives the call, cancelled or not."""
        attempts: dict[asyncio.Task, int] = {}  # attempt in flight -> its address's index
        failures: dict[int, str] = {}
        winner: Connection | None = None
        won = -1
        started = 0
        try:
            while winner is None:
                if started < len(addresses) and len(attempts) < MAX_PARALLEL_DIALS:
                    attempts[asyncio.ensure_future(self._dial_attempt(addresses[started], peer_id, bulk))] = started
                    started += 1
                if not attempts:
                    break
                stagger = started < len(addresses) and len(attempts) < MAX_PARALLEL_DIALS
                done, _ = await asyncio.wait(list(attempts), timeout=DIAL_STAGGER_SECONDS if stagger else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=attempts.__getitem__):
                    index = attempts.pop(task)
                    if task.cancelled():  # not by us: whatever dial ran in it gave up
                        failures[index] = f"{addresses[index]}: the dial was cancelled"
                        continue
                    error = task.exception()
                    if error is None:
                        if winner is None:
                            winner, won = task.result(), index
                        else:
                            task.result().close("another address of this peer answered first")
                    elif isinstance(error, (NetworkError, OSError, TimeoutError)):
                        failures[index] = f"{addresses[index]}: {str(error) or type(error).__name__}"
                    else:
                        del error
                        task.result()  # not a failed dial but a bug: raise it as it is
        except BaseException:
            if winner is not None:  # cancelled (or a bug) as one attempt had won: the caller never sees it
                winner.close("the dial was cancelled")
            raise
        finally:
            for task in attempts:  # still in flight: a winner exists, or we were cancelled
                task.cancel()
                task.add_done_callback(_close_late_dial)  # it connected all the same: not ours to keep
            if attempts:
                try:
                    await asyncio.wait(list(attempts))  # ended within a loop turn or two (cancelled)
                except BaseException:  # cancelled again meanwhile: the attempts end without us
                    if winner is not None:
                        winner.close("the dial was cancelled")
                    raise
        errors.extend(failures[i] for i in sorted(failures))
        if winner is None:
            return None
        self._vouch(peer_id, [addresses[won]])  # it proved its id here: a hint becomes a fact
        return winner

    async def _dial_attempt(self, address: Multiaddr, peer_id: PeerID, bulk: bool) -> Connection:
        async with compat.timeout(self.dial_timeout):
            return await self.dial(address, peer_id, bulk=bulk)

    # -- resolution -----------------------------------------------------------------------------
    async def _resolve(self, peer_id: PeerID) -> tuple[Multiaddr, ...]:
        """Addresses from `peer_id`'s signed record: cached, or looked up once for all concurrent
        dials. Raises PeerUnreachable if no record is found within RESOLVE_TIMEOUT."""
        loop = asyncio.get_running_loop()
        cached = self._resolved.get(peer_id)
        if cached is not None and loop.time() < cached[1]:
            if not cached[0]:
                raise PeerUnreachable(f"no signed peer record of {peer_id} in the DHT (looked up recently; "
                                      "it may be in client mode, offline, or never joined)")
            return cached[0]
        pending = self._resolving.get(peer_id)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup_record(peer_id, thorough=cached is not None and cached[2]))
            self._resolving[peer_id] = pending
            pending.add_done_callback(lambda f: (self._resolving.pop(peer_id, None),
                                                 f.cancelled() or f.exception()))
        await asyncio.wait([pending])  # bounded: the lookup has its own deadline
        if pending.cancelled():
            raise PeerUnreachable(f"the lookup of {peer_id}'s peer record was cancelled")
        if pending.exception() is not None:
            raise detached(pending.exception())
        return pending.result()

    async def _lookup_record(self, peer_id: PeerID, thorough: bool) -> tuple[Multiaddr, ...]:
        resolver = self._resolver
        assert resolver is not None
        loop = asyncio.get_running_loop()
        try:
            async with compat.timeout(RESOLVE_TIMEOUT):
                found = await resolver.resolve_peer(peer_id, RESOLVE_TIMEOUT, thorough)
        except TimeoutError:
            found = None
        except Exception:  # noqa: BLE001 - a broken lookup is one more reason the dial failed
            logger.warning("looking up the peer record of %s failed", peer_id, exc_info=True)
            found = None
        if found is None or not isinstance(found[0], PeerRecord) or found[0].peer_id != peer_id:
            self._cache_resolved(peer_id, (), loop.time() + RESOLVE_RETRY_SECONDS)
            raise PeerUnreachable(f"no known address for {peer_id}, and no signed peer record of it found in "
                                  f"the DHT within {RESOLVE_TIMEOUT:g} s (it may be in client mode, offline, "
                                  "or never joined)")
        record, ttl = found
        self._vouch(peer_id, record.addresses)
        self._cache_resolved(peer_id, record.addresses, loop.time() + max(0.0, ttl))
        return record.addresses

    def _cache_resolved(self, peer_id: PeerID, addresses: tuple[Multiaddr, ...], until: float) -> None:
        self._resolved.pop(peer_id, None)
        self._resolved[peer_id] = (addresses, until, False)
        drop_oldest(self._resolved, MAX_CACHED_RECORDS)

    def _retry_resolve_soon(self, peer_id: PeerID) -> None:
        cached = self._resolved.get(peer_id)
        if cached is not None:
            until = min(cached[1], asyncio.get_running_loop().time() + RESOLVE_RETRY_SECONDS)
            self._resolved[peer_id] = (cached[0], until, True)

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

    def close_loopback(self, reason: str) -> None:
        """End the in-memory connection to ourselves (calls on it fail; the next call makes a new one)."""
        if self._loopback is not None:
            self._loopback.close(reason)

    async def call(self, peer_id: PeerID, method: str, request: Any = None, *,
                   timeout: float | None = DEFAULT_CALL_TIMEOUT, resolve: bool = True) -> Any:
        """Call `method` on `peer_id` and return its response, within `timeout` seconds overall.
        A call to our own id is served by our own handlers in memory (`net.loopback`).
        `resolve=False` never looks up the peer's record (the DHT's own calls: no recursion)."""
        if peer_id == self.peer_id:
            return await self._loopback_connection().call(method, request, timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        conn = await self._shared_connection(peer_id, timeout, resolve)
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
            if (peer_id not in self._book and not self._bulk_idle.get(peer_id) and not self.is_connected(peer_id)
                    and self._resolver is not None):
                try:  # an unknown peer: its record says whether it can be dialed (bulk) at all
                    async with compat.timeout(timeout):
                        await self._resolve(peer_id)
                except TimeoutError:
                    raise PeerUnreachable(f"could not find {peer_id}'s address within {timeout} s") from None
            if self.puncher is not None and self._relayed_only(peer_id):
                # A punch in flight may soon give a direct connection to share.
                left = BULK_WAIT_SECONDS if deadline is None else min(BULK_WAIT_SECONDS, deadline - loop.time())
                await self.puncher.outcome(peer_id, left)
            dedicated = (peer_id in self._book or bool(self._bulk_idle.get(peer_id))) and not self._punched(peer_id)
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
            if not idle:  # no empty list per peer ever streamed to
                del self._bulk_idle[peer_id]
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
            if not idle:
                del self._bulk_idle[conn.peer_id]
            conn.close("idle bulk connection expired")

    async def close(self) -> None:
        """Stop listening and close every connection; pending calls fail with ConnectionLost."""
        if self._closed:
            return
        self._closed = True
        if self.puncher is not None:
            self.puncher.close()
        await self._stop_listening()
        self.close_loopback("peer is shutting down")
        for conn in list(self._all):
            conn.close("peer is shutting down")
        for fut in [*self._dialing.values(), *self._resolving.values()]:
            fut.cancel()
        await asyncio.sleep(0)


def _close_late_dial(attempt: asyncio.Future) -> None:
    """A losing dial attempt is over: close the connection it made if it made one (it was
    cancelled as it connected)."""
    if not attempt.cancelled() and attempt.exception() is None:
        attempt.result().close("another address of this peer answered first")


def _set_limit(limits: dict[str, float], method: str, seconds: float | None, longest: float) -> None:
    if seconds is None:
        limits.pop(method, None)
        return
    if not 0 < seconds <= longest:
        raise ValueError(f"max_seconds for {method!r} must be in (0, {longest:.0f}], got {seconds}")
    limits[method] = float(seconds)
