"""Reachability check (like libp2p's AutoNAT): can others dial us at the addresses we announce?

A peer asks a few others to dial it back (`nat.dialback`): it lists its addresses, and each
server dials those whose host is the one it saw the call come from (`RemoteInfo.observed`), on a
fresh connection that must prove the caller's id, within a short deadline, and answers which
worked and the address it saw. The host rule means nobody can aim our dials at a third party: the
only host a caller can make us dial is its own (or its router's).

The verdict: public if any dial-back worked; private if at least one server answered and none
worked; unknown if nobody answered (the caller keeps what it assumed and says so). One failed answer
is enough because the two mistakes cost very differently: a false "private" (one server's bad
day) costs relayed traffic until the next re-check (`potluck.Peer` re-checks every few minutes),
while a false "public" leaves the peer unreachable, announcing addresses nobody can dial. The
common home setup, one initial peer that is also the relay, gives exactly one answer.

Servers are peers that are themselves public: a NATed server's dial-back could reach the caller
through a shared LAN and pass where the internet would not.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from potluck.core import compat
from potluck.core.errors import MalformedMessage, NetworkError, RemoteError
from potluck.core.wire import list_field, text_field, wire_map
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.transport import Transport
from potluck.net.wire import addresses_value

__all__ = [
    "DIALBACK", "DialbackRefused", "DialbackReply", "DialbackService", "ReachabilityReport", "check_reachability",
]

logger = logging.getLogger(__name__)

DIALBACK = "nat.dialback"

# Addresses one request may ask us to dial: a peer listens on a few (IPv4, IPv6, an announced
# one); more would only multiply the dials one call costs us.
MAX_DIALBACK_ADDRESSES = 4
# Deadline of one dial-back (TCP connect + TLS + handshake): a reachable peer answers in well under
# a second even across continents; past this it counts as not reachable there.
DIALBACK_TIMEOUT = 5.0
# Dial-back requests served at once (each dials up to MAX_DIALBACK_ADDRESSES addresses); above it
# callers are refused and ask someone else. Peers check once at start, so a few are plenty.
MAX_CONCURRENT_DIALBACKS = 8
# A caller's call: the dial-backs' deadline plus the round trips of the call itself.
DIALBACK_CALL_TIMEOUT = DIALBACK_TIMEOUT + 5.0
# Peers asked in one check: a dial-back that works through any of them settles "public" even with
# one server down or slow, and few enough not to load the swarm's first peers with every newcomer's
# (and every re-check's) dials.
CHECK_PEERS = 3
# Observed hosts remembered (for hole punching's candidates): one per address family and router.
MAX_OBSERVED_HOSTS = 4

Verdict = Literal["public", "private", "unknown"]


class DialbackRefused(NetworkError):
    """A server would not dial us back (not public itself, busy, or a relayed call)."""


@dataclass(frozen=True)
class DialbackReply:
    """Which of the caller's addresses the server reached, and where it saw the call come from."""

    reached: tuple[str, ...]
    observed: str | None

    def to_wire(self) -> dict:
        return {"reached": list(self.reached), "observed": self.observed}

    @classmethod
    def from_wire(cls, msg: Any) -> DialbackReply:
        msg = wire_map(msg, "dial-back reply")
        reached = addresses_value(list_field(msg, "reached", "dial-back reply", MAX_DIALBACK_ADDRESSES),
                                  "reached", "dial-back reply")
        observed = text_field(msg, "observed", "dial-back reply", MAX_ADDRESS_CHARS, optional=True)
        if observed is not None:
            addresses_value([observed], "observed", "dial-back reply")
        return cls(reached, observed)


