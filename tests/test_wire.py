"""The shared field checks of every protocol's `from_wire` (core.wire, net.wire), and the declared
fields built on them."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import msgpack
import pytest

from potluck.core.errors import MalformedMessage
from potluck.core.wire import (
    Bytes,
    Dict,
    Int,
    List,
    Message,
    Nested,
    Number,
    Raw,
    Text,
    bool_field,
    bytes_field,
    encoded_value,
    int_field,
    int_value,
    list_field,
    number_field,
    text_field,
    wire_map,
)
from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import Identity, PeerID
from potluck.net.wire import (
    AddressesField,
    AddressField,
    PeerIdField,
    addresses_to_wire,
    addresses_value,
    peer_id_value,
)

PEER = Identity.generate().peer_id


def refused(check, *args, **kwargs) -> str:
    with pytest.raises(MalformedMessage) as caught:
        check(*args, **kwargs)
    assert str(caught.value).startswith("malformed thing"), caught.value
    return caught.value.field


@pytest.mark.parametrize("value", [True, 3.0, "1", None, -1, 8])
def test_int_checks_refuse_other_types_booleans_and_values_out_of_range(value):
    assert refused(int_field, {"k": value}, "k", "thing", 0, 8) == "'k' must be an integer in [0, 8)"
    assert refused(int_value, value, "k", "thing", 0, 8).startswith("'k'")
    assert int_field({"k": 7}, "k", "thing", 0, 8) == 7


@pytest.mark.parametrize("value, kwargs", [
    (-1.0, {}), (math.nan, {}), (math.inf, {"signed": True}), (0, {"positive": True}), (True, {}), ("1", {}),
    (None, {}),
])
def test_number_field_refuses_non_finite_negative_and_non_numbers(value, kwargs):
    assert refused(number_field, {"k": value}, "k", "thing", **kwargs).startswith("'k' must be a finite ")


def test_number_field_reads_absent_keys_as_the_default_and_none_as_none_if_optional():
    assert number_field({}, "k", "thing", default=2.5) == 2.5
    assert number_field({}, "k", "thing", optional=True) is None
    assert number_field({"k": -3}, "k", "thing", signed=True) == -3.0
    refused(number_field, {"k": None}, "k", "thing", default=2.5)  # sent as None: not a number


def test_maps_booleans_text_and_bytes_are_checked_by_type_and_size():
    assert refused(wire_map, [1], "thing") == "not a map"
    assert wire_map(MappingProxyType({"a": 1}), "thing")["a"] == 1
    assert refused(bool_field, {"k": 1}, "k", "thing") == "'k' must be a boolean"
    assert refused(text_field, {"k": "abc"}, "k", "thing", 2).startswith("'k'")
    assert text_field({}, "k", "thing", 2, optional=True) is None
    assert refused(bytes_field, {"k": b"abc"}, "k", "thing", 2).startswith("'k'")
    assert refused(bytes_field, {"k": b"a"}, "k", "thing", 2, exact=True).startswith("'k'")


def test_lists_are_capped_and_each_item_checked_under_the_list_key():
    assert list_field({"k": (1, 2)}, "k", "thing", 2) == [1, 2]  # loopback passes tuples as sent
    assert refused(list_field, {"k": [1, 2, 3]}, "k", "thing", 2) == "'k' must be a list of at most 2 items"
    assert refused(list_field, {"k": [1]}, "k", "thing", 2, length=2) == "'k' must be a list of 2 items"
    item = lambda v: int_value(v, "k", "thing", 0, 2)  # noqa: E731
    assert list_field({"k": [0, 1]}, "k", "thing", 2, each=item) == [0, 1]
    assert refused(list_field, {"k": [0, 5]}, "k", "thing", 2, each=item).startswith("'k'")


def test_opaque_metadata_is_capped_by_its_encoded_size():
    assert encoded_value({"a": [1, 2]}, "meta", "thing", 100) == {"a": [1, 2]}
    assert refused(encoded_value, "x" * 200, "meta", "thing", 100).startswith("'meta' must encode")
    assert refused(encoded_value, object(), "meta", "thing", 100).startswith("'meta' cannot be encoded")


def test_peer_ids_parse_in_text_or_raw_form_only_as_asked():
    assert peer_id_value(str(PEER), "p", "thing") == PEER
    assert peer_id_value(PEER.to_bytes(), "p", "thing", raw=True) == PEER
    assert refused(peer_id_value, PEER.to_bytes(), "p", "thing").startswith("'p' must be a peer id")
    assert refused(peer_id_value, str(PEER), "p", "thing", raw=True).startswith("'p' must be a peer id")


def test_addresses_must_parse_and_are_capped_where_sent_and_where_received():
    good = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(MAX_ADDRESSES_PER_PEER + 1)]
    assert addresses_to_wire(good) == tuple(good[:MAX_ADDRESSES_PER_PEER])
    assert addresses_value(addresses_to_wire(good), "a", "thing") == tuple(good[:MAX_ADDRESSES_PER_PEER])
    assert refused(addresses_value, good, "a", "thing").startswith("'a'")
    assert refused(addresses_value, ["/ip4/999.0.0.1/tcp/1"], "a", "thing").startswith("'a' must hold addresses")
    assert refused(addresses_value, [7], "a", "thing").startswith("'a' must hold addresses")


class Introduction(Message, what="thing"):
    peer: PeerID = PeerIdField()
    key: PeerID = PeerIdField("k", raw=True)
    at: str | None = AddressField(default=None)
    addresses: tuple[str, ...] = AddressesField("addrs", max_items=2, default=())


def test_declared_peer_ids_and_addresses_round_trip_in_their_wire_forms_and_are_checked():
    message = Introduction(PEER, PEER, "/ip4/10.0.0.1/tcp/1", ("/emu/3",))
    wire = message.to_wire()
    assert wire == {"peer": str(PEER), "k": PEER.to_bytes(), "at": "/ip4/10.0.0.1/tcp/1", "addrs": ("/emu/3",)}
    assert Introduction.from_wire(msgpack.unpackb(msgpack.packb(wire), raw=False)) == message
    assert Introduction(PEER, PEER).to_wire() == {"peer": str(PEER), "k": PEER.to_bytes()}
    for change, field in [({"peer": PEER.to_bytes()}, "'peer' must be a peer id"),
                          ({"k": str(PEER)}, "'k' must be a peer id"),
                          ({"at": "/ip4/999.0.0.1/tcp/1"}, "'at' must be an address"),
                          ({"addrs": ["/emu/1"] * 3}, "'addrs' must be a list of at most 2 items"),
                          ({"addrs": [7]}, "'addrs' must hold addresses")]:
        assert refused(Introduction.from_wire, {**wire, **change}).startswith(field)


class Statement(Message, what="thing", packed=64):
    says: str = Text("s", 32)
    signature: bytes = Bytes("sig", 4, exact=True)
    note: str = Text("n", 8, default="")


def test_a_packed_message_travels_as_bytes_with_exactly_its_declared_keys():
    statement = Statement("hello", b"abcd")
    wire = statement.to_wire()
    assert wire == msgpack.packb({"s": "hello", "sig": b"abcd"}) and Statement.from_wire(wire) == statement
    assert Statement.from_wire(Statement("hi", b"abcd", "ps").to_wire()).note == "ps"
    assert refused(Statement.from_wire, {"s": "hello", "sig": b"abcd"}).startswith("a thing is bytes")
    assert refused(Statement.from_wire, msgpack.packb({"s": "x" * 80, "sig": b"abcd"})).startswith("95 bytes, more than the 64")
    assert refused(Statement.from_wire, b"\xc1").startswith("not msgpack")
    assert refused(Statement.from_wire, msgpack.packb([1])) == "a thing is a msgpack map"
    for keys in [{"s": "hello"}, {"s": "hello", "sig": b"abcd", "extra": 1}]:
        assert refused(Statement.from_wire, msgpack.packb(keys)).startswith("a thing has exactly the keys ['s', 'sig']")
    assert refused(Statement.from_wire, msgpack.packb({"s": 5, "sig": b"abcd"})).startswith("'s' must be a string")


class Signed(Message, what="thing", exact=True):
    says: str = Text("s", 32)
    signature: bytes = Bytes("sig", 4, exact=True)
    note: str = Text("n", 8, default="")


def test_an_exact_map_has_exactly_its_declared_keys_and_is_no_packed_document():
    signed = Signed("hello", b"abcd")
    assert signed.to_wire() == {"s": "hello", "sig": b"abcd"} and Signed.from_wire(signed.to_wire()) == signed
    assert Signed.from_wire(MappingProxyType({"s": "hi", "sig": b"abcd", "n": "ps"})).note == "ps"
    exactly = "a thing has exactly the keys ['s', 'sig'], and may have ['n']"
    for wire in [{"s": "hello"}, {"s": "hello", "sig": b"abcd", "extra": 1}, ["hello", b"abcd"], b"\x80"]:
        assert refused(Signed.from_wire, wire) == exactly
    assert refused(Signed.from_wire, {"s": 5, "sig": b"abcd"}).startswith("'s' must be a string")
    with pytest.raises(TypeError, match="exact"):
        class Row(Message, positional=True, exact=True):
            a: int = Int()


class Readings(Message, what="thing"):
    steps: tuple[int, ...] = List("i", Int(None, 0, 10), 4)
    weights: tuple[float, ...] = List("w", Number(), length="n")


def test_lists_of_plain_items_pass_in_one_loop_and_still_name_a_wrong_item():
    readings = Readings((1, 2, 9), (0.5, 2.0))
    assert Readings.from_wire(readings.to_wire(), n=2) == readings
    assert Readings.from_wire({"i": [1], "w": [1, 2]}, n=2).weights == (1.0, 2.0)  # ints read as floats
    assert Readings.from_wire({"i": (3,), "w": (1.0,)}, n=1).steps == (3,)  # loopback's tuples
    for wire, field in [({"i": [1, 10], "w": []}, "'i' must be an integer in [0, 10)"),
                        ({"i": [True], "w": []}, "'i' must be an integer in [0, 10)"),
                        ({"i": [0] * 5, "w": []}, "'i' must be a list of at most 4 items"),
                        ({"i": [], "w": [math.nan]}, "'w' must be a finite non-negative number"),
                        ({"i": [], "w": [1.0, 2.0]}, "'w' must be a list of 1 items")]:
        assert refused(Readings.from_wire, wire, n=1) == field


class Greeting(Message, what="thing"):
    addresses: tuple[Multiaddr, ...] = AddressesField("addrs", max_items=2, parsed=True)


def test_parsed_addresses_are_read_as_multiaddrs_and_sent_as_text_up_to_their_cap():
    addresses = tuple(Multiaddr.parse(f"/ip4/10.0.0.{i}/tcp/1") for i in range(3))
    wire = Greeting(addresses).to_wire()
    assert wire == {"addrs": ["/ip4/10.0.0.0/tcp/1", "/ip4/10.0.0.1/tcp/1"]}
    assert Greeting.from_wire(wire) == Greeting(addresses[:2])
    assert refused(Greeting.from_wire, {"addrs": ["/emu/1"] * 3}).startswith("'addrs' must be a list of at most 2")
    assert refused(Greeting.from_wire, {"addrs": ["/nonsense"]}).startswith("'addrs' must hold addresses")


class Pair(Message, what="pair", positional=True):
    a: int = Int(None, 0, 10)
    b: str = Text(max_chars=4)


class Pairs(Message, what="thing"):
    pairs: tuple[Pair, ...] = List("p", Nested(None, Pair), 3)
    outcomes: tuple[bool | str, ...] = List("o", Raw(kind=(bool, str), kind_name="True, False or why"), length="n")


def test_lists_of_messages_and_of_typed_raw_values_name_the_list_key_and_the_inner_one():
    pairs = Pairs((Pair(1, "a"), Pair(2, "b")), (True, "no"))
    assert pairs.to_wire() == {"p": [[1, "a"], [2, "b"]], "o": (True, "no")}
    assert Pairs.from_wire(msgpack.unpackb(msgpack.packb(pairs.to_wire())), n=2) == pairs
    for wire, field in [({"p": [[1, "a"], [10, "b"]], "o": []}, "'p': 'a' must be an integer in [0, 10)"),
                        ({"p": [[1]], "o": []}, "'p': not a list of 2 items"),
                        ({"p": [], "o": [1]}, "'o' must be True, False or why"),
                        ({"p": [], "o": [True, None]}, "'o' must be True, False or why")]:
        assert refused(Pairs.from_wire, wire, n=len(wire["o"])) == field


class Tally(Message, what="thing"):
    count: int = Int("n")
    seen: tuple[int, ...] = List("s", Int(), 4, default=())
    names: dict = Dict("m", Int(), Text(max_chars=4), 4)

    def __post_init__(self) -> None:
        if self.count == 13:
            raise ValueError("unlucky")


def test_a_message_is_built_as_its_dataclass_would_be():
    tally = Tally(1)
    assert (tally.seen, tally.names) == ((), {}) and Tally(2).names is not tally.names  # a fresh default
    assert Tally(1, (2,), {3: "c"}) == Tally(count=1, names={3: "c"}, seen=(2,)) != tally
    assert dataclasses.replace(tally, count=5) == Tally(5) and Tally.from_wire({"n": 1}) == tally
    with pytest.raises(ValueError, match="unlucky"):  # __post_init__ runs, from_wire's too
        Tally.from_wire({"n": 13})
    with pytest.raises(dataclasses.FrozenInstanceError):
        tally.count = 2
    with pytest.raises(TypeError):
        Tally()
