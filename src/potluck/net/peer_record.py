"""The signed peer record: a peer's own statement of where it can be dialed, until when.

A record is `(peer id, addresses, expiration)` signed by the peer's identity key (the key *is*
the peer id), so anyone holding it can check it without asking anybody, and nobody but the
peer can make one. Protocols name peers by id only; a transport that has no address for an id
fetches this record (from the DHT, through a `PeerResolver`) and dials what it says.

Wire form (`to_wire()`: a plain dict, so it travels as any DHT value does; exactly these keys)::

    {"peer": <32-byte peer id>, "addrs": ["/ip4/.../tcp/...", ...], "exp": <DHT time>, "sig": <64 bytes>}

The signature covers `[PEER_RECORD_LABEL, peer id, addrs, exp]` (msgpack). A newer record replaces
an older one because it expires later (every peer re-signs with the same lifetime), so the
expiration doubles as the sequence number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgpack

from potluck.core.errors import AddressError, IdentityError, MalformedMessage
from potluck.core.wire import Bytes, Field, Message, Number
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import SIGNATURE_BYTES, Identity, PeerID
from potluck.net.wire import PeerIdField

__all__ = ["PEER_RECORD_LABEL", "PeerRecord", "PeerResolver"]

# Domain separation: a peer-record signature can never pass for a DHT-record or handshake one.
PEER_RECORD_LABEL = "potluck/peer-record/1"


def _signed_bytes(peer_id: PeerID, addresses: Iterable[str], expiration_time: float) -> bytes:
    return msgpack.packb([PEER_RECORD_LABEL, peer_id.to_bytes(), list(addresses), float(expiration_time)],
                         use_bin_type=True)


class CanonicalAddresses(Field):
    """A record's addresses: 1 to MAX_ADDRESSES_PER_PEER distinct address strings as `sign` writes
    them (each parses and prints back the same, without /p2p/); read as `Multiaddr`s. The caps
    apply before any parsing work."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[Multiaddr, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
            raise MalformedMessage(what, f"{key!r} must be a list of address strings")
        if not value:
            raise MalformedMessage(what, f"{key!r} is empty: a peer that cannot be dialed publishes no record")
        if len(value) > MAX_ADDRESSES_PER_PEER:  # a record lists no more than the address book keeps
            raise MalformedMessage(what, f"{key!r} lists {len(value)} addresses; at most {MAX_ADDRESSES_PER_PEER}")
        if any(len(text) > MAX_ADDRESS_CHARS for text in value):
            raise MalformedMessage(what, f"{key!r}: an address is longer than {MAX_ADDRESS_CHARS} characters")
        addresses: list[Multiaddr] = []
        for text in value:
            try:
                address = Multiaddr.parse(text)
            except (AddressError, IdentityError) as e:
                raise MalformedMessage(what, f"{key!r}: {e}") from None
            if address.peer_id is not None or str(address) != text:
                raise MalformedMessage(what, f"{key!r} must be canonical and without /p2p/ (as `sign` writes them)")
            if address in addresses:
                raise MalformedMessage(what, f"{key!r} lists an address twice")
            addresses.append(address)
        return tuple(addresses)

    def encode(self, value: tuple[Multiaddr, ...]) -> list[str]:
        return [str(a) for a in value]


class PeerRecord(Message, what="peer record", exact=True):
    """A verified (or self-made) signed statement: `peer_id` listens at `addresses` until
    `expiration_time` (DHT time). Instances come only from `sign` or a checked `from_wire`, which
    refuses a map with any other key than these (nothing unsigned rides along) and a signature
    that does not verify (`MalformedMessage` naming the key)."""

    peer_id: PeerID = PeerIdField("peer", raw=True)
    addresses: tuple[Multiaddr, ...] = CanonicalAddresses("addrs")
    expiration_time: float = Number("exp", signed=True)
    signature: bytes = Bytes("sig", SIGNATURE_BYTES, exact=True)

    @classmethod
    def sign(cls, identity: Identity, addresses: Iterable[Multiaddr | str], expiration_time: float) -> PeerRecord:
        """Our own record (our /p2p/ suffixes dropped); raises MalformedMessage if it would not pass
        `from_wire` elsewhere (it is checked as any other peer would)."""
        texts = []
        for address in addresses:
            try:
                parsed = address if isinstance(address, Multiaddr) else Multiaddr.parse(address)
            except (AddressError, IdentityError) as e:
                raise cls.refuse(f"'addrs': {e}") from None
            if parsed.peer_id is not None and parsed.peer_id != identity.peer_id:
                raise cls.refuse(f"'addrs': {str(address)[:120]!r} names another peer")
            texts.append(str(parsed.without_peer_id()))
        expiration_time = float(expiration_time)
        signature = identity.sign(_signed_bytes(identity.peer_id, texts, expiration_time))
        return cls.from_wire({"peer": identity.peer_id.to_bytes(), "addrs": texts, "exp": expiration_time,
                              "sig": signature})

    def validate(self, context: Mapping[str, Any]) -> None:
        signed = _signed_bytes(self.peer_id, [str(a) for a in self.addresses], self.expiration_time)
        if not self.peer_id.verify(self.signature, signed):
            raise self.refuse("'sig' does not verify with the record's peer id (forged, or signed by another key)")


class PeerResolver(Protocol):
    """Finds the signed record of a peer the transport has no working address for (the DHT
    registers one with `Transport.set_resolver`; the transport does not import the DHT)."""

    async def resolve_peer(self, peer_id: PeerID, timeout: float,
                           thorough: bool = False) -> tuple[PeerRecord, float] | None:
        """The peer's verified record and how many seconds it stays valid, or None if none is
        found within `timeout`. `thorough`: the last record found did not work; search harder
        for a newer one (e.g. the peer restarted elsewhere) rather than take the first copy."""
        ...
