"""The DHT on the emulated network under the virtual clock: swarms of up to 1,000 peers in one loop.

Connections get no keepalive here (`keepalive_interval=None`): with tens of thousands of emulated
connections its timers would dominate the run, and crashes in these tests are loud (reset at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics

import pytest

from potluck.core.errors import RemoteError
from potluck.core.serialization import dumps
from potluck.core.virtual_time import run_virtual
from potluck.dht import (
    DHT,
    DHTConfig,
    ExpirationTooFar,
    NotOwner,
    ValueTooLarge,
    event_loop_clock,
    key_id_of,
    owner_marker,
    protocol,
)
from potluck.dht.records import Record
from potluck.dht.routing import node_id_of
from potluck.dht.validation import sign_record
from potluck.net.emulated import NAT_KINDS, EmulatedNetwork
from potluck.net.reachability import DialbackService, check_reachability

LATENCY = 0.01  # 10 ms one way between any two emulated peers


async def build_swarm(net: EmulatedNetwork, n: int, *, seed: int = 0, config: DHTConfig | None = None,
                      client_mode: bool = False, first: list[DHT] | None = None, natted: float = 0.0) -> list[DHT]:
    """`n` DHT peers joining one by one, each through a random public peer already in (or in `first`).
    They publish no peer records: these tests follow the DHT's own records one by one (peer
    records have their own tests in test_peer_records.py). `natted`: the share of peers behind
    NAT (eim or edm): each asks the peer it joins through to dial it back (`net.reachability`),
    is found private and joins as a DHT client, as `potluck.Peer` does."""
    config = dataclasses.replace(config or DHTConfig(), peer_record_ttl=None)
    rng = random.Random(seed)
    clock = event_loop_clock()
    dhts: list[DHT] = []
    public: list[DHT] = []  # the peers others can join through
    for _ in range(n):
        nat = rng.choice(NAT_KINDS) if natted and public and rng.random() < natted else None
        transport = net.transport(keepalive_interval=None, client_mode=client_mode, nat=nat)
        await transport.start()
        pool = public if (public and not client_mode) else (first or dhts)
        boot = [rng.choice(pool).node.transport.addresses[0]] if pool else []
        if natted and nat is None:
            DialbackService(transport).start()
        if nat is not None:
            report = await check_reachability(transport, [await transport.connect(boot[0])])
            assert report.verdict == "private", report
            transport.set_public(False)
            for conn in transport.open_connections():  # its handshake said it was public
                conn.close("found private")
        dhts.append(await DHT.create(transport, clock=clock, initial_peers=boot, config=config))
        if not dhts[-1].node.client_mode:
            public.append(dhts[-1])
    return dhts


async def shutdown(dhts: list[DHT]) -> None:
    for dht in dhts:
        await dht.ashutdown()
        await dht.node.transport.close()


def true_nearest(dhts: list[DHT], key: str, count: int) -> list[DHT]:
    target = key_id_of(key)
    return sorted(dhts, key=lambda d: d.node.node_id ^ target)[:count]


@pytest.mark.timeout(60)
def test_store_get_subkeys_and_expiration_across_a_small_swarm():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=1)
        dhts = await build_swarm(net, 30, seed=1)
        a, b, c = dhts[3], dhts[17], dhts[29]
        now = a.get_time()
        assert await a.astore("model", {"layers": 12, "name": "tiny"}, now + 60)
        got = await b.aget("model")
        assert got.value == {"layers": 12, "name": "tiny"} and got.expiration_time == now + 60
        # a store with an earlier expiration loses everywhere; a later one wins
        assert not await c.astore("model", "older", now + 30)
        assert (await b.aget("model", latest=True)).value == {"layers": 12, "name": "tiny"}
        assert await c.astore("model", "newer", now + 90)
        assert (await a.aget("model", latest=True)).value == "newer"
        # subkeys from different peers form one dictionary; each entry expires on its own
        assert await a.astore("group", "addr-a", now + 20, subkey="a")
        assert await b.astore("group", "addr-b", now + 40, subkey="b")
        assert await c.astore("group", "addr-c", now + 60, subkey=3)
        group = await dhts[0].aget("group", latest=True)
        assert {s: v.value for s, v in group.value.items()} == {"a": "addr-a", "b": "addr-b", 3: "addr-c"}
        assert group.expiration_time == now + 60
        # many keys in one traversal
        assert await a.astore_many([(f"k{i}", i, now + 50) for i in range(10)]) == [True] * 10
        many = await c.aget_many([f"k{i}" for i in range(10)] + ["missing"])
        assert [many[f"k{i}"].value for i in range(10)] == list(range(10)) and many["missing"] is None
        # time passes (virtual): entries disappear as they expire
        await asyncio.sleep(30)
        group = await dhts[5].aget("group", latest=True)
        assert set(group.value) == {"b", 3}
        await asyncio.sleep(100)
        assert await dhts[8].aget("group", latest=True) is None
        assert await dhts[8].aget("model", latest=True) is None
        assert await a.astore("past", 1, a.get_time() - 1) is False  # already expired: not stored
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_client_mode_peers_store_and_get_but_never_enter_routing_tables():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=2)
        servers = await build_swarm(net, 20, seed=2)
        clients = await build_swarm(net, 3, seed=3, client_mode=True, first=servers)
        now = clients[0].get_time()
        assert await clients[0].astore("from-client", [1, 2, 3], now + 60)
        assert (await clients[1].aget("from-client")).value == [1, 2, 3]
        assert (await servers[4].aget("from-client")).value == [1, 2, 3]
        client_ids = {c.peer_id for c in clients}
        for dht in servers + clients:
            assert not client_ids & set(dht.node.routing)
        assert all(len(c.node.storage) == 0 for c in clients)  # clients hold no records
        await shutdown(servers + clients)

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_newly_joined_peer_receives_the_keys_it_is_now_responsible_for():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=4)
        config = DHTConfig(replicas=5)  # few replicas, so the newcomer displaces someone
        dhts = await build_swarm(net, 120, seed=4, config=config)
        now = dhts[0].get_time()
        keys = [f"key-{i}" for i in range(300)]
        writer = dhts[7]
        assert all(await writer.astore_many([(k, k.upper(), now + 3600) for k in keys]))
        await settle(dhts)
        newcomer = (await build_swarm(net, 1, seed=5, config=config, first=dhts))[0]
        everyone = dhts + [newcomer]
        for dht in everyone:
            await dht.node.wait_idle()
        responsible = [k for k in keys if newcomer in true_nearest(everyone, k, 5)]
        assert len(responsible) >= 5  # the scenario exercises the hand-off
        held = {r.key for _, records in newcomer.node.storage.items(newcomer.get_time()) for r in records}
        assert set(responsible) <= held, sorted(set(responsible) - held)
        # and it serves them: the only copy left is enough once the others are gone
        for key in responsible[:3]:
            for other in true_nearest(everyone, key, 5):
                if other is not newcomer:
                    other.node.storage = type(other.node.storage)()
            assert (await dhts[50].aget(key)).value == key.upper()
        await shutdown(everyone)

    run_virtual(scenario())


async def settle(dhts: list[DHT]) -> None:
    """Wait until every node has finished the replication work it started."""
    for dht in dhts:
        await dht.node.wait_idle()


async def swarm_holding(key: str, value: str, ttl: float, n: int, seed: int,
                        config: DHTConfig) -> tuple[list[DHT], float]:
    """A swarm of `n` nodes in which node 0 stored `key`; returns the nodes and the store's time."""
    dhts = await build_swarm(EmulatedNetwork(latency=LATENCY, seed=seed), n, seed=seed, config=config)
    now = dhts[0].get_time()
    assert await dhts[0].astore(key, value, now + ttl)
    await settle(dhts)
    return dhts, now


