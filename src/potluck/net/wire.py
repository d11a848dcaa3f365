"""Field checks for the net types messages carry (peer ids, addresses), beside the generic ones
in `potluck.core.wire`: same arguments, same `MalformedMessage` naming the key. Each check has
its declared field too (`PeerIdField`, `AddressField`, `AddressesField`) for `core.wire.Message`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from potluck.core.errors import AddressError, IdentityError, MalformedMessage
from potluck.core.wire import Field, list_value
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import PeerID

__all__ = ["AddressField", "AddressesField", "PeerIdField", "addresses_to_wire", "addresses_value", "peer_id_value"]


def peer_id_value(value: Any, key: str, what: str, *, raw: bool = False) -> PeerID:
    """A peer id in its text form (base58), or with `raw` as its 32 key bytes."""
    try:
        return PeerID(value) if raw else PeerID.from_string(value)
    except IdentityError as e:
        raise MalformedMessage(what, f"{key!r} must be a peer id: {e}") from None


def addresses_to_wire(addresses: Iterable[Multiaddr | str]) -> tuple[str, ...]:
    """A peer's addresses as a message carries them: text, the first MAX_ADDRESSES_PER_PEER only
    (`addresses_value` refuses more)."""
    return tuple(str(a) for a in addresses)[:MAX_ADDRESSES_PER_PEER]


def addresses_value(value: Any, key: str, what: str, max_items: int = MAX_ADDRESSES_PER_PEER, *,
                    parsed: bool = False) -> tuple[str, ...] | tuple[Multiaddr, ...]:
    """At most `max_items` address strings (a transport keeps no more than MAX_ADDRESSES_PER_PEER
    per peer), each one that parses, so a transport accepts it; returned as sent, or with `parsed`
    as the `Multiaddr`s they parse to."""
    values = list_value(value, key, what, max_items)
    addresses = []
    try:
        for text in values:
            if not isinstance(text, str) or len(text) > MAX_ADDRESS_CHARS:
                raise AddressError(f"not a string of at most {MAX_ADDRESS_CHARS} characters")
            addresses.append(Multiaddr.parse(text))
    except (AddressError, IdentityError) as e:
        raise MalformedMessage(what, f"{key!r} must hold addresses: {e}") from None
    return tuple(addresses) if parsed else tuple(values)


class PeerIdField(Field):
    """A peer id, read as a `PeerID`: on the wire its text form (base58), or with `raw` its 32 key
    bytes (half the size: what protocols that name many peers use). With `text`, the text form is
    kept as the value, checked (records that name peers as text: routes, layouts, plans)."""

    def __init__(self, key: str | None = None, *, raw: bool = False, text: bool = False, **options: Any):
        if raw and text:
            raise ValueError("a peer id kept as text travels as text: not raw")
        super().__init__(key, **options)
        self.raw, self.text = raw, text
        self.encodes = not text

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> PeerID | str:
        peer = peer_id_value(value, key, what, raw=self.raw)
        return value if self.text else peer

    def encode(self, value: PeerID) -> bytes | str:
        return value.to_bytes() if self.raw else str(value)


class AddressField(Field):
    """One address, as text that parses (`Multiaddr.parse`); read as sent."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or len(value) > MAX_ADDRESS_CHARS:
            raise MalformedMessage(what, f"{key!r} must be a string of at most {MAX_ADDRESS_CHARS} characters")
        try:
            Multiaddr.parse(value)
        except (AddressError, IdentityError) as e:
            raise MalformedMessage(what, f"{key!r} must be an address: {e}") from None
        return value


class AddressesField(Field):
    """A peer's addresses (`addresses_value`): at most `max_items` strings that parse, read as a
    tuple of the strings as sent (build the value with `addresses_to_wire`), or with `parsed` as
    `Multiaddr`s (given as any addresses, of which the first `max_items` are sent)."""

    def __init__(self, key: str | None = None, max_items: int = MAX_ADDRESSES_PER_PEER, *, parsed: bool = False,
                 **options: Any):
        super().__init__(key, **options)
        self.max_items, self.parsed = max_items, parsed
        self.encodes = parsed

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple:
        return addresses_value(value, key, what, self.max_items, parsed=self.parsed)

    def encode(self, value: Iterable[Multiaddr | str]) -> list[str]:
        return [str(a) for a in value][:self.max_items]
