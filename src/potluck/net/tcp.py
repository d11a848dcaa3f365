"""The real transport: asyncio TCP, TLS 1.3 by default, authenticated peer ids.

potluck accepts plain TCP connections itself: the connection caps below are applied to each as soon as
it is accepted, and only then does TLS start on it (so a connection over a cap costs no TLS handshake,
and one stalled in it counts as a pending handshake). Handshake, after TLS (or on TCP with `insecure=True`):
  1. both sides send HELLO (`TCPHello`: {v, id, nonce, addrs, client, max_frame, bulk, token}; token:
     the sender's membership token in an authority-governed run, else None);
  2. the dialer checks that the TLS certificate's key is the id in HELLO and the id it dialed;
  3. the dialer sends AUTH (`Auth`): a signature over (label, the other's nonce, own nonce, own id,
     other id); the acceptor checks it and answers with its own AUTH, so a dialer's handshake succeeds
     only once the acceptor has accepted it. Nobody can answer for a peer id without its key, and
     a signature cannot be replayed on another connection or relayed to another peer.
  4. in an authority-governed run (`membership` set), each side checks the other's token once the
     other has proved its id, and refuses with a GOAWAY (`GoAway`) that says why (the dialer raises
     MembershipRefused). The authority admits peers without a token as guests that may only ask
     for one (`net.membership.GuestHandlers`).
Without TLS the ids are still proven, but the channel is neither private nor tamper-proof.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import sys
from asyncio import sslproto
from typing import Any

from potluck.core import compat
from potluck.core.errors import (
    ConnectionLost,
    HandshakeError,
    MalformedMessage,
    MembershipRefused,
    MessageTooLarge,
    NetworkError,
    PeerUnreachable,
    ProtocolError,
    detached,
)
from potluck.core.wire import Bool, Bytes, Int, Message, Text
from potluck.net.address import Multiaddr
from potluck.net.connection import MAX_CONTROL_FRAMES, Connection, Load, RemoteInfo, Stream, call_shares
from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE, SCRATCH_SIZE, Frame, FrameDecoder, Hello, Kind, encode
from potluck.net.holepunch import HolePuncher
from potluck.net.identity import SIGNATURE_BYTES, Identity, PeerID, make_ssl_contexts, peer_id_from_certificate
from potluck.net.membership import GuestHandlers, MembershipGate
from potluck.net.origins import UNKNOWN_ORIGIN, Origin, Shares, origin_of
from potluck.net.relay import Circuits, RelayRefused, StreamPipe, accept_stop
from potluck.net.tcp_punch import TCPPunch
from potluck.net.tcp_sockets import announceable_hosts, listening_sockets, pace_socket, unacknowledged
from potluck.net.transport import KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_ADDRESSES_PER_PEER, Transport

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
AUTH_LABEL = b"potluck-auth-v1"
# Each side's fresh nonce, which the other side signs (256 bits: never repeated, never guessed).
NONCE_BYTES = 32

# A peer that has not finished the handshake by then is dropped (slowloris guard). For an accepted
# connection it counts from the TCP accept and covers the TLS handshake too.
HANDSHAKE_TIMEOUT = 10.0
# TLS close_notify exchange; a dead peer must not hold our shutdown for asyncio's default 30 s.
TLS_SHUTDOWN_TIMEOUT = 2.0
# asyncio takes a TLS shutdown timeout from Python 3.11 on (3.10 closes without waiting for the peer).
_TLS_SHUTDOWN = {"ssl_shutdown_timeout": TLS_SHUTDOWN_TIMEOUT} if sys.version_info >= (3, 11) else {}
# Payloads go to the socket in 1 MiB pieces, and `send` returns below the high-water mark: what a peer
# does not read stays with the call sending it (counted: net.connection), at most 2 MiB with the link.
WRITE_PIECE = 1 * 2**20
WRITE_HIGH_WATER = 2 * 2**20
# How long close() waits for sockets to finish closing.
CLOSE_TIMEOUT = 3.0
# After accept() fails for want of file descriptors or memory, wait this long before the next try
# (asyncio's own servers wait 1 s); the queued connections wait in the backlog meanwhile.
ACCEPT_RETRY_SECONDS = 1.0
# Connections accepted per readiness of a listener before other work gets the loop (asyncio's
# servers accept up to their backlog at once; a burst of dials is still served within a few turns).
ACCEPTS_PER_WAKEUP = 64
# A refusal's reason as shown to the user: a few lines of explanation, not a place for data.
MAX_REFUSAL_CHARS = 1000

# -- Limits on what a peer that has not proven anything can make us hold (issue 14) --------------
# Largest frame accepted before the handshake completes. A HELLO is ~150 bytes plus at most
# MAX_ADDRESSES_PER_PEER addresses (~60 bytes each) and a membership token (at most 1 KiB); AUTH is
# a 64-byte signature; a GOAWAY's reason is at most MAX_REFUSAL_CHARS. 8 KiB holds all of that
# with room to spare and bounds what a stranger can make us buffer per connection, as HTTP servers
# bound a request head before they know anything about the client (Apache and nginx: 8 KiB,
# h11: 16 KiB, node.js: 16 KiB). The decoder's scratch starts at this size too.
HANDSHAKE_MAX_FRAME = 8 * 2**10
# Connections we accept in all (authenticated or not; our own dials are not counted). A process
# commonly has 1,024 file descriptors (the usual soft limit); this leaves room for our own dials,
# files and the accelerator runtime, and far exceeds what a peer needs (a DHT node talks to a few
# dozen peers, an averaging group to at most a few hundred).
MAX_CONNECTIONS = 768
# Accepted connections from one IP address. Above this a single host (one attacker, however many
# peer ids it makes up) cannot take the whole of MAX_CONNECTIONS. Several honest peers may share
# an address (a lab behind one NAT, a test swarm on 127.0.0.1), each with a shared connection and
# up to MAX_IDLE_BULK_CONNECTIONS + a few active bulk ones: 256 serves ~40 such peers per address.
# Raise it (TCPTransport(max_connections_per_ip=...)) for a larger swarm behind one address.
MAX_CONNECTIONS_PER_IP = 256
# Accepted connections from one subnet (/24 of IPv4, /48 of IPv6, `net.origins`): half of
# MAX_CONNECTIONS. One party holds a whole /24 as easily as one address (a provider's block, a
# cloud tenant's), so the per-IP cap alone let three addresses of one subnet take every slot; with
# this one, whatever one subnet does, the other half stays for everyone else (as libp2p's resource
# manager scopes connection limits by IP and by subnet).
MAX_CONNECTIONS_PER_SUBNET = 384
# Authenticated connections with one peer id (both directions): one shared connection (two for a
# moment when both dial at once), up to MAX_IDLE_BULK_CONNECTIONS idle bulk ones and a bulk one
# per concurrent stream. Past 32 a peer is opening connections rather than using them.
MAX_CONNECTIONS_PER_PEER = 32
# Accepted connections still in the handshake, from the TCP accept (before TLS) until the peer
# has proven its id. An honest handshake takes milliseconds (two round trips and two signatures),
# so even a swarm's start-up burst has few at once; a stranger's stalled ones are held up to
# HANDSHAKE_TIMEOUT, and above this cap new ones are closed at once.
MAX_PENDING_HANDSHAKES = 128
# Of those, from one IP address: half, so that one host stalling handshakes (however many it opens)
# leaves the other half to everyone else, who can still connect while it is held. A test swarm on
# 127.0.0.1 dialing one peer at once stays far below 64 handshakes in flight.
MAX_PENDING_HANDSHAKES_PER_IP = 64
# Of those, from one subnet: the same half. Stalled handshakes from many addresses of one /24 (each
# under its per-IP cap) took all 128 before; now they leave the other half too.
MAX_PENDING_HANDSHAKES_PER_SUBNET = 64


class TCPHello(Hello, what="HELLO"):
    """The HELLO over TCP: the frames' `Hello`, the protocol version, and the nonce the other side
    signs in its AUTH."""

    version: int = Int("v", 0, 2**31)
    nonce: bytes = Bytes(max_bytes=NONCE_BYTES, exact=True)


class Auth(Message, what="AUTH"):
    """The sender's proof of its id: its signature of `TCPLink._auth_message`."""

    signature: bytes = Bytes("sig", SIGNATURE_BYTES, exact=True)