def holders_of(dhts: list[DHT], key: str) -> set[DHT]:
    """The nodes whose storage holds a live record of `key`."""
    return {d for d in dhts if d.node.storage.get(key_id_of(key), d.get_time())}


@pytest.mark.timeout(60)
def test_a_store_lands_exactly_on_the_replicas_nearest_nodes():
    """With caching off, after stores from several peers each key is held by exactly the
    `replicas` nodes whose ids are nearest to its id (brute force over the whole swarm)."""
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=12)
        dhts = await build_swarm(net, 60, seed=12, config=DHTConfig(replicas=3, cache_on_get=False))
        rng = random.Random(12)
        now = dhts[0].get_time()
        keys = [f"placed-{i}" for i in range(30)]
        assert all(await dhts[9].astore_many([(k, k, now + 600) for k in keys[:20]]))
        for key in keys[20:]:
            assert await rng.choice(dhts).astore(key, key, now + 600)
        await settle(dhts)
        for key in keys:
            assert holders_of(dhts, key) == set(true_nearest(dhts, key, 3)), key
        got = await dhts[40].aget_many(keys)  # gets change nothing without caching
        assert all(got[k].value == k for k in keys)
        await settle(dhts)
        assert all(holders_of(dhts, k) == set(true_nearest(dhts, k, 3)) for k in keys)
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.parametrize("cache_on_get", [True, False])
@pytest.mark.timeout(60)
def test_a_get_caches_the_record_on_the_closest_node_it_asked_that_lacked_it(cache_on_get):
    """Kademlia 2.3: after a get, the closest node that answered without the record gets a copy
    (and only that node); with `cache_on_get=False` nobody new holds it."""
    async def scenario():
        dhts, _ = await swarm_holding("cached", "v", 600, 60, 13, DHTConfig(replicas=3, cache_on_get=cache_on_get))
        before = holders_of(dhts, "cached")
        lookups = []
        for asker in [d for d in dhts if d not in before]:
            lookup = asker.node._lookup

            async def spy(*args, lookup=lookup, **kwargs):
                lookups.append(await lookup(*args, **kwargs))
                return lookups[-1]
            asker.node._lookup = spy
            assert (await asker.aget("cached")).value == "v"
            await asker.node.wait_idle()
            lacked = lookups[-1][key_id_of("cached")].without_value
            if lacked:
                break
            assert holders_of(dhts, "cached") == before  # everyone it asked had it: nothing to cache
        assert lacked and not {d.peer_id for d in before} & set(lacked)
        assert lacked == sorted(lacked, key=lambda p: node_id_of(p) ^ key_id_of("cached"))
        after = holders_of(dhts, "cached")
        if cache_on_get:
            assert {d.peer_id for d in after - before} == {lacked[0]} and before <= after
        else:
            assert after == before
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_get_latest_keeps_searching_past_the_first_value_for_the_newest():
    """A newer record planted on just one of the key's nearest holders: `latest=True` asks all of
    them and returns it; a plain get stops at the first holder that answers (here an older copy)."""
    async def scenario():
        dhts, now = await swarm_holding("model", "old", 60, 80, 14, DHTConfig(replicas=5, cache_on_get=False))
        nearest = true_nearest(dhts, "model", 20)
        assert holders_of(dhts, "model") == set(nearest[:5])
        planted = nearest[4]  # the farthest of the holders: the last a lookup reaches
        newer = Record("model", None, dumps("new"), now + 120)
        assert planted.node.storage.store(key_id_of("model"), newer, now)
        askers = [d for d in dhts if d not in nearest]
        plain = await askers[0].aget("model")
        assert plain.value == "old" and plain.expiration_time == now + 60
        for asker in askers[:10]:
            latest = await asker.aget("model", latest=True)
            assert latest.value == "new" and latest.expiration_time == now + 120
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_lookups_finish_within_their_deadline_when_peers_vanish_silently():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=6)
        dhts = await build_swarm(net, 60, seed=6)
        now = dhts[0].get_time()
        assert await dhts[0].astore("survivor", "yes", now + 600)
        holders = true_nearest(dhts, "survivor", 20)
        rng = random.Random(6)
        silent = [d for d in dhts if d not in holders[:5] and d is not dhts[1]]
        for dht in rng.sample(silent, 20):
            net.crash(dht.peer_id, silent=True)  # frames vanish; only deadlines notice
        loop = asyncio.get_running_loop()
        start = loop.time()
        got = await dhts[1].aget("survivor", latest=True, timeout=20)
        assert got is not None and got.value == "yes"
        assert loop.time() - start < 20
        # the silent peers are now in backoff: the next lookup does not wait for them again
        start = loop.time()
        assert (await dhts[1].aget("survivor", latest=True, timeout=20)).value == "yes"
        assert loop.time() - start < dhts[1].node.config.rpc_timeout
        await shutdown([d for d in dhts if not d.node.transport._crashed])

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_bad_input_is_refused_with_a_clear_error_and_the_node_keeps_serving():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=7)
        dhts = await build_swarm(net, 8, seed=7)
        alice, mallory, target = dhts[1], dhts[2], dhts[5]
        call = mallory.node.transport.call
        now = alice.get_time()
        owned = f"progress{owner_marker(alice.peer_id)}"
        assert await alice.astore(owned, {"step": 1}, now + 60)

        # malformed RPC payloads: each gets a BadRequest error naming the problem
        for method, payload in [(protocol.FIND, b"\xc1garbage"), (protocol.FIND, {"ids": []}),
                                (protocol.FIND, protocol.encode({"ids": [b"short"], "values": True})),
                                (protocol.STORE, None), (protocol.STORE, protocol.encode({"records": "x"})),
                                (protocol.STORE, protocol.encode({"records": [["k", None, 5, 1.0, None, None]]})),
                                (protocol.PING, b"\x00")]:
            with pytest.raises(RemoteError) as info:
                await call(target.peer_id, method, payload, timeout=5)
            assert info.value.remote_type == "BadRequest", info.value

        async def raw_store(record: Record) -> bool | str:
            answer = await call(target.peer_id, protocol.STORE, protocol.write(protocol.StoreRequest([record])), timeout=5)
            return protocol.read(protocol.StoreResponse, answer, n_records=1).results[0]

        signed = (await target.node.get_many([owned]))[owned].records[0]
        forged = Record(owned, None, dumps({"step": 99}), now + 70, bytes(64))
        assert (await raw_store(forged)).startswith("NotOwner")
        by_mallory = sign_record(Record(f"progress{owner_marker(mallory.peer_id)}", None, dumps(1), now + 70),
                                 mallory.node.transport.identity)
        overwrite = Record(owned, None, by_mallory.value, by_mallory.expiration_time, by_mallory.signature)
        assert "signature does not verify" in await raw_store(overwrite)
        replay = Record(owned, None, signed.value, now + 500, signed.signature)  # later expiry, old signature
        assert (await raw_store(replay)).startswith("NotOwner")
        oversized = Record("big", None, dumps(b"x" * 70_000), now + 10)
        assert (await raw_store(oversized)).startswith("ValueTooLarge")
        far = Record("far", None, dumps(1), now + 30 * 86400)
        assert (await raw_store(far)).startswith("ExpirationTooFar")
        assert (await raw_store(Record("junk", None, b"not potluck data", now + 10))).startswith("RecordRejected")

        # the same mistakes through the API fail at the caller, before anything is sent
        with pytest.raises(NotOwner, match="only that peer can store it"):
            await mallory.astore(owned, {"step": 99}, now + 70)
        with pytest.raises(ValueTooLarge, match="65536"):
            await mallory.astore("big", b"x" * 70_000, now + 10)
        with pytest.raises(ExpirationTooFar):
            await mallory.astore("far", 1, now + 30 * 86400)

        # nothing bad got in, and every node still serves
        assert (await dhts[6].aget(owned, latest=True)).value == {"step": 1}
        assert await dhts[6].aget("big", latest=True) is None and await dhts[6].aget("far", latest=True) is None
        assert await mallory.astore("fine", "ok", now + 10)
        assert (await target.aget("fine")).value == "ok"
        # and the targeted node still answers others: a find sent straight to it by a third peer
        bystander = dhts[0]
        answer = protocol.read(protocol.FindResponse, await bystander.node.transport.call(
            target.peer_id, protocol.FIND, protocol.write(protocol.FindRequest([key_id_of(owned)], values=True, stop=False)),
            timeout=5), n_ids=1)
        [result] = answer.results
        assert result.records == (signed,)
        assert {answer.peers[i][0] for i in result.nearest} >= {alice.peer_id, mallory.peer_id}
        await bystander.node.ping(target.peer_id)
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(30)
def test_a_full_bucket_pings_its_oldest_entry_and_replaces_it_only_if_it_is_dead():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=11)
        # The far half of the id space: one slot. No peer records: their stores would ping too.
        config = DHTConfig(bucket_size=1, depth_modulo=1, peer_record_ttl=None)
        home = await DHT.create(await started(net), clock=event_loop_clock(), config=config)
        far = []
        while len(far) < 3:  # peers in the half of the id space that does not hold home's id
            transport = await started(net)
            if (node_id_of(transport.peer_id) >> 159) != (home.node.node_id >> 159):
                transport.add_addresses(home.peer_id, home.node.transport.addresses)
                far.append(await DHT.create(transport, clock=event_loop_clock(), config=config))
        old, alive_newcomer, dead_oldest_newcomer = far
        await old.node.ping(home.peer_id)
        assert old.peer_id in home.node.routing
        await alive_newcomer.node.ping(home.peer_id)  # bucket full: home pings `old`, which answers
        await home.node.wait_idle()
        assert old.peer_id in home.node.routing and alive_newcomer.peer_id not in home.node.routing
        net.crash(old.peer_id)
        await old.ashutdown()
        await dead_oldest_newcomer.node.ping(home.peer_id)  # now the ping fails: the newcomer gets in
        await home.node.wait_idle()
        assert old.peer_id not in home.node.routing and dead_oldest_newcomer.peer_id in home.node.routing
        await shutdown([home, alive_newcomer, dead_oldest_newcomer])

    async def started(net: EmulatedNetwork):
        transport = net.transport(keepalive_interval=None)
        await transport.start()
        return transport

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_each_node_caps_its_storage_and_keeps_the_records_that_expire_last():
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=9)
        cap = 40_000
        dhts = await build_swarm(net, 6, seed=9, config=DHTConfig(max_storage_bytes=cap))
        now = dhts[0].get_time()
        items = [(f"blob-{i}", b"x" * 2000, now + 100 + i) for i in range(60)]  # ~135 KB in all
        stored = await dhts[0].astore_many(items)
        assert all(stored[-10:])  # the latest-expiring ones always find room
        for dht in dhts:
            assert dht.node.storage.total_bytes <= cap
        assert (await dhts[3].aget("blob-59", latest=True)).value == b"x" * 2000
        assert await dhts[3].aget("blob-0", latest=True) is None  # evicted everywhere: expires first
        await shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(30)
