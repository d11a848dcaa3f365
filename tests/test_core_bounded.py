"""potluck.core.bounded: caps on remembered things."""

from __future__ import annotations

from collections import OrderedDict

from potluck.core.bounded import drop_oldest


def test_drop_oldest_forgets_the_first_inserted_keys_of_a_dict():
    d = {"a": 1, "b": 2, "c": 3, "d": 4}
    d["a"] = 5  # a new value keeps its place: still the oldest
    drop_oldest(d, 2)
    assert list(d.items()) == [("c", 3), ("d", 4)]
    d.pop("c")
    d["c"] = 6  # re-inserted: now the newest
    drop_oldest(d, 1)
    assert d == {"c": 6}


def test_drop_oldest_leaves_a_mapping_within_its_cap_alone_and_can_empty_one():
    d = {1: None, 2: None}
    drop_oldest(d, 2)
    drop_oldest(d, 5)
    assert list(d) == [1, 2]
    drop_oldest(d, 0)
    assert d == {}
    drop_oldest(d, 0)  # empty already


def test_drop_oldest_follows_move_to_end_in_an_ordered_dict():
    d = OrderedDict((k, k) for k in "abcd")
    d.move_to_end("a")  # least recently used first: b, c, d, a
    drop_oldest(d, 2)
    assert list(d) == ["d", "a"]
