"""A DHT node that answers every find with made-up contacts must not stall honest lookups.

Ids are free: a hostile node answered every `dht.find` with 64 fresh made-up contacts per id asked
(the most an answer may name), ids ground close to the target, all at an address that never
answers. The lookup had no cap on what one answerer could add, and each made-up contact held one
of its alpha = 3 slots until SLOW_AFTER (1 s), so every lookup tried them all before it converged:
with 8 honest nodes and 1 hostile, a store, a get of a missing key and a get of the latest value
each took 22 s of virtual time instead of 0.03 s; with 40 nodes and 3 hostile ids on one host, 30 s
(the whole operation timeout), and a client-mode peer's store failed (the lookup used the whole
deadline, leaving the store calls 0 s). Now a lookup takes at most k contacts from one answer,
ignores what only an answerer named once two of its contacts that nobody else named failed, asks
at most 4k peers per target, and a store's lookup leaves part of the deadline for the store calls:
1 s and 3 s, and the client's store succeeds, even with a deadline shorter than the attack costs.

Several ids on one host that all named the SAME made-up contacts vouched for each other (each
contact had several answerers), so none was discredited: 7 s per store and get with 3 such ids in
a 40-node swarm, up to 15 s with 6 in pairs. Answerers are now counted by subnet, one voice per
subnet however many ids it has: 1.1 s.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from potluck.core.virtual_time import run_virtual
from potluck.dht import DHTNode, protocol
from potluck.dht.lookup import Answer, Lookup
from potluck.dht.routing import node_id_of
from potluck.net.address import Multiaddr
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import PeerID
from tests.emulated_swarm import add_peer, make_swarm

HOSTILE_IP = "6.6.6.6"


async def hostile_nodes(net, peers, count: int, grind_bits: int) -> list[int]:
    """`count` DHT nodes on one host whose finds name made-up contacts at a black hole, ids within
    2^-grind_bits of the target; returns a one-element list counting the finds they answered."""
    answered = [0]
    hole = net.transport(ip=HOSTILE_IP)
    await hole.start()
    hole_addr = Multiaddr("emu", hole._name, None, None)
    net.crash(hole.peer_id, silent=True)  # frames to it vanish: only deadlines notice

    async def made_up_find(request, ctx):
        find = protocol.read(protocol.FindRequest, request)
        answered[0] += 1
        contacts, results = [], []
        for target in find.ids:
            indices = []
            for _ in range(protocol.MAX_PEERS_PER_ID):
                while (node_id_of(fake := PeerID(os.urandom(32))) ^ target) >> (160 - grind_bits):
                    pass
                indices.append(len(contacts))
                contacts.append((fake, node_id_of(fake), (hole_addr,)))
            results.append(protocol.FindResult(indices, []))
        return protocol.write(protocol.FindResponse(contacts, results, None))

    for _ in range(count):
        hostile = await add_peer(net, peers, ip=HOSTILE_IP)
        hostile.transport.add_handler(protocol.FIND, made_up_find)
    return answered


async def scene(nodes: int, hostile: int, grind_bits: int):
    """`nodes` peers (the second a client) and `hostile` made-up-contact nodes, settled: the counter
    of finds the hostile ones answered, the client's DHT (it stores nothing itself), another's."""
    net, peers = await make_swarm(nodes, client_mode=(1,))
    answered = await hostile_nodes(net, peers, count=hostile, grind_bits=grind_bits)
    await asyncio.sleep(5)
    return answered, peers[1].dht, peers[2].dht


async def timed(coro):
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await coro
    return result, loop.time() - start


@pytest.mark.timeout(60)
def test_stores_and_gets_take_a_second_not_22_despite_made_up_contacts():
    async def main():
        answered, writer, reader = await scene(8, hostile=1, grind_bits=0)
        for i in range(3):
            ok, took = await timed(writer.astore(f"key{i}", b"v", writer.get_time() + 600))
            assert ok and took < 2.5, (i, ok, took)  # before: 22 s
            value, took = await timed(writer.aget(f"missing{i}"))
            assert value is None and took < 2.5, (i, took)  # before: 22 s
            value, took = await timed(reader.aget(f"key{i}", latest=True))
            assert value is not None and value.value == b"v" and took < 2.5, (i, took)  # before: 22 s
        assert answered[0] >= 9  # the hostile node was asked in every lookup
        # A deadline shorter than a made-up contact costs (SLOW_AFTER): the lookup leaves the store
        # calls their share of it, and the record lands on the nodes that answered by then.
        ok, took = await timed(writer.astore("hurried", b"v", writer.get_time() + 600, timeout=0.8))
        assert ok and took <= 0.8, (ok, took)  # before: ok=False after 0.8 s
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_client_mode_store_succeeds_with_three_hostile_ids_on_one_host():
    async def main():
        answered, client, reader = await scene(40, hostile=3, grind_bits=8)
        assert client.node.client_mode
        for i in range(3):
            ok, took = await timed(client.astore(f"key{i}", b"v", client.get_time() + 600))
            assert ok and took < 5.0, (i, ok, took)  # before: ok=False after 30 s
            value, took = await timed(reader.aget(f"key{i}", latest=True))
            assert value is not None and took < 5.0, (i, took)  # before: 30 s
        assert answered[0] > 0
    run_virtual(main())


@pytest.mark.timeout(10)
def test_a_lookup_gives_up_on_what_only_a_failing_answerer_named():
    """The rule itself, on `Lookup` alone: of 64 made-up contacts it takes k, and once two that
    nobody else named fail it stops waiting for the rest; one an honest answerer named too is asked."""
    def contact(node_id: int) -> tuple[PeerID, int]:
        return PeerID(os.urandom(32)), node_id

    target = 1 << 150
    hostile, honest = contact(target ^ (1 << 100)), contact(target ^ (1 << 101))
    lookup = Lookup({target: [hostile, honest]}, k=4, alpha=3, stop_on_value=False)
    assert set(lookup.next_requests()) == {hostile[0], honest[0]}
    fakes = [contact(target ^ (i + 1)) for i in range(protocol.MAX_PEERS_PER_ID)]
    lookup.on_response(hostile[0], [target], {target: Answer(fakes)})
    assert len(lookup.targets[target].state) == 2 + 4  # the k = 4 closest of the 64
    lookup.on_response(honest[0], [target], {target: Answer([fakes[3]])})  # corroborates one
    asked = list(lookup.next_requests())
    assert asked == [fakes[0][0], fakes[1][0], fakes[2][0]]
    lookup.on_slow(fakes[0][0], [target])
    lookup.on_slow(fakes[1][0], [target])
    # Two uncorroborated failures discredit the hostile answerer: fakes[2] stops holding a slot, and
    # only the contact the honest answerer named too is still asked; its failure counts against no one.
    assert lookup.next_requests() == {fakes[3][0]: [target]}
    lookup.on_slow(fakes[3][0], [target])
    assert lookup.next_requests() == {} and lookup.done
    assert lookup.strikes == {hostile[1]: 2} and lookup.result(target).nearest == [hostile[0], honest[0]]


# Hosting a handful of DHT ids on one rented machine: one /24 of a cloud provider's.
ONE_HOST = "51.15.0.7"


async def vouching_nodes(net, peers, count: int, per_set: int, grind_bits: int) -> list[int]:
    """`count` DHT nodes on ONE_HOST whose finds name made-up contacts at a black hole there, ids
    within 2^-grind_bits of the target; each `per_set` of them name the very same contacts, so each
    made-up contact has several answerers (ids) vouching for it. Returns a one-element list
    counting the finds they answered."""
    answered = [0]
    hole = net.transport(ip=ONE_HOST)
    await hole.start()
    hole_addr = Multiaddr("emu", hole._name, None, None)
    net.crash(hole.peer_id, silent=True)  # frames to it vanish: only deadlines notice
    made_up: dict[tuple[int, int], list[PeerID]] = {}

    def contacts_of(target: int, group: int) -> list[PeerID]:
        if (target, group) not in made_up:
            rng, fakes = random.Random(target * 1000 + group), []
            for _ in range(protocol.MAX_PEERS_PER_ID):
                while (node_id_of(fake := PeerID(rng.randbytes(32))) ^ target) >> (160 - grind_bits):
                    pass
                fakes.append(fake)
            made_up[target, group] = fakes
        return made_up[target, group]

    def vouching_find(group: int):
        async def find(request, ctx):
            find = protocol.read(protocol.FindRequest, request)
            answered[0] += 1
            contacts, index, results = [], {}, []
            for target in find.ids:
                indices = []
                for fake in contacts_of(target, group):
                    if fake not in index:
                        index[fake] = len(contacts)
                        contacts.append((fake, node_id_of(fake), (hole_addr,)))
                    indices.append(index[fake])
                results.append(protocol.FindResult(indices, []))
            return protocol.write(protocol.FindResponse(contacts, results, None))
        return find

    for i in range(count):
        hostile = await add_peer(net, peers, ip=ONE_HOST)
        hostile.transport.add_handler(protocol.FIND, vouching_find(i // per_set))
    return answered


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("hostile", "per_set"), [(3, 3), (6, 2)], ids=["3-ids-one-set", "6-ids-in-pairs"])
def test_ids_of_one_host_vouching_for_the_same_made_up_contacts_are_one_voice(hostile, per_set):
    """Several hostile ids on one host all name the same made-up contacts: each contact then had
    several answerers, counted as corroboration, so no answerer was ever discredited and every
    lookup waited out SLOW_AFTER for each of the k made-up contacts, alpha at a time. With 40 nodes
    (one a client) and 3 ids naming one set, every store and get of a stored key took 7 s of virtual
    time (7.0-7.1 s); with 6 ids naming 3 sets in pairs, 9-15 s (up to 4k asked per target, 27 s,
    with more pairs). Now the answerers of one subnet are one voice: a contact counts as
    corroborated only when another subnet names it too, and two failures of contacts only that
    subnet named discredit all its ids: 1.1 s, however many ids the host has."""
    async def main():
        net, peers = await make_swarm(40, client_mode=(1,))
        answered = await vouching_nodes(net, peers, count=hostile, per_set=per_set, grind_bits=8)
        await asyncio.sleep(5)
        client, writer, reader = peers[1].dht, peers[2].dht, peers[3].dht
        for i in range(3):
            for dht in (client, writer):
                ok, took = await timed(dht.astore(f"key{i}", b"v", dht.get_time() + 600))
                assert ok and took < 2.5, (i, ok, took)  # before: 7 s (in pairs: 9-15 s)
            value, took = await timed(reader.aget(f"key{i}", latest=True))
            assert value is not None and value.value == b"v" and took < 2.5, (i, took)  # before: 7 s (15 s)
            value, took = await timed(writer.aget(f"missing{i}"))
            assert value is None and took < 2.5, (i, took)
        assert answered[0] >= 3  # the hostile ids were asked
    run_virtual(main())


@pytest.mark.timeout(10)
def test_a_lookup_counts_the_answerers_of_one_subnet_as_one_voice():
    """The rule on `Lookup` alone: two ids of one subnet naming the same contacts do not corroborate
    them; failures of contacts that different ids of the subnet named count together; once the
    subnet is discredited, what a third id of it names is ignored too, while a contact another
    subnet also named is still asked. Answerers with no subnet (our own network) count per id."""
    def contact(node_id: int) -> tuple[PeerID, int]:
        return PeerID(os.urandom(32)), node_id

    target = 1 << 150
    subnet, other = "51.15.0.0/24", "198.51.100.0/24"
    a, b, c = (contact(target ^ (1 << bit)) for bit in (100, 101, 102))
    honest = contact(target ^ (1 << 103))
    # Interleaved: a's contacts are odd distances from the target, b's even ones.
    named_by_a = [contact(target ^ (2 * i + 1)) for i in range(protocol.MAX_PEERS_PER_ID)]
    named_by_b = [contact(target ^ (2 * i + 2)) for i in range(protocol.MAX_PEERS_PER_ID)]

    def answered_by_one_subnet(voice: str | None) -> Lookup:
        lookup = Lookup({target: [a, b, c, honest]}, k=4, alpha=4, stop_on_value=False)
        assert set(lookup.next_requests()) == {a[0], b[0], c[0], honest[0]}
        lookup.on_response(a[0], [target], {target: Answer(named_by_a + named_by_b[:1])}, subnet=voice)
        lookup.on_response(b[0], [target], {target: Answer(named_by_b + named_by_a[:1])}, subnet=voice)
        lookup.on_response(honest[0], [target], {target: Answer([named_by_b[2]])}, subnet=other)
        # a and b both named the two closest: corroborated only if they are two voices.
        assert lookup.next_requests() == {p: [target] for p, _ in (named_by_a[0], named_by_b[0], named_by_a[1])}
        lookup.on_slow(named_by_a[0][0], [target])
        lookup.on_slow(named_by_b[0][0], [target])
        return lookup

    per_id = answered_by_one_subnet(None)  # e.g. a lab on private addresses: as before
    assert per_id.strikes == {} and not per_id.discredited

    lookup = answered_by_one_subnet(subnet)
    # Two failed contacts only the subnet named: discredited, with every id of it.
    assert lookup.strikes == {subnet: 2} and lookup.discredited == {subnet}
    # named_by_a[1] stops holding a slot; only what the other subnet named too is still asked.
    assert lookup.next_requests() == {named_by_b[2][0]: [target]}
    lookup.on_response(c[0], [target], {target: Answer([contact(target ^ (3 << 10))])}, subnet=subnet)
    assert lookup.next_requests() == {}  # a third id of the subnet: what it names is ignored too
    lookup.on_response(named_by_b[2][0], [target], {target: Answer([])}, subnet="203.0.113.0/24")
    assert lookup.next_requests() == {} and lookup.done
    assert lookup.result(target).nearest[0] == named_by_b[2][0]


@pytest.mark.timeout(10)
def test_answerers_are_placed_by_the_subnet_of_their_open_connection():
    """Which voice a DHT node gives an answerer: the /24 of its connection's IP, however many ids
    share it; None (a voice per id) on our own network (private addresses); its own name for an
    emulated peer with no IP; UNPLACED, shared by all, for a peer with no open connection."""
    from potluck.dht.node import UNPLACED  # here, so the module's other tests run on older code too

    async def main():
        net = EmulatedNetwork(latency=0.005)
        node = DHTNode(me := net.transport())
        await me.start()
        ips = ["51.15.0.7", "51.15.0.99", "10.0.0.5", None]
        others = [net.transport(ip=ip) for ip in ips]
        for other in others:
            await other.start()
            await me.connect(other.addresses[0])
        assert [node._answerer_subnet(o.peer_id) for o in others] == ["51.15.0.0/24", "51.15.0.0/24", None,
                                                                      others[3]._name]
        stranger = net.transport(ip="51.15.0.8")
        await stranger.start()
        assert node._answerer_subnet(stranger.peer_id) == UNPLACED
        for transport in (me, *others, stranger):
            await transport.close()
    run_virtual(main())
