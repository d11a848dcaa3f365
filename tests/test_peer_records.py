"""One address path: each peer's signed record in the DHT, and dials that resolve a bare peer id."""

from __future__ import annotations

import asyncio

import pytest

import potluck
from potluck.core.errors import MalformedMessage, PeerUnreachable
from potluck.core.serialization import dumps
from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT, DHTConfig, ExpirationTooFar, NotOwner, RecordRejected, event_loop_clock, protocol
from potluck.dht.peer_records import (
    MAX_PEER_RECORD_TTL,
    PARSED_PEER_RECORDS,
    PeerRecordValidator,
    peer_record_from_bytes,
    peer_record_key,
)
from potluck.dht.records import Record
from potluck.dht.validation import Limits, check_record, sign_record
from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.peer_record import PeerRecord
from potluck.net.transport import RESOLVE_RETRY_SECONDS, RESOLVE_TIMEOUT
from tests.emulated_swarm import SimPeer, add_peer, make_swarm

ADDR = "/ip4/10.0.0.1/tcp/4000"


async def echo(request, ctx):
    return request


# -- the record itself ------------------------------------------------------------------------------
def test_a_signed_record_round_trips_and_any_change_breaks_its_signature():
    me = Identity.generate()
    record = PeerRecord.sign(me, [f"{ADDR}/p2p/{me.peer_id}", "/emu/7"], 1000.0)
    assert [str(a) for a in record.addresses] == [ADDR, "/emu/7"]
    assert PeerRecord.from_wire(record.to_wire()) == record
    for field, value in (("addrs", ["/ip4/203.0.113.9/tcp/1"]), ("exp", 99999.0),
                         ("peer", Identity.generate().peer_id.to_bytes())):
        tampered = dict(record.to_wire(), **{field: value})
        with pytest.raises(MalformedMessage, match="does not verify"):
            PeerRecord.from_wire(tampered)


def test_a_record_signed_by_another_key_is_refused_at_parse_time():
    victim, stranger = Identity.generate(), Identity.generate()
    forged = PeerRecord.sign(stranger, [ADDR], 1000.0).to_wire()
    forged["peer"] = victim.peer_id.to_bytes()  # claims the victim's id with the stranger's signature
    with pytest.raises(MalformedMessage, match="forged, or signed by another key"):
        PeerRecord.from_wire(forged)


@pytest.mark.parametrize(("value", "words"), [
    ({"peer": b"x", "addrs": [ADDR], "exp": 1.0, "sig": bytes(64)}, "'peer'"),
    ({"addrs": [ADDR], "exp": 1.0, "sig": bytes(64)}, "exactly"),
    ({"peer": bytes(32), "addrs": [ADDR], "exp": 1.0, "sig": bytes(64), "note": "unsigned"}, "exactly"),
    ("text", "exactly"),
    ({"peer": bytes(32), "addrs": [f"{ADDR}/p2p/{Identity.generate().peer_id}"], "exp": 1.0, "sig": bytes(64)},
     "canonical"),
    ({"peer": bytes(32), "addrs": [ADDR] * 2, "exp": 1.0, "sig": bytes(64)}, "twice"),
    ({"peer": bytes(32), "addrs": [f"/ip4/10.0.0.{i}/tcp/1" for i in range(MAX_ADDRESSES_PER_PEER + 1)],
      "exp": 1.0, "sig": bytes(64)}, f"at most {MAX_ADDRESSES_PER_PEER}"),
    ({"peer": bytes(32), "addrs": ["/ip4/10.0.0.1/tcp/" + "1" * 2000], "exp": 1.0, "sig": bytes(64)}, "longer than"),
    ({"peer": bytes(32), "addrs": [], "exp": 1.0, "sig": bytes(64)}, "empty"),
    ({"peer": bytes(32), "addrs": [ADDR], "exp": float("inf"), "sig": bytes(64)}, "finite"),
    ({"peer": bytes(32), "addrs": [ADDR], "exp": 1.0, "sig": b"short"}, "64 bytes"),
])
def test_malformed_records_name_the_field_that_is_wrong(value, words):
    with pytest.raises(MalformedMessage, match=words):
        PeerRecord.from_wire(value)


