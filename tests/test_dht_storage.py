"""Local record storage: later expiration wins, subkeys, deterministic ties, eviction (no network)."""

from __future__ import annotations

import itertools
import random

import pytest

from potluck.dht.records import Record
from potluck.dht.storage import ENTRY_OVERHEAD_BYTES, Storage, merge_records

KEY = 1


def rec(value: bytes, exp: float, subkey=None, key="k") -> Record:
    return Record(key, subkey, value, exp)


@pytest.mark.timeout(10)
def test_a_store_wins_only_with_a_later_expiration():
    s = Storage()
    assert s.store(KEY, rec(b"a", 10), now=0)
    assert not s.store(KEY, rec(b"b", 9), now=0)
    assert s.get(KEY, now=0) == [rec(b"a", 10)]
    assert s.store(KEY, rec(b"c", 11), now=0)
    assert s.get(KEY, now=0) == [rec(b"c", 11)]
    assert s.store(KEY, rec(b"c", 11), now=0)  # the same record again: accepted, nothing changes
    assert not s.store(KEY, rec(b"d", 5), now=6)  # expired records are never held
    assert s.get(KEY, now=11) == [] and len(s) == 0


def _state(records) -> list[tuple]:
    return sorted((str(r.subkey), r.value, r.expiration_time) for r in records)


@pytest.mark.timeout(20)
def test_the_result_depends_on_the_records_received_not_their_arrival_order():
    contenders = [rec(b"x", 10), rec(b"yy", 10), rec(b"a", 10), rec(b"q", 10, subkey="s"),
                  rec(b"r", 10, subkey="s"), rec(b"z", 9, subkey="t")]
    outcomes = set()
    for order in itertools.permutations(contenders):
        s = Storage()
        for r in order:
            s.store(KEY, r, now=0)
        outcomes.add(tuple(_state(s.get(KEY, now=0))))
    assert outcomes == {tuple(_state(merge_records(contenders)))}
    rng = random.Random(1)
    for _ in range(300):  # random mixes of plain values and subkeys, many orders each
        pool = [rec(bytes([rng.randrange(3)]), rng.randrange(1, 6), rng.choice([None, None, "a", "b"]))
                for _ in range(rng.randrange(1, 7))]
        expected = _state(merge_records(pool))
        for _ in range(5):
            rng.shuffle(pool)
            s = Storage()
            for r in pool:
                s.store(KEY, r, now=0)
            assert _state(s.get(KEY, now=0)) == expected, pool


@pytest.mark.timeout(10)
def test_subkeys_form_a_dictionary_whose_entries_expire_separately():
    s = Storage()
    assert s.store(KEY, rec(b"1", 10, subkey="a"), now=0)
    assert s.store(KEY, rec(b"2", 20, subkey="b"), now=0)
    assert s.store(KEY, rec(b"3", 30, subkey=7), now=0)
    assert not s.store(KEY, rec(b"old", 5, subkey="a"), now=0)
    assert {r.subkey for r in s.get(KEY, now=0)} == {"a", "b", 7}
    assert {r.subkey for r in s.get(KEY, now=15)} == {"b", 7}
    assert s.remove_expired(now=25) == 1
    assert {r.subkey for r in s.get(KEY, now=25)} == {7}


@pytest.mark.timeout(10)
def test_plain_value_and_dictionary_compete_on_the_latest_expiration():
    s = Storage()
    s.store(KEY, rec(b"d", 20, subkey="a"), now=0)
    assert not s.store(KEY, rec(b"plain", 20), now=0)  # tie: the dictionary stays
    assert s.store(KEY, rec(b"plain", 21), now=0)
    assert s.get(KEY, now=0) == [rec(b"plain", 21)]
    assert not s.store(KEY, rec(b"d", 20, subkey="a"), now=0)
    assert s.store(KEY, rec(b"d", 21, subkey="a"), now=0)  # tie: the dictionary wins
    assert s.get(KEY, now=0) == [rec(b"d", 21, subkey="a")]


@pytest.mark.timeout(10)
def test_full_storage_evicts_the_records_that_expire_soonest():
    size = len(b"v" * 100) + 1 + ENTRY_OVERHEAD_BYTES  # value + key "k" + overhead
    s = Storage(max_bytes=3 * size)
    for i, exp in enumerate([30, 10, 20]):
        assert s.store(i, rec(b"v" * 100, exp), now=0)
    assert s.total_bytes == 3 * size
    assert not s.store(9, rec(b"v" * 100, 5), now=0)  # expires before everything held: refused
    assert s.store(9, rec(b"v" * 100, 40), now=0)  # evicts the one expiring at 10
    assert s.get(1, now=0) == [] and s.get(9, now=0) and s.get(0, now=0) and s.get(2, now=0)
    assert s.total_bytes <= s.max_bytes
    # replacing a record in place needs no eviction
    assert s.store(9, rec(b"w" * 100, 41), now=0) and s.get(2, now=0)


@pytest.mark.timeout(10)
def test_one_keys_dictionary_is_capped_and_drops_its_soonest_entries():
    size = 10 + 1 + 1 + ENTRY_OVERHEAD_BYTES
    s = Storage(max_key_bytes=3 * size)
    for i, sub in enumerate("abc"):
        assert s.store(KEY, rec(b"x" * 10, 10 + i, subkey=sub), now=0)
    assert not s.store(KEY, rec(b"x" * 10, 5, subkey="d"), now=0)
    assert s.store(KEY, rec(b"x" * 10, 50, subkey="d"), now=0)
    assert {r.subkey for r in s.get(KEY, now=0)} == {"b", "c", "d"}


@pytest.mark.timeout(20)
def test_byte_accounting_stays_exact_under_random_operations():
    rng = random.Random(0)
    s = Storage(max_bytes=40_000, max_key_bytes=5_000)
    now = 0.0
    for step in range(5000):
        now += rng.random() * 0.1
        key = rng.randrange(30)
        sub = rng.choice([None, "a", "b", "c", 1])
        s.store(key, rec(rng.randbytes(rng.randrange(200)), now + rng.random() * 50, subkey=sub), now=now)
        if step % 100 == 0:
            s.remove_expired(now)
        live = [r for k in list(s._slots) for r in s._slots[k].entries()]
        assert s.total_bytes == sum(r.stored_bytes() + ENTRY_OVERHEAD_BYTES for r in live) <= s.max_bytes


@pytest.mark.timeout(10)
def test_merge_keeps_the_best_record_per_subkey():
    merged = merge_records([rec(b"a", 10, "x"), rec(b"b", 12, "x"), rec(b"c", 11, "y"), rec(b"p", 9)])
    assert sorted((r.subkey, r.value) for r in merged) == [("x", b"b"), ("y", b"c")]
    assert merge_records([rec(b"p", 20), rec(b"a", 10, "x")]) == [rec(b"p", 20)]
    assert merge_records([]) == []


def test_holds_recognises_only_the_very_same_live_record():
    """What lets a node skip re-validating a record every replica hands it again."""
    storage = Storage()
    record = Record("k", None, b"v", 10.0, bytes(64))
    assert storage.store(1, record, 0.0)
    assert storage.holds(1, Record("k", None, b"v", 10.0, bytes(64)), 0.0)
    assert not storage.holds(1, Record("k", None, b"v", 10.0, b"\1" * 64), 0.0)  # another signature
    assert not storage.holds(1, Record("k", None, b"w", 10.0, bytes(64)), 0.0)
    assert not storage.holds(1, Record("k", "sub", b"v", 10.0, bytes(64)), 0.0)
    assert not storage.holds(1, record, 10.0)  # expired
