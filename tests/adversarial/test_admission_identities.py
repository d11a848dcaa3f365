"""One password, a bounded number of identities; guessing from many origins slows only passwords
(issue 29).

Before, one password gave unlimited identities: 120 tokens named "alice" for 120 new peer ids in
4.9 s, each a separate peer wherever potluck counts peers (robust aggregation's f, state votes),
so one member raised the number of attackers the run must tolerate at will. Now a user name holds
at most `max_identities` live identities (default 1): a login of a new peer id replaces the name's
oldest, whose peer id goes on the revocation list that members read, and whose renewals are
refused with a reason.

On the emulated network in virtual time, where each peer is its own origin: the second test is a
botnet of 1,000 made-up peers, each from its own origin, guessing alice's password, while an
invite, an allowlisted key, a renewal and alice from a place she logged in from before are all
admitted. Everything asserted is a count of outcomes.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from potluck.core.dht_time import event_loop_clock
from potluck.core.errors import MembershipError, MembershipRefused, NetworkError, RemoteError
from potluck.core.virtual_time import run_virtual
from potluck.dht import DHT
from potluck.membership import Authority, MembershipClient, MembershipRecordValidator, Policy
from potluck.membership.authority import TOKEN_METHOD, TokenRequest
from potluck.membership.policy import Credential
from potluck.net.emulated import EmulatedNetwork
from tests.test_membership_emulated import start_authority

RUN = "one-person-one-peer"
PASSWORD = "correct horse"
LOGINS = 30  # new peer ids logging in as alice, one after the other


async def start_client(net: EmulatedNetwork, authority: Authority, credential: str | None,
                       with_dht: bool = False) -> tuple[MembershipClient, DHT | None]:
    transport = net.transport()
    address = authority.transport.addresses[0]
    dht = DHT(transport, initial_peers=[address], clock=event_loop_clock()) if with_dht else None
    client = MembershipClient(transport, address, credential, dht=dht, clock=event_loop_clock())
    transport.membership = client.gate
    if dht is not None:
        dht.add_validator(MembershipRecordValidator(client.gate))
    await transport.start()
    return client, dht


async def got_token(client: MembershipClient) -> bool:
    try:
        await client.fetch()
    except MembershipError:
        return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bound", [None, 3])
def test_one_password_holds_at_most_its_bound_of_live_identities(bound):
    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        policy = Policy()
        policy.add_user("alice", PASSWORD)
        if bound is not None:
            policy.set_max_identities(bound, "alice")
        authority, auth_dht = await start_authority(net, policy, RUN)
        member, m_dht = await start_client(net, authority, None, with_dht=True)
        policy.allow_peer(str(member.transport.peer_id), "honest")
        await member.fetch()
        await m_dht.astart()
        alices = [(await start_client(net, authority, f"password:alice:{PASSWORD}"))[0] for _ in range(LOGINS)]
        try:
            succeeded = [a for a in alices if await got_token(a)]
            await asyncio.sleep(30)  # the authority stores its new revocation list in the DHT
            assert await member.refresh_revocations()
            live = []
            for a in succeeded:  # what a member of the run admits
                try:
                    await a.transport.connect(member.transport.addresses[0], timeout=5)
                    live.append(a)
                except MembershipRefused as e:
                    assert "was revoked" in str(e)
            limit = bound or 1
            assert live == succeeded[-limit:], (len(succeeded), len(live))  # the newest ones
            from potluck.membership.policy import MAX_REPLACED_PER_NAME, IdentityReplaced
            assert len(succeeded) <= limit + MAX_REPLACED_PER_NAME
            # the identities alice holds renew; the replaced ones are told why, and do not log in again
            for a in live:
                await a.renew()
            for a in succeeded[:-limit]:
                with pytest.raises(IdentityReplaced, match="replaced by a newer login of 'alice'"):
                    await a.renew()
                with pytest.raises(IdentityReplaced):
                    await a.renew()  # not a new password login that would take a place back
            assert [p for p in policy.identities["alice"]] == [str(a.transport.peer_id) for a in live]
        finally:
            for c in (member, *alices):
                await c.transport.close()
            await authority.stop()
            await m_dht.ashutdown()
            await auth_dht.ashutdown()
            await authority.transport.close()

    run_virtual(scenario())


BOTNET = 1000
AT_ONCE = 50


def outcome(error: BaseException | None) -> str:
    if error is None:
        return "token"
    text = str(error)
    for words, name in (("wrong user name or password", "wrong password (checked)"),
                        ("too many password attempts", "refused before any check"),
                        ("busy checking passwords", "refused before any check"),
                        ("too many credential attempts", "one bucket")):
        if words in text:
            return name
    return f"other: {type(error).__name__}: {text[:120]}"


@pytest.mark.timeout(180)
def test_guessing_from_many_origins_slows_only_password_logins_from_new_places():
    async def scenario():
        net = EmulatedNetwork(latency=0.005)
        policy = Policy()
        policy.add_user("alice", PASSWORD)
        code = policy.add_invite("newcomer")
        authority, auth_dht = await start_authority(net, policy, RUN)
        alice, _ = await start_client(net, authority, f"password:alice:{PASSWORD}")
        member, _ = await start_client(net, authority, None)
        restarting, _ = await start_client(net, authority, None)
        invited, _ = await start_client(net, authority, f"invite:{code}")
        for c, name in ((member, "m"), (restarting, "r")):
            policy.allow_peer(str(c.transport.peer_id), name)
        clients = [alice, member, restarting, invited]
        try:
            await alice.fetch()  # alice logged in before, from her place
            await member.fetch()
            outcomes: Counter = Counter()
            slots = asyncio.Semaphore(AT_ONCE)
            halfway = asyncio.Event()

            async def bot(i: int) -> None:
                async with slots:
                    t = net.transport()  # a new origin and a new peer id each
                    await t.start()
                    error = None
                    try:
                        await t.connect(authority.transport.addresses[0], timeout=10)
                        request = TokenRequest(credential=Credential("password", "alice", f"guess-{i}"))
                        await t.call(authority.transport.peer_id, TOKEN_METHOD, request.to_wire(), timeout=30)
                    except (RemoteError, NetworkError) as e:
                        error = e
                    finally:
                        await t.close()
                    outcomes[outcome(error)] += 1
                    if sum(outcomes.values()) >= BOTNET // 2:
                        halfway.set()

            botnet = asyncio.ensure_future(asyncio.gather(*(bot(i) for i in range(BOTNET))))
            await halfway.wait()
            newcomer, _ = await start_client(net, authority, f"password:alice:{PASSWORD}")
            clients.append(newcomer)
            honest = await asyncio.gather(got_token(invited), got_token(restarting), got_token(alice),
                                          _renewed(member))
            new_place = await got_token(newcomer)
            await botnet
            assert honest == [True, True, True, True], (honest, outcomes)
            assert sum(outcomes.values()) == BOTNET and outcomes["token"] == 0, outcomes
            from potluck.membership.admission import PASSWORDS_PER_NAME
            assert outcomes["wrong password (checked)"] <= PASSWORDS_PER_NAME, outcomes
            # what the botnet can do: a new place of alice's is refused while the name's budget is spent
            assert not new_place
        finally:
            for c in clients:
                await c.transport.close()
            await authority.stop()
            await auth_dht.ashutdown()
            await authority.transport.close()

    run_virtual(scenario())


async def _renewed(client: MembershipClient) -> bool:
    try:
        await client.renew()
    except MembershipError:
        return False
    return True
