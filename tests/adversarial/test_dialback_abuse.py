"""The reachability check's dial-back (`nat.dialback`) cannot be turned into a weapon (issue 16).

A public peer dials back whoever asks: unchecked, anyone could make every public peer of a swarm
connect to a third party's address (a reflected flood, or a scan that looks like it came from
them), or hold them all dialing at once. The server dials only the caller's own observed host,
and at most MAX_CONCURRENT_DIALBACKS callers at a time, one dial-back each.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.errors import RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.net.address import Multiaddr
from potluck.net.emulated import EmulatedNetwork
from potluck.net.reachability import DIALBACK, MAX_CONCURRENT_DIALBACKS, DialbackService


def test_a_caller_cannot_aim_a_dial_back_at_a_third_party():
    async def scenario():
        network = EmulatedNetwork(latency=0.01)
        server, attacker, victim, relay = (network.transport() for _ in range(4))
        for t in (server, attacker, victim, relay):
            await t.start()
        DialbackService(server).start()
        dialed = []
        dial = server.dial

        async def recording(address, expected, bulk, answer_within=None):
            dialed.append(address)
            return await dial(address, expected, bulk, answer_within)
        server.dial = recording
        await attacker.connect(server.addresses[0])
        aimed = [victim.addresses[0], Multiaddr.circuit(relay.addresses[0], victim.peer_id),
                 Multiaddr.parse("/ip4/192.0.2.7/tcp/80"), attacker.addresses[0]]
        reply = await attacker.call(server.peer_id, DIALBACK, {"addrs": [str(a.without_peer_id()) for a in aimed]})
        assert reply["reached"] == [str(attacker.addresses[0].without_peer_id())]
        assert dialed == [attacker.addresses[0].without_peer_id()]  # nobody else was even tried
        for bystander in (victim, relay):
            assert server.peer_id not in {c.peer_id for c in bystander.open_connections()}
    run_virtual(scenario())


def test_dial_backs_in_flight_are_capped_in_all_and_per_caller():
    async def scenario():
        network = EmulatedNetwork(latency=0.01)
        server = network.transport()
        await server.start()
        DialbackService(server).start()
        slow_dial = server.dial

        async def hanging(address, expected, bulk, answer_within=None):  # every dial-back takes a second
            await asyncio.sleep(1)
            return await slow_dial(address, expected, bulk, answer_within)
        server.dial = hanging
        callers = [network.transport() for _ in range(MAX_CONCURRENT_DIALBACKS + 4)]
        for c in callers:
            await c.start()
            await c.connect(server.addresses[0])

        async def ask(caller):
            request = {"addrs": [str(caller.addresses[0].without_peer_id())]}
            try:
                return await caller.call(server.peer_id, DIALBACK, request, timeout=10)
            except RemoteError as e:
                return str(e)
        answers = await asyncio.gather(*(ask(c) for c in callers), ask(callers[0]))
        refused = [a for a in answers if isinstance(a, str)]
        assert len(refused) == 5 and all("too many dial-backs" in a for a in refused), answers
        assert isinstance(answers[0], dict) and answers[0]["reached"]
    run_virtual(scenario())


@pytest.mark.parametrize("reachability", ["private", "relayed"])
def test_a_peer_that_is_not_public_refuses_to_dial_back(reachability):
    async def scenario():
        network = EmulatedNetwork(latency=0.01)
        server, caller, relay = network.transport(), network.transport(), network.transport()
        for t in (server, caller, relay):
            await t.start()
        DialbackService(server).start()
        await caller.connect(server.addresses[0])
        server.set_public(False)
        if reachability == "relayed":
            server.set_relayed_addresses([Multiaddr.circuit(relay.addresses[0], server.peer_id)])
        with pytest.raises(RemoteError, match="not publicly reachable"):
            await caller.call(server.peer_id, DIALBACK, {"addrs": [str(caller.addresses[0].without_peer_id())]})
    run_virtual(scenario())
