"""Membership on the emulated network in virtual time: hours of a governed run in a second.

The background loops run for real here (renewal, revocation reads, sweeps); only the clock is
virtual, so token lifetimes pass without waiting.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import MembershipRefused
from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT
from potluck.membership import Authority, MembershipClient, MembershipRecordValidator, Policy
from potluck.net.emulated import EmulatedNetwork
from potluck.net.membership import TOKEN_LIFETIME

RUN = "virtual-run"


async def echo(request, ctx):
    return request


async def start_authority(net: EmulatedNetwork, policy: Policy, run: str = RUN) -> tuple[Authority, DHT]:
    """An authority of `run` on its own emulated peer, publishing its records."""
    transport = net.transport()
    dht = DHT(transport, clock=event_loop_clock())
    authority = Authority(transport, run, policy, dht=dht, clock=event_loop_clock())
    await transport.start()
    await dht.astart()
    authority.start_publishing()
    return authority, dht


async def start_member(net: EmulatedNetwork, authority: Authority, policy: Policy, name: str) -> tuple[MembershipClient, DHT]:
    transport = net.transport()
    transport.add_handler("echo", echo)
    policy.allow_peer(str(transport.peer_id), name)
    bootstrap = authority.transport.addresses[0]
    dht = DHT(transport, initial_peers=[bootstrap], clock=event_loop_clock())
    client = MembershipClient(transport, bootstrap, None, dht=dht, clock=event_loop_clock())
    transport.membership = client.gate
    dht.add_validator(MembershipRecordValidator(client.gate))
    await transport.start()
    await client.fetch()
    await dht.astart()
    return client, dht


@pytest.mark.timeout(120)
def test_renewal_keeps_members_connected_for_hours_and_lapsed_members_are_dropped():
    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        policy = Policy()
        authority, auth_dht = await start_authority(net, policy)
        (a, a_dht), (b, b_dht), (lapsed, l_dht) = [await start_member(net, authority, policy, n)
                                                   for n in ("a", "b", "lapsed")]
        a.start()
        b.start()  # `lapsed` never renews
        try:
            await b.transport.connect(a.transport.addresses[0], timeout=5)
            await lapsed.transport.connect(a.transport.addresses[0], timeout=5)
            first = b.token
            await asyncio.sleep(3 * TOKEN_LIFETIME)  # virtual: three token lifetimes
            assert b.token.expires > first.expires + TOKEN_LIFETIME
            assert a.transport.is_connected(b.transport.peer_id)
            assert await b.transport.call(a.transport.peer_id, "echo", 1, timeout=5) == 1
            assert not a.transport.is_connected(lapsed.transport.peer_id)
            with pytest.raises(MembershipRefused, match="expired"):
                await lapsed.transport.connect(a.transport.addresses[0], timeout=5)
            # the DHT keeps working among members, with tokens on owned records
            assert await a_dht.astore("k", 1, a_dht.get_time() + 60)
            assert (await b_dht.aget("k", latest=True)).value == 1
        finally:
            for client in (a, b, lapsed):
                await client.stop()
            await authority.stop()
            for dht in (a_dht, b_dht, l_dht, auth_dht):
                await dht.ashutdown()
            for t in (a.transport, b.transport, lapsed.transport, authority.transport):
                await t.close()

    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_stranger_on_the_emulated_network_is_refused_with_the_reason():
    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        policy = Policy()
        authority, auth_dht = await start_authority(net, policy)
        member, m_dht = await start_member(net, authority, policy, "m")
        stranger = net.transport()
        await stranger.start()
        try:
            with pytest.raises(MembershipRefused, match="presented no membership token"):
                await stranger.connect(member.transport.addresses[0], timeout=5)
            # the authority takes it as a guest that may only ask for a token
            await stranger.connect(authority.transport.addresses[0], timeout=5)
            with pytest.raises(Exception, match="serves only membership requests"):
                await stranger.call(authority.transport.peer_id, "dht.find", {}, timeout=5)
        finally:
            await authority.stop()
            await m_dht.ashutdown()
            await auth_dht.ashutdown()
            for t in (stranger, member.transport, authority.transport):
                await t.close()

    run_virtual(scenario())
