"""Local record storage: later expiration wins, subkeys, deterministic ties, eviction (no network)."""

from __future__ import annotations

import itertools
import random

import pytest

from potluck.dht.records import Record, owner_marker
from potluck.dht.storage import ENTRY_OVERHEAD_BYTES, SOURCE_QUOTA_DIVISOR, Storage, merge_records
from potluck.net.identity import PeerID
from potluck.net.origins import origin_of

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


def _check_books(s: Storage) -> None:
    """Every byte counter equals what is held: node-wide, per key and per source; no source is kept
    without a record; every held record has a live entry in its source's heap; quotas hold."""
    live = [(k, r) for k in list(s._slots) for r in s._slots[k].entries()]
    cost = {id(r): r.stored_bytes() + ENTRY_OVERHEAD_BYTES for _, r in live}
    assert s.total_bytes == sum(cost.values()) <= s.max_bytes
    for slot in s._slots.values():
        assert slot.bytes == sum(cost[id(r)] for r in slot.entries()) <= s.max_key_bytes
        assert set(slot.meta) == {r.subkey for r in slot.entries()}
    by_source: dict = {}
    for k, r in live:
        seq, source = s._slots[k].meta[r.subkey]
        by_source[source] = by_source.get(source, 0) + cost[id(r)]
        assert any(item[1] == seq for item in s._sources[source].heap)
    assert s.bytes_by_source() == by_source  # a source that holds nothing has no entry at all
    assert all(state.count > 0 for state in s._sources.values())
    assert all(b <= s.max_source_bytes for source, b in by_source.items() if source is not None)
    assert s._heap_entries == sum(len(state.heap) for state in s._sources.values())
    expiring = {item[1] for item in s._expiry}
    assert all(s._slots[k].meta[r.subkey][0] in expiring for k, r in live)
    biggest: dict = {}
    for b, _, p in s._largest:
        biggest[p] = max(biggest.get(p, 0), -b)
    by_subnet: dict = {}
    for source, state in s._sources.items():
        by_subnet.setdefault(state.subnet, []).append(source)
    assert set(by_subnet) == set(s._subnets)  # a subnet that holds nothing has no entry at all
    for subnet, group in s._subnets.items():  # the largest heaps never understate a subnet or a source
        assert biggest[subnet] >= group.bytes == sum(s._sources[p].bytes for p in by_subnet[subnet])
        assert group.sources == len(by_subnet[subnet])
        largest: dict = {}
        for b, _, p in group.largest:
            largest[p] = max(largest.get(p, 0), -b)
        assert all(largest[p] >= s._sources[p].bytes for p in by_subnet[subnet])
    assert all(b <= s.max_subnet_bytes for subnet, b in s.bytes_by_subnet().items() if subnet is not None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_bytes, max_source_bytes, max_subnet_bytes, origins",
                         [(40_000, 12_000, None, False), (15_000, 5_000, None, False), (20_000, 4_000, None, False),
                          (20_000, 6_000, 8_000, True), (12_000, 6_000, 6_000, True)],
                         ids=["roomy", "often-full", "often-over-quota", "subnets", "subnets-often-full"])
def test_byte_accounting_stays_exact_under_random_operations(max_bytes, max_source_bytes, max_subnet_bytes, origins):
    rng = random.Random(0)
    peers = [PeerID(bytes([i + 1]) * 32) for i in range(6)]
    # with origins: the first three peers share a subnet (two of them an address), the others have their own
    where = dict(zip(peers, [origin_of(ip) for ip in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.1.1", "10.0.2.1",
                                                      "10.0.3.1")], strict=True))
    s = Storage(max_bytes=max_bytes, max_key_bytes=5_000, max_source_bytes=max_source_bytes,
                max_subnet_bytes=max_subnet_bytes)
    now = 0.0
    for step in range(5000):
        now += rng.random() * 0.1
        key = rng.randrange(30)
        sub = rng.choice([None, "a", "b", "c", 1])
        sender = rng.choice([None, *peers])
        name = "k"
        if key % 3 == 0:  # owned keys: charged to their owner whoever sends them
            name = f"k{owner_marker(peers[key % 6])}"
        s.store(key, Record(name, sub, rng.randbytes(rng.randrange(200)), now + rng.random() * 50), now=now,
                source=sender, origin=where[sender] if origins and sender is not None else None)
        if step % 100 == 0:
            s.remove_expired(now)
        _check_books(s)
    s.remove_expired(now + 100)
    assert s.total_bytes == 0 and s.bytes_by_source() == {} and not s._slots and s._heap_entries == 0


A, B, C = (PeerID(bytes([i]) * 32) for i in (7, 8, 9))
SIZE = 100 + 1 + ENTRY_OVERHEAD_BYTES  # a 100-byte value under key "k"


def v(exp: float, subkey=None, key="k") -> Record:
    return Record(key, subkey, b"v" * 100, exp)


@pytest.mark.timeout(10)
def test_a_source_over_its_quota_evicts_its_own_soonest_records_or_is_refused():
    s = Storage(max_source_bytes=3 * SIZE)
    assert s.max_bytes // SOURCE_QUOTA_DIVISOR == Storage().max_source_bytes
    for i, exp in enumerate([10, 20, 30]):
        assert s.store(i, v(exp), now=0, source=A)
    assert s.store(10, v(5), now=0, source=B)  # another source is not affected
    assert not s.store(3, v(9), now=0, source=A)  # A's records all expire later: refused
    assert s.store(3, v(25), now=0, source=A)  # evicts A's record expiring at 10, not B's at 5
    assert s.get(0, now=0) == [] and s.get(10, now=0) and s.get(1, now=0)
    assert s.bytes_by_source() == {A: 3 * SIZE, B: SIZE}
    assert not s.store(4, Record("k", None, b"v" * (3 * SIZE), 99), now=0, source=A)  # over the quota alone
    assert s.bytes_by_source() == {A: 3 * SIZE, B: SIZE}
    # replacing one's own record in place needs no room
    assert s.store(3, Record("k", None, b"w" * 100, 26), now=0, source=A)


