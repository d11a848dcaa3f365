"""The emulated network: many peers in one process, with bandwidth, latency, crashes and partitions.

`EmulatedTransport` is a `Transport` like the TCP one, so the DHT, averaging and pipeline code
run on it unchanged; with the virtual clock (`potluck.core.virtual_time`) thousands of peers and
hours of protocol time fit in seconds. Every frame is really encoded and decoded, so what crosses
the emulated wire is proven serializable, sized as on TCP, and arrives as fresh objects.

Timing model (deterministic; all times are loop time):
- Output queues, as in a switch: a frame of S bytes from A to B leaves as soon as A's upload is
  free and takes S / A.upload; B's download takes arrivals one after another at B.download, so
  the frame is in when both are done (a lone frame: S / min(upload, download)); it arrives one
  link latency later. A sender is never held up by a busy receiver of someone else's frames.
  Each direction of a link is FIFO.
- `send()` returns when A's upload of the frame is finished: that is the backpressure.
- A dial costs one round trip (2x latency), like TCP's SYN / SYN-ACK; handshake frames are free.
- An orderly close reaches the other side one latency later, after the data sent before it.
- A frame is dropped if, when it is sent or when it would arrive, either end has crashed or the
  two ends are partitioned. Dropped frames still use the sender's upload.

NAT model (`network.transport(nat="eim" | "edm")`): a peer behind NAT dials out freely and its
connections work both ways, but a dial to its /emu/ address is refused ("behind NAT", after the
round trip a router's reset takes) unless a hole punch opened its NAT to that dialer
(`open_nat`). "eim" (endpoint-independent mapping: one public port for every destination) lets
punches through; "edm" (endpoint-dependent, symmetric NAT: a new port per destination) does not
when the other side is NATed too (`punchable`). Others see a NATed peer's connections come from
its own name: its router's public address stands for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
from collections import deque
from collections.abc import Iterable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from potluck.core import compat
from potluck.core.errors import ConnectionLost, HandshakeError, MembershipRefused, PeerUnreachable
from potluck.net.address import Multiaddr
from potluck.net.connection import Connection, RemoteInfo, Stream
from potluck.net.frames import Frame, FrameDecoder, Hello, Kind, encode
from potluck.net.holepunch import HolePuncher
from potluck.net.identity import Identity, PeerID
from potluck.net.membership import GuestHandlers, MembershipGate
from potluck.net.origins import Origin, origin_of
from potluck.net.relay import Circuits, StreamPipe, accept_stop
from potluck.net.transport import Transport

__all__ = ["EmulatedNetwork", "EmulatedTransport"]

logger = logging.getLogger(__name__)

# Ed25519 private keys are 32 random bytes (RFC 8032); emulated peers draw them from the seed.
_KEY_BYTES = 32
# The NAT kinds modelled: endpoint-independent and endpoint-dependent mapping.
NAT_KINDS = ("eim", "edm")


class EmulatedNetwork:
    """The in-process "internet" that emulated transports dial each other through.

    Identities the network generates derive from `seed`, so a scenario repeats exactly, peer ids
    (and so DHT routing) included. They are test keys: anyone who knows the seed has them.
    """

    def __init__(self, latency: float = 0.0, seed: int = 0):
        self.latency = _non_negative("latency", latency)
        self._rng = random.Random(seed)
        self._names = itertools.count()
        self._listeners: dict[str, EmulatedTransport] = {}
        self._peers: dict[PeerID, EmulatedTransport] = {}
        self._latency: dict[frozenset[PeerID], float] = {}
        self._partitions: list[tuple[frozenset[PeerID], frozenset[PeerID]]] = []
        self._decoder = FrameDecoder()

    def transport(self, identity: Identity | None = None, *, upload: float | None = None,
                  download: float | None = None, client_mode: bool = False, nat: str | None = None,
                  ip: str | None = None, **transport_kwargs: Any) -> EmulatedTransport:
        """A new peer on this network (not started yet); bandwidths in bytes/s, None = unlimited;
        `nat`: None (public), or behind a NAT of a kind in NAT_KINDS (see the module docstring);
        `ip`: the IP address others see its connections come from (`RemoteInfo.origin`), so that
        several peers can share a host or a subnet (made-up identities on one machine); None: a
        host of its own, named after the peer."""
        if identity is None:
            key = Ed25519PrivateKey.from_private_bytes(self._rng.randbytes(_KEY_BYTES))
            identity = Identity(key)
        return EmulatedTransport(self, identity, upload=upload, download=download,
                                 client_mode=client_mode, nat=nat, ip=ip, **transport_kwargs)

    def set_latency(self, a: PeerID, b: PeerID, seconds: float) -> None:
        """One-way latency between `a` and `b`, both directions (default: the network's)."""
        self._latency[frozenset((a, b))] = _non_negative("latency", seconds)

    def latency_between(self, a: PeerID, b: PeerID) -> float:
        """The one-way latency of the link between `a` and `b`, in seconds."""
        return self._latency.get(frozenset((a, b)), self.latency)

    def crash(self, peer_id: PeerID, silent: bool = False) -> None:
        """The peer vanishes. Loud: its connections reset at once, like a killed process's.
        Silent: its frames vanish and nothing is signalled, like a machine that lost power; only
        deadlines and keepalives notice, and dials to it hang."""
        peer = self._peers.get(peer_id)
        if peer is None:
            raise KeyError(f"no emulated peer {peer_id} on this network")
        peer._crashed = True
        peer.close_loopback("this peer crashed")
        if not silent and self._listeners.get(peer._name) is peer:
            del self._listeners[peer._name]
        for end in list(peer._links):
            other = end.peer
            end._lose("this peer crashed")
            if not silent:
                other._lose(f"connection reset by {peer_id} (it crashed)")

    def partition(self, group_a: Iterable[PeerID], group_b: Iterable[PeerID]) -> None:
        """Drop every frame between the two groups; dials across hang until their deadline."""
        self._partitions.append((frozenset(group_a), frozenset(group_b)))

    def heal(self) -> None:
        """Undo all partitions (crashed peers stay crashed)."""
        self._partitions.clear()

    def open_nat(self, peer: PeerID, dialer: PeerID) -> None:
        """A hole punch succeeded: `peer`'s NAT now lets `dialer`'s dials in."""
        self._peers[peer]._nat_open.add(dialer)

    @staticmethod
    def punchable(a: EmulatedTransport, b: EmulatedTransport) -> bool:
        """Whether a hole punch between `a` and `b` can work: unless both are NATed and either
        NAT maps endpoint-dependently (the port the other aims at is not the one it gets)."""
        return a.nat is None or b.nat is None or (a.nat == "eim" and b.nat == "eim")

    # -- internals --------------------------------------------------------------------------------
    def _blocked(self, a: EmulatedTransport, b: EmulatedTransport) -> bool:
        """Whether frames between `a` and `b` are lost right now."""
        if a._crashed or b._crashed:
            return True
        pa, pb = a.peer_id, b.peer_id
        return any((pa in x and pb in y) or (pb in x and pa in y) for x, y in self._partitions)

    def _copy(self, frame: Frame, max_frame_size: int) -> Frame:
        """Encode `frame` as for the wire (sets its size) and decode it into fresh objects.

        One decoder serves the whole network: each call feeds it exactly one whole frame, so it is
        empty again afterwards. A failure here means pack and unpack disagree (a bug), so it is
        raised to the sender, and the decoder is replaced in case it was left mid-frame.
        """
        buffers = encode(frame, max_frame_size=max_frame_size)
        self._decoder.max_frame_size = max_frame_size
        try:
            decoded = [f for buf in buffers for f in self._decoder.feed(buf)]
        except Exception:
            self._decoder = FrameDecoder()
            raise
        assert len(decoded) == 1, "one encoded frame must decode to exactly one frame"
        return decoded[0]


class EmulatedTransport(Transport):
    """A peer on an `EmulatedNetwork`, at `/emu/<n>/p2p/<peer id>`.

    The handshake is trusted: the network is in-process and knows who is who, so no signatures
    are exchanged. It still carries everything the TCP handshake does into `RemoteInfo`
    (addresses, client mode, max frame size, bulk, membership token), checks membership tokens as
    the TCP transport does when given a `membership` gate, and costs one round trip.
    """

    def __init__(self, network: EmulatedNetwork, identity: Identity, *,
                 upload: float | None = None, download: float | None = None,
                 client_mode: bool = False, membership: MembershipGate | None = None, nat: str | None = None,
                 ip: str | None = None, **transport_kwargs: Any):
        if nat is not None and nat not in NAT_KINDS:
            raise ValueError(f"nat must be None or one of {NAT_KINDS}, got {nat!r}")
        super().__init__(identity, client_mode=client_mode, **transport_kwargs)
        self.nat = nat  # None: publicly reachable; else behind a NAT of this kind
        self._nat_open: set[PeerID] = set()  # dialers a hole punch let through our NAT
        self.membership = membership  # the run's membership check, as in `TCPTransport`
        # Hole punches where the other side dials (`EmulatedPunch`): that peer -> the connection it made.
        self._punches: dict[PeerID, asyncio.Future[Connection]] = {}
        self.network = network
        self.upload = _bandwidth("upload", upload)
        self.download = _bandwidth("download", download)
        self._name = str(next(network._names))
        # Where others see this peer's connections come from: its IP if given, else its own name.
        self.origin = origin_of(self._name if ip is None else ip)
        if ip is not None and self.origin.ip == ip and self.origin.subnet == ip:
            raise ValueError(f"ip must be an IP address, got {ip!r}")
        self._crashed = False
        self._upload_free = -math.inf  # loop time when the upload is next idle
        self._download_free = -math.inf
        self._links: dict[_LinkEnd, None] = {}  # a dict, not a set: ordered, so runs repeat
        # Relayed connections and hole punching (`net.relay`, `net.holepunch`), as on TCP.
        self.circuits = Circuits(self)
        self.puncher = HolePuncher(self)
        network._peers[self.peer_id] = self

    @property
    def listen_addresses(self) -> list[Multiaddr]:
        if self.network._listeners.get(self._name) is not self:
            return []
        return [Multiaddr("emu", self._name, None, self.peer_id)]

    async def start(self) -> None:
        if self._crashed:
            raise PeerUnreachable("this emulated peer has crashed; create a new transport")
        if not self.forced_client:
            self.network._listeners[self._name] = self

    async def _stop_listening(self) -> None:
        if self.network._listeners.get(self._name) is self:
            del self.network._listeners[self._name]

    async def dial(self, address: Multiaddr, expected: PeerID | None, bulk: bool,
                   answer_within: float | None = None) -> Connection:
        if self._crashed:
            raise PeerUnreachable("this emulated peer has crashed")
        return await super().dial(address, expected, bulk, answer_within)

    async def _dial_direct(self, address: Multiaddr, expected: PeerID | None, bulk: bool,
                           answer_within: float | None = None) -> Connection:
        if address.kind != "emu":
            raise PeerUnreachable(f"{address} is not an emulated address")
        loop = asyncio.get_running_loop()
        try:
            async with compat.timeout(answer_within):
                listener = await self._reach(address)
                await _sleep_until(loop, loop.time() + 2 * self.network.latency_between(
                    self.peer_id, listener.peer_id))
        except TimeoutError:
            raise PeerUnreachable(f"{address} did not answer within {answer_within:g} s") from None
        if await self._reach(address) is not listener or self._crashed:
            raise PeerUnreachable(f"{address} went away during the handshake")
        if listener.nat is not None and self.peer_id not in listener._nat_open:
            raise PeerUnreachable(f"{address} is behind NAT (connection refused)")
        if expected is not None and listener.peer_id != expected:
            raise HandshakeError(f"{address} is {listener.peer_id}, not the expected {expected}")
        return self._join(listener, bulk)

    async def link_over_stream(self, stream: Stream, relay: PeerID, initiator: bool,
                               expected: PeerID, bulk: bool) -> Connection:
        """Frames over the relayed bytes; the first is each side's trusted hello (the relay
        vouches for the dialer's id, the dialer named the target's)."""
        if not initiator:
            await accept_stop(stream)
        link = _RelayedLink(self, initiator, expected, bulk, relay)
        pipe = StreamPipe(stream, relay)
        pipe.begin(link)
        link.connection_made(pipe)
        try:
            await link.handshake
        except BaseException:
            link.close("handshake failed")
            raise
        if link.connection is None:
            raise PeerUnreachable(f"the relayed connection to {expected} closed right after the handshake")
        return link.connection

    def _loopback_connection(self) -> Connection:
        if self._crashed:
            raise PeerUnreachable("this emulated peer has crashed")
        return super()._loopback_connection()

    async def _reach(self, address: Multiaddr) -> EmulatedTransport:
        """The peer listening at `address`; refuse if none, hang (until the caller's deadline)
        if it is behind a partition or silently crashed, as SYNs into a black hole do."""
        listener = self.network._listeners.get(address.host)
        if listener is None:
            raise PeerUnreachable(f"nothing listens at {address} (connection refused)")
        if self.network._blocked(self, listener):
            await asyncio.get_running_loop().create_future()  # never resolved
        return listener

    def _join(self, acceptor: EmulatedTransport, bulk: bool) -> Connection:
        """Create both connections of a new link and register them on each side."""
        mine_hello, their_hello = self._hello(bulk), acceptor._hello(bulk)
        their_handlers = acceptor._admit(self.peer_id, mine_hello.token, accepting=True)
        my_handlers = self._admit(acceptor.peer_id, their_hello.token, accepting=False)
        mine, theirs = _LinkEnd(self, acceptor), _LinkEnd(acceptor, self)
        mine.peer, theirs.peer = theirs, mine
        conn = self._connection(their_hello, initiator=True, handlers=my_handlers)
        accepted = acceptor._connection(mine_hello, initiator=False, handlers=their_handlers)
        mine.attach(conn)
        theirs.attach(accepted)
        acceptor.add_connection(accepted)
        if accepted.closed:
            conn.close("the other side refused the connection")
            raise PeerUnreachable(f"{acceptor.peer_id} refused the connection (shutting down)")
        self.add_connection(conn)
        return conn

    def _admit(self, remote: PeerID, token: bytes | None, accepting: bool) -> Any:
        """The handlers `remote` may use here; MembershipRefused (worded for the dialer) if its
        token does not admit it. As in `net.tcp`, the authority takes tokenless dialers as guests."""
        gate = self.membership
        if gate is None:
            return self.handlers
        try:
            gate.check(remote, token)
        except MembershipRefused as e:
            if not accepting:
                raise
            if gate.guest_methods:
                return GuestHandlers(self.handlers, gate.guest_methods, str(e))
            raise MembershipRefused(f"{self.peer_id} refused this peer's membership: {e}") from None
        return self.handlers

    def _connection(self, remote: RemoteInfo, initiator: bool, handlers: Any = None) -> Connection:
        return Connection(self.handlers if handlers is None else handlers, remote, initiator,
                          keepalive_interval=self.keepalive_interval,
                          keepalive_timeout=self.keepalive_timeout, on_close=self.connection_closed)

    def _hello(self, bulk: bool) -> RemoteInfo:
        """What this peer's side of the handshake tells the other side."""
        return RemoteInfo(self.peer_id, tuple(self.addresses), self.client_mode, self.max_frame_size, bulk,
                          token=self.membership.own_token() if self.membership is not None else None,
                          observed=Multiaddr("emu", self._name), origin=self.origin)

    def punch_endpoint(self) -> EmulatedPunch:
        """One hole punch try (`net.holepunch`), as the NAT model allows it."""
        return EmulatedPunch(self)


class _RelayedLink(asyncio.Protocol):
    """A `FrameLink` over a relayed byte pipe (`net.relay.StreamPipe`): encoded frames out,
    decoded frames in; the first frame each way is a HELLO (`Hello`) carrying the sender's `_hello`."""

    def __init__(self, owner: EmulatedTransport, initiator: bool, expected: PeerID, bulk: bool, relay: PeerID):
        self.owner, self.initiator, self.expected, self.bulk = owner, initiator, expected, bulk
        self.relay = relay
        loop = asyncio.get_running_loop()
        # None once the connection is made (not the connection: it holds this link, a cycle).
        self.handshake: asyncio.Future[None] = loop.create_future()
        self.connection: Connection | None = None
        self._pipe: StreamPipe | None = None
        self._decoder = FrameDecoder(owner.max_frame_size)
        self._remote_max: int | None = None
        self._paused = False
        self._drained = asyncio.Event()
        self._closing_reason: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._pipe = transport  # type: ignore[assignment]
        mine = self.owner._hello(self.bulk)
        hello = Hello(mine.peer_id, mine.addresses, mine.client_mode, mine.max_frame_size, mine.bulk, mine.token)
        self._write(Frame(Kind.HELLO, meta=hello.to_wire()))

    def data_received(self, data: bytes) -> None:
        try:
            for frame in self._decoder.feed(data):
                if self.connection is not None:
                    self.connection.frame_received(frame)
                else:
                    self._on_hello(frame)
        except Exception as e:  # noqa: BLE001 - a bad frame ends this link, not the loop
            if not self.handshake.done():
                self.handshake.set_exception(HandshakeError(f"relayed handshake failed: {e}"))
            self.close(f"bad relayed frame: {e}")

    def _on_hello(self, frame: Frame) -> None:
        hello = Hello.from_wire(frame.meta) if frame.kind is Kind.HELLO else None
        if hello is None or hello.peer_id != self.expected:
            raise HandshakeError(f"expected a HELLO from {self.expected}")
        remote = RemoteInfo(self.expected, hello.addresses, hello.client_mode, hello.max_frame_size,
                            hello.bulk if not self.initiator else self.bulk, token=hello.token, relayed=True,
                            origin=Origin.relayed(str(self.relay)))
        handlers = self.owner._admit(self.expected, remote.token, accepting=not self.initiator)
        self._remote_max = remote.max_frame_size
        conn = self.owner._connection(remote, self.initiator, handlers)
        conn.attach(self)
        self.connection = conn
        self.owner.add_connection(conn)
        if not self.handshake.done():
            self.handshake.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True
        self._drained.clear()

    def resume_writing(self) -> None:
        self._paused = False
        self._drained.set()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        reason = self._closing_reason or (str(exc) if exc else "the relayed connection was closed")
        self._closing_reason = reason
        self._drained.set()
        if not self.handshake.done():
            self.handshake.set_exception(PeerUnreachable(f"relayed connection closed during handshake: {reason}"))
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.link_lost(reason)

    # -- FrameLink ---------------------------------------------------------------------------------
    def _write(self, frame: Frame) -> None:
        for buf in encode(frame, self._remote_max):
            self._pipe.write(buf)  # type: ignore[union-attr]

    async def send(self, frame: Frame) -> int:
        while self._paused and self._closing_reason is None:
            await self._drained.wait()
        if self._closing_reason is not None or self._pipe is None or self._pipe.is_closing():
            raise ConnectionLost(f"relayed connection closed: {self._closing_reason or 'closing'}")
        self._write(frame)
        return frame.size

    def send_nowait(self, frame: Frame) -> None:
        if self._closing_reason is None and self._pipe is not None and not self._pipe.is_closing():
            self._write(frame)

    def close(self, reason: str | None = None) -> None:
        if self._closing_reason is None:
            self._closing_reason = reason or "closed"
        if self.connection is not None:
            self.connection.link_lost(self._closing_reason)
        if self._pipe is not None:
            self._pipe.close()


class _LinkEnd:
    """One side of an emulated connection (a `FrameLink`); frames it sends arrive at `peer`."""

    def __init__(self, local: EmulatedTransport, remote: EmulatedTransport):
        self.local, self.remote = local, remote
        self.network = local.network
        self.peer: _LinkEnd = None  # type: ignore[assignment] - set right after both ends exist
        self.connection: Connection = None  # type: ignore[assignment] - set by attach()
        self.lost = False
        self._loop = asyncio.get_running_loop()
        self._arrivals: deque[tuple[float, Frame | str]] = deque()  # a str is a close (FIN)
        self._last_arrival = -math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._uploads: dict[asyncio.Future[None], None] = {}  # ordered, so runs repeat
        local._links[self] = None

    def attach(self, connection: Connection) -> None:
        self.connection = connection
        connection.attach(self)

    # -- FrameLink ---------------------------------------------------------------------------------
    async def send(self, frame: Frame) -> int:
        """Send a frame; returns its wire size once this side's upload of it is finished."""
        done = self._transmit(frame)
        if done > self._loop.time():
            future = self._loop.create_future()
            self._uploads[future] = None
            try:
                lost = await _sleep_until(self._loop, done, future)
            finally:
                self._uploads.pop(future, None)
            if lost is not None:  # a fresh error: a stored one raised here would form a cycle
                raise ConnectionLost(f"connection to {self.remote.peer_id} lost: {lost}")
        return frame.size

    def send_nowait(self, frame: Frame) -> None:
        """Queue a frame without waiting for the upload; dropped if the link is already closed."""
        if not self.lost:
            self._transmit(frame)

    def close(self, reason: str | None = None) -> None:
        """Close now on this side; the other side learns one latency later, after the data."""
        if self.lost:
            return
        latency = self.network.latency_between(self.local.peer_id, self.remote.peer_id)
        if not self.network._blocked(self.local, self.remote):
            self.peer._arrive(self._loop.time() + latency,
                              f"closed by the other side ({reason or 'no reason given'})")
        self._lose(reason or "closed")

    # -- timing ------------------------------------------------------------------------------------
    def _transmit(self, frame: Frame) -> float:
        """Schedule `frame` per the module's timing model; returns when its upload ends."""
        if self.lost:
            raise ConnectionLost(f"connection to {self.remote.peer_id} is closed")
        now = self._loop.time()
        received = self.network._copy(frame, self.remote.max_frame_size)
        up, down = self.local.upload, self.remote.download
        # Output queues, as in a switch: the frame leaves at the sender's upload rate as soon as
        # its upload is free, and the receiver's download takes arrivals one after another.
        up_start = max(now, self.local._upload_free)
        up_done = up_start + (frame.size / up if up else 0.0)
        self.local._upload_free = up_done
        self.local.stats.bytes_sent += frame.size
        down_done = max(up_done, max(up_start, self.remote._download_free) + (frame.size / down if down else 0.0))
        self.remote._download_free = down_done
        if not self.network._blocked(self.local, self.remote):
            latency = self.network.latency_between(self.local.peer_id, self.remote.peer_id)
            self.peer._arrive(down_done + latency, received)
        return up_done

    def _arrive(self, when: float, item: Frame | str) -> None:
        if self.lost:
            return
        when = max(when, self._last_arrival)  # FIFO even if the latency was lowered meanwhile
        self._last_arrival = when
        self._arrivals.append((when, item))
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._deliver)

    def _deliver(self) -> None:
        """Timer callback: hand every frame due now to the connection, in order."""
        self._timer = None
        due = self._arrivals[0][0]
        while self._arrivals and self._arrivals[0][0] <= due and not self.lost:
            _, item = self._arrivals.popleft()
            if self.network._blocked(self.remote, self.local):
                continue
            if isinstance(item, str):
                self._lose(item)
                break
            self.local.stats.bytes_received += item.size
            try:
                self.connection.frame_received(item)
            except Exception:  # noqa: BLE001 - a broken link must not wedge the loop's timers
                logger.exception("connection to %s failed on a received frame", self.remote.peer_id)
                self.close("internal error while handling a frame")
        if self._arrivals and not self.lost:
            self._timer = self._loop.call_at(self._arrivals[0][0], self._deliver)

    def _lose(self, reason: str) -> None:
        """This side is closed: drop what is in flight to it and tell its connection, once."""
        if self.lost:
            return
        self.lost = True
        self._arrivals.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for future in list(self._uploads):
            if not future.done():
                future.set_result(reason)
        self.local._links.pop(self, None)
        connection, self.connection, self.peer = self.connection, None, None  # no cycles once closed
        connection.link_lost(reason)