def test_a_dht_without_a_runner_points_to_the_async_methods():
    async def scenario():
        net = EmulatedNetwork(seed=10)
        transport = net.transport(keepalive_interval=None)
        await transport.start()
        dht = await DHT.create(transport, clock=event_loop_clock())
        assert await dht.astore("solo", 1, dht.get_time() + 10)  # a lone node stores locally
        assert (await dht.aget("solo")).value == 1
        with pytest.raises(RuntimeError, match="use the async methods"):
            dht.get("solo")
        await shutdown([dht])

    run_virtual(scenario())


def mean_hops(outcomes: list[dict]) -> list[int]:
    """Hops of every get that had to ask the network (hops 0 = the asker held the key itself)."""
    return [o.hops for result in outcomes for o in result.values() if o.hops]


@pytest.mark.scenario
@pytest.mark.timeout(240)  # ~35 s alone on 2 cores; the margin is for a busy machine
def test_thousand_peers_find_every_key_and_keep_99_percent_after_half_die():
    """1,000 peers, about 40% of them behind NAT (found private by a dial-back, so DHT clients
    that store nothing), 10 keys, all pairs: every peer gets all keys in one traversal (10,000
    gets) and must find every one. Then the copies those gets cached along the way are wiped, so
    only the k = 20 replicas of the stores remain; 50% of the peers crash at random, and every
    survivor gets all keys again: at least 99% of these 5,000 gets must succeed (in practice all do)."""
    async def scenario():
        net = EmulatedNetwork(latency=LATENCY, seed=8)
        dhts = await build_swarm(net, 1000, seed=8, natted=0.4)
        public = {d for d in dhts if d.node.transport.nat is None}
        assert 300 <= 1000 - len(public) <= 500 and all(d.node.client_mode for d in set(dhts) - public)
        rng = random.Random(8)
        keys = [f"expert.ffn.{i}" for i in range(10)]
        now = dhts[0].get_time()
        for writer, chunk in zip(rng.sample(dhts, 5), range(0, 10, 2), strict=True):
            assert all(await writer.astore_many([(k, {"uid": k}, now + 3600) for k in keys[chunk:chunk + 2]]))
        await settle(dhts)
        assert all(len(holders_of(dhts, k)) >= 20 and holders_of(dhts, k) <= public for k in keys)  # k = 20
        replicas = {d: list(d.node.storage.items(d.get_time())) for d in dhts}

        results = await asyncio.gather(*(d.node.get_many(keys) for d in dhts))
        missing = [(d.peer_id, k) for d, r in zip(dhts, results, strict=True) for k in keys if not r[k].records]
        assert not missing, (len(missing), missing[:5])
        assert all(r[k].records[0].value == dumps({"uid": k}) for r in results for k in keys)

        for dht in dhts:  # forget what the gets cached: only the stored replicas count below
            await dht.node.wait_idle()
            dht.node.storage = type(dht.node.storage)()
            for key_id, records in replicas[dht]:
                for record in records:
                    assert dht.node.storage.store(key_id, record, dht.get_time())
        dead = set(rng.sample(range(1000), 500))
        for i in sorted(dead):
            net.crash(dhts[i].peer_id)
            await dhts[i].ashutdown()
        alive = [d for i, d in enumerate(dhts) if i not in dead]
        results = await asyncio.gather(*(d.node.get_many(keys) for d in alive))
        found = sum(1 for r in results for k in keys if r[k].records)
        print(f"after 500 of 1000 peers died: {found} of {len(keys) * len(alive)} gets found their key")
        assert found >= 0.99 * len(keys) * len(alive), f"found {found} of {len(keys) * len(alive)}"
        by_key = {k: sum(1 for r in results if r[k].records) for k in keys}
        assert all(n >= 0.95 * len(alive) for n in by_key.values()), by_key  # no key is lost
        await shutdown(alive)

    run_virtual(scenario())


