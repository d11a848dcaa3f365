"""`AddressBook`: where each peer can be dialed, and how much we believe it.

Two kinds of entries per peer:
- *vouched*: addresses the peer itself stated over an authenticated connection (its handshake),
  an address where it proved its id when we dialed, or its own signed peer record. Only the peer
  can produce these, so a stranger cannot plant or displace them.
- *hints*: addresses a third party told us (a DHT find answer, a protocol's record). Tried after
  the vouched ones; a hint never evicts a vouched address, only older hints.
Plain logic, no I/O: the transport feeds it and asks it for a dial order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from potluck.core.bounded import drop_oldest
from potluck.net.address import Multiaddr
from potluck.net.identity import PeerID

__all__ = ["MAX_ADDRESSES_PER_PEER", "MAX_HINTED_PEERS", "MAX_HINTS_PER_PEER", "MAX_VOUCHED_PEERS", "AddressBook"]

# Addresses remembered per peer; a peer that advertises more is trimmed (it gains nothing). A host
# has a handful of interfaces (v4, v6, a public mapping). Also the most a signed peer record or a
# protocol message may list for one peer (peer_record, net.wire).
MAX_ADDRESSES_PER_PEER = 8
# Third-party hints kept per peer, newest first. Separate from the vouched ones, so flooding hints
# (a stranger's fake addresses) can push out only other hints.
MAX_HINTS_PER_PEER = 8
# Peers whose addresses are remembered, each kind apart; the least recently stated go first. A
# handshake or a hint costs a made-up id nothing, so without a cap every id ever met stayed (about
# 2 KB each). 8,192 covers a full DHT routing table and its replacements (20 x 256) twice over; a
# peer we still talk to is vouched for again at each connection, so it stays among the newest.
MAX_VOUCHED_PEERS = 8192
MAX_HINTED_PEERS = 8192
# Bare forms of /p2p/ addresses remembered: every authenticated connection states its peer's
# addresses again, and rebuilding (and re-checking) a Multiaddr each time showed in profiles.
BARE_ADDRESS_CACHE = 4096


def _bare(addr: Multiaddr | str) -> Multiaddr:
    addr = Multiaddr.parse(addr) if isinstance(addr, str) else addr
    return _without_peer_id(addr) if addr.peer_id is not None else addr


@functools.lru_cache(maxsize=BARE_ADDRESS_CACHE)
def _without_peer_id(addr: Multiaddr) -> Multiaddr:
    return addr.without_peer_id()


class AddressBook:
    """Per-peer vouched addresses and hints, each list newest first and capped."""

    def __init__(self) -> None:
        self._vouched: dict[PeerID, list[Multiaddr]] = {}
        self._hints: dict[PeerID, list[Multiaddr]] = {}

    def add_vouched(self, peer_id: PeerID, addresses: Iterable[Multiaddr | str]) -> None:
        """Addresses the peer stated itself (authenticated connection or signed record)."""
        known = self._vouched[peer_id] = self._vouched.pop(peer_id, [])  # now the most recent
        drop_oldest(self._vouched, MAX_VOUCHED_PEERS)
        hints = self._hints.get(peer_id)
        for addr in reversed([_bare(a) for a in addresses]):  # keep the given order, ahead of older ones
            if addr in known:
                known.remove(addr)
            known.insert(0, addr)  # newest first: the most likely to be current
            if hints and addr in hints:
                hints.remove(addr)
        del known[MAX_ADDRESSES_PER_PEER:]
        if not known:
            del self._vouched[peer_id]
        if hints is not None and not hints:
            del self._hints[peer_id]

    def add_hints(self, peer_id: PeerID, addresses: Iterable[Multiaddr | str]) -> None:
        """Addresses a third party gave for `peer_id`: kept apart, behind the vouched ones."""
        vouched = self._vouched.get(peer_id, ())
        known = self._hints[peer_id] = self._hints.pop(peer_id, [])
        drop_oldest(self._hints, MAX_HINTED_PEERS)
        for addr in reversed([_bare(a) for a in addresses]):
            if addr in vouched or addr in known:
                continue
            known.insert(0, addr)
        del known[MAX_HINTS_PER_PEER:]
        if not known:
            del self._hints[peer_id]

    def dial_order(self, peer_id: PeerID) -> list[Multiaddr]:
        """Vouched addresses first (newest first), then hints."""
        return [*self._vouched.get(peer_id, ()), *self._hints.get(peer_id, ())]

    def vouched(self, peer_id: PeerID) -> list[Multiaddr]:
        return list(self._vouched.get(peer_id, ()))

    def hints(self, peer_id: PeerID) -> list[Multiaddr]:
        return list(self._hints.get(peer_id, ()))

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._vouched or peer_id in self._hints
