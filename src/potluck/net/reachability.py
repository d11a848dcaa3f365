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

Identities cost nothing (issue 29), so a check asks servers of different network origins first
(one per subnet, `net.origins`, before a second of any subnet): a thousand made-up servers of one
host are one voice. A "private" that only one subnet says, while a server of another subnet was
too busy to answer, stays "unknown": an attacker that keeps the honest servers busy cannot make
its own lying servers the only answer. Servers share their dial-back slots per origin for the
same reason (`MAX_DIALBACKS_PER_SUBNET`), and give up on a dial whose far end does not answer
(TCP and TLS) within `DIALBACK_ANSWER_TIMEOUT`. In an authority-governed run they serve members only.

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
from potluck.core.wire import Message
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.membership import require_member
from potluck.net.origins import UNKNOWN_ORIGIN, Shares, rounds_by_subnet
from potluck.net.transport import Transport
from potluck.net.wire import AddressesField, AddressField

__all__ = [
    "DIALBACK", "DialbackBusy", "DialbackRefused", "DialbackReply", "DialbackRequest", "DialbackService",
    "ReachabilityReport", "check_reachability", "spread_by_origin",
]

logger = logging.getLogger(__name__)

DIALBACK = "nat.dialback"

# Addresses one request may ask us to dial: a peer listens on a few (IPv4, IPv6, an announced
# one); more would only multiply the dials one call costs us.
MAX_DIALBACK_ADDRESSES = 4
# Deadline of one dial-back (TCP connect + TLS + handshake): a reachable peer answers in well under
# a second even across continents; past this it counts as not reachable there.
DIALBACK_TIMEOUT = 5.0
# The far end of one dial must answer (TCP connect and the TLS server's reply: two round trips)
# within this, or the dial is given up and its slot freed: a listener that accepts TCP and never
# answers TLS held a slot the whole DIALBACK_TIMEOUT before. Two seconds is two round trips of a
# second, or one lost SYN (resent after 1 s) and two intercontinental round trips.
DIALBACK_ANSWER_TIMEOUT = 2.0
# Dial-back requests served at once (each dials up to MAX_DIALBACK_ADDRESSES addresses); above it
# callers are refused and ask someone else. Peers check once at start, so a few are plenty.
MAX_CONCURRENT_DIALBACKS = 8
# Of those, from one subnet (and so from one IP), and from one caller id: a quarter, and one.
# Made-up ids of one host took all 8 before (one each); now it gets 2 and six stay for others.
# Honest peers behind one address check at start and every RECHECK_INTERVAL: two at once is plenty,
# and a refused one asks another server.
MAX_DIALBACKS_PER_SUBNET = 2
MAX_DIALBACKS_PER_IP = 2
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


class DialbackBusy(DialbackRefused):
    """A server has no dial-back slot for us now (its slots, or our origin's share, are taken)."""


class DialbackRequest(Message, what="dial-back request"):
    """The addresses the caller asks to be dialed back at."""

    addresses: tuple[str, ...] = AddressesField("addrs", MAX_DIALBACK_ADDRESSES)


class DialbackReply(Message, what="dial-back reply"):
    """Which of the caller's addresses the server reached, and where it saw the call come from."""

    reached: tuple[str, ...] = AddressesField(max_items=MAX_DIALBACK_ADDRESSES)
    observed: str | None = AddressField(default=None)


class DialbackService:
    """Serves `nat.dialback` while this peer is public (it refuses otherwise)."""

    def __init__(self, transport: Transport, max_concurrent: int = MAX_CONCURRENT_DIALBACKS,
                 max_per_subnet: int = MAX_DIALBACKS_PER_SUBNET, max_per_ip: int = MAX_DIALBACKS_PER_IP):
        self.transport = transport
        self.max_concurrent = max_concurrent
        # Callers being dialed back now: one per caller id, a share per IP and subnet.
        self._slots = Shares.fitted("dial-backs in progress", max_concurrent, per_subnet=max_per_subnet,
                                    per_ip=max_per_ip, per_peer=1)

    @property
    def in_progress(self) -> int:
        return self._slots.held

    def start(self) -> None:
        self.transport.add_handler(DIALBACK, self._dialback, max_seconds=DIALBACK_CALL_TIMEOUT)

    def close(self) -> None:
        self.transport.remove_handler(DIALBACK)

    async def _dialback(self, request: Any, ctx: CallContext) -> dict:
        require_member(self.transport.membership, ctx.peer_id, ctx.remote.token, "this peer's dial-back")
        addresses = [Multiaddr.parse(a) for a in DialbackRequest.from_wire(request).addresses]
        if self.transport.reachability != "public":
            raise DialbackRefused("this peer is not publicly reachable itself; ask a public peer")
        observed = ctx.remote.observed
        if ctx.remote.relayed or observed is None:
            raise DialbackRefused("dial-backs are served over direct connections only")
        origin, caller = ctx.remote.origin, ctx.peer_id
        refusal = self._slots.refusal(origin, caller)
        if refusal is not None:
            raise DialbackBusy(f"too many dial-backs in progress ({refusal}); ask another peer")
        # Only the caller's own host: a request cannot aim our dials at anyone else.
        targets = [a for a in addresses if not a.is_circuit and _same_host(a, observed)]
        self._slots.claim(origin, caller)
        try:
            results = await asyncio.gather(*(self._try(a, caller) for a in targets))
        finally:
            self._slots.release(origin, caller)
        reached = tuple(str(a) for a, ok in zip(targets, results, strict=True) if ok)
        return DialbackReply(reached, str(observed)).to_wire()

    async def _try(self, address: Multiaddr, caller: PeerID) -> bool:
        """Dial `address` afresh (not the pooled connection we already have) expecting `caller`."""
        try:
            async with compat.timeout(DIALBACK_TIMEOUT):
                conn = await self.transport.dial(address.without_peer_id(), caller, bulk=True,
                                                 answer_within=DIALBACK_ANSWER_TIMEOUT)
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
    answered_subnets: tuple[str, ...] = ()  # the subnets of the servers that answered
    busy_subnets: tuple[str, ...] = ()  # the subnets of servers that had no slot for us

    def combine(self, more: ReachabilityReport) -> ReachabilityReport:
        """This check's evidence and a later one's (asked of other servers), judged together."""
        reached = tuple(dict.fromkeys(self.reached + more.reached))
        answered = tuple(dict.fromkeys(self.answered_subnets + more.answered_subnets))
        busy = tuple(dict.fromkeys(self.busy_subnets + more.busy_subnets))
        answers = self.answers + more.answers
        return ReachabilityReport(_verdict(reached, answers, answered, busy), reached, answers,
                                  self.asked + more.asked,
                                  tuple(dict.fromkeys(self.observed_hosts + more.observed_hosts)), answered, busy)