def test_the_dht_refuses_forged_misplaced_or_long_lived_peer_records():
    now = 1000.0
    victim, stranger = Identity.generate(), Identity.generate()
    rules = [PeerRecordValidator(lambda: now)]
    key = peer_record_key(victim.peer_id)

    def dht_record(signer: Identity, record: PeerRecord, key: str = key) -> Record:
        return sign_record(Record(key, None, dumps(record.to_wire()), record.expiration_time), signer)

    good = PeerRecord.sign(victim, [ADDR], now + 60)
    check_record(dht_record(victim, good), Limits(), now, rules)
    with pytest.raises(NotOwner):  # the stranger cannot even write the victim's key
        check_record(Record(key, None, dumps(good.to_wire()), good.expiration_time,
                            stranger.sign(b"anything")), Limits(), now, rules)
    with pytest.raises(RecordRejected, match="not its owner's"):  # the victim's key, the stranger's record
        check_record(dht_record(victim, PeerRecord.sign(stranger, [ADDR], now + 60)), Limits(), now, rules)
    with pytest.raises(RecordRejected, match="must equal"):
        check_record(sign_record(Record(key, None, dumps(good.to_wire()), now + 30), victim), Limits(), now, rules)
    with pytest.raises(ExpirationTooFar, match="peer records may live"):
        check_record(dht_record(victim, PeerRecord.sign(victim, [ADDR], now + 2 * MAX_PEER_RECORD_TTL)),
                     Limits(), now, rules)
    with pytest.raises(RecordRejected, match="hold peer records only"):
        check_record(Record("_peer.anything", None, dumps(1), now + 60), Limits(), now, rules)


def test_parsed_peer_records_are_remembered_by_their_bytes_and_forgeries_never():
    victim, stranger = Identity.generate(), Identity.generate()
    good = PeerRecord.sign(victim, [ADDR], 1000.0)
    assert peer_record_from_bytes(dumps(good.to_wire())) == good
    assert peer_record_from_bytes(dumps(good.to_wire())) == good  # remembered
    forged = dict(good.to_wire(), peer=stranger.peer_id.to_bytes())
    moved = dict(good.to_wire(), addrs=["/ip4/203.0.113.9/tcp/1"])
    for value in (forged, moved, forged):
        with pytest.raises(RecordRejected, match="does not verify"):
            peer_record_from_bytes(dumps(value))
    for i in range(PARSED_PEER_RECORDS + 10):  # bounded: the oldest are forgotten, and parse again
        peer_record_from_bytes(dumps(PeerRecord.sign(victim, [ADDR], 2000.0 + i).to_wire()))
    assert peer_record_from_bytes(dumps(good.to_wire())) == good


# -- resolution on the emulated network --------------------------------------------------------------
async def newcomer_knowing_nobody(net: EmulatedNetwork, peers: list[SimPeer]) -> SimPeer:
    """A client-mode peer that joined before the others it will call, so it holds no address of them."""
    return await add_peer(net, peers[:1], client=True)


