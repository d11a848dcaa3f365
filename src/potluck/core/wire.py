"""The field checks every protocol's `from_wire` is built from, in one place.

Each check takes the value (or, for `*_field`, the decoded map and the key), the key and a name
for the message, and raises `MalformedMessage(message, detail)` whose detail starts with the key
it refused (`'step' must be an integer in [0, 8)`), so one test shape covers every protocol.
The checks are cheap (type tests and comparisons): they run on every message, chunks included.
Checks that need peer ids or addresses are in `potluck.net.wire`; nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from potluck.core import serialization
from potluck.core.errors import MalformedMessage, SerializationError

__all__ = [
    "Bool", "Bytes", "Choice", "Dict", "Field", "FromContext", "Int", "List", "Message", "Nested", "Number", "OneOf",
    "Opaque", "Raw", "Text", "Tuple", "bool_field", "bytes_field", "encoded_value", "int_field", "int_value",
    "list_field", "list_value", "number_field", "number_value", "text_field", "wire_map",
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


# -- declared messages ------------------------------------------------------------------------------
# A message type is declared once, as a class whose attributes are `Field`s:
#
#     class PartRequest(Message, what="part request"):
#         group_id: bytes = Bytes("g", MAX_GROUP_ID_BYTES)
#         shard: int = Int("j", 0, 2**31)
#
# and gets from the declaration a frozen dataclass, `to_wire()` (a map of the short keys; a field
# with a default is left out while it holds it) and `from_wire(msg, **context)`, which checks every
# field as declared and raises `MalformedMessage(what, "'<key>' ...")` on the first that is wrong.
# Bounds may name a context value (`Int("m", 0, "n")`: `from_wire(msg, n=len(group))`) or compute
# one from the context (a callable). Cross-field rules go in a `validate(self, context)` method,
# which refuses with `self.refuse(detail)`. Both functions are generated code, so a message costs
# what a hand-written one did (`benchmarks/dht.py`, `benchmarks/allreduce.py`).
# A value the reader knows but the wire does not carry (the expiration of the DHT entry a record
# came from, say) is a `FromContext` field.
#
# A packed message (`packed=<max bytes>`) travels as its own msgpack document: `to_wire()` gives
# bytes and `from_wire` takes them. It is for signed statements that other messages and DHT
# records carry and pass on as they were made (a membership token); so that nothing unsigned
# rides along, a packed map has exactly its declared keys. A map that travels inside another
# document (a signed record stored as a DHT value) can ask for the same with `exact=True`.

_ABSENT = object()
_REQUIRED = object()
# A bound of a field: a number, the name of a context value, or a function of the context.
Bound = Union[int, str, Callable[[Mapping[str, Any]], int]]  # noqa: UP007 - evaluated at import on 3.10


def _bound(bound: Bound, context: Mapping[str, Any]) -> int:
    if bound.__class__ is int:
        return bound
    if isinstance(bound, str):
        return context[bound]
    return bound(context)


class Field:
    """One field of a `Message`: its key on the wire (default: the attribute's name), its check
    (`check`, on a value that is not None), its wire form (`encode`), and its default if the key
    may be absent (`default`, or `default_factory` for a mutable one). `optional`: None passes.
    A field whose check reads the context sets `uses_context` (a nested message is given the
    context only if one of its fields, or its `validate`, uses it)."""

    encodes = False  # `encode` is not the identity (the generated to_wire skips the call if so)
    uses_context = False
    on_wire = True  # False: not carried, given by the context of `from_wire` (`FromContext`)

    def __init__(self, key: str | None = None, *, default: Any = _REQUIRED,
                 default_factory: Callable[[], Any] | None = None, optional: bool = False):
        self.key = key
        self.name = ""
        self.default = default if default_factory is None else _REQUIRED
        self.default_factory = default_factory
        self.optional = optional or default is None

    @property
    def has_default(self) -> bool:
        return self.default is not _REQUIRED or self.default_factory is not None

    def parse(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        if value is None and self.optional:
            return None
        return self.check(value, key, what, context)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        return value

    def check_items(self, values: list, key: str, what: str, context: Mapping[str, Any]) -> tuple:
        """The items of a `List` of this field, each checked."""
        each = self.parse if self.optional else self.check
        return tuple([each(v, key, what, context) for v in values])

    def encode(self, value: Any) -> Any:
        return value

    def encode_items(self, values: Sequence) -> list:
        """The items of a `List` of this field, in their wire form."""
        encode = self.encode
        return [encode(v) for v in values]

    def fast(self, v: str) -> str | None:
        """An expression of the variable `v`, true when the value is valid as it is (the common
        case, tested inline by the generated `from_wire` before calling `check`)."""
        return None

    def inline(self, v: str, names: dict[str, Any]) -> tuple[str, list[str]] | None:
        """For the generated `from_wire`: (a condition on the variable `v`, statements that
        check it in place when it holds), its common case without a call to `check` (which
        takes the rest); None: `fast`. Names the statements use go in `names`."""
        fast = self.fast(v)
        return None if fast is None else (fast, ["pass"])

    def encoder(self, expr: str, names: dict[str, Any]) -> str:
        """For the generated `to_wire`: an expression of `expr` (a value of this field) in its
        wire form. Names it uses go in `names`."""
        name = f"e{len(names)}"
        names[name] = self.encode
        return f"{name}({expr})"


class Int(Field):
    """An integer in [low, high) (booleans refused); a bound may name a context value."""

    def __init__(self, key: str | None = None, low: Bound = 0, high: Bound = 2**62, **options: Any):
        super().__init__(key, **options)
        self.low, self.high = low, high
        self.uses_context = not (low.__class__ is int and high.__class__ is int)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> int:
        low = self.low if self.low.__class__ is int else _bound(self.low, context)
        high = self.high if self.high.__class__ is int else _bound(self.high, context)
        if value.__class__ is int and low <= value < high:  # the common case (list items), without a call
            return value
        return int_value(value, key, what, low, high)

    def fast(self, v: str) -> str | None:
        if not all(b.__class__ is int or isinstance(b, str) for b in (self.low, self.high)):
            return None  # a bound computed from the context: `check` computes it
        low, high = (repr(b) if b.__class__ is int else f"ctx[{b!r}]" for b in (self.low, self.high))
        return f"{v}.__class__ is int and {low} <= {v} < {high}"


class Number(Field):
    """A finite number, >= 0 (> 0 if `positive`, any sign if `signed`), read as a float; with
    `most`, a larger one is read as `most` (a claim cut to what is plausible, not refused)."""

    def __init__(self, key: str | None = None, *, positive: bool = False, signed: bool = False,
                 most: float | None = None, **options: Any):
        super().__init__(key, **options)
        self.positive, self.signed, self.most = positive, signed, most

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> float:
        number = number_value(value, key, what, positive=self.positive, signed=self.signed)
        return number if self.most is None else min(number, self.most)

    def fast(self, v: str) -> str | None:
        low = "-INF <" if self.signed else "0.0 <" if self.positive else "0.0 <="
        return f"{v}.__class__ is float and {low} {v} < {'INF' if self.most is None else repr(float(self.most))}"


class Bool(Field):
    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> bool:
        if value is not True and value is not False:
            raise MalformedMessage(what, f"{key!r} must be a boolean")
        return value

    def fast(self, v: str) -> str | None:
        return f"{v} is True or {v} is False"


class Text(Field):
    """A string of at most `max_chars` characters."""

    def __init__(self, key: str | None = None, max_chars: int = 256, **options: Any):
        super().__init__(key, **options)
        self.max_chars = max_chars

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> str:
        if not isinstance(value, str) or len(value) > self.max_chars:
            raise MalformedMessage(what, f"{key!r} must be a string of at most {self.max_chars} characters")
        return value

    def fast(self, v: str) -> str | None:
        return f"{v}.__class__ is str and len({v}) <= {self.max_chars}"


class Bytes(Field):
    """A byte string of at most (`exact`: exactly) `max_bytes` bytes."""

    def __init__(self, key: str | None = None, max_bytes: int = 64, *, exact: bool = False, **options: Any):
        super().__init__(key, **options)
        self.max_bytes, self.exact = max_bytes, exact

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> bytes:
        if not isinstance(value, bytes) or len(value) > self.max_bytes or (self.exact and len(value) != self.max_bytes):
            raise MalformedMessage(what, f"{key!r} must be {'' if self.exact else 'at most '}{self.max_bytes} bytes")
        return value

    def fast(self, v: str) -> str | None:
        return f"{v}.__class__ is bytes and len({v}) {'==' if self.exact else '<='} {self.max_bytes}"


class Choice(Field):
    """One of a fixed set of values (strings: roles, kinds)."""

    def __init__(self, key: str | None = None, choices: Collection[Any] = (), **options: Any):
        super().__init__(key, **options)
        self.choices = tuple(choices)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        if value.__class__ not in (str, int) or value not in self.choices:
            raise MalformedMessage(what, f"{key!r} must be one of {list(self.choices)}")
        return value


class Opaque(Field):
    """Anything encodable, opaque to the protocol (a user's metadata), of at most `max_bytes`
    encoded."""

    def __init__(self, key: str | None = None, max_bytes: int = 1024, **options: Any):
        options.setdefault("default", None)
        super().__init__(key, **options)
        self.max_bytes = max_bytes

    def parse(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        return encoded_value(value, key, what, self.max_bytes)


class Raw(Field):
    """Passed on as received, checked by its user (a codec payload is checked when decoded);
    `kind`: the type it must have (a map: `Mapping`), named `kind_name` in the error."""

    def __init__(self, key: str | None = None, kind: type | tuple[type, ...] | None = None, kind_name: str = "",
                 **options: Any):
        super().__init__(key, **options)
        self.kind, self.kind_name = kind, kind_name

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        if self.kind is not None and not isinstance(value, self.kind):
            raise MalformedMessage(what, f"{key!r} must be {self.kind_name}")
        return value

    def fast(self, v: str) -> str | None:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if self.kind is None:
            return "True"
        if any(k.__module__ != "builtins" for k in kinds):
            return None  # (a test names builtin types only)
        return f"isinstance({v}, ({', '.join(k.__name__ for k in kinds)},))"


class List(Field):
    """A list of at most `max_items` items (exactly `length` if given), each checked by `item`
    (a field without a key); read as a tuple. Items whose field has a `fast` test are tested in
    one generated loop first (a find answer's peer indices, a chunk's ids), and checked one by
    one only if one fails it."""

    def __init__(self, key: str | None = None, item: Field | None = None, max_items: Bound = 1024, *,
                 length: Bound | None = None, **options: Any):
        super().__init__(key, **options)
        self.item = item if item is not None else Field()
        self.max_items, self.length = max_items, length
        self.encodes = self.item.encodes
        self.uses_context = (self.item.uses_context or max_items.__class__ is not int
                             or (length is not None and length.__class__ is not int))
        fast = self.item.fast("v")
        self.all_valid = None if fast is None else _all_valid(fast)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple:
        length = self.length
        if length is None:
            limit = self.max_items if self.max_items.__class__ is int else _bound(self.max_items, context)
            if value.__class__ is not list or len(value) > limit:
                value = list_value(value, key, what, limit)
        else:
            if length.__class__ is not int:
                length = _bound(length, context)
            if value.__class__ is not list or len(value) != length:
                value = list_value(value, key, what, length, length=length)
        if not value or self.item.__class__ is Field or self.all_valid is not None and self.all_valid(value, context):
            return tuple(value)
        return self.item.check_items(value, key, what, context)

    def encode(self, value: Any) -> list:
        return self.item.encode_items(value)

    def inline(self, v: str, names: dict[str, Any]) -> tuple[str, list[str]] | None:
        # A list within its bound is read here; one that is not (or a tuple) goes to `check`.
        tag, item = f"L{len(names)}", self.item
        bound = self.max_items if self.length is None else self.length
        if bound.__class__ is int:
            limit = str(bound)
        elif isinstance(bound, str):
            limit = f"ctx[{bound!r}]"
        else:
            names[f"{tag}b"] = bound
            limit = f"{tag}b(ctx)"
        condition = f"{v}.__class__ is list and len({v}) {'<=' if self.length is None else '=='} {limit}"
        if item.__class__ is Field:
            return condition, [f"{v} = tuple({v})"]
        names[f"{tag}c"] = item.check_items
        items = f"{tag}c({v}, {self.key!r}, WHAT, ctx)"
        if self.all_valid is not None:
            names[f"{tag}a"] = self.all_valid
            return condition, [f"{v} = tuple({v}) if not {v} or {tag}a({v}, ctx) else {items}"]
        if isinstance(item, Nested) and not item.optional:  # one frame per item: its from_wire
            names[f"{tag}m"] = item.message.from_wire
            each = f"{tag}m(x, **ctx)" if item.uses_context else f"{tag}m(x)"
            return condition, ["try:", f"    {v} = tuple([{each} for x in {v}])", "except Malformed as e:",
                               f"    raise Malformed(WHAT, {f'{self.key!r}: '!r} + e.field) from None"]
        return condition, [f"{v} = {items}"]

    def encoder(self, expr: str, names: dict[str, Any]) -> str:
        if isinstance(self.item, Nested) and not self.item.optional:
            return f"[x.to_wire() for x in {expr}]"
        return super().encoder(expr, names)


def _all_valid(fast: str, item: str = "v") -> Callable[[Sequence, Mapping[str, Any]], bool]:
    """Whether every item passes the test `fast` (a `Field.fast` of the variable `item`, which may
    read the context `ctx`: a bound named there), as one generated loop."""
    names: dict[str, Any] = {"INF": math.inf}
    lines = ["def all_valid(items, ctx):", f"    for {item} in items:", f"        if not ({fast}): return False",
             "    return True"]
    exec("\n".join(lines), names)  # noqa: S102 - code generated from the declaration only
    return names["all_valid"]


class Dict(Field):
    """A map of at most `max_items` entries, on the wire as [key, value] pairs in key order (or as
    a map, `pairs=False`), each half checked by its field; read as a dict."""

    def __init__(self, key: str | None = None, keys: Field | None = None, values: Field | None = None,
                 max_items: Bound = 1024, *, pairs: bool = True, **options: Any):
        options.setdefault("default_factory", dict)
        super().__init__(key, **options)
        self.keys, self.values = keys or Field(), values or Field()
        self.max_items, self.pairs = max_items, pairs
        self.encodes = True
        self.uses_context = self.keys.uses_context or self.values.uses_context or max_items.__class__ is not int
        k, v = (("True" if f.__class__ is Field else f.fast(half))
                for f, half in ((self.keys, "e[0]"), (self.values, "e[1]")))
        pair = "e.__class__ is list and len(e) == 2 and " if pairs else ""  # entries as sent; items of a map
        self.all_valid = None if k is None or v is None else _all_valid(f"{pair}({k}) and ({v})", "e")

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> dict:
        limit = _bound(self.max_items, context)
        if self.pairs:
            entries = list_value(value, key, what, limit)
            if self.all_valid is not None and self.all_valid(entries, context):
                return dict(entries)
            if not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in entries):
                raise MalformedMessage(what, f"{key!r} entries must be [key, value] pairs")
        else:
            if not isinstance(value, Mapping) or len(value) > limit:
                raise MalformedMessage(what, f"{key!r} must be a map of at most {limit} entries")
            entries = value.items()
            if self.all_valid is not None and self.all_valid(entries, context):
                return dict(entries)
        keys, values = self.keys, self.values
        return {keys.parse(k, key, what, context): values.parse(v, key, what, context) for k, v in entries}

    def encode(self, value: Any) -> Any:
        keys, values = self.keys, self.values
        if not (keys.encodes or values.encodes):  # both halves go as they are: no call per entry
            return [[k, v] for k, v in sorted(value.items())] if self.pairs else dict(value)
        if self.pairs:
            if not keys.encodes:
                return [[k, values.encode(v)] for k, v in sorted(value.items())]
            return [[keys.encode(k), values.encode(v)] for k, v in sorted(value.items())]
        return {keys.encode(k): values.encode(v) for k, v in value.items()}


class Tuple(Field):
    """A list of exactly these fields' values, in order (e.g. [upload, download])."""

    def __init__(self, key: str | None = None, items: Sequence[Field] = (), **options: Any):
        super().__init__(key, **options)
        self.items = tuple(items)
        self.encodes = any(f.encodes for f in self.items)
        self.uses_context = any(f.uses_context for f in self.items)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple:
        values = list_value(value, key, what, len(self.items), length=len(self.items))
        return tuple(f.parse(v, key, what, context) for f, v in zip(self.items, values, strict=True))

    def encode(self, value: Any) -> list:
        return [f.encode(v) for f, v in zip(self.items, value, strict=True)]


class Nested(Field):
    """A message of type `message` (checked with the same context), whose error is named
    `'<key>': <its detail>`."""

    encodes = True

    def __init__(self, key: str | None = None, message: Any = None, **options: Any):
        super().__init__(key, **options)
        self.message = message
        fields = getattr(message, "FIELDS", None)  # (a OneOf has none: it passes the context on)
        self.uses_context = fields is None or hasattr(message, "validate") or any(f.uses_context for f in fields)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Any:
        try:
            return self.message.from_wire(value, **context) if self.uses_context else self.message.from_wire(value)
        except MalformedMessage as e:
            raise MalformedMessage(what, f"{key!r}: {e.field}") from None

    def check_items(self, values: list, key: str, what: str, context: Mapping[str, Any]) -> tuple:
        if self.optional:
            return super().check_items(values, key, what, context)
        from_wire = self.message.from_wire
        try:  # (one frame for the list: a store carries hundreds of records)
            if self.uses_context and context:
                return tuple([from_wire(v, **context) for v in values])
            return tuple([from_wire(v) for v in values])
        except MalformedMessage as e:
            raise MalformedMessage(what, f"{key!r}: {e.field}") from None

    def encode(self, value: Any) -> Any:
        return value.to_wire()

    def encode_items(self, values: Sequence) -> list:
        return [v.to_wire() for v in values]


class FromContext(Field):
    """Not on the wire: the value `from_wire` is given in its context (`source`: the name of a
    context value, or a function of the context), e.g. the expiration of the DHT entry a record
    was read from, or the trial a result belongs to. `to_wire` leaves it out."""

    on_wire = False
    uses_context = True

    def __init__(self, source: str | Callable[[Mapping[str, Any]], Any], **options: Any):
        super().__init__(None, **options)
        self.source = source

    def take(self, context: Mapping[str, Any]) -> Any:
        return context[self.source] if isinstance(self.source, str) else self.source(context)


class Message:
    """A wire message declared by its `Field`s (see above). Subclass options: `what` (its name
    in errors), `tag` ((key, value) that every one carries: messages that share a method are
    told apart by it), `positional` (a list in field order instead of a map, for small tuples),
    `packed` (the most bytes of a message that travels as its own msgpack document, see above),
    `exact` (a map with exactly its declared keys, see above), `frozen` (default True)."""

    WHAT: ClassVar[str] = "message"
    TAG: ClassVar[tuple[str, str] | None] = None
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    PACKED: ClassVar[int | None] = None
    EXACT: ClassVar[bool] = False

    def __init_subclass__(cls, what: str | None = None, tag: tuple[str, str] | None = None,
                          positional: bool = False, frozen: bool = True, packed: int | None = None,
                          exact: bool = False, **options: Any):
        super().__init_subclass__(**options)
        if exact and positional:
            raise TypeError(f"{cls.__name__}: `exact` is for maps; a positional message has its length checked")
        cls.WHAT = what or cls.__name__
        cls.TAG = tag
        cls.PACKED = packed
        cls.EXACT = exact or packed is not None
        fields = list(cls.FIELDS)
        for name in cls.__dict__.get("__annotations__", {}):
            declared = cls.__dict__.get(name)
            if not isinstance(declared, Field):
                continue
            declared.name, declared.key = name, declared.key or name
            fields.append(declared)
            if declared.default_factory is not None:
                setattr(cls, name, dataclasses.field(default_factory=declared.default_factory))
            elif declared.default is not _REQUIRED:
                setattr(cls, name, declared.default)
            else:
                delattr(cls, name)
        cls.FIELDS = tuple(fields)
        own_init = "__init__" in cls.__dict__
        dataclasses.dataclass(frozen=frozen)(cls)
        if not own_init:
            cls.__init__ = _make_init(cls, frozen)
        cls.to_wire = _make_to_wire(cls, positional)
        cls.from_wire = classmethod(_make_from_wire(cls, positional))

    def to_wire(self) -> Any:  # replaced by the generated one
        raise NotImplementedError

    @classmethod
    def from_wire(cls, msg: Any, **context: Any) -> Any:  # replaced by the generated one
        raise NotImplementedError

    @classmethod
    def refuse(cls, detail: str) -> MalformedMessage:
        """The error for a message that breaks a rule of `validate`: raise it."""
        return MalformedMessage(cls.WHAT, detail)


def _make_init(cls: type, frozen: bool) -> Callable[..., None]:
    """The dataclass's `__init__` (same parameters, defaults and `__post_init__`), with
    object.__setattr__ bound once: a frozen dataclass's own looks it up for every field, which is
    a third of what building a small message costs. (Not through the instance's __dict__: that
    would make every later read of its fields slower.)"""
    # (the generated names start with "__": no field's name does)
    names: dict[str, Any] = {"__missing": dataclasses.MISSING, "__setattr": object.__setattr__}
    params, body = [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        names[f"__default{i}"], names[f"__factory{i}"] = f.default, f.default_factory
        if not f.init:  # not a parameter: its default, if it has one
            value = f"__default{i}" if f.default is not dataclasses.MISSING else f"__factory{i}()"
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                continue
        elif f.default is not dataclasses.MISSING:
            params.append(f"{f.name}=__default{i}")
            value = f.name
        elif f.default_factory is not dataclasses.MISSING:
            params.append(f"{f.name}=__missing")
            value = f"__factory{i}() if {f.name} is __missing else {f.name}"
        else:
            params.append(f.name)
            value = f.name
        body.append(f"    __setattr(self, {f.name!r}, {value})" if frozen else f"    self.{f.name} = {value}")
    lines = [f"def __init__(self, {', '.join(params)}):", *(body or ["    pass"])]
    if hasattr(cls, "__post_init__"):
        lines.append("    self.__post_init__()")
    exec("\n".join(lines), names)  # noqa: S102 - code generated from the declaration only
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def _make_to_wire(cls: type, positional: bool) -> Callable[[Any], Any]:
    names: dict[str, Any] = {"pack": _pack}
    lines = ["def to_wire(self):"]
    done = "pack" if cls.PACKED is not None else ""

    def value(f: Field, i: int) -> str:
        if not f.encodes:
            return f"self.{f.name}"
        encoded = f.encoder(f"self.{f.name}", names)
        return encoded if not f.optional else f"(None if self.{f.name} is None else {encoded})"
    carried = [(i, f) for i, f in enumerate(cls.FIELDS) if f.on_wire]
    if positional:
        lines.append(f"    return {done}([" + ", ".join(value(f, i) for i, f in carried) + "])")
    else:
        first = [] if cls.TAG is None else [f"{cls.TAG[0]!r}: {cls.TAG[1]!r}"]
        first += [f"{f.key!r}: {value(f, i)}" for i, f in carried if not f.has_default]
        lines.append("    w = {" + ", ".join(first) + "}")
        for i, f in carried:
            if f.has_default:
                names[f"d{i}"] = f.default
                test = (f"self.{f.name}" if f.default_factory is not None else f"self.{f.name} is not None"
                        if f.default is None else f"self.{f.name} != d{i}")
                lines.append(f"    if {test}: w[{f.key!r}] = {value(f, i)}")
        lines.append(f"    return {done}(w)")
    exec("\n".join(lines), names)  # noqa: S102 - code generated from the declaration only
    return names["to_wire"]


def _make_from_wire(cls: type, positional: bool) -> Callable[..., Any]:
    what = cls.WHAT
    names: dict[str, Any] = {"cls": cls, "WHAT": what, "wire_map": wire_map, "ABSENT": _ABSENT,
                             "Malformed": MalformedMessage, "INF": math.inf}
    lines = ["def from_wire(cls, msg, **ctx):"]
    if cls.PACKED is not None:
        names["unpack"] = _unpack
        lines.append(f"    msg = unpack(msg, WHAT, {cls.PACKED})")
    if positional:
        n = sum(f.on_wire for f in cls.FIELDS)
        lines += [f"    if msg.__class__ is not list and not isinstance(msg, (list, tuple)) or len(msg) != {n}:",
                  f"        raise Malformed(WHAT, 'not a list of {n} items')"]
    elif cls.EXACT:
        keys = {f.key for f in cls.FIELDS if f.on_wire} | ({cls.TAG[0]} if cls.TAG is not None else set())
        required = keys - {f.key for f in cls.FIELDS if f.has_default}
        names["KEYS"], names["REQUIRED"], names["Mapping"] = frozenset(keys), frozenset(required), Mapping
        names["NOT_MAP"] = f"a {what} is a msgpack map"
        names["EXACT"] = f"a {what} has exactly the keys {sorted(required)}" + (
            f", and may have {sorted(keys - required)}" if keys != required else "")
        if cls.PACKED is not None:
            lines.append("    if msg.__class__ is not dict: raise Malformed(WHAT, NOT_MAP)")
        else:  # (not decoded here: loopback may pass any mapping)
            lines.append("    if msg.__class__ is not dict and not isinstance(msg, Mapping):"
                         " raise Malformed(WHAT, EXACT)")
        lines.append("    if not (msg.keys() >= REQUIRED and msg.keys() <= KEYS): raise Malformed(WHAT, EXACT)")
    else:
        lines.append("    if msg.__class__ is not dict: msg = wire_map(msg, WHAT)")
    if not positional:
        if cls.TAG is not None:
            key, tag = cls.TAG
            lines += [f"    if msg.get({key!r}) != {tag!r}:",
                      f"        raise Malformed(WHAT, {f'{key!r} must be {tag!r}'!r})"]
    args = []
    place = 0  # the next carried field's place in a positional message
    for i, f in enumerate(cls.FIELDS):
        v = f"v{i}"
        args.append(v)
        if not f.on_wire:
            names[f"t{i}"] = f.take
            lines.append(f"    {v} = t{i}(ctx)")
            continue
        names[f"p{i}"] = f.parse if f.optional else f.check
        read = (f"msg[{place}]" if positional else f"msg.get({f.key!r}, ABSENT)" if f.has_default
                else f"msg.get({f.key!r})")
        lines.append(f"    {v} = {read}")
        # if <absent>: <default> / elif <None, optional>: pass / elif <common case>: ... / else: check
        branches = []
        if f.has_default and not positional:
            names[f"d{i}"], names[f"f{i}"] = f.default, f.default_factory
            branches.append((f"{v} is ABSENT", [f"{v} = d{i}" if f.default_factory is None else f"{v} = f{i}()"]))
        if f.optional:
            branches.append((f"{v} is None", ["pass"]))
        inline = f.inline(v, names)
        if inline is not None:
            branches.append(inline)
        for n, (condition, statements) in enumerate(branches):
            lines.append(f"    {'el' if n else ''}if {condition}:")
            lines += [f"        {s}" for s in statements]
        check = f"{v} = p{i}({v}, {f.key!r}, WHAT, ctx)"
        lines += ["    else:", f"        {check}"] if branches else [f"    {check}"]
        place += 1
    lines.append(f"    m = cls({', '.join(args)})")
    if hasattr(cls, "validate"):
        lines.append("    m.validate(ctx)")
    lines.append("    return m")
    exec("\n".join(lines), names)  # noqa: S102 - code generated from the declaration only
    return names["from_wire"]


def _pack(document: Any) -> bytes:
    """A packed message's bytes (see `Message`)."""
    return msgpack.packb(document, use_bin_type=True)


def _unpack(data: Any, what: str, max_bytes: int) -> Any:
    """The document inside a packed message's bytes (see `Message`), at most `max_bytes` of them."""
    if data.__class__ is not bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMessage(what, f"a {what} is bytes, got {type(data).__name__}")
        data = bytes(data)
    if len(data) > max_bytes:
        raise MalformedMessage(what, f"{len(data)} bytes, more than the {max_bytes} a {what} may take")
    try:
        return serialization.unpackb_bounded(data, raw=False, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage
        raise MalformedMessage(what, f"not msgpack ({type(e).__name__})") from None


class OneOf:
    """Messages that travel under one method, told apart by their tag (`Message(tag=...)`) or,
    untagged, by the key of each one's first field (in the order given; the last one also takes
    any message none of the others' keys is in, and names what it lacks)."""

    def __init__(self, what: str, *kinds: type[Message]):
        self.what, self.kinds = what, kinds
        tags = {kind.TAG for kind in kinds}
        self.tag_key = None if None in tags or len({t[0] for t in tags}) != 1 else next(iter(tags))[0]
        self.by_tag = {kind.TAG[1]: kind for kind in kinds} if self.tag_key is not None else {}

    def from_wire(self, msg: Any, **context: Any) -> Any:
        msg = wire_map(msg, self.what)
        if self.tag_key is not None:
            kind = self.by_tag.get(msg.get(self.tag_key)) if isinstance(msg.get(self.tag_key), str) else None
            if kind is None:
                raise MalformedMessage(self.what, f"{self.tag_key!r} must be one of {sorted(self.by_tag)}")
            return kind.from_wire(msg, **context)
        for kind in self.kinds[:-1]:
            if kind.FIELDS[0].key in msg:
                return kind.from_wire(msg, **context)
        return self.kinds[-1].from_wire(msg, **context)
