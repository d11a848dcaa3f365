"""Field checks shared by the averaging protocols' `from_wire` parsers (matchmaking, state download,
the averager's DHT records). Each takes the decoded map, the key and a name for the message, and
raises `MalformedMessage(message, field)` naming the field it refused; nothing here does I/O.
"""

from __future__ import annotations

import math
from typing import Any

from potluck.core import serialization
from potluck.core.errors import AddressError, IdentityError, MalformedMessage, SerializationError
from potluck.net.address import MAX_ADDRESS_CHARS, Multiaddr
from potluck.net.identity import PeerID
from potluck.net.transport import MAX_ADDRESSES_PER_PEER

# Addresses a message or record may carry per peer: a transport keeps no more per peer anyway.
MAX_ADDRESSES = MAX_ADDRESSES_PER_PEER


def wire_map(msg: Any, what: str) -> dict:
    """`msg` itself, if it is a map (msgpack maps decode to dicts)."""
    if not isinstance(msg, dict):
        raise MalformedMessage(what, "not a map")
    return msg


def int_field(msg: dict, key: str, what: str, low: int, high: int) -> int:
    """An integer in [low, high) (booleans refused: msgpack keeps them apart from ints)."""
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise MalformedMessage(what, f"{key!r} must be an integer in [{low}, {high})")
    return value


def number_field(msg: dict, key: str, what: str, *, positive: bool = False, optional: bool = False) -> float | None:
    """A finite number >= 0 (> 0 if `positive`); None if absent and `optional`."""
    value = msg.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise MalformedMessage(what, f"{key!r} must be a finite {'positive' if positive else 'non-negative'} number")
    return float(value)


def text_field(msg: dict, key: str, what: str, max_chars: int, *, optional: bool = False) -> str | None:
    """A string of at most `max_chars` characters; None if absent and `optional`."""
    value = msg.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_chars:
        raise MalformedMessage(what, f"{key!r} must be a string of at most {max_chars} characters")
    return value


def bytes_field(msg: dict, key: str, what: str, max_bytes: int, *, exact: bool = False) -> bytes:
    """A byte string of at most (`exact`: exactly) `max_bytes` bytes."""
    value = msg.get(key)
    if not isinstance(value, bytes) or len(value) > max_bytes or (exact and len(value) != max_bytes):
        raise MalformedMessage(what, f"{key!r} must be {'' if exact else 'at most '}{max_bytes} bytes")
    return value


def list_field(msg: dict, key: str, what: str, max_items: int, *, length: int | None = None) -> list:
    """A list of at most `max_items` items (exactly `length` if given); its items unchecked."""
    value = msg.get(key)
    if not isinstance(value, list) or len(value) > max_items or (length is not None and len(value) != length):
        size = f"{length}" if length is not None else f"at most {max_items}"
        raise MalformedMessage(what, f"{key!r} must be a list of {size} items")
    return value


def encoded_field(msg: dict, key: str, what: str, max_bytes: int) -> Any:
    """Anything encodable (opaque to the protocol: a user's metadata) of at most `max_bytes`
    encoded; absent is None."""
    value = msg.get(key)
    if value is None or isinstance(value, (int, float, bool)):
        return value  # the common cases, free
    try:
        size = len(serialization.dumps(value))
    except SerializationError as e:
        raise MalformedMessage(what, f"{key!r} cannot be encoded: {e}") from None
    if size > max_bytes:
        raise MalformedMessage(what, f"{key!r} must encode to at most {max_bytes} bytes")
    return value


def addresses_field(msg: dict, key: str, what: str) -> tuple[str, ...]:
    """At most MAX_ADDRESSES address strings, each one that parses (so a transport accepts it)."""
    values = list_field(msg, key, what, MAX_ADDRESSES)
    try:
        for value in values:
            if not isinstance(value, str) or len(value) > MAX_ADDRESS_CHARS:
                raise AddressError(f"not a string of at most {MAX_ADDRESS_CHARS} characters")
            Multiaddr.parse(value)
    except (AddressError, IdentityError) as e:
        raise MalformedMessage(what, f"{key!r} must be at most {MAX_ADDRESSES} addresses: {e}") from None
    return tuple(values)


def peer_ids_field(msg: dict, key: str, what: str, max_items: int) -> tuple[PeerID, ...]:
    """At most `max_items` peer ids, each as its raw key bytes."""
    values = list_field(msg, key, what, max_items)
    try:
        return tuple(PeerID(v) for v in values)
    except IdentityError as e:
        raise MalformedMessage(what, f"{key!r} must hold peer ids: {e}") from None
