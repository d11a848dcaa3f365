"""The real transport: asyncio TCP, TLS 1.3 by default, authenticated peer ids.

potluck accepts plain TCP connections itself: the connection caps below are applied to each as
soon as it is accepted, and only then does TLS start on it (so a connection over a cap costs no
TLS handshake, and one stalled in the TLS handshake counts as a pending handshake). Handshake,
after TLS (or directly on TCP with `insecure=True`):
  1. both sides send HELLO {id, nonce, addrs, client, max_frame, bulk, token} (token: the sender's
     membership token in an authority-governed run, else None);
  2. the dialer checks that the TLS certificate's key is the id in HELLO and the id it dialed;
  3. the dialer sends AUTH: a signature over (label, the other's nonce, own nonce, own id, other
     id); the acceptor checks it and answers with its own AUTH, so a dialer's handshake succeeds
     only once the acceptor has accepted it. Nobody can answer for a peer id without its key, and
     a signature cannot be replayed on another connection or relayed to another peer.
  4. in an authority-governed run (`membership` set), each side checks the other's token once the
     other has proved its id, and refuses with a GOAWAY that says why (the dialer raises
     MembershipRefused). The authority admits peers without a token as guests that may only ask
     for one (`net.membership.GuestHandlers`).
Without TLS the ids are still proven, but the channel is neither private nor tamper-proof.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import ssl
import sys
from asyncio import sslproto
from typing import Any

from potluck.core.errors import (
    ConnectionLost,
    HandshakeError,
    MembershipRefused,
    MessageTooLarge,
    NetworkError,
    PeerUnreachable,
    ProtocolError,
    detached,
)
from potluck.net.address import Multiaddr
from potluck.net.connection import Connection, PeerLoad, RemoteInfo, Stream
from potluck.net.frames import DEFAULT_MAX_FRAME_SIZE, SCRATCH_SIZE, Frame, FrameDecoder, Kind, encode
from potluck.net.holepunch import MAX_CANDIDATES
from potluck.net.identity import Identity, PeerID, make_ssl_contexts, peer_id_from_certificate
from potluck.net.membership import MAX_TOKEN_BYTES, GuestHandlers, MembershipGate
from potluck.net.relay import RelayRefused, StreamPipe, accept_stop, dial_circuit
from potluck.net.transport import KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_ADDRESSES_PER_PEER, Transport

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
AUTH_LABEL = b"potluck-auth-v1"

# A peer that has not finished the handshake by then is dropped (slowloris guard). For an accepted
# connection it counts from the TCP accept and covers the TLS handshake too.
HANDSHAKE_TIMEOUT = 10.0
# TLS close_notify exchange; a dead peer must not hold our shutdown for asyncio's default 30 s.
TLS_SHUTDOWN_TIMEOUT = 2.0
# asyncio takes a TLS shutdown timeout from Python 3.11 on (3.10 closes without waiting for the peer).
_TLS_SHUTDOWN = {"ssl_shutdown_timeout": TLS_SHUTDOWN_TIMEOUT} if sys.version_info >= (3, 11) else {}
# Large payloads are handed to the socket in pieces so the transport never copies a whole tensor
# into its own buffer; it pauses us above the high-water mark.
WRITE_PIECE = 1 * 2**20
WRITE_HIGH_WATER = 8 * 2**20
# How long close() waits for sockets to finish closing.
CLOSE_TIMEOUT = 3.0
# Pending connections the OS queues for us to accept (asyncio's create_server uses 100).
LISTEN_BACKLOG = 1024
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
# Connections a hole punch's listener queues (`TCPPunch`): it waits for one, from one peer.
PUNCH_BACKLOG = 4
# Ports shared by a punch's listener and its dial need SO_REUSEPORT (Linux, macOS, BSDs).
_REUSE_PORT = hasattr(socket, "SO_REUSEPORT")


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
                 max_pending_handshakes_per_ip: int = MAX_PENDING_HANDSHAKES_PER_IP):
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
        self.max_connections = max_connections
        self.max_connections_per_ip = max_connections_per_ip
        self.max_connections_per_peer = max_connections_per_peer
        self.max_pending_handshakes = max_pending_handshakes
        self.max_pending_handshakes_per_ip = max_pending_handshakes_per_ip
        self._accepted = 0  # accepted links, open
        self._accepted_per_ip: dict[str, int] = {}  # an entry per address with an open accepted link
        self._pending_handshakes = 0  # accepted links not yet authenticated
        self._pending_per_ip: dict[str, int] = {}  # an entry per address with a pending one
        # What each authenticated peer's requests hold over all its connections (connection.PeerLoad):
        # an entry only while the peer has an open connection or a running handler.
        self._peer_loads: dict[PeerID, PeerLoad] = {}
        # Authenticated links per peer id (for MAX_CONNECTIONS_PER_PEER), an entry while it has one.
        self._links_per_peer: dict[PeerID, int] = {}

    def _accept(self, ip: str) -> str | None:
        """Count a newly accepted connection, or say why it is refused (one of the caps above)."""
        if self._accepted >= self.max_connections:
            return f"this peer has too many connections (limit {self.max_connections})"
        if self._accepted_per_ip.get(ip, 0) >= self.max_connections_per_ip:
            return f"too many connections from {ip} (limit {self.max_connections_per_ip} per address)"
        if self._pending_handshakes >= self.max_pending_handshakes:
            return f"too many handshakes in progress (limit {self.max_pending_handshakes}); try again"
        if self._pending_per_ip.get(ip, 0) >= self.max_pending_handshakes_per_ip:
            return (f"too many handshakes in progress from {ip} "
                    f"(limit {self.max_pending_handshakes_per_ip} per address); try again")
        self._accepted += 1
        self._accepted_per_ip[ip] = self._accepted_per_ip.get(ip, 0) + 1
        self._pending_handshakes += 1
        self._pending_per_ip[ip] = self._pending_per_ip.get(ip, 0) + 1
        return None

    def _handshake_over(self, ip: str) -> None:
        self._pending_handshakes -= 1
        _decrement(self._pending_per_ip, ip)

    def _release(self, ip: str) -> None:
        self._accepted -= 1
        _decrement(self._accepted_per_ip, ip)

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
        self._listeners = await _listening_sockets(self.host, self.port)
        for sock in self._listeners:
            host, port = sock.getsockname()[:2]
            for h in _announceable_hosts(host):
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
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refusal = self._accept(ip)
        if refusal is not None:
            # Refused before a byte of it is read. Without TLS, a GOAWAY says why; with TLS only a
            # close can (the dialer expects a TLS handshake, and answering it is what this saves).
            logger.info("refusing a connection from %s: %s", ip, refusal)
            if self._server_ctx is None:
                goaway = b"".join(bytes(b) for b in encode(Frame(Kind.GOAWAY, meta={"reason": refusal})))
                with contextlib.suppress(OSError):
                    sock.send(goaway)  # a few hundred bytes into an empty socket buffer
            sock.close()
            return
        sock.setblocking(False)
        TCPLink(self, initiator=False).adopt(sock, peer, ip)

    async def _dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool) -> Connection:
        if address.is_circuit:
            return await dial_circuit(self, address, expected, bulk)
        if address.kind == "emu" or address.port is None:
            raise PeerUnreachable(f"{address} is not a TCP address")
        loop = asyncio.get_running_loop()
        link = TCPLink(self, initiator=True, expected=expected, bulk=bulk)
        kwargs: dict[str, Any] = {}
        if self._client_ctx is not None:
            kwargs.update(ssl=self._client_ctx, server_hostname="", ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
                          **_TLS_SHUTDOWN)
        try:
            await loop.create_connection(lambda: link, address.host, address.port, **kwargs)
        except (OSError, ssl.SSLError) as e:
            raise PeerUnreachable(f"could not connect to {address}: {e}") from None
        return await link.authenticated(str(address))

    async def _link_over_stream(self, stream: Stream, relay: PeerID, initiator: bool,
                                expected: PeerID, bulk: bool) -> Connection:
        """A relayed connection: TLS (dialer = TLS client) and the usual handshake over the
        relayed bytes, so the relay sees only ciphertext. Accepted ones count in the caps under
        `relay:<relay id>` in place of an IP address."""
        link = TCPLink(self, initiator=initiator, expected=expected, bulk=bulk, relay=relay)
        pipe = StreamPipe(stream, relay)
        if not initiator:
            key = f"relay:{relay}"
            refusal = self._accept(key)
            if refusal is not None:
                raise RelayRefused(refusal)
            try:
                await accept_stop(stream)
            except BaseException:
                self._handshake_over(key)
                self._release(key)
                raise
            link.adopt_relayed(pipe, key)
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
        """One hole punch try (`net.holepunch`): a fresh port, and the dial from it."""
        return TCPPunch(self)


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
        # Until the handshake is over: frames of at most HANDSHAKE_MAX_FRAME, one at a time (see
        # buffer_updated), and a scratch that small.
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME, scratch_size=HANDSHAKE_MAX_FRAME)
        self._decoder.one_at_a_time = True
        self._accepted_ip: str | None = None  # counted in the owner's caps while set
        self._handshaking = False  # counted as a pending handshake while set
        self._nonce = os.urandom(32)
        self._hello: dict | None = None
        self._remote_max: int | None = None
        self._write_lock = asyncio.Lock()
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

    def adopt_relayed(self, pipe: StreamPipe, key: str) -> None:
        """Serve a relayed connection we accepted (counted under `key`), as `adopt` a socket."""
        self._accepted_ip, self._handshaking, self._peername = key, True, key
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

    def adopt(self, sock: socket.socket, peer: Any, ip: str) -> None:
        """Serve a connection we accepted (and counted, under `ip`): it is a pending handshake from
        now until the peer proves its id, and the handshake deadline covers TLS too."""
        self._accepted_ip, self._handshaking, self._peername = ip, True, peer
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
        hello = {
            "v": PROTOCOL_VERSION, "id": self.owner.peer_id.to_bytes(), "nonce": self._nonce,
            "addrs": [str(a.without_peer_id()) for a in self.owner.addresses[:MAX_ADDRESSES_PER_PEER]],
            "client": self.owner.client_mode, "max_frame": self.owner.max_frame_size,
            "bulk": self.bulk,
            "token": self.owner.membership.own_token() if self.owner.membership is not None else None,
        }
        self._write_now(encode(Frame(Kind.HELLO, meta=hello)))

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
            frames = self._decoder.buffer_updated(nbytes)
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
                self._write_now(encode(Frame(Kind.GOAWAY, meta={"reason": str(e), "membership": True})))
            elif not isinstance(e, HandshakeError):
                self._write_now(encode(Frame(Kind.GOAWAY, meta={"reason": str(e)})))
            self.close(str(e))

    def eof_received(self) -> bool:
        return False  # half-open connections are of no use to us: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gone:  # the end of an accepted one may be reported twice (see _open)
            return
        self._gone = True
        self.owner._links.discard(self)
        self._end_pending_handshake()
        if self._accepted_ip is not None:
            self.owner._release(self._accepted_ip)
            self._accepted_ip = None
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
            reason = meta.get("reason")
            reason = reason[:MAX_REFUSAL_CHARS] if isinstance(reason, str) else "no reason given"
            if meta.get("membership") is True:
                raise MembershipRefused(f"{self._peer_name()} refused this peer's membership: {reason}")
            raise HandshakeError(f"refused by the other side: {reason}")
        else:
            raise ProtocolError(f"expected a handshake frame, got {frame.kind.name}")

    def _on_hello(self, meta: dict) -> None:
        if meta.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {meta.get('v')!r}")
        try:
            remote_id = PeerID(meta["id"])
            nonce = meta["nonce"]
            if not isinstance(nonce, bytes) or len(nonce) != 32:
                raise ValueError("bad nonce")
            max_frame = meta.get("max_frame")
            if not isinstance(max_frame, int) or max_frame < 1024:
                raise ValueError("bad max_frame")
            addrs = [Multiaddr.parse(a) for a in list(meta.get("addrs") or [])[:MAX_ADDRESSES_PER_PEER]]
            token = meta.get("token")
            if token is not None and (not isinstance(token, bytes) or len(token) > MAX_TOKEN_BYTES):
                raise ValueError(f"bad token: None or at most {MAX_TOKEN_BYTES} bytes")
        except (KeyError, TypeError, ValueError, NetworkError, Exception) as e:
            raise ProtocolError(f"malformed HELLO: {e}") from None
        if self.expected is not None and remote_id != self.expected:
            raise HandshakeError(f"dialed {self.expected} but the peer there is {remote_id}")
        if remote_id == self.owner.peer_id:
            raise HandshakeError("connected to ourselves")
        if self.initiator and self.owner._client_ctx is not None:
            ssl_object = self._transport.get_extra_info("ssl_object")
            cert_id = peer_id_from_certificate(ssl_object.getpeercert(binary_form=True))
            if cert_id != remote_id:
                raise HandshakeError(f"TLS certificate belongs to {cert_id}, not to {remote_id}")
        self._hello = {"id": remote_id, "nonce": nonce, "addrs": tuple(addrs),
                       "client": bool(meta.get("client")), "bulk": bool(meta.get("bulk")),
                       "token": token}
        self._remote_max = max_frame
        if self.initiator:  # the acceptor proves itself only after checking the dialer's proof
            self._send_auth()

    def _send_auth(self) -> None:
        hello = self._hello
        assert hello is not None
        signature = self.owner.identity.sign(self._auth_message(
            hello["nonce"], self._nonce, self.owner.peer_id, hello["id"]))
        self._write_now(encode(Frame(Kind.AUTH, meta={"sig": signature})))

    def _on_auth(self, meta: dict) -> None:
        hello = self._hello
        assert hello is not None
        signature = meta.get("sig")
        message = self._auth_message(self._nonce, hello["nonce"], hello["id"], self.owner.peer_id)
        if not isinstance(signature, bytes) or not hello["id"].verify(signature, message):
            raise HandshakeError(f"the peer could not prove it holds the key of {hello['id']}")
        handlers = self._admit(hello["id"], hello["token"])
        if self.owner._connections_with(hello["id"]) >= self.owner.max_connections_per_peer:
            reason = (f"too many connections with {hello['id']} "
                      f"(limit {self.owner.max_connections_per_peer} per peer)")
            self._write_now(encode(Frame(Kind.GOAWAY, meta={"reason": reason})))
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
        remote = RemoteInfo(hello["id"], hello["addrs"], hello["client"], self._remote_max,
                            bulk=hello["bulk"] if not self.initiator else self.bulk,
                            token=hello["token"], observed=None if self.relay else _observed(self._peername),
                            relayed=self.relay is not None)
        conn = Connection(handlers, remote, self.initiator,
                          self.owner.keepalive_interval, self.owner.keepalive_timeout,
                          on_close=self.owner._unregister, load=PeerLoad.of(self.owner._peer_loads, hello["id"]))
        conn.attach(self)
        self.connection = conn
        self.owner._links_per_peer[conn.peer_id] = self.owner._links_per_peer.get(conn.peer_id, 0) + 1
        self.owner._register(conn)
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

    def _end_pending_handshake(self) -> None:
        if self._handshaking:
            self._handshaking = False
            self.owner._handshake_over(self._accepted_ip or "?")

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
                        self._transport.write(view[start:start + WRITE_PIECE])
                        started = True
            except BaseException:
                if started:  # a deadline or a cancellation cut a frame in half: the stream is lost
                    self.close("a frame was abandoned half-sent (its deadline passed)")
                raise
            if self.relay is None:
                self.owner.stats.bytes_sent += frame.size
            self._flush_control()
        return frame.size

    def send_nowait(self, frame: Frame) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        buffers = encode(frame, self._remote_max)
        if self._write_lock.locked():
            self._control.append(buffers)
        else:
            self._write_now(buffers)

    def _flush_control(self) -> None:
        while self._control:
            self._write_now(self._control.pop(0))

    def _write_now(self, buffers: list[bytes | memoryview]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            for buf in buffers:
                self._transport.write(buf)
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
            return str(self._hello["id"])
        return str(self._peername)


class TCPPunch:
    """One hole punch try on TCP (`net.holepunch`): a socket listening on a fresh port, and a dial
    from that same port to the other side's first candidate of our address family (one address
    each, so both sides' dials are one TCP connection). The connection is our dial if our SYN
    crossed theirs (a simultaneous open through both NATs), or the one we accepted (where nothing
    drops their SYN before ours leaves: no NAT on our side, or loopback). Candidates: our port on
    each host others saw us at (a port-preserving NAT keeps it), else on our listening hosts. The listener and the
    dial share the port through SO_REUSEADDR and SO_REUSEPORT; where SO_REUSEPORT is missing there
    is no listener, and only a simultaneous open connects."""

    def __init__(self, owner: TCPTransport):
        self.owner = owner
        self._family = socket.AF_INET6 if ":" in owner.host else socket.AF_INET
        self._kind = "ip6" if self._family == socket.AF_INET6 else "ip4"
        self._listener: socket.socket | None = _punch_socket(self._family, (owner.host, 0))
        port = self._listener.getsockname()[1]
        self._local = (owner.host, port)
        if _REUSE_PORT:
            self._listener.listen(PUNCH_BACKLOG)
        hosts = owner.observed_hosts or [a.host for a in owner.listen_addresses]
        self.candidates: list[Multiaddr] = []
        for host in dict.fromkeys(hosts):
            with contextlib.suppress(ValueError):  # not an address: skipped
                addr = Multiaddr.tcp(host, port)
                if addr.kind == self._kind:
                    self.candidates.append(addr)
        del self.candidates[MAX_CANDIDATES:]

    async def connect(self, remote: list[Multiaddr], expected: PeerID, client: bool) -> Connection:
        """The direct connection with `expected`: TLS client and dialing TCPLink if `client`, else
        TLS server and accepting one, counted in the caps like any accepted connection."""
        target = next((a for a in remote if a.kind == self._kind and a.port), None)
        if target is None:
            raise PeerUnreachable(f"{expected} gave no {self._kind} address to punch to")
        loop = asyncio.get_running_loop()
        if not _REUSE_PORT and self._listener is not None:
            self._listener.close()  # frees the port for the dial (there is no listener)
            self._listener = None
        tries = [loop.create_task(self._dial(target))]
        if self._listener is not None:
            tries.append(loop.create_task(self._accept(target.host)))
        sock, peer = await _first_socket(tries)
        self.close()
        if client:
            link = TCPLink(self.owner, initiator=True, expected=expected)
            kwargs: dict[str, Any] = {}
            if self.owner._client_ctx is not None:
                kwargs.update(ssl=self.owner._client_ctx, server_hostname="",
                              ssl_handshake_timeout=HANDSHAKE_TIMEOUT, **_TLS_SHUTDOWN)
            try:
                await loop.create_connection(lambda: link, sock=sock, **kwargs)
            except (OSError, ssl.SSLError) as e:
                raise PeerUnreachable(f"TLS with {expected} on the punched connection failed: {e}") from None
        else:
            ip = str(peer[0])
            refusal = self.owner._accept(ip)
            if refusal is not None:
                sock.close()
                raise PeerUnreachable(f"refusing the punched connection from {ip}: {refusal}")
            link = TCPLink(self.owner, initiator=False, expected=expected)
            link.adopt(sock, peer, ip)
        return await link.authenticated(f"{expected} on the punched connection")

    async def _dial(self, target: Multiaddr) -> tuple[socket.socket, Any]:
        sock = _punch_socket(self._family, self._local)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (target.host, target.port))
        except BaseException:
            sock.close()
            raise
        return sock, sock.getpeername()

    async def _accept(self, host: str) -> tuple[socket.socket, Any]:
        """The first connection from `host` (others are strangers: closed)."""
        assert self._listener is not None
        while True:
            sock, peer = await asyncio.get_running_loop().sock_accept(self._listener)
            if str(peer[0]) == host:
                sock.setblocking(False)
                return sock, peer
            sock.close()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _punch_socket(family: int, address: tuple[str, int]) -> socket.socket:
    """A TCP socket bound to `address`, whose port other punch sockets may share."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
        if _REUSE_PORT:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, True)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _first_socket(tries: list[asyncio.Task]) -> tuple[socket.socket, Any]:
    """The socket of the first of `tries` that connects; the others are cancelled (or closed)."""
    errors: list[str] = []
    pending = set(tries)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    for other in done - {task}:
                        if other.exception() is None:
                            other.result()[0].close()
                    return task.result()
                errors.append(str(task.exception()) or type(task.exception()).__name__)
    finally:
        for task in pending:
            task.cancel()
            task.add_done_callback(_close_socket)
    raise PeerUnreachable("punch dial failed: " + "; ".join(errors))


def _close_socket(task: asyncio.Task) -> None:
    """A try that connected after another had won (or after the deadline): close its socket."""
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()


async def _listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for `host` (each of its addresses), as
    loop.create_server(host, port, reuse_address=True) makes them."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # e.g. no IPv6 on this host
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            try:
                sock.bind(address)
            except OSError as e:
                raise OSError(e.errno, f"error while attempting to bind on address {address!r}: "
                                       f"{e.strerror.lower() if e.strerror else e}") from None
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


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


def _announceable_hosts(bound: str) -> list[str]:
    """The hosts to advertise for a listening socket: wildcard binds expand to local addresses."""
    ip = ipaddress.ip_address(bound)
    if not ip.is_unspecified:
        return [bound]
    hosts = []
    try:
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        for info in socket.getaddrinfo(socket.gethostname(), None, family=family):
            host = info[4][0]
            if host not in hosts and not ipaddress.ip_address(host).is_loopback:
                hosts.append(host)
    except OSError:
        pass
    loopback = "127.0.0.1" if ip.version == 4 else "::1"
    return hosts + [loopback]
