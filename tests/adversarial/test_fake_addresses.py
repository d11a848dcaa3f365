"""A stranger's fake addresses for a peer cannot cut that peer off (issue 14: a squatted DHT entry
listed fake addresses for an honest donor, and they pushed its real address out of a newcomer's
address book). Protocols read such unsigned entries and hand their addresses to the transport as
hints; what the peer vouched for itself (its handshake, its signed peer record) must still win.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.virtual_time import run_virtual
from potluck.net import address_book
from potluck.net.emulated import EmulatedNetwork
from potluck.net.transport import MAX_ADDRESSES_PER_PEER
from tests.emulated_swarm import add_peer, make_swarm

# Three times what the address book keeps per peer: enough to have flushed any list of addresses.
FAKES = [f"/emu/fake-{i}" for i in range(3 * MAX_ADDRESSES_PER_PEER)]


async def echo(request, ctx):
    return request


@pytest.mark.timeout(30)
def test_fake_hints_do_not_push_out_the_address_a_peer_proved_in_its_handshake():
    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        victim = net.transport(keepalive_interval=1.0, keepalive_timeout=3.0)
        newcomer = net.transport(keepalive_interval=1.0, keepalive_timeout=3.0)
        await victim.start()
        await newcomer.start()
        victim.add_handler("echo", echo)
        await newcomer.connect(victim.addresses[0])
        assert await newcomer.call(victim.peer_id, "echo", 1, timeout=5) == 1
        newcomer.add_addresses(victim.peer_id, FAKES)  # read from the stranger's unsigned entry
        net.partition([victim.peer_id], [newcomer.peer_id])  # the link drops; keepalive closes it
        await asyncio.sleep(10)
        net.heal()
        assert not newcomer.is_connected(victim.peer_id)
        assert await newcomer.call(victim.peer_id, "echo", 2, timeout=5) == 2
        await newcomer.close()
        await victim.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_newcomer_fed_only_fake_addresses_still_reaches_the_peer_through_its_signed_record():
    async def scenario():
        net, peers = await make_swarm(4)
        newcomer = await add_peer(net, peers[:1], client=True)
        victim = await add_peer(net, peers)  # joins later: the newcomer has no address of it
        victim.transport.add_handler("echo", echo)
        newcomer.transport.add_addresses(victim.transport.peer_id, FAKES)
        assert await newcomer.transport.call(victim.transport.peer_id, "echo", 3, timeout=10) == 3
        for p in [*peers, newcomer, victim]:
            await p.dht.ashutdown()
            await p.transport.close()
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_made_up_ids_that_connect_and_leave_do_not_grow_the_address_book_for_good(monkeypatch):
    """Every handshake states the caller's addresses, and every DHT answer hints at others': kept
    per peer ever met, a host cycling through made-up ids grew the book by about 2 KB each, without
    end. It now keeps the MAX_VOUCHED_PEERS (and MAX_HINTED_PEERS) most recently stated; an honest
    peer that connects again stays among them (here the caps are cut to 20 to show it)."""
    monkeypatch.setattr(address_book, "MAX_VOUCHED_PEERS", 20, raising=False)
    monkeypatch.setattr(address_book, "MAX_HINTED_PEERS", 20, raising=False)

    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        server, honest = net.transport(), net.transport()
        await server.start()
        await honest.start()
        server.add_handler("echo", echo)
        for i in range(60):
            fake = net.transport()
            await fake.start()
            await fake.connect(server.addresses[0])
            assert await fake.call(server.peer_id, "echo", i, timeout=5) == i
            server.add_addresses(fake.peer_id, [f"/emu/hint-{i}"])  # what a DHT answer would tell
            await fake.close()
            if i % 10 == 0:
                await honest.connect(server.addresses[0])  # the honest peer keeps talking to it
                assert await honest.call(server.peer_id, "echo", i, timeout=5) == i
        book = server._book
        assert len(book._vouched) <= 20 and len(book._hints) <= 20
        assert honest.peer_id in book  # stated again at each of its connections
        await honest.close()
        await server.close()
    run_virtual(scenario())
