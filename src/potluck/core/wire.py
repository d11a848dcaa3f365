"""The field checks every protocol's `from_wire` is built from, in one place.

Each check takes the value (or, for `*_field`, the decoded map and the key), the key and a name
for the message, and raises `MalformedMessage(message, detail)` whose detail starts with the key
it refused (`'step' must be an integer in [0, 8)`), so one test shape covers every protocol.
The checks are cheap (type tests and comparisons): they run on every message, chunks included.
Checks that need peer ids or addresses are in `potluck.net.wire`; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from potluck.core import serialization
from potluck.core.errors import MalformedMessage, SerializationError

__all__ = [
    "bool_field", "bytes_field", "encoded_value", "int_field", "int_value", "list_field", "list_value",
    "number_field", "number_value", "text_field", "wire_map",
]

T = TypeVar("T")


def wire_map(msg: Any, what: str) -> Mapping:
    """`msg` itself, if it is a map (msgpack maps decode to dicts; loopback may pass any mapping)."""
    if msg.__class__ is dict or isinstance(msg, Mapping):
        return msg
    raise MalformedMessage(what, "not a map")


def int_value(value: Any, key: str, what: str, low: int, high: int) -> int:
    """An integer in [low, high) (booleans refused: msgpack keeps them apart from ints)."""
    if (value.__class__ is int or isinstance(value, int) and not isinstance(value, bool)) and low <= value < high:
        return value
    raise MalformedMessage(what, f"{key!r} must be an integer in [{low}, {high})")


def int_field(msg: Mapping, key: str, what: str, low: int, high: int) -> int:
    value = msg.get(key)
    if value.__class__ is int and low <= value < high:  # the common case, without a second call
        return value
    return int_value(value, key, what, low, high)


def number_value(value: Any, key: str, what: str, *, optional: bool = False, positive: bool = False,
                 signed: bool = False) -> float | None:
    """A finite number, >= 0 (> 0 if `positive`, any sign if `signed`); None if None and `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or (not signed and (value < 0 or (positive and value == 0))):
        kind = "" if signed else "positive " if positive else "non-negative "
        raise MalformedMessage(what, f"{key!r} must be a finite {kind}number")
    return float(value)


def number_field(msg: Mapping, key: str, what: str, *, default: float | None = None, optional: bool = False,
                 positive: bool = False, signed: bool = False) -> float | None:
    """`number_value` of `msg[key]`, read as `default` if the key is absent."""
    return number_value(msg.get(key, default), key, what, optional=optional, positive=positive, signed=signed)


def bool_field(msg: Mapping, key: str, what: str) -> bool:
    value = msg.get(key)
    if value is not True and value is not False:
        raise MalformedMessage(what, f"{key!r} must be a boolean")
    return value


def text_field(msg: Mapping, key: str, what: str, max_chars: int, *, optional: bool = False) -> str | None:
    """A string of at most `max_chars` characters; None if absent and `optional`."""
    value = msg.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_chars:
        raise MalformedMessage(what, f"{key!r} must be a string of at most {max_chars} characters")
    return value


def bytes_field(msg: Mapping, key: str, what: str, max_bytes: int, *, exact: bool = False) -> bytes:
    """A byte string of at most (`exact`: exactly) `max_bytes` bytes."""
    value = msg.get(key)
    if not isinstance(value, bytes) or len(value) > max_bytes or (exact and len(value) != max_bytes):
        raise MalformedMessage(what, f"{key!r} must be {'' if exact else 'at most '}{max_bytes} bytes")
    return value


def list_value(value: Any, key: str, what: str, max_items: int, *, length: int | None = None,
               each: Callable[[Any], T] | None = None) -> list:
    """A list (or tuple: loopback passes what was sent) of at most `max_items` items, exactly
    `length` if given; each item passed through `each` (a check that raises `MalformedMessage`)
    if given, else left unchecked."""
    if not isinstance(value, (list, tuple)) or len(value) > max_items or (length is not None and len(value) != length):
        size = f"{length}" if length is not None else f"at most {max_items}"
        raise MalformedMessage(what, f"{key!r} must be a list of {size} items")
    if each is not None:
        return [each(v) for v in value]
    return value if isinstance(value, list) else list(value)


def list_field(msg: Mapping, key: str, what: str, max_items: int, *, length: int | None = None,
               each: Callable[[Any], T] | None = None) -> list:
    return list_value(msg.get(key), key, what, max_items, length=length, each=each)


def encoded_value(value: Any, key: str, what: str, max_bytes: int) -> Any:
    """Anything encodable (opaque to the protocol: a user's metadata) of at most `max_bytes`
    encoded; None passes."""
    if value is None or isinstance(value, (int, float, bool)):
        return value  # the common cases, free
    try:
        size = len(serialization.dumps(value))
    except SerializationError as e:
        raise MalformedMessage(what, f"{key!r} cannot be encoded: {e}") from None
    if size > max_bytes:
        raise MalformedMessage(what, f"{key!r} must encode to at most {max_bytes} bytes")
    return value