@pytest.mark.timeout(60)
def test_a_newcomer_that_knows_only_a_peer_id_can_call_it():
    async def scenario():
        net, peers = await make_swarm(4)
        newcomer = await newcomer_knowing_nobody(net, peers)
        target = await add_peer(net, peers)  # joins after the newcomer: the newcomer never heard of it
        target.transport.add_handler("echo", echo)
        assert newcomer.transport.addresses_of(target.transport.peer_id) == []
        assert await newcomer.transport.call(target.transport.peer_id, "echo", "hi", timeout=5) == "hi"
        assert newcomer.transport.vouched_addresses_of(target.transport.peer_id) == [
            a.without_peer_id() for a in target.transport.addresses]
        for p in [*peers, newcomer, target]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_dial_whose_lookup_ends_at_the_peer_itself_does_not_wait_for_itself():
    """Only the target holds its record (others lost theirs), so the lookup that resolves it ends
    with a find call to the target, over a connection without resolution. That call used to wait
    for the dial that was waiting for the lookup, until the lookup gave up on it (SLOW_AFTER, 1 s):
    every first call to a peer by id in a big swarm, a matchmaking window missed."""
    async def scenario():
        net, peers = await make_swarm(8)
        newcomer = await newcomer_knowing_nobody(net, peers)
        target = await add_peer(net, peers)
        target.transport.add_handler("echo", echo)
        for p in peers:
            p.dht.node.storage = type(p.dht.node.storage)()  # the record is left on the target only
        assert newcomer.transport.addresses_of(target.transport.peer_id) == []
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await newcomer.transport.call(target.transport.peer_id, "echo", "hi", timeout=5) == "hi"
        assert loop.time() - started < 0.2, "the call waited for itself"  # a few round trips of 5 ms
        for p in [*peers, newcomer, target]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_concurrent_dials_to_one_unknown_id_share_one_lookup_and_later_dials_use_the_cache():
    async def scenario():
        net, peers = await make_swarm(4)
        newcomer = await newcomer_knowing_nobody(net, peers)
        target = await add_peer(net, peers)
        target.transport.add_handler("echo", echo)
        lookups = []
        resolve = newcomer.dht.node.resolve_peer

        async def counting(peer_id, timeout, thorough=False):
            lookups.append(peer_id)
            return await resolve(peer_id, timeout, thorough)
        newcomer.dht.node.resolve_peer = counting
        pid = target.transport.peer_id
        assert await asyncio.gather(*(newcomer.transport.call(pid, "echo", i, timeout=5) for i in range(5))) == [
            0, 1, 2, 3, 4]
        assert lookups == [pid]
        stream = await newcomer.transport.open_stream(pid, "missing", timeout=5)  # a bulk dial: no new lookup
        stream.abort()
        assert lookups == [pid]
        for p in [*peers, newcomer, target]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_peer_restarted_at_a_new_address_is_found_again_by_a_thorough_lookup():
    async def scenario():
        net, peers = await make_swarm(4)
        newcomer = await newcomer_knowing_nobody(net, peers)
        target = await add_peer(net, peers)
        target.transport.add_handler("echo", echo)
        pid = target.transport.peer_id
        assert await newcomer.transport.call(pid, "echo", 1, timeout=5) == 1
        net.crash(pid)
        await target.dht.ashutdown()
        reborn = net.transport(identity=target.transport.identity)  # same id, new address
        await reborn.start()
        reborn.add_handler("echo", echo)
        reborn_dht = DHT(reborn, initial_peers=[peers[0].transport.addresses[0]], clock=event_loop_clock())
        await reborn_dht.astart()
        assert reborn.addresses != target.transport.addresses
        thorough = []
        resolve = newcomer.dht.node.resolve_peer

        async def watching(peer_id, timeout, thorough_lookup=False):
            thorough.append(thorough_lookup)
            return await resolve(peer_id, timeout, thorough_lookup)
        newcomer.dht.node.resolve_peer = watching
        with pytest.raises(PeerUnreachable):  # the cached record still names the old address
            await newcomer.transport.call(pid, "echo", 2, timeout=5)
        await asyncio.sleep(RESOLVE_RETRY_SECONDS)
        assert await newcomer.transport.call(pid, "echo", 3, timeout=5) == 3
        assert thorough and thorough[-1] is True
        await reborn_dht.ashutdown()
        await reborn.close()
        for p in [*peers, newcomer]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_dial_to_an_id_with_no_record_fails_with_peer_unreachable_within_its_deadline():
    async def scenario():
        net, peers = await make_swarm(4)
        loop = asyncio.get_running_loop()
        nobody = Identity.generate().peer_id
        start = loop.time()
        with pytest.raises(PeerUnreachable, match="no signed peer record"):
            await peers[1].transport.call(nobody, "echo", 1, timeout=5)
        assert loop.time() - start <= 5
        # A network that never answers: the dial still ends at the caller's deadline.
        net.partition([peers[3].transport.peer_id], [p.transport.peer_id for p in peers[:3]])
        start = loop.time()
        with pytest.raises(PeerUnreachable):
            await peers[3].transport.call(Identity.generate().peer_id, "echo", 1, timeout=2)
        assert loop.time() - start <= 2 + 1e-6
        net.heal()
        await asyncio.sleep(RESOLVE_TIMEOUT)  # the abandoned lookup ends at its own deadline
        assert not peers[3].transport._resolving
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_the_record_is_refreshed_before_it_expires():
    ttl = 60.0

    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        config = DHTConfig(peer_record_ttl=ttl)
        dhts = []
        for _ in range(3):
            transport = net.transport()
            await transport.start()
            boot = [dhts[0].node.transport.addresses[0]] if dhts else []
            dhts.append(await DHT.create(transport, clock=event_loop_clock(), initial_peers=boot, config=config))
        owner, reader = dhts[1], dhts[2]
        first = await reader.node.resolve_peer(owner.peer_id, 5)
        assert first is not None and first[1] <= ttl
        await asyncio.sleep(5 * ttl)  # virtual: five lifetimes
        latest = await reader.node.resolve_peer(owner.peer_id, 5)
        assert latest is not None, "the record lapsed: it was not re-published in time"
        assert latest[0].expiration_time > first[0].expiration_time + 4 * ttl - ttl / 3 - 1
        for d in dhts:
            await d.ashutdown()
            await d.node.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_strangers_record_for_another_peer_is_refused_by_every_node():
    async def scenario():
        net, peers = await make_swarm(3)
        victim, node, stranger = peers
        key = peer_record_key(victim.transport.peer_id)
        fake = PeerRecord.sign(stranger.transport.identity, ["/emu/nowhere"], node.dht.get_time() + 60)
        forged = Record(key, None, dumps(fake.to_wire()), fake.expiration_time,
                        stranger.transport.identity.sign(b"x" * 64))
        answer = protocol.read(protocol.StoreResponse, await stranger.transport.call(
            node.transport.peer_id, protocol.STORE, protocol.write(protocol.StoreRequest([forged])), timeout=5),
            n_records=1).results
        assert isinstance(answer[0], str) and "NotOwner" in answer[0]
        found = await stranger.dht.node.resolve_peer(victim.transport.peer_id, 5)
        assert found is not None and list(found[0].addresses) == [
            a.without_peer_id() for a in victim.transport.addresses]
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