class EmulatedPunch:
    """One emulated hole punch try. It works if the two peers are `punchable` (see the module
    docstring): the side that dialed the relayed connection (the TLS client on TCP) then dials the
    other's address through its opened NAT (a round trip, as crossing SYNs take), and the other side
    takes that connection. If not, both hang until their deadline, as SYNs dropped by a NAT do."""

    def __init__(self, owner: EmulatedTransport):
        self.owner = owner
        self.candidates = [a.without_peer_id() for a in owner.listen_addresses]

    async def connect(self, remote: list[Multiaddr], expected: PeerID, client: bool) -> Connection:
        owner, loop = self.owner, asyncio.get_running_loop()
        other = owner.network._peers.get(expected)
        if other is None or not owner.network.punchable(owner, other):
            await loop.create_future()  # never resolved: the caller's deadline ends the try
        if client:
            target = next((a for a in remote if a.kind == "emu"), None)
            if target is None:
                raise PeerUnreachable(f"{expected} gave no emulated address to punch to")
            owner.network.open_nat(expected, owner.peer_id)
            conn = await owner.dial(target, expected, bulk=False)
            accepted = other._punches.setdefault(owner.peer_id, loop.create_future())
            if not accepted.done():
                accepted.set_result(conn.link.peer.connection)
            return conn
        waiting = owner._punches.get(expected)
        if waiting is None or waiting.done() and waiting.result().closed:
            waiting = owner._punches[expected] = loop.create_future()
        try:
            return await waiting
        finally:
            if owner._punches.get(expected) is waiting:
                del owner._punches[expected]

    def close(self) -> None:
        """Nothing is bound per try."""


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float,
                       future: asyncio.Future[Any] | None = None) -> Any:
    """Wait until loop time `when` on a timer (then None); others may end the wait early by
    setting `future`'s result (e.g. to why the link was lost)."""
    future = loop.create_future() if future is None else future
    handle = loop.call_at(when, _resolve, future)
    try:
        return await future
    finally:
        handle.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _non_negative(name: str, seconds: float) -> float:
    if not seconds >= 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {seconds!r}")
    return float(seconds)


def _bandwidth(name: str, rate: float | None) -> float | None:
    if rate is not None and not rate > 0:
        raise ValueError(f"{name} bandwidth must be > 0 bytes/s or None (unlimited), got {rate!r}")
    return None if rate is None else float(rate)
