"""Issue 29: a DHT node's storage was shared per source peer id (an eighth of the budget each, and the
largest source evicted first when full), and peer ids cost nothing. A thousand made-up ids of one
host, each storing one record, fill a node while every one of them holds less than an honest peer
that stored a few records, so the honest peers were the largest sources and paid first: their
records were evicted and their new ones refused.

Storage is now charged per subnet as well (`dht.storage`: a subnet holds at most a quarter of a
node, and when the node is full the subnet holding the most pays first). Here one attacking host
(1,000 made-up ids on one /24) floods a node while honest peers from other origins keep every record
they stored before and store new ones. Emulated network, virtual clock; the node's budget is 1 MiB,
so the flood (4 MB) fills it four times over. The made-up ids' origin is set on the transports after
they are built, so the same test runs (and fails) against the code from before origins existed."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.serialization import dumps
from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT, DHTConfig, event_loop_clock, key_id_of, protocol
from potluck.dht.records import Record
from potluck.net.emulated import EmulatedNetwork
from potluck.net.origins import origin_of

BUDGET = 2**20
MADE_UP_IDS = 1000
FLOOD_VALUE = dumps(b"\x00" * 4000)  # one 4 KB record per made-up id
FLOOD_TTL = 23 * 3600.0  # about the longest any record may ask for: they would outlive the honest ones
HONEST_VALUE = {"pad": "h" * 8000}  # honest peers each store a few larger records
HONEST_TTL = 600.0


async def swarm(net: EmulatedNetwork, n: int) -> list[DHT]:
    config = DHTConfig(max_storage_bytes=BUDGET, peer_record_ttl=None)
    dhts: list[DHT] = []
    for _ in range(n):
        transport = net.transport(keepalive_interval=None)
        await transport.start()
        boot = [dhts[0].node.transport.addresses[0]] if dhts else []
        dhts.append(await DHT.create(transport, clock=event_loop_clock(), initial_peers=boot, config=config))
    return dhts


def held_at(node: DHT, keys: list[str]) -> int:
    now = node.get_time()
    return sum(bool(node.node.storage.get(key_id_of(key), now)) for key in keys)


async def honest_stores(peers: list[DHT], round_: str, per_peer: int) -> list[str]:
    keys = []
    for p, peer in enumerate(peers):
        batch = [(f"{round_}.{p}.{i}", HONEST_VALUE, peer.get_time() + HONEST_TTL) for i in range(per_peer)]
        assert all(await peer.astore_many(batch))
        keys += [item[0] for item in batch]
    return keys


@pytest.mark.timeout(300)
def test_a_thousand_made_up_ids_of_one_host_do_not_evict_honest_records() -> None:
    async def scenario() -> None:
        net = EmulatedNetwork(latency=0.01, seed=29)
        dhts = await swarm(net, 5)
        target, honest = dhts[0], dhts[1:]
        before = await honest_stores(honest, "before", 6)
        assert held_at(target, before) == len(before)  # every node is a replica in a swarm this small

        stored = 0
        for n in range(MADE_UP_IDS):
            fake = net.transport(keepalive_interval=None)
            fake.origin = origin_of(f"198.51.100.{1 + n % 50}")  # 50 hosts of one /24
            await fake.start()
            fake.add_addresses(target.peer_id, target.node.transport.addresses)
            record = Record(f"flood.{n}", None, FLOOD_VALUE, target.get_time() + FLOOD_TTL)
            answer = await fake.call(target.peer_id, protocol.STORE,
                                     protocol.write(protocol.StoreRequest([record])), timeout=30)
            stored += protocol.read(protocol.StoreResponse, answer, n_records=1).results[0] is True
            await fake.close()
        await asyncio.sleep(1)

        assert held_at(target, before) == len(before), "the made-up ids' flood evicted honest records"
        after = await honest_stores(honest, "after", 6)
        assert held_at(target, after) == len(after), "honest records stored after the flood no longer fit"
        assert held_at(target, before) == len(before)
        storage = target.node.storage
        assert storage.total_bytes <= BUDGET
        flooded = storage.bytes_by_subnet()[origin_of("198.51.100.1").subnet]
        assert flooded <= storage.max_subnet_bytes == BUDGET // 4, f"one subnet holds {flooded} bytes"
        assert stored < MADE_UP_IDS  # the rest were refused for want of room in the subnet's share
        for dht in dhts:
            await dht.ashutdown()
            await dht.node.transport.close()

    run_virtual(scenario())
