"""Hole punching: turn a relayed connection into a direct one (like libp2p's DCUtR).

Two peers that share a relayed connection use it to signal, on a `holepunch` stream:
  1. the initiator (by default the side that accepted the relayed connection: the one behind NAT,
     as in DCUtR) sends CONNECT {its candidate addresses};
  2. the other side answers CONNECT {its own}; the initiator measures the round trip (RTT);
  3. the initiator sends SYNC and dials after RTT/2; the other side dials as SYNC arrives, so both
     dials leave at about the same moment and each opens its own NAT for the other's (a TCP
     simultaneous open);
  4. on the new connection the relayed connection's dialer is the TLS client, and both run the
     usual HELLO/AUTH handshake expecting the id they know from the relayed connection.
Up to MAX_ATTEMPTS tries, each from fresh sockets. On success the direct connection goes first in
the transport's shared pool and the relayed one is closed once idle; on failure the relayed one
keeps working. The transport provides one attempt (`punch_endpoint()`, a `transport.PunchEndpoint`):
TCP binds a fresh port (`net.tcp_punch`), the emulated network follows its NAT model. A
`HolePuncher` is the transport's `Punching`, plugged in by whoever builds the transport.

A peer's CONNECT is untrusted: its candidates are capped (MAX_CANDIDATES), must be plain IP or
emulated addresses (no names to resolve, no circuits), and are dialed only with the identity check.
Only relayed connections are punched, and MAX_CONCURRENT_PUNCHES at a time.

A punch that failed every try is remembered: no new one with that peer starts for
PUNCH_BACKOFF_SECONDS, doubled after each further failure up to MAX_PUNCH_BACKOFF_SECONDS (a
symmetric NAT defeats every punch, and each costs ~15 s of tries); a success forgets the failures.
This holds for punches we serve as for those we start (issue 29: only started ones counted, so a
peer could open punch after punch, each making us dial an address of its choice 3 times). And since
identities are free, the subnets we dialed in a failed punch back off the same way: no punch (with
any peer) dials a candidate there until it ends, and at most MAX_PUNCHES_PER_TARGET_SUBNET punches
dial one subnet at a time, so made-up ids that all point us at one third party get a few dials
there, not three each. Served punches take at most MAX_SERVED_PUNCHES of the slots, so the ones
we start (for the relayed connections we accept) always have room.
A bulk stream to a peer reached only through relays waits up to `transport.BULK_WAIT_SECONDS` for
a punch in flight (`outcome`), so that it runs on the direct connection rather than a relayed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Mapping
from typing import Any

from potluck.core import compat
from potluck.core.errors import (
    AddressError,
    EndOfStream,
    IdentityError,
    MalformedMessage,
    NetworkError,
    PeerUnreachable,
)
from potluck.core.wire import Field, List, Message
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.connection import CallContext, Connection, Stream
from potluck.net.identity import PeerID
from potluck.net.origins import origin_of
from potluck.net.transport import PunchEndpoint, Transport

__all__ = ["MAX_ATTEMPTS", "MAX_CANDIDATES", "PUNCH_BACKOFF_SECONDS", "PUNCH_METHOD", "Connect", "HolePuncher", "Sync"]

logger = logging.getLogger(__name__)

PUNCH_METHOD = "holepunch"
# Tries before giving up (DCUtR's number): a try fails when the SYNs missed each other (one
# left too early and met a closed NAT); a third failure means the NATs do not allow it.
MAX_ATTEMPTS = 3
# Candidate addresses one CONNECT may carry. A peer has a public address or two per address family
# (what others observed, one per NAT or interface); more would only make us dial addresses it chose
# for other reasons (a stranger's host), so more is malformed.
MAX_CANDIDATES = 8
# Each wait for the other side's CONNECT or SYNC: one round trip through a relay, well under a
# second on a live network; past this the relay or the peer is too slow for punching to matter.
SIGNAL_TIMEOUT = 10.0
# One try's dial, TCP open and TLS and HELLO/AUTH handshakes together. Crossing SYNs connect within
# a round trip; a SYN dropped by the other's NAT (it had not opened yet) is sent again after 1 s
# and 3 s; the handshakes are three round trips more. Past 5 s this try has failed.
PUNCH_TIMEOUT = 5.0
# A whole punch, as its stream's deadline: every try's signalling and dial, with room to spare.
PUNCH_SECONDS = MAX_ATTEMPTS * (3 * SIGNAL_TIMEOUT + PUNCH_TIMEOUT)
# Punches one transport runs at once, both roles (one per peer at most). Each holds a listening
# socket and a few dials; a peer behind NAT has a handful of relayed connections at a time, and
# a flood of CONNECTs must not make us dial (or bind) without end.
MAX_CONCURRENT_PUNCHES = 8
# Of those, punches other peers start and we serve: half, so that a flood of them (each a relayed
# connection from a new made-up id) never keeps us from punching the relayed connections we accept.
MAX_SERVED_PUNCHES = MAX_CONCURRENT_PUNCHES // 2
# Punches that may dial candidates in one subnet (/24, /48) at once: two NATed peers behind one
# router punching us together, while made-up ids aiming us at one third party get two punches'
# dials there before its backoff (below) stops them.
MAX_PUNCHES_PER_TARGET_SUBNET = 2
# After a punch with a peer failed every try, none with it starts for this long, doubled after each
# further failure: a NAT that defeated three tries (a symmetric one, a new port per destination)
# defeats the next, and each punch costs ~15 s of tries and a bound port per try. A few minutes
# lets a network that changed (a peer that moved, a router restarted) be tried again soon.
PUNCH_BACKOFF_SECONDS = 300.0
# The longest backoff, and how long past its backoff a peer's failures are remembered (then it
# starts over): a peer that keeps failing is still tried every hour, and nothing is kept forever.
MAX_PUNCH_BACKOFF_SECONDS = 3600.0
# Peers whose failures are remembered (oldest dropped first): far more than one peer talks to
# through relays, and a bound on what a flood of relayed connections from new ids can make us keep.
MAX_REMEMBERED_FAILURES = 1024
# How often a relayed connection replaced by a direct one is checked for idleness (then closed):
# calls and streams already on it finish there; new ones take the direct connection.
IDLE_CHECK_SECONDS = 1.0


# -- messages -----------------------------------------------------------------------------------------
class Candidate(Field):
    """A dialable address from a peer: an IP literal with a port, or an emulated name; never a
    name we would resolve for it, a circuit, or an address no host answers (any, multicast).
    Read as a `Multiaddr` without its /p2p/ part."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Multiaddr:
        if not isinstance(value, str) or len(value) > MAX_ADDRESS_CHARS:
            raise MalformedMessage(what, f"{key!r} must hold strings of at most {MAX_ADDRESS_CHARS} characters")
        try:
            addr = Multiaddr.parse(value)
        except (AddressError, IdentityError) as e:
            raise MalformedMessage(what, f"{key!r} must hold addresses: {e}") from None
        if addr.is_circuit or addr.kind not in ("ip4", "ip6", "emu"):
            raise MalformedMessage(what, f"{key!r} must hold IP or emulated addresses, not {addr}")
        if addr.kind != "emu":
            ip = ipaddress.ip_address(addr.host)
            if not addr.port or ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
                raise MalformedMessage(what, f"{key!r} holds an address no single host answers: {addr}")
        return addr.without_peer_id()

    def encode(self, value: Multiaddr) -> str:
        return str(value)