class GoAway(Message, what="GOAWAY"):
    """Why the sender refuses (or ends) the connection, for the user; `membership`: because of the
    receiver's membership token (the dialer raises MembershipRefused)."""

    reason: str = Text(max_chars=MAX_REFUSAL_CHARS, default="no reason given")
    membership: bool = Bool(default=False)


def goaway(reason: str, membership: bool = False) -> list[bytes | memoryview]:
    """A GOAWAY frame's buffers (the reason cut to what a receiver reads)."""
    return encode(Frame(Kind.GOAWAY, meta=GoAway(reason[:MAX_REFUSAL_CHARS], membership).to_wire()))


def _cap(shares: str, limit: str) -> property:
    """A limit of one of a transport's `Shares`, read and set as a plain attribute."""
    return property(lambda self: getattr(getattr(self, shares), limit),
                    lambda self, n: setattr(getattr(self, shares), limit, n))


class TCPTransport(Transport):
    """A peer on real TCP; see the module docstring for the handshake."""

    def __init__(self, identity: Identity, *, host: str = "0.0.0.0", port: int = 0,
                 client_mode: bool = False, insecure: bool = False,
                 announce: list[str] | None = None,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 dial_timeout: float = 10.0,
                 keepalive_interval: float | None = KEEPALIVE_INTERVAL,
                 keepalive_timeout: float | None = KEEPALIVE_TIMEOUT,
                 membership: MembershipGate | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_ip: int = MAX_CONNECTIONS_PER_IP,
                 max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
                 max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
                 max_pending_handshakes_per_ip: int = MAX_PENDING_HANDSHAKES_PER_IP,
                 max_connections_per_subnet: int = MAX_CONNECTIONS_PER_SUBNET,
                 max_pending_handshakes_per_subnet: int = MAX_PENDING_HANDSHAKES_PER_SUBNET):
        super().__init__(identity, client_mode=client_mode, max_frame_size=max_frame_size,
                         dial_timeout=dial_timeout, keepalive_interval=keepalive_interval,
                         keepalive_timeout=keepalive_timeout)
        self.host, self.port = host, port
        self.insecure = insecure
        self._announce = [Multiaddr.parse(a) for a in announce or []]
        self._server_ctx, self._client_ctx = (None, None) if insecure else make_ssl_contexts(identity)
        self._listeners: list[socket.socket] = []
        self._retrying: dict[socket.socket, asyncio.TimerHandle] = {}  # listeners resting after a failed accept
        self._listen: list[Multiaddr] = []
        self._links: set[TCPLink] = set()
        # The run's membership check (None: anyone who proves a peer id is admitted, as before).
        self.membership = membership
        # Accepted links, open, and those still in their handshake: each counted per IP and subnet
        # (`net.origins.Shares`; an entry only while an origin holds one). The caps are the
        # `max_*` properties below, which a test or an operator may change on a live transport.
        self._connections = Shares.fitted("connections", max_connections, per_subnet=max_connections_per_subnet,
                                          per_ip=max_connections_per_ip, per_peer=1)
        self._handshakes = Shares.fitted("handshakes in progress", max_pending_handshakes,
                                         per_subnet=max_pending_handshakes_per_subnet,
                                         per_ip=max_pending_handshakes_per_ip, per_peer=1)
        self.max_connections_per_peer = max_connections_per_peer
        # Handler calls, and the bytes of their requests and answers, in progress: per peer id (over
        # all its connections), per IP and subnet and in all (`connection.call_shares`).
        self._call_shares = call_shares()
        # Authenticated links per peer id (for MAX_CONNECTIONS_PER_PEER), an entry while it has one.
        self._links_per_peer: dict[PeerID, int] = {}
        # Relayed connections and hole punching (`net.relay`, `net.holepunch`).
        self.circuits = Circuits(self)
        self.puncher = HolePuncher(self)

    # -- the caps on accepted connections (see the module constants) ------------------------------
    max_connections = _cap("_connections", "total")
    max_connections_per_subnet = _cap("_connections", "per_subnet")
    max_connections_per_ip = _cap("_connections", "per_ip")
    max_pending_handshakes = _cap("_handshakes", "total")
    max_pending_handshakes_per_subnet = _cap("_handshakes", "per_subnet")
    max_pending_handshakes_per_ip = _cap("_handshakes", "per_ip")

    @property
    def accepted_connections(self) -> int:
        """Connections others opened to us that are open now (handshakes in progress included)."""
        return self._connections.held

    @property
    def pending_handshakes(self) -> int:
        """Accepted connections whose peer has not proven its id yet."""
        return self._handshakes.held

    def _accept(self, origin: Origin) -> str | None:
        """Count a newly accepted connection from `origin`, or say why it is refused (one of the
        caps above: in all, per subnet, per IP; for connections and handshakes in progress)."""
        refusal = self._connections.refusal(origin)
        if refusal is None:
            refusal = self._handshakes.refusal(origin)
            if refusal is not None:
                refusal += "; try again in a few seconds"
        if refusal is not None:
            return f"this peer refuses the connection: {refusal}"
        self._connections.claim(origin)
        self._handshakes.claim(origin)
        return None

    def _handshake_over(self, origin: Origin) -> None:
        self._handshakes.release(origin)

    def _release(self, origin: Origin) -> None:
        self._connections.release(origin)

    def _connections_with(self, peer_id: PeerID) -> int:
        return self._links_per_peer.get(peer_id, 0)

    @property
    def listen_addresses(self) -> list[Multiaddr]:
        return [a.with_peer_id(self.peer_id) for a in (self._announce or self._listen)]

    async def start(self) -> None:
        if self.forced_client:
            return
        loop = asyncio.get_running_loop()
        # Our own accept loop rather than loop.create_server: asyncio would run the TLS handshake
        # of every connection before we see it, over any cap.
        self._listeners = await listening_sockets(self.host, self.port)
        for sock in self._listeners:
            host, port = sock.getsockname()[:2]
            for h in announceable_hosts(host):
                self._listen.append(Multiaddr.tcp(h, port))
            loop.add_reader(sock.fileno(), self._accept_ready, sock)
        del self._listen[MAX_ADDRESSES_PER_PEER:]

    def _accept_ready(self, listener: socket.socket) -> None:
        """The listener is readable: accept what is queued, up to ACCEPTS_PER_WAKEUP (the reader
        stays registered, as in asyncio's own servers: one registration per listener, not per
        connection)."""
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # out of file descriptors or memory: the backlog waits meanwhile
                logger.warning("accepting a connection failed: %s; trying again in %g s", e, ACCEPT_RETRY_SECONDS)
                loop = asyncio.get_running_loop()
                loop.remove_reader(listener.fileno())
                self._retrying[listener] = loop.call_later(ACCEPT_RETRY_SECONDS, self._resume_accepting, listener)
                return
            try:
                self._accepted_socket(sock, peer)
            except Exception:  # noqa: BLE001 - one bad connection must not stop the server
                logger.exception("could not serve a connection from %s", peer)
                sock.close()

    def _resume_accepting(self, listener: socket.socket) -> None:
        self._retrying.pop(listener, None)
        if listener in self._listeners:
            asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_ready, listener)

    def _accepted_socket(self, sock: socket.socket, peer: Any) -> None:
        """Apply the caps to a new TCP connection, before TLS; hand it to a link if they allow."""
        origin = origin_of(str(peer[0])) if isinstance(peer, tuple) and peer else UNKNOWN_ORIGIN
        refusal = self._accept(origin)
        if refusal is not None:
            # Refused before a byte of it is read. Without TLS, a GOAWAY says why; with TLS only a
            # close can (the dialer expects a TLS handshake, and answering it is what this saves).
            logger.info("refusing a connection from %s: %s", origin.ip, refusal)
            if self._server_ctx is None:
                with contextlib.suppress(OSError):
                    sock.send(b"".join(bytes(b) for b in goaway(refusal)))  # a few hundred bytes, an empty buffer
            sock.close()
            return
        sock.setblocking(False)
        TCPLink(self, initiator=False).adopt(sock, peer, origin)

    def _tls_client(self) -> dict[str, Any]:
        """What `loop.create_connection` takes to run TLS as the client (nothing if insecure)."""
        if self._client_ctx is None:
            return {}
        return {"ssl": self._client_ctx, "server_hostname": "", "ssl_handshake_timeout": HANDSHAKE_TIMEOUT,
                **_TLS_SHUTDOWN}

    async def _dial_direct(self, address: Multiaddr, expected: PeerID | None, bulk: bool,
                           answer_within: float | None = None) -> Connection:
        if address.kind == "emu" or address.port is None:
            raise PeerUnreachable(f"{address} is not a TCP address")
        link = TCPLink(self, initiator=True, expected=expected, bulk=bulk)
        try:
            async with compat.timeout(answer_within):
                await asyncio.get_running_loop().create_connection(lambda: link, address.host, address.port,
                                                                   **self._source(address), **self._tls_client())
        except TimeoutError:
            link.close("no answer")
            raise PeerUnreachable(f"{address} did not answer (TCP and TLS) within {answer_within:g} s") from None
        except (OSError, ssl.SSLError) as e:
            raise PeerUnreachable(f"could not connect to {address}: {e}") from None
        return await link.authenticated(str(address))

    def _source(self, address: Multiaddr) -> dict[str, Any]:
        """Where a dial to `address` leaves from: a peer listening on one loopback address dials
        other loopback addresses from it, so that peers on 127.x.y.z (every such address is this
        machine) look like separate hosts to each other, as on a network; otherwise the system's
        choice."""
        try:
            here, there = ipaddress.ip_address(self.host), ipaddress.ip_address(address.host)
        except ValueError:
            return {}
        if here.is_loopback and there.is_loopback and here.version == there.version:
            return {"local_addr": (self.host, 0)}
        return {}

    async def link_over_stream(self, stream: Stream, relay: PeerID, initiator: bool,
                               expected: PeerID, bulk: bool) -> Connection:
        """A relayed connection: TLS (dialer = TLS client) and the usual handshake over the
        relayed bytes, so the relay sees only ciphertext. Accepted ones count in the caps under
        `relay:<relay id>` in place of an IP address."""
        link = TCPLink(self, initiator=initiator, expected=expected, bulk=bulk, relay=relay)
        pipe = StreamPipe(stream, relay)
        if not initiator:
            origin = Origin.relayed(str(relay))
            refusal = self._accept(origin)
            if refusal is not None:
                raise RelayRefused(refusal)
            try:  # its slots are held from now: a relay that stops reading us must not keep them
                async with compat.timeout(HANDSHAKE_TIMEOUT):
                    await accept_stop(stream)
            except BaseException:
                self._handshake_over(origin)
                self._release(origin)
                raise
            link.adopt_relayed(pipe, origin)
            return await link.authenticated(f"a connection relayed by {relay}")
        pipe.begin(link)
        if self._client_ctx is None:
            link.connection_made(pipe)
        else:
            try:
                tls = await _start_tls(pipe, link, self._client_ctx, server_side=False)
            except (OSError, ssl.SSLError, NetworkError) as e:
                pipe.abort()
                raise PeerUnreachable(f"TLS through relay {relay} failed: {e}") from None
            link.connection_made(tls)
        return await link.authenticated(f"{expected} through relay {relay}")

    async def _stop_listening(self) -> None:
        loop = asyncio.get_running_loop()
        for handle in self._retrying.values():
            handle.cancel()
        self._retrying = {}
        for sock in self._listeners:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners = []

    async def close(self) -> None:
        await super().close()
        for link in list(self._links):
            link.close("peer is shutting down")
        waits = [link.lost for link in self._links]
        if waits:
            await asyncio.wait(waits, timeout=CLOSE_TIMEOUT)
            for link in list(self._links):
                link.abort()

    def punch_endpoint(self) -> TCPPunch:
        """One hole punch try (`net.holepunch`): a fresh port, and the dial from it. Candidates: our
        port on each host others saw us at (a port-preserving NAT keeps it), else on our listening hosts."""
        return TCPPunch(self.host, self.observed_hosts or [a.host for a in self.listen_addresses], self._link_punched)

    async def _link_punched(self, sock: socket.socket, peer: Any, expected: PeerID, client: bool) -> Connection:
        """A connection over a hole punch's socket: TLS client and a dialing link if `client`, else
        TLS server and an accepting link, counted in the caps like any accepted connection."""
        if client:
            link = TCPLink(self, initiator=True, expected=expected)
            try:
                await asyncio.get_running_loop().create_connection(lambda: link, sock=sock, **self._tls_client())
            except (OSError, ssl.SSLError) as e:
                raise PeerUnreachable(f"TLS with {expected} on the punched connection failed: {e}") from None
        else:
            origin = origin_of(str(peer[0]))
            refusal = self._accept(origin)
            if refusal is not None:
                sock.close()
                raise PeerUnreachable(f"refusing the punched connection from {origin.ip}: {refusal}")
            link = TCPLink(self, initiator=False, expected=expected)
            link.adopt(sock, peer, origin)
        return await link.authenticated(f"{expected} on the punched connection")


