"""Reachability check (net.reachability) on real TCP and on the emulated network, and the emulated
NAT model it is tested against."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from potluck.core.errors import PeerUnreachable, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.net.address import Multiaddr
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.net.reachability import DIALBACK, DialbackService, check_reachability
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport
from potluck.peer import Peer


async def echo(request, ctx):
    return request


def serving(t: Transport) -> Transport:
    DialbackService(t).start()
    t.add_handler("echo", echo)
    return t


def closed_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def tcp_servers(n: int) -> AsyncIterator[list[TCPTransport]]:
    servers = [serving(TCPTransport(Identity.generate(), host="127.0.0.1")) for _ in range(n)]
    try:
        for s in servers:
            await s.start()
        yield servers
    finally:
        for s in servers:
            await s.close()


async def checked(me: Transport, servers: list[Transport]):
    await me.start()
    try:
        for s in servers:
            await me.connect(s.listen_addresses[0])
        return await check_reachability(me, [s.peer_id for s in servers])
    finally:
        await me.close()


@pytest.mark.timeout(30)
def test_a_reachable_tcp_peer_is_found_public_and_learns_the_host_others_see(arun):
    async def main():
        async with tcp_servers(2) as servers:
            me = TCPTransport(Identity.generate(), host="127.0.0.1")
            report = await checked(me, servers)
            assert report.verdict == "public"
            assert report.answers == len(report.asked) == 2
            assert list(report.reached) == [a.without_peer_id() for a in me.listen_addresses]
            assert me.observed_hosts == ["127.0.0.1"]
    arun(main())


@pytest.mark.timeout(30)
def test_a_tcp_peer_announcing_an_address_nobody_can_reach_is_found_private(arun):
    async def main():
        async with tcp_servers(2) as servers:
            me = TCPTransport(Identity.generate(), host="127.0.0.1", announce=[f"/ip4/127.0.0.1/tcp/{closed_port()}"])
            report = await checked(me, servers)
            assert report.verdict == "private" and report.answers == 2 and not report.reached
    arun(main())


@pytest.mark.timeout(30)
def test_one_answer_without_a_dial_back_is_private_and_no_answer_is_unknown(arun):
    async def main():
        async with tcp_servers(2) as servers:
            servers[1].set_public(False)  # a server behind NAT refuses: its dial-back would prove nothing
            me = TCPTransport(Identity.generate(), host="127.0.0.1", announce=[f"/ip4/127.0.0.1/tcp/{closed_port()}"])
            await me.start()
            try:
                for s in servers:
                    await me.connect(s.listen_addresses[0])
                report = await check_reachability(me, [servers[1].peer_id])
                assert report.verdict == "unknown" and report.answers == 0
                report = await check_reachability(me, [s.peer_id for s in servers])
                assert report.verdict == "private" and report.answers == 1 and len(report.asked) == 2
            finally:
                await me.close()
    arun(main())


def test_the_emulated_nat_refuses_dials_in_and_lets_a_punch_through():
    async def scenario():
        net = EmulatedNetwork(latency=0.01)
        public, natted, other = net.transport(), net.transport(nat="edm"), net.transport(nat="eim")
        for t in (public, natted, other):
            await t.start()
            t.add_handler("echo", echo)
        assert natted.nat == "edm" and public.nat is None
        with pytest.raises(PeerUnreachable, match="behind NAT"):
            await public.connect(natted.listen_addresses[0])
        # It dials out, and the connection it made works both ways.
        await natted.connect(public.addresses[0])
        assert await natted.call(public.peer_id, "echo", 1) == 1
        assert await public.call(natted.peer_id, "echo", 2) == 2
        assert public.open_connections()[0].remote.observed.host == natted.listen_addresses[0].host
        net.open_nat(other.peer_id, public.peer_id)  # a punch opened `other`'s NAT to `public`
        assert await public.connect(other.listen_addresses[0]) == other.peer_id
        assert EmulatedNetwork.punchable(public, natted) and EmulatedNetwork.punchable(other, other)
        assert not EmulatedNetwork.punchable(natted, other)
        with pytest.raises(ValueError, match="nat must be"):
            net.transport(nat="full-cone")
    run_virtual(scenario())


def test_on_the_emulated_network_a_natted_peer_is_private_and_a_public_one_public():
    async def scenario():
        net = EmulatedNetwork(latency=0.01)
        servers = [serving(net.transport()) for _ in range(3)]
        for s in servers:
            await s.start()
        for nat, verdict in ((None, "public"), ("eim", "private"), ("edm", "private")):
            me = net.transport(nat=nat)
            report = await checked(me, servers)
            assert report.verdict == verdict and len(report.asked) == 3 and report.answers == 3
            assert me.observed_hosts == list(report.observed_hosts) and len(me.observed_hosts) == 1
    run_virtual(scenario())


def test_reachability_states_their_addresses_and_the_watchers_of_a_change():
    async def scenario():
        net = EmulatedNetwork()
        t, relay, forced = net.transport(), net.transport(), net.transport(client_mode=True)
        for x in (t, relay, forced):
            await x.start()
        seen = []
        t.watch_addresses(lambda: seen.append(t.addresses))
        assert t.reachability == "public" and not t.client_mode and t.addresses == t.listen_addresses
        t.set_public(False)
        assert t.reachability == "private" and t.client_mode and t.addresses == [] and seen == [[]]
        circuit = Multiaddr.circuit(relay.addresses[0], t.peer_id)
        t.set_relayed_addresses([circuit])
        assert t.reachability == "relayed" and t.client_mode and t.addresses == [circuit] and seen[-1] == [circuit]
        t.set_relayed_addresses([circuit])  # no change, no call
        assert len(seen) == 2
        t.set_relayed_addresses([])
        assert t.reachability == "private" and seen[-1] == []
        assert forced.forced_client and forced.reachability == "private" and forced.listen_addresses == []
        with pytest.raises(ValueError, match="forced client"):
            forced.set_public(True)
    run_virtual(scenario())


def test_a_dial_back_request_with_too_many_addresses_is_refused():
    async def scenario():
        net = EmulatedNetwork()
        server, me = serving(net.transport()), net.transport()
        await server.start()
        await me.start()
        await me.connect(server.listen_addresses[0])
        with pytest.raises(RemoteError, match="addrs"):
            await me.call(server.peer_id, DIALBACK, {"addrs": [str(me.listen_addresses[0])] * 99}, timeout=5)
    run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_tcp_peer_found_private_runs_as_a_client_and_says_what_to_do():
    port = closed_port()
    with Peer(host="127.0.0.1") as a, Peer(a.addresses, host="127.0.0.1") as b:
        assert b.transport.reachability == "public" and b.reachability_summary.startswith("Publicly reachable at ")
        # the address others reached, whole: what a user gives another machine
        assert f"at {b.transport.listen_addresses[0]}:" in b.reachability_summary
        with Peer([*a.addresses, *b.addresses], host="127.0.0.1", announce=[f"/ip4/127.0.0.1/tcp/{port}"]) as c:
            assert c.transport.reachability == "private" and c.addresses == [] and c.transport.client_mode
            assert f"open or forward TCP port {port}" in c.reachability_summary
            assert "potluck peer --relay" in c.reachability_summary
            assert "others see this machine as 127.0.0.1" in c.reachability_summary
            assert c.dht.store("k", 1, c.dht.get_time() + 60)  # it works as a client
            assert a.dht.get("k").value == 1
