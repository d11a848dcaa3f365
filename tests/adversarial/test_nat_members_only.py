"""Issue 29: in an authority-governed run, relays and dial-back serve members only. The handshake
admits members, but a connection outlives what admitted it: a member revoked since, or whose token
expired, kept a relay's reservations and circuits and public peers' dial-backs until the next sweep
of open connections (every 2 minutes), and spent them for its made-up friends. Now each request
checks the newest token the caller showed (`net.membership.require_member`), and is refused with
a reason. Emulated network (its handshake checks tokens as TCP's does), virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from potluck.core.errors import MembershipError, NetworkError, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.net.emulated import EmulatedNetwork, EmulatedTransport
from potluck.net.identity import Identity
from potluck.net.membership import MembershipGate, MembershipToken, RevocationList
from potluck.net.reachability import DIALBACK, DialbackService
from potluck.net.relay import RELAY_HOP, Hop, RelayService, reserve

RUN = "members-only"
DAY = 86400.0
SHORT = 60.0  # the lifetime of the token that expires during the test


def member(net: EmulatedNetwork, authority: Identity, name: str, lifetime: float = DAY) -> EmulatedTransport:
    transport = net.transport()
    clock = asyncio.get_running_loop().time
    token = MembershipToken.issue(authority, transport.peer_id, name, RUN, clock() + lifetime)
    transport.membership = MembershipGate(authority.peer_id, RUN, clock=clock, token=lambda: token)
    transport.puncher.auto = False
    return transport


def dialback_request(t: EmulatedTransport) -> dict:
    return {"addrs": [str(t.listen_addresses[0].without_peer_id())]}


def test_a_relay_and_dial_backs_serve_members_only_even_on_connections_opened_while_they_were():
    async def main():
        net = EmulatedNetwork(latency=0.005)
        authority = Identity.generate()
        relay = member(net, authority, "relay")
        honest, revoked, lapsed = (member(net, authority, n, SHORT if n == "lapsed" else DAY)
                                   for n in ("honest", "revoked", "lapsed"))
        for t in (relay, honest, revoked, lapsed):
            await t.start()
            await t.connect(relay.addresses[0]) if t is not relay else None
        RelayService(relay).start()
        DialbackService(relay).start()
        honest_circuit = (await reserve(honest, relay.peer_id)).addresses[0]
        # The authority revokes one member (the relay reads the list), and another's token lapses.
        clock = asyncio.get_running_loop().time
        relay.membership.update_revocations(RevocationList.issue(authority, RUN, 1, clock() + DAY, [revoked.peer_id]))
        await asyncio.sleep(2 * SHORT)
        for outsider, why in ((revoked, "revoked"), (lapsed, "expired")):
            assert outsider.is_connected(relay.peer_id)  # the connection that admitted it is still open
            with pytest.raises(NetworkError, match=f"this relay serves members of this run only: .*{why}"):
                await reserve(outsider, relay.peer_id)
            with pytest.raises(NetworkError, match=why):  # a circuit, over a new connection: the handshake
                await outsider.connect(honest_circuit, timeout=10)
            hop = await outsider.open_stream(relay.peer_id, RELAY_HOP, Hop(honest.peer_id).to_wire(), timeout=10,
                                             dedicated=False)  # over the old one: the relay
            with pytest.raises(RemoteError, match=f"this relay serves members of this run only: .*{why}"):
                await hop.recv()
            with pytest.raises(RemoteError, match=f"dial-back serves members of this run only: .*{why}") as info:
                await outsider.call(relay.peer_id, DIALBACK, dialback_request(outsider), timeout=10)
            assert info.value.remote_type == MembershipError.__name__
        # Members are served as before.
        assert (await reserve(honest, relay.peer_id)).addresses == [honest_circuit]
        reply = await honest.call(relay.peer_id, DIALBACK, dialback_request(honest), timeout=10)
        assert reply["reached"] == dialback_request(honest)["addrs"]

    run_virtual(main())