class TCPLink(asyncio.BufferedProtocol):
    """One TCP (or TLS) connection: frames in and out, the handshake, then a `Connection`."""

    def __init__(self, owner: TCPTransport, initiator: bool, expected: PeerID | None = None,
                 bulk: bool = False, relay: PeerID | None = None):
        self.owner = owner
        self.initiator = initiator
        self.expected = expected
        self.bulk = bulk
        self.relay = relay  # the relay a relayed connection runs through (net.relay)
        loop = self._loop = asyncio.get_running_loop()
        # None once authenticated, or the error that ended the handshake (a result, not an
        # exception: see connection._Failed; not the connection either, which holds this link).
        self.handshake: asyncio.Future[BaseException | None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.connection: Connection | None = None
        self._transport: asyncio.Transport | None = None
        # Until the handshake: frames of at most HANDSHAKE_MAX_FRAME, one at a time, a scratch that small
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME, scratch_size=HANDSHAKE_MAX_FRAME)
        self._decoder.one_at_a_time = True
        self._accepted: Origin | None = None  # counted in the owner's caps (under this origin) while set
        self._handshaking = False  # counted as a pending handshake while set
        self._nonce = os.urandom(NONCE_BYTES)
        self._hello: TCPHello | None = None
        self._remote_max: int | None = None
        self._write_lock = asyncio.Lock()
        self.written = 0  # bytes handed to the transport (minus `unsent()`: what the other side has)
        self._control: list[list[bytes | memoryview]] = []
        self._paused = False
        self._drain_waiter: asyncio.Future[str | None] | None = None  # why the link was lost, if it was
        self._closing_reason: str | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._peername: Any = None
        # An accepted connection until asyncio hands it back to us (after its TLS handshake): the
        # task that hands it over (cancelling it closes the connection).
        self._opening: asyncio.Task | None = None
        self._gone = False  # connection_lost has run

    async def authenticated(self, name: str) -> Connection:
        """The connection, once the handshake (started elsewhere) is over; closes the link if not."""
        try:
            error = await self.handshake
        except BaseException:
            self.close("handshake failed")
            raise
        if error is not None:
            self.close("handshake failed")
            raise detached(error)
        if self.connection is None:
            raise PeerUnreachable(f"{name} closed the connection right after the handshake")
        return self.connection

    def adopt_relayed(self, pipe: StreamPipe, origin: Origin) -> None:
        """Serve a relayed connection we accepted (counted under `origin`), as `adopt` a socket."""
        self._accepted, self._handshaking, self._peername = origin, True, origin.ip
        self.owner._links.add(self)
        self._handshake_timer = self._loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_expired)
        self._opening = self._loop.create_task(self._open_relayed(pipe))

    async def _open_relayed(self, pipe: StreamPipe) -> None:
        pipe.begin(self)
        if self.owner._server_ctx is None:
            self._opening = None
            self.connection_made(pipe)
            return
        try:
            tls = await _start_tls(pipe, self, self.owner._server_ctx, server_side=True)
        except BaseException as e:  # noqa: BLE001 - a failed or cancelled TLS handshake ends the link
            pipe.abort()
            self._tls_failed(e)
            return
        self._opening = None
        self.connection_made(tls)

    def adopt(self, sock: socket.socket, peer: Any, origin: Origin) -> None:
        """Serve a connection we accepted (and counted, under `origin`): it is a pending handshake
        from now until the peer proves its id, and the handshake deadline covers TLS too."""
        self._accepted, self._handshaking, self._peername = origin, True, peer
        self.owner._links.add(self)
        self._handshake_timer = self._loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_expired)
        self._opening = self._loop.create_task(self._open(sock))

    async def _open(self, sock: socket.socket) -> None:
        kwargs: dict[str, Any] = {}
        if self.owner._server_ctx is not None:
            kwargs.update(ssl=self.owner._server_ctx, ssl_handshake_timeout=HANDSHAKE_TIMEOUT, **_TLS_SHUTDOWN)
        try:
            # Calls connection_made with the (TLS) transport once its handshake is done.
            await self._loop.connect_accepted_socket(lambda: self, sock, **kwargs)
        except BaseException as e:  # noqa: BLE001 - a failed or cancelled TLS handshake ends the link
            self._tls_failed(e)
            return
        self._opening = None

    def _tls_failed(self, error: BaseException) -> None:
        """An accepted connection's TLS handshake failed or was cancelled: asyncio has closed the
        connection and does not tell the protocol of a connection lost in the TLS handshake, so end
        the link here (connection_lost runs once); re-raise what is not an error (KeyboardInterrupt)."""
        self._opening = None
        cancelled = isinstance(error, asyncio.CancelledError)
        if isinstance(error, Exception) and not cancelled:
            logger.debug("TLS handshake with %s failed: %r", self._peer_name(), error)
            # Its traceback holds asyncio's frames, which hold the future that holds the error
            # (and this link, their protocol): a cycle only the GC would free. Not needed now.
            _drop_tracebacks(error)
        self.connection_lost(None if cancelled or not isinstance(error, Exception) else error)
        if not isinstance(error, Exception) and not cancelled:
            raise error

    # -- asyncio protocol callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if self._closing_reason is not None or self._gone:  # closed (or expired) during TLS
            transport.close()
            return
        if self.initiator:
            self._peername = transport.get_extra_info("peername")
            self.owner._links.add(self)
            self._handshake_timer = self._loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_expired)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        hello = TCPHello(self.owner.peer_id, tuple(a.without_peer_id() for a in self.owner.addresses),
                         self.owner.client_mode, self.owner.max_frame_size, self.bulk,
                         self.owner.membership.own_token() if self.owner.membership is not None else None,
                         PROTOCOL_VERSION, self._nonce)
        self._write_now(encode(Frame(Kind.HELLO, meta=hello.to_wire())))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.relay is None:  # a relayed link's bytes are counted on the connection to the relay
            self.owner.stats.bytes_received += nbytes
        if self.connection is not None:
            # Any bytes are proof of life, not only whole frames: a large frame on a slow link may
            # take longer than the keepalive timeout, and its sender cannot answer pings meanwhile.
            self.connection.last_received = self._loop.time()
        try:
            held = self._decoder.one_at_a_time
            frames = self._decoder.paced(self._decoder.buffer_updated(nbytes), nbytes, self._loop.time())
            while True:
                for frame in frames:
                    if self.connection is not None:
                        self.connection.frame_received(frame)
                    else:
                        self._handshake_frame(frame)
                # During the handshake the decoder stops after each frame, so the frames after
                # it are read under the limits that hold once it has been handled.
                if not (held and frames) or self._closing_reason is not None:
                    break
                held = self._decoder.one_at_a_time
                frames = self._decoder.parse_more()
        except (ProtocolError, MessageTooLarge, HandshakeError) as e:
            logger.info("dropping connection from %s: %s", self._peer_name(), e)
            self._fail_handshake(e)
            if isinstance(e, MembershipRefused):
                self._write_now(goaway(str(e), membership=True))
            elif not isinstance(e, HandshakeError):
                self._write_now(goaway(str(e)))
            self.close(str(e))

    def eof_received(self) -> bool:
        return False  # half-open connections are of no use to us: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gone:  # the end of an accepted one may be reported twice (see _open)
            return
        self._gone = True
        self.owner._links.discard(self)
        self._end_pending_handshake()
        if self._accepted is not None:
            self.owner._release(self._accepted)
            self._accepted = None
        self._transport = None  # asyncio's (TLS) transport holds our methods: drop the cycle
        reason = self._closing_reason or (f"{exc}" if exc else "the other side closed the connection")
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._fail_handshake(PeerUnreachable(f"connection closed during handshake: {reason}"))
        self._paused = True
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(reason)
        if self.connection is not None:
            _decrement(self.owner._links_per_peer, self.connection.peer_id)
            self.connection.link_lost(reason)
            self.connection = None  # the connection keeps its link; drop the way back (a cycle)
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- handshake --------------------------------------------------------------------------------
    def _handshake_frame(self, frame: Frame) -> None:
        meta = frame.meta or {}
        if frame.kind is Kind.HELLO and self._hello is None:
            self._on_hello(meta)
        elif frame.kind is Kind.AUTH and self._hello is not None:
            self._on_auth(meta)
        elif frame.kind is Kind.GOAWAY:
            try:
                refusal = GoAway.from_wire(meta)
            except MalformedMessage as e:  # a refusal all the same
                raise HandshakeError(f"refused by the other side, with a {e}") from None
            if refusal.membership:
                raise MembershipRefused(f"{self._peer_name()} refused this peer's membership: {refusal.reason}")
            raise HandshakeError(f"refused by the other side: {refusal.reason}")
        else:
            raise ProtocolError(f"expected a handshake frame, got {frame.kind.name}")

    def _on_hello(self, meta: dict) -> None:
        if meta.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {meta.get('v')!r}")
        hello = TCPHello.from_wire(meta)  # MalformedMessage, a ProtocolError: "malformed HELLO: '<key>' ..."
        remote_id = hello.peer_id
        if self.expected is not None and remote_id != self.expected:
            raise HandshakeError(f"dialed {self.expected} but the peer there is {remote_id}")
        if remote_id == self.owner.peer_id:
            raise HandshakeError("connected to ourselves")
        if self.initiator and self.owner._client_ctx is not None:
            ssl_object = self._transport.get_extra_info("ssl_object")
            cert_id = peer_id_from_certificate(ssl_object.getpeercert(binary_form=True))
            if cert_id != remote_id:
                raise HandshakeError(f"TLS certificate belongs to {cert_id}, not to {remote_id}")
        self._hello = hello
        self._remote_max = hello.max_frame_size
        if self.initiator:  # the acceptor proves itself only after checking the dialer's proof
            self._send_auth()

    def _send_auth(self) -> None:
        hello = self._hello
        assert hello is not None
        signature = self.owner.identity.sign(self._auth_message(
            hello.nonce, self._nonce, self.owner.peer_id, hello.peer_id))
        self._write_now(encode(Frame(Kind.AUTH, meta=Auth(signature).to_wire())))

    def _on_auth(self, meta: dict) -> None:
        hello = self._hello
        assert hello is not None
        message = self._auth_message(self._nonce, hello.nonce, hello.peer_id, self.owner.peer_id)
        try:
            proven = hello.peer_id.verify(Auth.from_wire(meta).signature, message)
        except MalformedMessage:
            proven = False
        if not proven:
            raise HandshakeError(f"the peer could not prove it holds the key of {hello.peer_id}")
        handlers = self._admit(hello.peer_id, hello.token)
        if self.owner._connections_with(hello.peer_id) >= self.owner.max_connections_per_peer:
            reason = (f"too many connections with {hello.peer_id} "
                      f"(limit {self.owner.max_connections_per_peer} per peer)")
            self._write_now(goaway(reason))
            raise HandshakeError(reason)
        if not self.initiator:
            self._send_auth()
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._end_pending_handshake()
        # Authenticated: the peer's own frame limit from now on, and the usual scratch.
        self._decoder.max_frame_size = self.owner.max_frame_size
        self._decoder.one_at_a_time = False
        self._decoder.grow_scratch(SCRATCH_SIZE)
        remote = RemoteInfo(hello.peer_id, hello.addresses, hello.client_mode, self._remote_max,
                            bulk=hello.bulk if not self.initiator else self.bulk,
                            token=hello.token, observed=None if self.relay else _observed(self._peername),
                            relayed=self.relay is not None, origin=self._origin())
        conn = Connection(handlers, remote, self.initiator,
                          self.owner.keepalive_interval, self.owner.keepalive_timeout,
                          on_close=self.owner.connection_closed,
                          load=Load(self.owner._call_shares, remote.origin, hello.peer_id))
        conn.attach(self)
        self.connection = conn
        self.owner._links_per_peer[conn.peer_id] = self.owner._links_per_peer.get(conn.peer_id, 0) + 1
        self.owner.add_connection(conn)
        if not self.handshake.done():
            self.handshake.set_result(None)

    def _admit(self, remote: PeerID, token: bytes | None) -> Any:
        """The handlers a proven peer may use; MembershipRefused if its token does not admit it.
        The authority (whose gate has guest methods) admits tokenless dialers as guests."""
        gate = self.owner.membership
        if gate is None:
            return self.owner.handlers
        try:
            gate.check(remote, token)
        except MembershipRefused as e:
            if self.initiator or not gate.guest_methods:
                raise
            logger.debug("admitting %s as a guest: %s", remote, e)
            return GuestHandlers(self.owner.handlers, gate.guest_methods, str(e))
        return self.owner.handlers

    @staticmethod
    def _auth_message(verifier_nonce: bytes, signer_nonce: bytes, signer: PeerID, verifier: PeerID) -> bytes:
        return AUTH_LABEL + verifier_nonce + signer_nonce + signer.to_bytes() + verifier.to_bytes()

    def _origin(self) -> Origin:
        """Where the peer's bytes come from: the relay for a relayed link, else its IP."""
        if self.relay is not None:
            return Origin.relayed(str(self.relay))
        if self._accepted is not None:
            return self._accepted
        observed = _observed(self._peername)
        return origin_of(observed) if observed is not None else UNKNOWN_ORIGIN

    def _end_pending_handshake(self) -> None:
        if self._handshaking and self._accepted is not None:
            self._handshaking = False
            self.owner._handshake_over(self._accepted)

    def _handshake_expired(self) -> None:
        if self.connection is None:
            self._fail_handshake(HandshakeError(f"handshake not finished within {HANDSHAKE_TIMEOUT} s"))
            self.close("handshake timeout")

    def _fail_handshake(self, error: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_result(detached(error))  # `error` may have been raised here

    # -- FrameLink ---------------------------------------------------------------------------------
    async def send(self, frame: Frame) -> int:
        buffers = encode(frame, self._remote_max)
        async with self._write_lock:
            self._flush_control()
            started = False
            try:
                for buf in buffers:
                    view = memoryview(buf)
                    for start in range(0, view.nbytes, WRITE_PIECE):
                        if self._paused:
                            await self._drain()
                        piece = view[start:start + WRITE_PIECE]
                        self._transport.write(piece)
                        self.written += piece.nbytes
                        started = True
            except BaseException:
                if started:  # a deadline or a cancellation cut a frame in half: the stream is lost
                    self.close("a frame was abandoned half-sent (its deadline passed)")
                raise
            if self.relay is None:
                self.owner.stats.bytes_sent += frame.size
            self._flush_control()
            if self._paused:  # (8 MiB left with each link let made-up ids park 2 GiB per IP)
                await self._drain()
        return frame.size

    def send_nowait(self, frame: Frame) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        buffers = encode(frame, self._remote_max)
        if not self._write_lock.locked():
            self._write_now(buffers)
        elif len(self._control) < MAX_CONTROL_FRAMES:
            self._control.append(buffers)
        else:  # answers to pings and refused calls of a peer that does not read ours
            self.close(f"{MAX_CONTROL_FRAMES} control frames wait behind a send the other side does not read")

    def _flush_control(self) -> None:
        while self._control:
            self._write_now(self._control.pop(0))

    def _write_now(self, buffers: list[bytes | memoryview]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            for buf in buffers:
                self._transport.write(buf)
                self.written += len(buf)
                if self.relay is None:
                    self.owner.stats.bytes_sent += len(buf)

    async def _drain(self) -> None:
        if self._transport is None or self._transport.is_closing():
            raise ConnectionLost(self._closing_reason or "connection closed")
        self._drain_waiter = asyncio.get_running_loop().create_future()
        lost = await self._drain_waiter
        self._drain_waiter = None
        if lost is not None:
            raise ConnectionLost(lost)

    def unsent(self) -> int:
        """Bytes handed to this link (`send` returned) that the other side's TCP has not acknowledged
        yet: the transport's buffer plus the kernel's send queue (Linux; elsewhere the buffer alone)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return 0
        sock = transport.get_extra_info("socket")
        return transport.get_write_buffer_size() + (0 if sock is None else unacknowledged(sock))

    def pace(self, rate: float | None) -> None:
        """Send at most `rate` bytes/s, queueing little (None: as fast as congestion control goes;
        `TransferStats.pace` says why). Linux only; elsewhere, and on a relayed link, nothing."""
        transport = self._transport
        sock = None if transport is None or transport.is_closing() else transport.get_extra_info("socket")
        if sock is not None and self.relay is None:  # (a relayed link's socket is the relay's, shared)
            transport.set_write_buffer_limits(high=pace_socket(sock, rate) or WRITE_HIGH_WATER)  # type: ignore[attr-defined]

    def close(self, reason: str | None = None) -> None:
        """Close now: pending calls fail at once, without waiting for the TLS goodbye."""
        if self._closing_reason is None:
            self._closing_reason = reason or "closed"
        if self.connection is not None:
            self.connection.link_lost(self._closing_reason)
        if self._transport is not None:
            if not self._transport.is_closing():
                self._transport.close()
        elif self._opening is not None:
            self._opening.cancel()  # asyncio closes the connection; _open ends the link

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
        elif self._opening is not None:
            self._opening.cancel()

    def _peer_name(self) -> str:
        if self._hello is not None:
            return str(self._hello.peer_id)
        return str(self._peername)


def _observed(peername: Any) -> Multiaddr | None:
    """The address a connection came from (TCP peername), as a Multiaddr."""
    try:
        return Multiaddr.tcp(peername[0], peername[1])
    except Exception:  # noqa: BLE001 - not an (ip, port) pair: e.g. a socket already gone
        return None


async def _start_tls(pipe: StreamPipe, protocol: asyncio.BaseProtocol, context: ssl.SSLContext, *,
                     server_side: bool) -> asyncio.BaseTransport:
    """TLS over a relayed pipe, as the standard loop's `start_tls` does it: uvloop's `start_tls`
    accepts only uvloop's own transports, and potluck's runner uses uvloop when installed."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    tls = sslproto.SSLProtocol(loop, protocol, context, waiter, server_side, None if server_side else "",
                               call_connection_made=False, ssl_handshake_timeout=HANDSHAKE_TIMEOUT, **_TLS_SHUTDOWN)
    pipe.pause_reading()
    pipe.set_protocol(tls)
    made = loop.call_soon(tls.connection_made, pipe)
    resumed = loop.call_soon(pipe.resume_reading)
    try:
        await waiter
    except BaseException:
        pipe.close()
        made.cancel()
        resumed.cancel()
        raise
    return tls._app_transport


def _drop_tracebacks(error: BaseException) -> None:
    """Forget the tracebacks of `error` and of the errors it was raised from or during."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def _decrement(counts: dict[Any, int], key: Any) -> None:
    """One less under `key`; the entry goes at zero (nothing is kept per address or peer once idle)."""
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
