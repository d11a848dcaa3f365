"""A DHT node that answers finds but never answers stores must not hold up honest stores.

A hostile node answers every `dht.find` at once, so lookups rank it among a key's replicas, and
never answers `dht.store`. A store gathered every replica's store call, so each one waited the
whole RPC timeout (3 s) on it: with 20 honest nodes and 2 hostile ids on one host, every store
took 3.07 s of virtual time instead of 0.08 s. The failed store put the node aside for 5 s only,
and its next prompt find answer cleared the failure count, so it was never evicted and every store
more than 5 s after the previous one paid again (every periodic announcement). Now a store returns
once a majority of each record's replicas hold it (0.08 s here), or once one does and STORE_GRACE
(1 s) has passed (1.02 s instead of 3.02 s with 3 honest nodes and 3 hostile: no majority
without them); the calls to silent replicas end in the background within their own deadline.
Failed stores count apart from answered finds: the node is not picked as a replica while in that
backoff (0.03 s stores meanwhile in the 3 + 3 swarm; 3 store calls to each hostile node in 6
stores, not 6), and after three it leaves the writer's routing table.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.virtual_time import run_virtual
from potluck.dht import protocol
from potluck.dht.node import RPC_TIMEOUT, STALE_AFTER_FAILURES
from tests.emulated_swarm import add_peer, make_swarm

HOSTILE_IP = "6.6.6.6"
STORES = 6
GAP = 10.0  # seconds between stores: more than the 5 s a failure used to cost


async def silent_replicas(net, peers, count: int) -> tuple[list, dict]:
    """`count` nodes on one host that answer finds but never stores; returns their peer ids and
    the store calls each got, by (its id, caller)."""
    calls: dict = {}
    hostile = []
    for _ in range(count):
        node = await add_peer(net, peers, ip=HOSTILE_IP)

        async def never_store(request, ctx, me=node.dht.peer_id):
            calls[me, ctx.peer_id] = calls.get((me, ctx.peer_id), 0) + 1
            await asyncio.sleep(3600)

        node.transport.add_handler(protocol.STORE, never_store)
        hostile.append(node.dht.peer_id)
    return hostile, calls


async def store_repeatedly(writer, reader, limit: float) -> list[float]:
    loop = asyncio.get_running_loop()
    took = []
    for i in range(STORES):
        await asyncio.sleep(GAP)
        start = loop.time()
        ok = await writer.astore(f"key{i}", b"v", writer.get_time() + 600)
        took.append(loop.time() - start)
        assert ok and took[-1] < limit, (i, ok, took)  # before: 3.07 s, each time
        value = await reader.aget(f"key{i}")
        assert value is not None and value.value == b"v", i
    return took


@pytest.mark.timeout(60)
def test_stores_do_not_wait_for_replicas_that_answer_finds_but_never_store():
    async def main():
        net, peers = await make_swarm(20)
        hostile, calls = await silent_replicas(net, peers, 2)
        await asyncio.sleep(5)
        writer, reader = peers[1].dht, peers[2].dht
        took = await store_repeatedly(writer, reader, limit=0.5)
        assert max(took) < 0.2, took  # as fast as without the hostile nodes (0.08 s)
        node = writer.node
        for h in hostile:
            sent = calls.get((h, writer.peer_id), 0)
            assert STALE_AFTER_FAILURES <= sent < STORES, (sent, calls)  # picked, failed, then skipped
            assert node.store_backoff.failures(h) >= STALE_AFTER_FAILURES
            assert h not in node.routing  # stale, however promptly it answers finds
        await asyncio.sleep(RPC_TIMEOUT)
        assert not node._store_calls  # the calls left behind ended with their deadline
    run_virtual(main())


@pytest.mark.timeout(60)
def test_without_a_majority_a_store_returns_after_the_grace_not_the_rpc_timeout():
    async def main():
        net, peers = await make_swarm(3)
        await silent_replicas(net, peers, 3)  # of the writer's 6 replicas, 3 can never hold a record
        await asyncio.sleep(5)
        took = await store_repeatedly(peers[1].dht, peers[2].dht, limit=1.5)
        assert min(took) < 0.2, took  # the silent ones, in store backoff, were not picked
    run_virtual(main())