class DialbackService:
    """Serves `nat.dialback` while this peer is public (it refuses otherwise)."""

    def __init__(self, transport: Transport, max_concurrent: int = MAX_CONCURRENT_DIALBACKS):
        self.transport = transport
        self.max_concurrent = max_concurrent
        self._serving: set[PeerID] = set()  # callers being dialed back now (one each at a time)

    def start(self) -> None:
        self.transport.add_handler(DIALBACK, self._dialback, max_seconds=DIALBACK_CALL_TIMEOUT)

    def close(self) -> None:
        self.transport.remove_handler(DIALBACK)

    async def _dialback(self, request: Any, ctx: CallContext) -> dict:
        msg = wire_map(request, "dial-back request")
        addresses = [Multiaddr.parse(a) for a in addresses_value(
            list_field(msg, "addrs", "dial-back request", MAX_DIALBACK_ADDRESSES), "addrs", "dial-back request")]
        if self.transport.reachability != "public":
            raise DialbackRefused("this peer is not publicly reachable itself; ask a public peer")
        observed = ctx.remote.observed
        if ctx.remote.relayed or observed is None:
            raise DialbackRefused("dial-backs are served over direct connections only")
        if ctx.peer_id in self._serving or len(self._serving) >= self.max_concurrent:
            raise DialbackRefused(f"too many dial-backs in progress (limit {self.max_concurrent}); ask another peer")
        # Only the caller's own host: a request cannot aim our dials at anyone else.
        targets = [a for a in addresses if not a.is_circuit and _same_host(a, observed)]
        self._serving.add(ctx.peer_id)
        try:
            results = await asyncio.gather(*(self._try(a, ctx.peer_id) for a in targets))
        finally:
            self._serving.discard(ctx.peer_id)
        reached = tuple(str(a) for a, ok in zip(targets, results, strict=True) if ok)
        return DialbackReply(reached, str(observed)).to_wire()

    async def _try(self, address: Multiaddr, caller: PeerID) -> bool:
        """Dial `address` afresh (not the pooled connection we already have) expecting `caller`."""
        try:
            async with compat.timeout(DIALBACK_TIMEOUT):
                conn = await self.transport._dial(address.without_peer_id(), caller, bulk=True)
        except (NetworkError, OSError, TimeoutError) as e:
            logger.debug("dial-back to %s at %s failed: %s", caller, address, e)
            return False
        conn.close("dial-back done")
        return True


def _same_host(address: Multiaddr, observed: Multiaddr) -> bool:
    """Whether `address` names the observed host: the same IP (an IPv4-mapped IPv6 peername counts
    as its IPv4), or the same emulated name. DNS names never match: resolving one could point anywhere."""
    if address.kind == "emu" or observed.kind == "emu":
        return address.kind == observed.kind and address.host == observed.host
    if address.kind not in ("ip4", "ip6") or observed.kind not in ("ip4", "ip6"):
        return False
    return _ip(address.host) == _ip(observed.host)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class ReachabilityReport:
    """What a check found: the verdict, and the evidence behind it."""

    verdict: Verdict
    reached: tuple[Multiaddr, ...]  # our addresses some server dialed back
    answers: int  # servers that answered (with or without a working dial-back)
    asked: tuple[PeerID, ...]
    observed_hosts: tuple[str, ...]  # our hosts as the servers saw us

    def combine(self, more: ReachabilityReport) -> ReachabilityReport:
        """This check's evidence and a later one's (asked of other servers), judged together."""
        reached = tuple(dict.fromkeys(self.reached + more.reached))
        answers = self.answers + more.answers
        return ReachabilityReport(_verdict(reached, answers), reached, answers, self.asked + more.asked,
                                  tuple(dict.fromkeys(self.observed_hosts + more.observed_hosts)))


def _verdict(reached: tuple[Multiaddr, ...], answers: int) -> Verdict:
    if reached:
        return "public"
    return "private" if answers else "unknown"


async def check_reachability(transport: Transport, servers: Sequence[PeerID],
                             timeout: float = DIALBACK_CALL_TIMEOUT) -> ReachabilityReport:
    """Ask up to CHECK_PEERS of `servers` to dial us back; records the observed hosts in
    `transport.observed_hosts`. Does not change the transport's reachability: the caller decides."""
    addresses = transport.listen_addresses[:MAX_DIALBACK_ADDRESSES]
    asked = [s for s in dict.fromkeys(servers) if s != transport.peer_id][:CHECK_PEERS]
    if not addresses or not asked:
        return ReachabilityReport("unknown" if addresses else "private", (), 0, tuple(asked), ())
    request = {"addrs": [str(a.without_peer_id()) for a in addresses]}
    replies = await asyncio.gather(*(_ask(transport, s, request, timeout) for s in asked))
    answered = [r for r in replies if r is not None]
    ours = {a.without_peer_id() for a in addresses}  # a server can only vouch for what we asked
    reached = tuple(dict.fromkeys(a for r in answered for a in map(Multiaddr.parse, r.reached) if a in ours))
    hosts = tuple(dict.fromkeys(Multiaddr.parse(r.observed).host for r in answered if r.observed))
    for host in hosts:
        if host not in transport.observed_hosts:
            transport.observed_hosts.append(host)
    del transport.observed_hosts[:-MAX_OBSERVED_HOSTS]
    return ReachabilityReport(_verdict(reached, len(answered)), reached, len(answered), tuple(asked), hosts)


async def _ask(transport: Transport, server: PeerID, request: dict, timeout: float) -> DialbackReply | None:
    try:
        return DialbackReply.from_wire(await transport.call(server, DIALBACK, request, timeout=timeout))
    except RemoteError as e:
        logger.debug("%s did not dial us back: %s", server, e)
    except (NetworkError, MalformedMessage, TimeoutError) as e:
        logger.debug("asking %s for a dial-back failed: %s", server, e)
    return None