def test_a_joining_peer_leaves_its_record_on_the_nodes_its_lookup_visits_with_no_store_calls():
    async def scenario():
        net, peers = await make_swarm(12)
        stores = []
        original = peers[0].transport.__class__.call

        async def counting(self, peer, method, *args, **kwargs):
            if method == protocol.STORE:
                stores.append(peer)
            return await original(self, peer, method, *args, **kwargs)

        peers[0].transport.__class__.call = counting
        try:
            newcomer = await add_peer(net, peers)
        finally:
            peers[0].transport.__class__.call = original
        assert stores == []  # the record rode along the joining lookup's find calls
        key = peer_record_key(newcomer.transport.peer_id)
        holders = [p for p in peers if p.dht.node.storage.get(newcomer.dht.node.node_id, p.dht.get_time())]
        assert len(holders) >= 8, "the lookup of its own id visits the record's replicas"
        found = await peers[-1].dht.node.get_many([key])
        assert found[key].records and peer_record_from_bytes(found[key].records[0].value).peer_id == \
            newcomer.transport.peer_id
        for p in [*peers, newcomer]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


def test_a_find_carries_only_its_callers_own_peer_record():
    async def scenario():
        net, peers = await make_swarm(3)
        victim, node, stranger = peers
        fake = PeerRecord.sign(stranger.transport.identity, ["/emu/nowhere"], node.dht.get_time() + 60)
        wrong = sign_record(Record(peer_record_key(stranger.transport.peer_id), None, dumps(fake.to_wire()),
                                   fake.expiration_time), stranger.transport.identity)
        wrong = Record(peer_record_key(victim.transport.peer_id), None, wrong.value, wrong.expiration_time,
                       wrong.signature)  # the stranger's record, filed under the victim's key
        answer = await stranger.transport.call(node.transport.peer_id, protocol.FIND, protocol.write(
            protocol.FindRequest([node.dht.node.node_id], False, False, own_record=wrong)), timeout=5)
        held = protocol.read(protocol.FindResponse, answer, n_ids=1).held
        assert isinstance(held, str) and "only the caller's own peer record" in held
        found = await stranger.dht.node.resolve_peer(victim.transport.peer_id, 5, thorough=True)
        assert found is not None and list(found[0].addresses) == [
            a.without_peer_id() for a in victim.transport.addresses]
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


# -- resolution over TCP -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_newcomer_that_knows_only_a_peer_id_can_call_it_over_tcp():
    with potluck.Peer(host="127.0.0.1") as first, \
            potluck.Peer(initial_peers=first.addresses, client_mode=True) as newcomer, \
            potluck.Peer(initial_peers=first.addresses, host="127.0.0.1") as target:
        target.transport.add_handler("echo", echo)
        target_id = target.transport.peer_id
        assert newcomer.transport.addresses_of(target_id) == []
        assert newcomer.call(target.peer_id, "echo", [1, 2], timeout=20) == [1, 2]
        assert newcomer.transport.vouched_addresses_of(target_id) == [
            Multiaddr.parse(a).without_peer_id() for a in target.addresses]
