"""The Kademlia routing table and the lookup state machine, as plain logic (no network)."""

from __future__ import annotations

import random

import pytest

from potluck.dht.lookup import Answer, Backoff, Lookup
from potluck.dht.records import Record
from potluck.dht.routing import ID_BITS, RoutingTable, node_id_of
from potluck.net.identity import PeerID


def peer(i: int) -> PeerID:
    return PeerID(i.to_bytes(32, "big"))


def peers(n: int, seed: int = 0) -> list[tuple[PeerID, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = PeerID(rng.randbytes(32))
        out.append((p, node_id_of(p)))
    return out


@pytest.mark.timeout(10)
def test_node_ids_are_sha1_of_the_public_key_and_160_bits():
    p = peer(7)
    import hashlib
    assert node_id_of(p) == int.from_bytes(hashlib.sha1(p.to_bytes()).digest(), "big")
    assert all(0 <= node_id_of(q) < 2**ID_BITS for q, _ in peers(50))


@pytest.mark.timeout(10)
def test_nearest_matches_brute_force_xor_order():
    table = RoutingTable(own_id=node_id_of(peer(0)), bucket_size=20, depth_modulo=5)
    known = peers(2000, seed=1)
    for p, i in known:
        table.add_or_update(p, i, now=0.0)
    rng = random.Random(2)
    for _ in range(20):
        target = rng.getrandbits(ID_BITS)
        got = table.nearest(target, 10)
        everyone = sorted(((i ^ target, p) for p in table for i in [table.node_id(p)]), key=lambda x: x[0])
        assert [p for p, _ in got] == [p for _, p in everyone[:10]]
        excluded = got[0][0]
        assert excluded not in [p for p, _ in table.nearest(target, 10, exclude=[excluded])]



@pytest.mark.timeout(10)
@pytest.mark.parametrize(("size", "k", "b"), [(0, 4, 1), (3, 4, 1), (50, 2, 1), (300, 4, 2), (600, 20, 5)])
def test_nearest_walks_buckets_by_distance_and_still_matches_brute_force(size, k, b):
    """`nearest` ranks only the first buckets in XOR order; the answer must be the true one
    for any count, exclusions, and targets inside and outside the table."""
    own = node_id_of(peer(0))
    table = RoutingTable(own_id=own, bucket_size=k, depth_modulo=b)
    for p, i in peers(size, seed=size):
        table.add_or_update(p, i, now=0.0)
    members = [table.node_id(p) for p in table]
    rng = random.Random(size)
    targets = [own, *rng.sample(members, min(5, len(members))), *(rng.getrandbits(ID_BITS) for _ in range(10))]
    for target in targets:
        truth = sorted(table, key=lambda p, t=target: table.node_id(p) ^ t)
        for count in (1, 2, k, 3 * k, len(truth) + 1):
            assert [p for p, _ in table.nearest(target, count)] == truth[:count]
            dropped = set(rng.sample(truth, min(3, len(truth))))
            kept = [p for p in truth if p not in dropped]
            assert [p for p, _ in table.nearest(target, count, exclude=dropped)] == kept[:count]

@pytest.mark.timeout(10)
def test_surely_closer_counts_only_peers_that_are_closer_and_all_within_half_the_distance():
    table = RoutingTable(own_id=node_id_of(peer(0)), bucket_size=8, depth_modulo=2)
    for p, i in peers(500, seed=3):
        table.add_or_update(p, i, now=0.0)
    members = [table.node_id(p) for p in table]
    rng = random.Random(4)
    for _ in range(200):
        target = rng.choice(members) if rng.random() < 0.3 else rng.getrandbits(ID_BITS)
        distance = rng.choice(members) ^ target if rng.random() < 0.5 else rng.getrandbits(rng.randrange(ID_BITS + 1))
        bound = table.surely_closer(target, distance)
        assert bound <= sum(1 for i in members if i ^ target < distance)
        assert bound >= sum(1 for i in members if 2 * (i ^ target) < distance)
    assert table.surely_closer(members[0], 0) == 0


@pytest.mark.timeout(10)
def test_buckets_split_near_own_id_and_by_depth_modulo_and_never_exceed_k():
    own = node_id_of(peer(0))
    table = RoutingTable(own_id=own, bucket_size=4, depth_modulo=2)
    for p, i in peers(3000, seed=3):
        table.add_or_update(p, i, now=0.0)
    assert all(len(b.nodes) <= 4 for b in table.buckets)
    # buckets tile the whole id space, in order, without gaps
    assert table.buckets[0].lower == 0 and table.buckets[-1].upper == 2**ID_BITS
    assert all(a.upper == b.lower for a, b in zip(table.buckets, table.buckets[1:], strict=False))
    # a bucket that does not hold our id stops splitting at a depth that is a multiple of b
    far = [b for b in table.buckets if not b.covers(own)]
    assert all(b.depth % 2 == 0 or len(b.nodes) < 4 for b in far)
    # the deepest bucket is the one around our own id
    assert table.bucket_for(own).depth == max(b.depth for b in table.buckets)
    # with b=2 a far region keeps up to 2^2 buckets per 2 bits: more than plain Kademlia's one
    assert len(table) > 4 * 160 / 20


@pytest.mark.timeout(10)
def test_full_bucket_keeps_the_oldest_until_a_failed_ping_promotes_the_newest_replacement():
    own = 0
    table = RoutingTable(own_id=own, bucket_size=2, depth_modulo=1)
    high = [(peer(i), (1 << 159) + i) for i in range(1, 6)]  # all in the far half: one bucket
    assert table.add_or_update(*high[0], now=1) is None
    assert table.add_or_update(*high[1], now=2) is None
    assert table.add_or_update(*high[2], now=3) == high[0][0]  # full: ping the least recently seen
    assert table.add_or_update(*high[3], now=4) == high[0][0]
    assert high[2][0] not in table and high[3][0] not in table
    # seeing the oldest again makes it the most recent; the next candidate to ping is the other one
    table.add_or_update(*high[0], now=5)
    assert table.add_or_update(*high[4], now=6) == high[1][0]
    # the pinged peer failed: it goes, and the freshest replacement takes its place
    assert table.remove(high[1][0]) == high[4][0]
    assert high[4][0] in table and high[1][0] not in table


@pytest.mark.timeout(10)
def test_stale_buckets_are_those_not_touched_for_the_interval():
    table = RoutingTable(own_id=0, bucket_size=20, depth_modulo=5, now=0.0)
    assert table.stale_buckets(now=100.0, interval=60.0) == table.buckets
    table.add_or_update(peer(1), 1 << 159, now=90.0)
    assert table.stale_buckets(now=100.0, interval=60.0) == []


# -- lookup state machine ---------------------------------------------------------------------------
class FakeNetwork:
    """Nodes whose routing tables were offered every other node (so each knows its own
    neighbourhood fully, as Kademlia guarantees), answering lookups without sockets."""

    def __init__(self, n: int, k: int, seed: int = 0):
        self.nodes = dict(peers(n, seed))
        self.k = k
        self.values: dict[int, set[PeerID]] = {}
        self.dead: set[PeerID] = set()
        self.tables = {}
        for p, i in self.nodes.items():
            table = RoutingTable(i, bucket_size=k)
            for q, j in self.nodes.items():
                table.add_or_update(q, j, now=0.0)
            self.tables[p] = table

    def answer(self, p: PeerID, targets: list[int]) -> dict[int, Answer]:
        out = {}
        for t in targets:
            recs = [Record("k", None, b"v", 1.0)] if p in self.values.get(t, ()) else []
            out[t] = Answer(self.tables[p].nearest(t, self.k), recs)
        return out

    def run(self, lookup: Lookup) -> int:
        rounds = 0
        while not lookup.done:
            plan = lookup.next_requests()
            if not plan:
                break
            rounds += 1
            for p, targets in plan.items():
                if p in self.dead:
                    lookup.on_failure(p)
                else:
                    lookup.on_response(p, targets, self.answer(p, targets))
        return rounds


@pytest.mark.timeout(30)
def test_lookup_converges_on_the_true_k_closest_for_several_targets_at_once():
    net = FakeNetwork(300, k=8)
    start = next(iter(net.nodes))
    rng = random.Random(5)
    targets = [rng.getrandbits(ID_BITS) for _ in range(5)]
    lookup = Lookup({t: net.tables[start].nearest(t, 8) for t in targets}, k=8, alpha=3,
                    stop_on_value=False, self_id=net.nodes[start])
    net.run(lookup)
    for t in targets:
        truth = sorted((i ^ t, p) for p, i in net.nodes.items() if p != start)[:8]
        assert lookup.result(t).nearest[:8] == [p for _, p in truth]


@pytest.mark.timeout(30)
def test_lookup_routes_around_dead_peers_and_stops_at_the_first_value():
    net = FakeNetwork(300, k=8, seed=1)
    everyone = list(net.nodes)
    rng = random.Random(6)
    net.dead = set(rng.sample(everyone, 100))
    start = next(p for p in everyone if p not in net.dead)
    target = rng.getrandbits(ID_BITS)
    holders = [p for _, p in sorted((i ^ target, p) for p, i in net.nodes.items() if p not in net.dead)[:3]]
    net.values[target] = set(holders)
    lookup = Lookup({target: net.tables[start].nearest(target, 8)}, k=8, alpha=3, stop_on_value=True,
                    self_id=net.nodes[start])
    net.run(lookup)
    result = lookup.result(target)
    assert result.records and result.records[0][0] in holders
    assert result.hops is not None and result.hops >= 1
    assert not set(result.nearest) & net.dead


@pytest.mark.timeout(10)
def test_lookup_asks_one_peer_about_several_targets_in_one_request_and_respects_alpha():
    p, i = peers(1)[0]
    lookup = Lookup({1: [(p, i)], 2: [(p, i)], 3: [(p, i)]}, k=4, alpha=1, stop_on_value=False)
    plan = lookup.next_requests()
    assert plan == {p: [1, 2, 3]}
    assert lookup.next_requests() == {}  # alpha=1 and one request in flight per target
    lookup.on_response(p, [1, 2, 3], {})
    assert lookup.next_requests() == {} and lookup.done


@pytest.mark.timeout(10)
def test_unusable_peers_are_put_aside_and_backoff_grows_exponentially():
    (a, ia), (b, ib) = peers(2)
    lookup = Lookup({5: [(a, ia), (b, ib)]}, k=4, alpha=3, stop_on_value=False, usable=lambda p: p != a)
    assert lookup.next_requests() == {b: [5]}
    backoff = Backoff(base=1.0, cap=10.0)
    assert backoff.failed(a, now=0.0) == 1 and backoff.blocked(a, 0.5) and not backoff.blocked(a, 1.0)
    backoff.failed(a, now=1.0)
    assert backoff.blocked(a, 2.5) and not backoff.blocked(a, 3.0)
    for _ in range(10):
        backoff.failed(a, now=3.0)
    assert not backoff.blocked(a, 13.0)  # capped
    backoff.succeeded(a)
    assert backoff.failures(a) == 0 and not backoff.blocked(a, 3.0)


@pytest.mark.timeout(10)
def test_a_slow_peer_frees_its_slot_but_its_late_answer_still_counts():
    (a, ia), (b, ib), (c, ic) = peers(3, seed=9)
    lookup = Lookup({5: [(a, ia), (b, ib)]}, k=4, alpha=1, stop_on_value=True)
    first = lookup.next_requests()
    (slow_peer,) = first
    other = b if slow_peer == a else a
    lookup.on_slow(slow_peer, [5])
    assert lookup.next_requests() == {other: [5]}  # the slot went to the next candidate
    lookup.on_response(other, [5], {5: Answer([(c, ic)])})
    late = Record("k", None, b"v", 1.0)
    lookup.on_response(slow_peer, [5], {5: Answer([], [late])})
    assert lookup.done and lookup.result(5).records == [(slow_peer, [late])]
