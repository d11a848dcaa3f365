"""Issue 14, "a storage flood evicts a node's honest records": one peer sent 2,304 records of 65 KB
in 0.8 s straight to a node, and the node's byte budget, full, evicted the records expiring soonest
node-wide, which were every one of its 50 honest records (afterwards only 131 of 1,000 new ones
fit). Storage now charges each record to its source (its owner, else the peer that sent it), caps
each source at an eighth of the budget, and when the node is full evicts from the source holding
the most. So the flood displaces only the flooder's own records.

Everything runs on the emulated network in virtual time; the node under attack has a 4 MiB budget
(so a few dozen flood records would fill it) and the flood records ask for the DHT's longest
lifetime, so by expiration alone they would outlive every honest record."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.serialization import dumps
from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT, DHTConfig, event_loop_clock, key_id_of, owner_marker, protocol
from potluck.dht.records import Record
from potluck.dht.validation import sign_record
from potluck.net.emulated import EmulatedNetwork

BUDGET = 4 * 2**20
FLOOD_VALUE = dumps(b"\x00" * 60_000)  # a 60 KB value, under the 64 KiB record limit
FLOOD_TTL = 23 * 3600.0  # about the longest any record may ask for (24 h)
HONEST_TTL = 600.0
BATCH = 16  # flood records per store call


async def _swarm(net: EmulatedNetwork, n: int) -> list[DHT]:
    config = DHTConfig(max_storage_bytes=BUDGET, peer_record_ttl=None)
    clock = event_loop_clock()
    dhts: list[DHT] = []
    for _ in range(n):
        transport = net.transport(keepalive_interval=None)
        await transport.start()
        boot = [dhts[0].node.transport.addresses[0]] if dhts else []
        dhts.append(await DHT.create(transport, clock=clock, initial_peers=boot, config=config))
    return dhts


async def _shutdown(dhts: list[DHT]) -> None:
    for dht in dhts:
        await dht.ashutdown()
        await dht.node.transport.close()


def _honest_items(peers: list[DHT], round_: str, count: int) -> dict[DHT, list[tuple]]:
    """`count` records spread over the honest peers: half owned (signed) entries, half unowned keys."""
    items: dict[DHT, list[tuple]] = {p: [] for p in peers}
    for i in range(count):
        peer = peers[i % len(peers)]
        expiry = peer.get_time() + HONEST_TTL
        if i % 2:
            items[peer].append((f"{round_}.progress.{i}", {"step": i, "pad": "h" * 500}, expiry,
                                owner_marker(peer.peer_id)))
        else:
            items[peer].append((f"{round_}.layout.{i}", {"stage": i, "pad": "h" * 500}, expiry))
    return items


def _held_at(node_dht: DHT, items: dict[DHT, list[tuple]]) -> int:
    now = node_dht.get_time()
    return sum(bool(node_dht.node.storage.get(key_id_of(item[0]), now)) for batch in items.values() for item in batch)


async def _flood(attacker_transport, target: DHT, count: int, prefix: str, signed: bool) -> list[bool | str]:
    """`count` 60 KB records sent straight to `target` (no lookup, as a raw client would)."""
    answers: list[bool | str] = []
    identity = attacker_transport.identity
    marker = owner_marker(attacker_transport.peer_id)
    for start in range(0, count, BATCH):
        now = target.get_time()
        records = []
        for i in range(start, min(count, start + BATCH)):
            if signed and i % 2:
                records.append(sign_record(Record(f"{prefix}.{i}{marker}", None, FLOOD_VALUE, now + FLOOD_TTL), identity))
            else:
                records.append(Record(f"{prefix}.{i}", None, FLOOD_VALUE, now + FLOOD_TTL))
        answer = await attacker_transport.call(target.peer_id, protocol.STORE,
                                               protocol.write(protocol.StoreRequest(records)), timeout=30)
        answers.extend(protocol.read(protocol.StoreResponse, answer, n_records=len(records)).results)
    return answers


@pytest.mark.timeout(120)
def test_one_peers_flood_displaces_only_its_own_records():
    async def scenario():
        net = EmulatedNetwork(latency=0.01, seed=14)
        dhts = await _swarm(net, 7)
        target, attacker, honest = dhts[0], dhts[1], dhts[2:]
        before = _honest_items(honest, "before", 50)
        results = await asyncio.gather(*(p.astore_many(batch) for p, batch in before.items()))
        assert all(all(r) for r in results)
        assert _held_at(target, before) == 50  # every node is a replica in a swarm this small

        # 2,400 records of 60 KB (about 140 MiB, 35 budgets), unowned and owned by the attacker alike
        answers = await _flood(attacker.node.transport, target, 2400, "flood", signed=True)
        assert not any(isinstance(a, str) for a in answers), answers[:3]  # valid records, refused for room only

        assert _held_at(target, before) == 50, "the flood evicted honest records"
        assert target.node.storage.total_bytes <= BUDGET
        charged = target.node.storage.bytes_by_source()
        assert charged[attacker.peer_id] <= target.node.storage.max_source_bytes
        after = _honest_items(honest, "after", 50)
        results = await asyncio.gather(*(p.astore_many(batch) for p, batch in after.items()))
        assert all(all(r) for r in results)
        assert _held_at(target, after) == 50, "honest records stored after the flood no longer fit"
        assert _held_at(target, before) == 50
        await _shutdown(dhts)

    run_virtual(scenario())


@pytest.mark.timeout(120)
def test_a_flood_from_many_identities_evicts_the_largest_source_not_the_honest_ones():
    async def scenario():
        net = EmulatedNetwork(latency=0.01, seed=15)
        dhts = await _swarm(net, 6)
        target, honest = dhts[0], dhts[1:]
        before = _honest_items(honest, "before", 50)
        results = await asyncio.gather(*(p.astore_many(batch) for p, batch in before.items()))
        assert all(all(r) for r in results) and _held_at(target, before) == 50

        # 12 sybils, each within its own quota (an eighth of the budget), fill the node one and a half times over
        sybils = []
        for _ in range(12):
            transport = net.transport(keepalive_interval=None)
            await transport.start()
            transport.add_addresses(target.peer_id, target.node.transport.addresses)
            sybils.append(transport)
        for n, sybil in enumerate(sybils):
            answers = await _flood(sybil, target, 12, f"sybil{n}", signed=False)
            assert not any(isinstance(a, str) for a in answers), answers[:3]

        assert _held_at(target, before) == 50, "the sybils' flood evicted honest records"
        storage = target.node.storage
        assert storage.total_bytes <= BUDGET and storage.total_bytes > BUDGET - len(FLOOD_VALUE) - 1024  # full
        after = _honest_items(honest, "after", 50)
        results = await asyncio.gather(*(p.astore_many(batch) for p, batch in after.items()))
        assert all(all(r) for r in results) and _held_at(target, after) == 50
        assert _held_at(target, before) == 50
        for sybil in sybils:
            await sybil.close()
        await _shutdown(dhts)

    run_virtual(scenario())

