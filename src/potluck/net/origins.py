"""Where a peer comes from (`Origin`), and fair shares of what strangers can claim (`Shares`).

Identities cost nothing; network addresses do: a host has one IP, a home or a small provider a
/24 of IPv4, an IPv6 customer a /48. So every resource a stranger can claim (connections,
handshakes, relay reservations and circuits, dial-back slots, DHT storage, an expert's stash,
admission attempts) is capped per peer id, per IP and per subnet as well as in all, each cap a
stated share of the whole, as libp2p's resource manager scopes limits by peer and by IP. One
host then never holds more than its subnet's share, however many identities it makes; a botnet
spread over many subnets still can (docs/security.md says what it can do).

A peer that is not on IP (the emulated network) has its name for IP and subnet; one that reached
us through a relay counts under the relay (`relayed`), which is where its bytes come from.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from potluck.net.address import Multiaddr

T = TypeVar("T")

__all__ = ["IPV4_SUBNET_BITS", "IPV6_SUBNET_BITS", "UNKNOWN_ORIGIN", "Origin", "Shares", "origin_of",
           "outside_subnet", "rounds_by_subnet"]

# The prefix one party plausibly holds: a /24 of IPv4 (a small provider's or an office's block),
# a /48 of IPv6 (what one customer site is given).
IPV4_SUBNET_BITS = 24
IPV6_SUBNET_BITS = 48


@dataclass(frozen=True)
class Origin:
    """A peer's network origin: its IP (or what stands for it) and its subnet."""

    ip: str
    subnet: str

    @classmethod
    def relayed(cls, relay: str) -> Origin:
        """A peer that reached us through the relay `relay` (its peer id)."""
        return cls(f"relay:{relay}", f"relay:{relay}")

    @property
    def is_relayed(self) -> bool:
        """Whether this stands for a relay rather than the peer's own network (see `relayed`)."""
        return self.ip.startswith("relay:")


# Where a connection we cannot place comes from (our own loopback calls, a socket already gone).
UNKNOWN_ORIGIN = Origin("unknown", "unknown")


def origin_of(where: Multiaddr | str | None) -> Origin:
    """The origin of a connection seen coming from `where` (an observed address, or a host)."""
    if where is None:
        return UNKNOWN_ORIGIN
    host = where.host if isinstance(where, Multiaddr) else str(where)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return Origin(host, host)  # an emulated peer's name: its own origin
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = IPV4_SUBNET_BITS if ip.version == 4 else IPV6_SUBNET_BITS
    return Origin(str(ip), str(ipaddress.ip_network(f"{ip}/{bits}", strict=False)))


def outside_subnet(origin: Origin) -> str | None:
    """The subnet `origin` counts under where rules share things per subnet among strangers
    (matchmaking's seats and holds): None for our own network (loopback, private addresses), which
    such rules exempt, since a lab or a test swarm on one host is one subnet."""
    try:
        ip = ipaddress.ip_address(origin.ip)
    except ValueError:
        return origin.subnet  # an emulated peer's name, a relay
    return None if ip.is_loopback or ip.is_private else origin.subnet


class Shares:
    """One capped resource that strangers claim: at most `total` claims in all, `per_subnet` from
    one subnet, `per_ip` from one IP and `per_peer` by one peer id. `refusal` says why a new claim
    would be refused (None: it fits); `claim` and `release` count it. A claim made before the
    claimant has proven an id (an accepted connection still in its handshake) passes `peer=None`
    and counts per IP and subnet only. Counts are kept only while positive, so the bookkeeping is
    bounded by the claims held. The limits are plain attributes: a transport may change them on a
    live instance (each check reads them)."""

    def __init__(self, name: str, total: int, *, per_subnet: int, per_ip: int, per_peer: int):
        if not 0 < per_peer <= per_ip <= per_subnet <= total:
            raise ValueError(f"{name}: need 0 < per_peer <= per_ip <= per_subnet <= total")
        self.name, self.total = name, total
        self.per_subnet, self.per_ip, self.per_peer = per_subnet, per_ip, per_peer
        self.held = 0
        self._subnets: dict[str, int] = {}
        self._ips: dict[str, int] = {}
        self._peers: dict[object, int] = {}

    @classmethod
    def fitted(cls, name: str, total: int, *, per_subnet: int, per_ip: int, per_peer: int) -> Shares:
        """Shares whose caps are each cut to the one above it (a configured total smaller than a
        default share makes that share the total)."""
        per_subnet = min(per_subnet, total)
        per_ip = min(per_ip, per_subnet)
        return cls(name, total, per_subnet=per_subnet, per_ip=per_ip, per_peer=min(per_peer, per_ip))

    def refusal(self, origin: Origin, peer: object = None, amount: int = 1) -> str | None:
        if _over(self.held, amount, self.total):
            return f"too many {self.name} (all {self.total} are taken)"
        if _over(self._subnets.get(origin.subnet, 0), amount, self.per_subnet):
            return f"too many {self.name} from {origin.subnet} (its share: {self.per_subnet} of {self.total})"
        if _over(self._ips.get(origin.ip, 0), amount, self.per_ip):
            return f"too many {self.name} from {origin.ip} (its share: {self.per_ip} of {self.total})"
        if peer is not None and _over(self._peers.get(peer, 0), amount, self.per_peer):
            return f"too many {self.name} from this peer (its share: {self.per_peer} of {self.total})"
        return None

    def claim(self, origin: Origin, peer: object = None, amount: int = 1) -> None:
        """Count a claim that `refusal` let through."""
        self.held += amount
        for counts, key in self._counts(origin, peer):
            counts[key] = counts.get(key, 0) + amount

    def release(self, origin: Origin, peer: object = None, amount: int = 1) -> None:
        """Give back a claim counted with the same origin, peer and amount."""
        self.held -= amount
        for counts, key in self._counts(origin, peer):
            left = counts.get(key, 0) - amount
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)

    def _counts(self, origin: Origin, peer: object) -> list[tuple[dict, object]]:
        counts: list[tuple[dict, object]] = [(self._subnets, origin.subnet), (self._ips, origin.ip)]
        if peer is not None:
            counts.append((self._peers, peer))
        return counts

    def held_by(self, origin: Origin) -> int:
        """Claims held from `origin`'s subnet."""
        return self._subnets.get(origin.subnet, 0)

    def held_by_ip(self, origin: Origin) -> int:
        """Claims held from `origin`'s IP."""
        return self._ips.get(origin.ip, 0)

    def held_by_peer(self, peer: object) -> int:
        return self._peers.get(peer, 0)

    def counted(self) -> bool:
        """Whether anything is counted (nothing is kept once every claim is released)."""
        return bool(self.held or self._subnets or self._ips or self._peers)


def _over(held: int, amount: int, cap: int) -> bool:
    """Whether claiming `amount` more where `held` is counted passes `cap` (never when nothing is
    held: for claims of one, `held >= cap`)."""
    return held > 0 and held + amount > cap


def rounds_by_subnet(items: Iterable[T], subnet_of: Callable[[T], str],
                     taken: Mapping[str, int] | None = None) -> list[list[T]]:
    """`items` (in their order) in rounds: the first holds one item of each subnet, the second a
    second of each, and so on; a subnet that `taken` says holds n already starts in round n. Many
    ids of one subnet then get one place per round, whoever made them up (servers to ask, relays
    to try)."""
    held = dict(taken or {})
    rounds: list[list[T]] = []
    for item in items:
        subnet = subnet_of(item)
        n = held[subnet] = held.get(subnet, 0) + 1
        rounds.extend([] for _ in range(n - len(rounds)))
        rounds[n - 1].append(item)
    return rounds