def _verdict(reached: tuple[Multiaddr, ...], answers: int, answered: tuple[str, ...] = (),
             busy: tuple[str, ...] = ()) -> Verdict:
    """Public if any dial-back worked; private if servers answered and none did, unless one subnet
    alone said so while a server of another subnet was busy (then unknown: see the module)."""
    if reached:
        return "public"
    if not answers:
        return "unknown"
    if len(answered) < 2 and any(b not in answered for b in busy):
        return "unknown"
    return "private"


def spread_by_origin(transport: Transport, servers: Sequence[PeerID]) -> list[PeerID]:
    """`servers` (in their order) one per subnet first, then a second of each, and so on; servers
    whose origin we do not know yet come last. Our own id is left out."""
    servers = [s for s in dict.fromkeys(servers) if s != transport.peer_id]
    origins = {s: transport.peer_origin(s) for s in servers}
    known = [s for s in servers if origins[s] != UNKNOWN_ORIGIN]
    rounds = rounds_by_subnet(known, lambda s: origins[s].subnet)
    return [s for r in rounds for s in r] + [s for s in servers if origins[s] == UNKNOWN_ORIGIN]


async def check_reachability(transport: Transport, servers: Sequence[PeerID],
                             timeout: float = DIALBACK_CALL_TIMEOUT) -> ReachabilityReport:
    """Ask up to CHECK_PEERS of `servers`, of different origins first, to dial us back; records
    the observed hosts in `transport.observed_hosts`. Does not change the transport's
    reachability: the caller decides."""
    addresses = transport.listen_addresses[:MAX_DIALBACK_ADDRESSES]
    asked = spread_by_origin(transport, servers)[:CHECK_PEERS]
    if not addresses or not asked:
        return ReachabilityReport("unknown" if addresses else "private", (), 0, tuple(asked), ())
    request = DialbackRequest(tuple(str(a.without_peer_id()) for a in addresses)).to_wire()
    replies = await asyncio.gather(*(_ask(transport, s, request, timeout) for s in asked))
    answered = [r for r in replies if isinstance(r, DialbackReply)]
    subnets = [transport.peer_origin(s).subnet for s in asked]
    answered_subnets = tuple(dict.fromkeys(n for n, r in zip(subnets, replies, strict=True)
                                           if isinstance(r, DialbackReply)))
    busy_subnets = tuple(dict.fromkeys(n for n, r in zip(subnets, replies, strict=True) if r == "busy"))
    ours = {a.without_peer_id() for a in addresses}  # a server can only vouch for what we asked
    reached = tuple(dict.fromkeys(a for r in answered for a in map(Multiaddr.parse, r.reached) if a in ours))
    hosts = tuple(dict.fromkeys(Multiaddr.parse(r.observed).host for r in answered if r.observed))
    for host in hosts:
        if host not in transport.observed_hosts:
            transport.observed_hosts.append(host)
    del transport.observed_hosts[:-MAX_OBSERVED_HOSTS]
    return ReachabilityReport(_verdict(reached, len(answered), answered_subnets, busy_subnets), reached,
                              len(answered), tuple(asked), hosts, answered_subnets, busy_subnets)


async def _ask(transport: Transport, server: PeerID, request: dict, timeout: float) -> DialbackReply | str | None:
    """The server's reply; "busy" if it had no slot for us; None if it did not answer."""
    try:
        return DialbackReply.from_wire(await transport.call(server, DIALBACK, request, timeout=timeout))
    except RemoteError as e:
        logger.debug("%s did not dial us back: %s", server, e)
        if e.remote_type == DialbackBusy.__name__:
            return "busy"
    except (NetworkError, MalformedMessage, TimeoutError) as e:
        logger.debug("asking %s for a dial-back failed: %s", server, e)
    return None
