"""Strangers cannot take part in an authority-governed run (issue 14: HELLO always sent
`token: None` and nobody checked it, so anyone who could reach a peer joined its DHT and called
its services). Before membership checks, each stranger below got in; now each is refused at the
handshake, with a reason, and the members keep working."""

from __future__ import annotations

import pytest

from potluck import Peer
from potluck.core.errors import MembershipRefused
from potluck.membership import Authority, Policy
from potluck.net import Identity, TCPTransport
from potluck.net.membership import MembershipGate, MembershipToken

RUN = "guarded-run"


async def echo(request, ctx):
    return request


@pytest.mark.timeout(60)
def test_strangers_without_or_with_forged_tokens_cannot_join_or_call_members(arun):
    policy = Policy()
    code = policy.add_invite("member")
    auth_peer = Peer(host="127.0.0.1")
    peers = [auth_peer]
    try:
        auth_peer.run(_authority(auth_peer, policy), timeout=10)
        member = Peer(initial_peers=[auth_peer.addresses[0]], host="127.0.0.1",
                      authority=auth_peer.addresses[0], credential=f"invite:{code}")
        peers.append(member)
        member.transport.add_handler("echo", echo)

        # 1. a plain peer that never asked the authority
        with pytest.raises(MembershipRefused, match="presented no membership token"):
            peers.append(Peer(initial_peers=[member.addresses[0]], host="127.0.0.1"))

        # 2. a peer that signs its own token for the run, claiming to be the authority
        async def forged() -> None:
            me = Identity.generate()
            token = MembershipToken.issue(me, me.peer_id, "mallory", RUN, member.dht.get_time() + 3600)
            gate = MembershipGate(auth_peer.transport.peer_id, RUN, clock=member.dht.get_time, token=lambda: token)
            stranger = TCPTransport(me, host="127.0.0.1", membership=gate)
            await stranger.start()
            try:
                with pytest.raises(MembershipRefused, match="not signed by this run's authority"):
                    await stranger.connect(member.addresses[0], timeout=5)
            finally:
                await stranger.close()

        member.run(forged(), timeout=20)

        # 3. a member's token replayed by another identity
        async def replayed() -> None:
            stolen = member.membership
            gate = MembershipGate(auth_peer.transport.peer_id, RUN, clock=member.dht.get_time, token=lambda: stolen)
            thief = TCPTransport(Identity.generate(), host="127.0.0.1", membership=gate)
            await thief.start()
            try:
                with pytest.raises(MembershipRefused, match="issued to peer"):
                    await thief.connect(member.addresses[0], timeout=5)
            finally:
                await thief.close()

        member.run(replayed(), timeout=20)
        assert member.call(member.peer_id, "echo", 2) == 2
        assert member.dht.store("still-works", 1, member.dht.get_time() + 60)
    finally:
        for peer in reversed(peers):
            peer.shutdown()


async def _authority(peer: Peer, policy: Policy) -> Authority:
    authority = Authority(peer.transport, RUN, policy, dht=peer.dht)
    authority.start_publishing()
    return authority


@pytest.mark.timeout(60)
def test_members_refuse_owned_records_of_non_members_even_when_a_member_relays_them():
    from potluck.core.serialization import dumps
    from potluck.dht.records import Record, key_id_of, owner_marker
    from potluck.dht.validation import sign_record

    policy = Policy()
    code = policy.add_invite("member", uses=2)
    auth_peer = Peer(host="127.0.0.1")
    peers = [auth_peer]
    try:
        auth_peer.run(_authority(auth_peer, policy), timeout=10)
        honest = Peer(initial_peers=[auth_peer.addresses[0]], host="127.0.0.1",
                      authority=auth_peer.addresses[0], credential=f"invite:{code}")
        peers.append(honest)
        relay = Peer(initial_peers=[honest.addresses[0]], host="127.0.0.1",
                     authority=auth_peer.addresses[0], credential=f"invite:{code}")
        peers.append(relay)
        outsider = Identity.generate()
        now = relay.dht.get_time()
        squat = sign_record(Record(f"run.progress{owner_marker(outsider.peer_id)}", None, dumps(10**9), now + 3600),
                            outsider)

        async def relay_it() -> list:
            return await relay.dht.node.store_many([squat], 10)

        relay.run(relay_it(), timeout=20)  # the relay may keep it itself; nobody else does
        assert not honest.dht.node.storage.get(key_id_of(squat.key), honest.dht.get_time())
        assert honest.dht.get(squat.key, latest=True) is None  # and a copy read from the relay is refused
        # members' own owned records carry their token and are accepted
        mine = f"run.progress{owner_marker(honest.peer_id)}"
        assert honest.dht.store(mine, 5, now + 60)
        assert relay.dht.get(mine, latest=True).value == 5
    finally:
        for peer in reversed(peers):
            peer.shutdown()