@pytest.mark.timeout(10)
def test_owned_records_are_charged_to_their_owner_whoever_forwards_them():
    owned = [Record(f"p{i}{owner_marker(A)}", None, b"v" * 100, 10 + i) for i in range(3)]
    s = Storage(max_source_bytes=2 * (owned[0].stored_bytes() + ENTRY_OVERHEAD_BYTES))
    assert s.store(0, owned[0], now=0, source=B)
    assert s.store(1, owned[1], now=0, source=C)
    assert s.store(5, v(50), now=0, source=B)
    assert set(s.bytes_by_source()) == {A, B} and s.bytes_by_source()[B] == SIZE
    assert s.store(2, owned[2], now=0, source=B)  # A's quota: A's soonest record goes
    assert s.get(0, now=0) == [] and s.get(1, now=0) and s.get(2, now=0) and s.get(5, now=0)
    assert s.store(6, Record("k", f"{owner_marker(A)}", b"x", 60), now=0)  # an owned subkey, stored locally
    assert s.get(1, now=0) == []


@pytest.mark.timeout(10)
def test_this_nodes_own_unowned_records_have_no_quota():
    s = Storage(max_bytes=10 * SIZE, max_source_bytes=SIZE)
    for i in range(5):
        assert s.store(i, v(10 + i), now=0)
    assert s.bytes_by_source() == {None: 5 * SIZE}


@pytest.mark.timeout(10)
def test_a_full_node_evicts_from_the_largest_source():
    s = Storage(max_bytes=10 * SIZE, max_source_bytes=10 * SIZE)
    for i in range(6):
        assert s.store(i, v(100 + i), now=0, source=A)  # the flooder: long-lived records
    for i in range(3):
        assert s.store(10 + i, v(10 + i), now=0, source=B)  # honest ones, expiring sooner
    assert s.store(20, v(5), now=0)  # this node's own
    assert s.total_bytes == s.max_bytes
    assert s.store(30, v(50), now=0, source=C)  # A is the largest: its soonest record goes, whatever its expiration
    assert s.get(0, now=0) == [] and all(s.get(10 + i, now=0) for i in range(3)) and s.get(20, now=0)
    assert s.bytes_by_source() == {A: 5 * SIZE, B: 3 * SIZE, None: SIZE, C: SIZE}
    # the largest source's own newcomer displaces only its own records that expire before it
    assert not s.store(40, v(99), now=0, source=A)
    assert s.store(40, v(200), now=0, source=A) and s.get(1, now=0) == []
    assert all(s.get(10 + i, now=0) for i in range(3))
    # C grows: A, the largest, pays; then C itself, with its own records expiring before its newcomer
    for i in range(41, 44):
        assert s.store(i, v(300 + i), now=0, source=C)
    assert s.bytes_by_source() == {A: 3 * SIZE, B: 3 * SIZE, None: SIZE, C: 3 * SIZE} and s.get(30, now=0) == []
    assert not s.store(50, v(5), now=0, source=C)  # C would be the largest and holds nothing sooner
    assert s.store(51, v(1000), now=0, source=B) and s.get(10, now=0) == []  # B would be: its own soonest goes
    assert s.bytes_by_source() == {A: 3 * SIZE, B: 3 * SIZE, None: SIZE, C: 3 * SIZE}
    _check_books(s)


@pytest.mark.timeout(10)
def test_a_refused_store_changes_nothing():
    size = 10 + 1 + 1 + ENTRY_OVERHEAD_BYTES
    s = Storage(max_key_bytes=2 * size, max_source_bytes=2 * size)
    assert s.store(KEY, rec(b"x" * 10, 10, subkey="a"), now=0, source=B)
    assert s.store(KEY, rec(b"x" * 10, 40, subkey="b"), now=0, source=B)
    assert s.store(2, rec(b"x" * 10, 30, subkey="z"), now=0, source=A)
    assert s.store(3, rec(b"x" * 10, 35, subkey="z"), now=0, source=A)
    # room in the key would mean dropping "a", but A's quota cannot make room: nothing happens
    assert not s.store(KEY, rec(b"x" * 10, 20, subkey="c"), now=0, source=A)
    assert {r.subkey for r in s.get(KEY, now=0)} == {"a", "b"}
    _check_books(s)
    assert s.store(KEY, rec(b"x" * 10, 50, subkey="c"), now=0, source=A)  # A's record at 30 and key entry "a" go
    assert {r.subkey for r in s.get(KEY, now=0)} == {"b", "c"} and s.get(2, now=0) == [] and s.get(3, now=0)
    _check_books(s)


@pytest.mark.timeout(10)
def test_a_source_leaves_no_trace_once_its_records_are_gone():
    s = Storage(max_bytes=4 * SIZE, max_source_bytes=4 * SIZE)
    for round_ in range(50):
        peer = PeerID(bytes([round_ + 1]) * 32)
        assert s.store(round_ % 3, v(round_ + 1.5), now=round_, source=peer)
        assert s.store(100 + round_, Record(f"k{owner_marker(peer)}", "s", b"v", round_ + 1.2), now=round_, source=C)
        s.remove_expired(round_ + 0.5)
        assert len(s.bytes_by_source()) <= 4 and len(s._sources) <= 4
    s.remove_expired(1000)
    assert s.bytes_by_source() == {} and s._sources == {} and s._heap_entries == 0


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
