"""The shared field checks of every protocol's `from_wire` (core.wire, net.wire)."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest

from potluck.core.errors import MalformedMessage
from potluck.core.wire import (
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
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.identity import Identity
from potluck.net.wire import addresses_to_wire, addresses_value, peer_id_value

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