@pytest.mark.scenario
@pytest.mark.timeout(240)  # ~18 s alone on 2 cores; the margin is for a busy machine
def test_lookup_hops_grow_like_log_n(record_property):
    """Mean hops of gets from 100 random peers, at 100, 300 and 1,000 peers. With buckets split
    by b = 5 bits (routing.py), a lookup gains about 5 bits per hop: hops ~ log_32(N)."""
    measured = {}

    async def scenario(n: int):
        net = EmulatedNetwork(latency=LATENCY, seed=n)
        dhts = await build_swarm(net, n, seed=n)
        rng = random.Random(n)
        keys = [f"k{i}" for i in range(5)]
        assert all(await dhts[0].astore_many([(k, 1, dhts[0].get_time() + 3600) for k in keys]))
        askers = rng.sample(dhts, 100)
        results = await asyncio.gather(*(d.node.get_many(keys) for d in askers))
        assert all(o.records for r in results for o in r.values())
        hops = mean_hops(results)
        measured[n] = (statistics.mean(hops), max(hops))
        await shutdown(dhts)

    for n in (100, 300, 1000):
        run_virtual(scenario(n))
    for n, (mean, worst) in measured.items():
        record_property(f"mean_hops_{n}", round(mean, 3))
        record_property(f"max_hops_{n}", worst)
        print(f"DHT lookup hops at N={n}: mean {mean:.2f}, max {worst}")
        assert mean <= math.log(n, 32) + 0.5, measured  # log_{2^b} N, plus half a hop
        assert worst <= math.ceil(math.log2(n)), measured
    assert measured[100][0] < measured[300][0] < measured[1000][0], measured  # it does grow...
    growth = measured[1000][0] / measured[100][0]
    assert growth <= 1.5 * math.log(1000) / math.log(100), measured  # ...but no faster than log N