class Connect(Message, what="hole punch CONNECT", tag=("op", "connect")):
    """Where the sender can be dialed for this try (its bound port on each public host)."""

    addresses: tuple[Multiaddr, ...] = List("addrs", Candidate(), MAX_CANDIDATES)


class Sync(Message, what="hole punch SYNC", tag=("op", "sync")):
    """Dial now (the initiator dials RTT/2 after sending it)."""


# -- the protocol -------------------------------------------------------------------------------------
class HolePuncher:
    """One per transport: serves `holepunch` streams, and punches relayed connections as they come."""

    def __init__(self, transport: Transport):
        self.transport = transport
        # Punch each relayed connection we accept (False: the relay carries all, e.g. to measure it).
        self.auto = True
        # Peers with a punch in progress (either role) -> set once its outcome is known (see `outcome`).
        self._active: dict[PeerID, asyncio.Event] = {}
        # Peers whose last punch failed every try -> (failures in a row, loop time the backoff ends);
        # and the same for the subnets that punch dialed (keys "subnet:<subnet>").
        self._failures: dict[PeerID | str, tuple[int, float]] = {}
        self._serving: set[PeerID] = set()  # peers whose punch we serve now
        self._dialing: dict[str, int] = {}  # punches that dial candidates in a subnet, by subnet
        self._tasks: set[asyncio.Task] = set()  # background punches and idle checks, ended by close()
        transport.add_stream_handler(PUNCH_METHOD, self._serve, max_seconds=PUNCH_SECONDS)

    def start(self, relayed: Connection) -> None:
        """Punch `relayed` in the background (the caller is not held): a new relayed connection."""
        if self.auto and self._refusal(relayed.peer_id) is None:
            self._spawn(self._punch_logged(relayed))

    async def punch(self, relayed: Connection) -> Connection:
        """Run the protocol as initiator over `relayed`: the direct connection (now preferred).
        Raises NetworkError (PeerUnreachable if every try failed); `relayed` is left as it was."""
        peer, loop = relayed.peer_id, asyncio.get_running_loop()
        refusal = self._refusal(peer)
        if refusal is not None:
            raise PeerUnreachable(f"no hole punch with {peer}: {refusal}")
        self._active[peer] = asyncio.Event()
        errors: list[str] = []
        dialed: set[str] = set()  # the subnets this punch holds (see `_targets`)
        refused_only = True  # every try's candidates were ones we would not dial (not their failure)
        try:
            stream = await relayed.open_stream(PUNCH_METHOD, None, timeout=PUNCH_SECONDS)
            try:
                for _ in range(MAX_ATTEMPTS):
                    endpoint = self.transport.punch_endpoint()
                    try:
                        sent = loop.time()
                        await stream.send(Connect(tuple(endpoint.candidates)).to_wire(), SIGNAL_TIMEOUT)
                        theirs = Connect.from_wire(await stream.recv(SIGNAL_TIMEOUT))
                        rtt = loop.time() - sent
                        await stream.send(Sync().to_wire(), SIGNAL_TIMEOUT)
                        await asyncio.sleep(rtt / 2)
                        targets = self._targets(theirs.addresses, dialed, errors)
                        refused_only = refused_only and bool(theirs.addresses) and not targets
                        direct = await self._dial(endpoint, targets, relayed, errors)
                    finally:
                        endpoint.close()
                    if direct is not None:
                        await stream.close()
                        self._prefer(direct, relayed)
                        return direct
            except BaseException:
                stream.abort("hole punch stopped")
                raise
            await stream.close()
        finally:
            self._active.pop(peer).set()
            self._release(dialed)
        if not refused_only:
            self._failed(peer, dialed)
        raise PeerUnreachable(f"hole punch to {peer} failed {MAX_ATTEMPTS} times: " + "; ".join(errors))

    async def _serve(self, stream: Stream, ctx: CallContext) -> None:
        """The other side of `punch`: answer each CONNECT with ours, dial on SYNC, until END."""
        relayed, peer = ctx.connection, ctx.peer_id
        if not relayed.relayed:
            raise PeerUnreachable("hole punching is for relayed connections only")
        refusal = self._refusal(peer)
        if refusal is None and len(self._serving) >= MAX_SERVED_PUNCHES:
            refusal = f"{MAX_SERVED_PUNCHES} punches other peers started are being served (the limit)"
        if refusal is not None:
            raise PeerUnreachable(f"no hole punch: {refusal}")
        self._active[peer] = asyncio.Event()
        self._serving.add(peer)
        errors: list[str] = []
        dialed: set[str] = set()
        punched, refused_only, tries = False, True, 0
        try:
            for _ in range(MAX_ATTEMPTS):
                try:
                    theirs = Connect.from_wire(await stream.recv(SIGNAL_TIMEOUT))
                except EndOfStream:
                    return
                endpoint = self.transport.punch_endpoint()
                try:
                    await stream.send(Connect(tuple(endpoint.candidates)).to_wire(), SIGNAL_TIMEOUT)
                    Sync.from_wire(await stream.recv(SIGNAL_TIMEOUT))
                    targets = self._targets(theirs.addresses, dialed, errors)
                    refused_only = refused_only and bool(theirs.addresses) and not targets
                    tries += 1
                    direct = await self._dial(endpoint, targets, relayed, errors)
                finally:
                    endpoint.close()
                if direct is not None:  # the initiator ends the stream, or tries again if its side failed
                    punched = True
                    self._prefer(direct, relayed)
        finally:
            self._active.pop(peer).set()
            self._serving.discard(peer)
            self._release(dialed)
            if tries and not punched and not refused_only:  # a served punch failed: as one we started
                self._failed(peer, dialed)
            if errors:
                logger.debug("hole punch tries with %s that failed here: %s", peer, "; ".join(errors))

    def _targets(self, candidates: tuple[Multiaddr, ...], held: set[str], errors: list[str]) -> list[Multiaddr]:
        """The candidates this try may dial: none in a subnet whose punches failed recently, nor in
        one that MAX_PUNCHES_PER_TARGET_SUBNET other punches are dialing. Subnets newly taken are
        added to `held` (the punch's; released when it ends)."""
        now = asyncio.get_running_loop().time()
        allowed = []
        for address in candidates:
            subnet = origin_of(address).subnet
            if subnet not in held:
                failed = self._failures.get(f"subnet:{subnet}")
                if failed is not None and now < failed[1]:
                    errors.append(f"not dialing {address}: punches to {subnet} failed recently "
                                  f"(next in {failed[1] - now:.0f} s)")
                    continue
                if self._dialing.get(subnet, 0) >= MAX_PUNCHES_PER_TARGET_SUBNET:
                    errors.append(f"not dialing {address}: {MAX_PUNCHES_PER_TARGET_SUBNET} punches dial {subnet} now")
                    continue
                held.add(subnet)
                self._dialing[subnet] = self._dialing.get(subnet, 0) + 1
            allowed.append(address)
        return allowed

    def _release(self, held: set[str]) -> None:
        for subnet in held:
            left = self._dialing.get(subnet, 0) - 1
            if left > 0:
                self._dialing[subnet] = left
            else:
                self._dialing.pop(subnet, None)

    async def _dial(self, endpoint: PunchEndpoint, remote: list[Multiaddr], relayed: Connection,
                    errors: list[str]) -> Connection | None:
        """One try's dial within PUNCH_TIMEOUT; None (and why, in `errors`) if it failed."""
        if not remote:
            return None  # no candidate may be dialed (`_targets` said why)
        try:
            async with compat.timeout(PUNCH_TIMEOUT):
                return await endpoint.connect(list(remote), relayed.peer_id, client=relayed.initiator)
        except TimeoutError:
            errors.append(f"no connection within {PUNCH_TIMEOUT:g} s")
        except (NetworkError, OSError) as e:
            errors.append(str(e) or type(e).__name__)
        return None

    def _prefer(self, direct: Connection, relayed: Connection) -> None:
        """Calls take `direct` from now on; `relayed` closes once what runs on it is over."""
        self.transport.prefer(direct)
        self._failures.pop(direct.peer_id, None)
        if direct.remote.origin.subnet:
            self._failures.pop(f"subnet:{direct.remote.origin.subnet}", None)
        self._active[direct.peer_id].set()  # bulk streams waiting in `outcome` may go
        self._spawn(self._close_when_idle(relayed, direct))

    async def _close_when_idle(self, relayed: Connection, direct: Connection) -> None:
        while not relayed.closed and not direct.closed:
            if relayed.idle:
                relayed.close("replaced by a direct connection (hole punched)")
                return
            await asyncio.sleep(IDLE_CHECK_SECONDS)

    async def _punch_logged(self, relayed: Connection) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.punch(relayed)
        except (NetworkError, OSError) as e:
            if not relayed.closed:
                logger.info("hole punch with %s failed; staying on the relay: %s", relayed.peer_id, e)
            return
        logger.info("hole punched to %s in %.3f s: traffic moves to the direct connection",
                    relayed.peer_id, loop.time() - started)

    async def outcome(self, peer: PeerID, within: float) -> None:
        """Wait, at most `within` seconds, until a punch with `peer` in flight has made a direct
        connection or ended; at once if none is in flight."""
        running = self._active.get(peer)
        if running is not None:
            with contextlib.suppress(TimeoutError):
                async with compat.timeout(within):
                    await running.wait()

    def _refusal(self, peer: PeerID) -> str | None:
        """Why no punch with `peer` starts now, if none may."""
        if peer in self._active:
            return "one is already running"
        if len(self._active) >= MAX_CONCURRENT_PUNCHES:
            return f"{MAX_CONCURRENT_PUNCHES} are running (the limit)"
        if self.transport.is_connected_directly(peer):
            return "already connected directly"
        failed = self._failures.get(peer)
        now = asyncio.get_running_loop().time()
        if failed is not None and now < failed[1]:
            return f"{failed[0]} failed in a row; the next may start in {failed[1] - now:.0f} s"
        return None

    def _failed(self, peer: PeerID, subnets: set[str]) -> None:
        """Remember that a punch with `peer` failed every try, dialing in `subnets`: back off with
        the peer and with those subnets (see PUNCH_BACKOFF_SECONDS)."""
        now = asyncio.get_running_loop().time()
        for key in (peer, *(f"subnet:{subnet}" for subnet in sorted(subnets))):
            count, until = self._failures.pop(key, (0, now))
            if now >= until + MAX_PUNCH_BACKOFF_SECONDS:  # long past its backoff: start over
                count = 0
            backoff = min(PUNCH_BACKOFF_SECONDS * 2 ** min(count, 32), MAX_PUNCH_BACKOFF_SECONDS)
            self._failures[key] = (count + 1, now + backoff)
        for old, (_, ends) in list(self._failures.items()):  # oldest first: forget those long over
            if len(self._failures) <= MAX_REMEMBERED_FAILURES and now < ends + MAX_PUNCH_BACKOFF_SECONDS:
                break
            del self._failures[old]

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Stop background punches and idle checks (the transport is closing)."""
        for task in list(self._tasks):
            task.cancel()
