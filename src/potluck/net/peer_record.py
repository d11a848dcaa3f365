"""The signed peer record: a peer's own statement of where it can be dialed, until when.

A record is `(peer id, addresses, expiration)` signed by the peer's identity key (the key *is*
the peer id), so anyone holding it can check it without asking anybody, and nobody but the
peer can make one. Protocols name peers by id only; a transport that has no address for an id
fetches this record (from the DHT, through a `PeerResolver`) and dials what it says.

Wire form (a plain dict, so it travels as any DHT value does)::

    {"peer": <32-byte peer id>, "addrs": ["/ip4/.../tcp/...", ...], "exp": <DHT time>, "sig": <64 bytes>}

The signature covers `[PEER_RECORD_LABEL, peer id, addrs, exp]` (msgpack). A newer record replaces
an older one because it expires later (every peer re-signs with the same lifetime), so the
expiration doubles as the sequence number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import msgpack

from potluck.core.errors import AddressError, IdentityError, MalformedMessage
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import SIGNATURE_BYTES, Identity, PeerID

__all__ = ["PEER_RECORD_LABEL", "PeerRecord", "PeerRecordError", "PeerResolver"]

# Domain separation: a peer-record signature can never pass for a DHT-record or handshake one.
PEER_RECORD_LABEL = "potluck/peer-record/1"


class PeerRecordError(MalformedMessage):
    """A peer record failed validation (bad field, too many addresses, or a bad signature)."""

    def __init__(self, field: str):
        super().__init__("peer record", field)


@dataclass(frozen=True)
class PeerRecord:
    """A verified (or self-made) signed statement: `peer_id` listens at `addresses` until
    `expiration_time` (DHT time). Instances come only from `sign` or a checked `from_value`."""

    peer_id: PeerID
    addresses: tuple[Multiaddr, ...]
    expiration_time: float
    signature: bytes

    @staticmethod
    def _signed_bytes(peer_id: PeerID, addresses: Iterable[str], expiration_time: float) -> bytes:
        return msgpack.packb([PEER_RECORD_LABEL, peer_id.to_bytes(), list(addresses), float(expiration_time)],
                             use_bin_type=True)

    @classmethod
    def sign(cls, identity: Identity, addresses: Iterable[Multiaddr | str], expiration_time: float) -> PeerRecord:
        """Our own record; raises PeerRecordError if it would not pass `from_value` elsewhere."""
        addrs = _canonical(identity.peer_id, [str(a) for a in addresses])
        expiration_time = float(expiration_time)
        signature = identity.sign(cls._signed_bytes(identity.peer_id, [str(a) for a in addrs], expiration_time))
        return cls(identity.peer_id, addrs, expiration_time, signature)

    def to_value(self) -> dict:
        return {"peer": self.peer_id.to_bytes(), "addrs": [str(a) for a in self.addresses],
                "exp": self.expiration_time, "sig": self.signature}

    @classmethod
    def from_value(cls, value: object) -> PeerRecord:
        """Parse and verify a record from another peer; PeerRecordError names what is wrong."""
        if not isinstance(value, dict) or set(value) != {"peer", "addrs", "exp", "sig"}:
            raise PeerRecordError("a peer record is a dict with exactly 'peer', 'addrs', 'exp' and 'sig'")
        raw_peer, addrs, expiration, signature = value["peer"], value["addrs"], value["exp"], value["sig"]
        if not isinstance(raw_peer, bytes):
            raise PeerRecordError("'peer' must be the 32-byte peer id")
        try:
            peer_id = PeerID(raw_peer)
        except IdentityError as e:
            raise PeerRecordError(f"'peer': {e}") from None
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise PeerRecordError("'addrs' must be a list of address strings")
        if isinstance(expiration, bool) or not isinstance(expiration, (int, float)) or not math.isfinite(expiration):
            raise PeerRecordError("'exp' must be a finite number (DHT time)")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise PeerRecordError(f"'sig' must be {SIGNATURE_BYTES} bytes")
        parsed = _canonical(peer_id, addrs)
        if [str(a) for a in parsed] != addrs:
            raise PeerRecordError("'addrs' must be canonical, distinct and without /p2p/ (as `sign` writes them)")
        if not peer_id.verify(signature, cls._signed_bytes(peer_id, addrs, float(expiration))):
            raise PeerRecordError("'sig' does not verify with the record's peer id (forged, or signed by another key)")
        return cls(peer_id, parsed, float(expiration), signature)


def _canonical(peer_id: PeerID, addrs: list[str]) -> tuple[Multiaddr, ...]:
    """Parse, check and strip the `/p2p/` suffix; the caps apply before any parsing work."""
    if not addrs:
        raise PeerRecordError("'addrs' is empty: a peer that cannot be dialed publishes no record")
    if len(addrs) > MAX_ADDRESSES_PER_PEER:  # a record lists no more than the address book keeps
        raise PeerRecordError(f"'addrs' lists {len(addrs)} addresses; at most {MAX_ADDRESSES_PER_PEER}")
    out: list[Multiaddr] = []
    for text in addrs:
        if len(text) > MAX_ADDRESS_CHARS:
            raise PeerRecordError(f"an address is longer than {MAX_ADDRESS_CHARS} characters")
        try:
            addr = Multiaddr.parse(text)
        except AddressError as e:
            raise PeerRecordError(f"'addrs': {e}") from None
        if addr.peer_id is not None and addr.peer_id != peer_id:
            raise PeerRecordError(f"'addrs': {text[:120]!r} names another peer")
        addr = addr.without_peer_id()
        if addr in out:
            raise PeerRecordError("'addrs' lists an address twice")
        out.append(addr)
    return tuple(out)


class PeerResolver(Protocol):
    """Finds the signed record of a peer the transport has no working address for (the DHT
    registers one with `Transport.set_resolver`; the transport does not import the DHT)."""

    async def resolve_peer(self, peer_id: PeerID, timeout: float,
                           thorough: bool = False) -> tuple[PeerRecord, float] | None:
        """The peer's verified record and how many seconds it stays valid, or None if none is
        found within `timeout`. `thorough`: the last record found did not work; search harder
        for a newer one (e.g. the peer restarted elsewhere) rather than take the first copy."""
        ...
