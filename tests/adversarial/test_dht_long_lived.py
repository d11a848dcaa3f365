"""Issue 14: a record that asks for the DHT's full 24-hour lifetime outlives every honest re-store
(the later expiration wins), and a plain record under a per-peer key displaces every peer's entry.
Every node now applies the rules of potluck's kinds of key (`dht.key_kinds`): each kind lives at
most a few times its honest writer's lifetime, and per-peer kinds take only owner-signed entries.
The squatter's records are refused outright, even signed as its own and sent straight to the
nodes, bypassing its own client's checks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.averaging import Averager
from potluck.averaging.matchmaking import Declaration
from potluck.core.names import RunNames
from potluck.core.serialization import dumps
from potluck.core.virtual_time import run_virtual
from potluck.dht import protocol
from potluck.dht.records import Record, key_id_of, own_subkey
from potluck.dht.validation import sign_record
from tests.emulated_swarm import make_swarm

DAY = 23 * 3600.0


async def store_directly(attacker, node, record: Record) -> bool | str:
    """Send one record straight to `node`, as a hostile client would (no client-side checks)."""
    answer = await attacker.transport.call(node.transport.peer_id, protocol.STORE,
                                           protocol.write(protocol.StoreRequest([record])), timeout=5)
    return protocol.read(protocol.StoreResponse, answer, n_records=1).results[0]


@pytest.mark.timeout(60)
def test_day_long_declarations_signed_by_the_squatter_itself_are_refused_and_groups_form():
    async def main():
        net, peers = await make_swarm(4)
        honest, squatter = peers[:3], peers[3]
        avgs = [Averager(p, [torch.full((8,), float(i))], "match", matchmaking_time=1.0)
                for i, p in enumerate(honest)]
        key = RunNames("match").averager("tensors").declarations("all")
        me = squatter.transport.identity
        declared = dumps(Declaration(avgs[0].schema).to_wire())
        record = sign_record(Record(key, own_subkey(me.peer_id), declared, squatter.dht.get_time() + DAY), me)
        answers = [await store_directly(squatter, p, record) for p in honest]
        assert all(isinstance(a, str) and "ExpirationTooFar" in a for a in answers), answers
        assert all(not p.dht.node.storage.get(key_id_of(key), p.dht.get_time()) for p in honest)
        results = await asyncio.gather(*(a.astep(timeout=20) for a in avgs), return_exceptions=True)
        assert [getattr(r, "group_size", r) for r in results] == [3, 3, 3]
    run_virtual(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["run.progress", "run.avg.state.donors", "run.pipeline.profiles", "run.pipeline.layout",
                                 "run.sweep.s.leases"])
def test_each_kind_of_potluck_key_refuses_a_day_long_record(key):
    async def main():
        net, peers = await make_swarm(2)
        node, squatter = peers
        me = squatter.transport.identity
        now = squatter.dht.get_time()
        long_lived = sign_record(Record(key, own_subkey(me.peer_id), dumps({"x": 1}), now + DAY), me)
        answer = await store_directly(squatter, node, long_lived)
        assert isinstance(answer, str) and "ExpirationTooFar" in answer
        short = sign_record(Record(key, own_subkey(me.peer_id), dumps({"x": 1}), now + 2.0), me)
        assert await store_directly(squatter, node, short) is True  # an honest lifetime still fits
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_plain_record_under_a_donor_key_is_refused_and_donors_keep_announcing():
    """A plain record expiring after the donors' entries would displace them all and refuse their
    re-announcements until it expires (found while fixing the owned subkeys)."""
    async def main():
        net, peers = await make_swarm(3)
        donor, squatter, newcomer = peers
        key = RunNames("squat").averager("tensors").donors
        plain = Record(key, None, dumps({"version": 10**9}), squatter.dht.get_time() + 3000)
        assert "only owner-signed entries" in await store_directly(squatter, donor, plain)
        assert "only owner-signed entries" in await store_directly(squatter, newcomer, plain)
        unsigned = Record(key, str(donor.transport.peer_id), dumps({"version": 10**9}), plain.expiration_time)
        assert "only owner-signed entries" in await store_directly(squatter, donor, unsigned)
        source = Averager(donor, [torch.full((4,), 3.0)], "squat", matchmaking_time=1.0)
        await source.announce_state()
        target = Averager(newcomer, [torch.zeros(4)], "squat", matchmaking_time=1.0)
        await target.aload_state_from_peers(timeout=10)
        assert torch.equal(target._tensors[0], torch.full((4,), 3.0))
    run_virtual(main())
