"""A stranger's fake addresses for a peer cannot cut that peer off (issue 14: a squatted DHT entry
listed fake addresses for an honest donor, and they pushed its real address out of a newcomer's
address book). Protocols read such unsigned entries and hand their addresses to the transport as
hints; what the peer vouched for itself (its handshake, its signed peer record) must still win.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.virtual_time import run_virtual
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
