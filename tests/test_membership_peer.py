"""`Peer(authority=..., credential=...)` on real TCP: members join with tokens from a running
authority, strangers are turned away with a reason, and a revocation published in the DHT cuts a
member off from the others."""

from __future__ import annotations

import pytest

from potluck import Peer
from potluck.core.errors import MembershipError, MembershipRefused
from potluck.membership import Authority, Policy

RUN = "run-peer"


def start_authority(policy: Policy) -> tuple[Peer, Authority]:
    peer = Peer(host="127.0.0.1")

    async def start() -> Authority:
        authority = Authority(peer.transport, RUN, policy, dht=peer.dht)
        authority.start_publishing()
        return authority

    return peer, peer.run(start(), timeout=10)


@pytest.mark.timeout(90)
def test_members_join_strangers_are_refused_and_revoked_members_are_cut_off():
    policy = Policy()
    code = policy.add_invite("volunteers", uses=2)
    auth_peer, authority = start_authority(policy)
    address = auth_peer.addresses[0]
    peers = [auth_peer]
    try:
        first = Peer(initial_peers=[address], host="127.0.0.1", authority=address, credential=f"invite:{code}")
        peers.append(first)
        assert (first.membership.name, first.membership.run_id) == ("volunteers", RUN)
        # the authority's peer id is enough when the authority is among the initial peers
        second = Peer(initial_peers=[address, first.addresses[0]], host="127.0.0.1",
                      authority=auth_peer.peer_id, credential=f"invite:{code}")
        peers.append(second)
        assert first.dht.store("shared", 1, first.dht.get_time() + 60)
        assert second.dht.get("shared", latest=True).value == 1
        assert second.call(first.peer_id, "membership.present",
                           second.membership.to_wire()) is None

        with pytest.raises(MembershipError, match="unknown or used up"):
            peers.append(Peer(initial_peers=[address], host="127.0.0.1", authority=address,
                              credential=f"invite:{code}"))
        with pytest.raises(MembershipRefused, match="presented no membership token"):
            peers.append(Peer(initial_peers=[first.addresses[0]], host="127.0.0.1"))

        auth_peer.run(authority.revoke(second.peer_id), timeout=30)
        assert not auth_peer.transport.is_connected(second.transport.peer_id)  # the authority cuts it off at once
        assert first.run(first._membership.refresh_revocations(), timeout=30)
        assert first.run(_sweep(first), timeout=10) >= 1
        assert not first.transport.is_connected(second.transport.peer_id)
        with pytest.raises(MembershipError, match="revoked"):
            second.run(second._membership.renew(), timeout=30)
    finally:
        for peer in reversed(peers):
            peer.shutdown()


async def _sweep(peer: Peer) -> int:
    return peer._membership.sweep()


@pytest.mark.timeout(30)
def test_a_refused_credential_stops_the_peer_with_the_reason():
    auth_peer, _ = start_authority(Policy())
    try:
        with pytest.raises(MembershipError, match="not on the authority's allowlist"):
            Peer(host="127.0.0.1", authority=auth_peer.addresses[0])
        with pytest.raises(MembershipError, match="no address for the authority"):
            Peer(host="127.0.0.1", authority=auth_peer.peer_id)
        with pytest.raises(MembershipError, match="must end in /p2p/"):
            Peer(host="127.0.0.1", authority="/ip4/127.0.0.1/tcp/1")
    finally:
        auth_peer.shutdown()
