"""Field checks for the net types messages carry (peer ids, addresses), beside the generic ones
in `potluck.core.wire`: same arguments, same `MalformedMessage` naming the key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from potluck.core.errors import AddressError, IdentityError, MalformedMessage
from potluck.core.wire import list_value
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import PeerID

__all__ = ["addresses_to_wire", "addresses_value", "peer_id_value"]


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


def addresses_value(value: Any, key: str, what: str) -> tuple[str, ...]:
    """At most MAX_ADDRESSES_PER_PEER address strings (a transport keeps no more per peer), each
    one that parses, so a transport accepts it; returned as sent."""
    values = list_value(value, key, what, MAX_ADDRESSES_PER_PEER)
    try:
        for text in values:
            if not isinstance(text, str) or len(text) > MAX_ADDRESS_CHARS:
                raise AddressError(f"not a string of at most {MAX_ADDRESS_CHARS} characters")
            Multiaddr.parse(text)
    except (AddressError, IdentityError) as e:
        raise MalformedMessage(what, f"{key!r} must hold addresses: {e}") from None
    return tuple(values)
