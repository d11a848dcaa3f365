"""A flood of credential requests from one origin refuses no honest credential (issue 29).

Before, every credential request counted against one bucket of 120 a minute shared by everybody,
counted before the credential was read: about 2 requests a second from anyone blocked every new
member, every restart of an allowlisted machine and every renewal that fell back to its credential
(a valid invite, an allowlisted key and the right password were all refused right after a flood).

Here an attacker on 127.0.0.1 sends 1,000 requests, each from a new made-up peer id: wrong
passwords for the user "alice" and junk invite codes. While it does, a valid invite and an
allowlisted key (both from the attacker's own address: neither can be guessed, so neither is
rationed) and alice's right password (from 127.0.1.1, another /24) are each admitted, and
renewals succeed, including one that falls back to its credential. Real TCP on 127.0.0.x, because
origins are IP addresses; the authority's clock is a hand-moved one that never moves, so no
attempt ever leaves its window. Everything asserted is a count of outcomes.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from potluck.core.errors import MembershipError, NetworkError, RemoteError
from potluck.membership import Authority, MembershipClient, Policy
from potluck.membership.authority import TOKEN_METHOD, TokenRequest
from potluck.membership.policy import Credential
from potluck.net import Identity, TCPTransport
from potluck.net.membership import TOKEN_LIFETIME, MembershipToken

RUN = "flooded-run"
NOW = 1_800_000_000.0
ATTACKER = "127.0.0.1"
ELSEWHERE = "127.0.1.1"  # another /24 on the loopback interface
MADE_UP_IDS = 1000
AT_ONCE = 16  # the attacker's requests in flight: under the transport's 64 handshakes per address


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def outcome(error: BaseException | None) -> str:
    if error is None:
        return "token"
    text = str(error)
    for words, name in (("wrong user name or password", "wrong password (checked)"),
                        ("too many password attempts", "refused before any check"),
                        ("busy checking passwords", "refused before any check"),
                        ("unknown or used up", "junk invite"), ("too many credential attempts", "one bucket")):
        if words in text:
            return name
    return f"other: {type(error).__name__}: {text[:120]}"


async def flood(authority: TCPTransport, credential: Callable[[int], Credential], count: int = MADE_UP_IDS,
                halfway: asyncio.Event | None = None) -> Counter:
    """`count` token requests from 127.0.0.1, each from a new made-up peer id (AT_ONCE at a time);
    how they ended. Sets `halfway` when half of them are answered."""
    outcomes: Counter = Counter()
    slots = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> None:
        async with slots:
            t = TCPTransport(Identity.generate(), host=ATTACKER, client_mode=True)
            await t.start()
            error = None
            try:
                await t.connect(authority.addresses[0], timeout=30)
                await t.call(authority.peer_id, TOKEN_METHOD, TokenRequest(credential=credential(i)).to_wire(),
                             timeout=30)
            except (RemoteError, NetworkError) as e:
                error = e
            finally:
                await t.close()
            outcomes[outcome(error)] += 1
            if halfway is not None and sum(outcomes.values()) >= count // 2:
                halfway.set()

    await asyncio.gather(*(one(i) for i in range(count)))
    return outcomes


def guesses_and_junk(i: int) -> Credential:
    """Wrong passwords for alice and junk invite codes, in turn."""
    if i % 2:
        return Credential("invite", "", f"made-up-code-{i}")
    return Credential("password", "alice", f"guess-{i}")


async def authority_on_loopback(policy: Policy, clock: Clock) -> tuple[TCPTransport, Authority]:
    transport = TCPTransport(Identity.generate(), host=ATTACKER)
    authority = Authority(transport, RUN, policy, clock=clock)
    await transport.start()
    return transport, authority


async def client(authority: TCPTransport, clock: Clock, credential: str | None,
                 host: str = ATTACKER) -> MembershipClient:
    """A member dialing from `host` (a transport on one loopback address dials others from it)."""
    t = TCPTransport(Identity.generate(), host=host, client_mode=True)
    c = MembershipClient(t, authority.addresses[0], credential, clock=clock)
    t.membership = c.gate
    await t.start()
    return c


def seen_from(authority: TCPTransport, member: MembershipClient) -> str:
    """The address the authority sees `member` come from."""
    hosts = {c.remote.observed.host for c in authority.open_connections() if c.peer_id == member.transport.peer_id}
    assert len(hosts) == 1, hosts
    return hosts.pop()


async def admitted(work: Awaitable[Any]) -> str:
    """"token" if `work` got a token, else why not."""
    try:
        await work
    except MembershipError as e:
        return outcome(e)
    return "token"


@pytest.mark.timeout(180)
def test_a_flood_from_one_origin_refuses_no_invite_allowlisted_key_or_password_from_elsewhere(arun):
    async def main():
        clock, policy = Clock(), Policy()
        policy.add_user("alice", "correct horse")
        code = policy.add_invite("newcomer")
        auth_t, authority = await authority_on_loopback(policy, clock)
        invited = await client(auth_t, clock, f"invite:{code}")
        known = await client(auth_t, clock, None)
        policy.allow_peer(str(known.transport.peer_id), "lab-gpu")
        alice = await client(auth_t, clock, "password:alice:correct horse", host=ELSEWHERE)
        clients = [invited, known, alice]
        try:
            halfway = asyncio.Event()
            flooding = asyncio.ensure_future(flood(auth_t, guesses_and_junk, halfway=halfway))
            await halfway.wait()  # 500 made-up ids in: the old shared bucket of 120 is long spent
            honest = await asyncio.gather(
                admitted(invited.fetch()),  # from the attacker's own address
                admitted(known.fetch()),  # likewise: an allowlisted machine restarting
                admitted(alice.fetch()))
            attack = await flooding
            assert honest == ["token", "token", "token"], (honest, attack)
            assert (invited.token.name, known.token.name, alice.token.name) == ("newcomer", "lab-gpu", "alice")
            from potluck.membership.admission import PASSWORDS_PER_NAME_PER_SUBNET
            # the attacker got nothing, and at most its subnet's share of alice's scrypt checks
            assert sum(attack.values()) == MADE_UP_IDS and "token" not in attack, attack
            assert attack["junk invite"] == MADE_UP_IDS // 2, attack
            assert attack["wrong password (checked)"] <= PASSWORDS_PER_NAME_PER_SUBNET, attack
            assert attack["wrong password (checked)"] + attack["refused before any check"] == MADE_UP_IDS // 2, attack
            assert seen_from(auth_t, alice) == ELSEWHERE and seen_from(auth_t, known) == ATTACKER
            # after the flood, the same again: nothing the attacker did is held against the others
            late = await client(auth_t, clock, f"invite:{policy.add_invite('late')}")
            clients.append(late)
            assert await admitted(late.fetch()) == "token"
        finally:
            for c in clients:
                await c.transport.close()
            await auth_t.close()

    arun(main(), timeout=170)


@pytest.mark.timeout(180)
def test_renewals_succeed_during_a_flood_even_those_that_fall_back_to_the_credential(arun):
    async def main():
        clock, policy = Clock(), Policy()
        policy.add_user("alice", "correct horse")
        auth_t, authority = await authority_on_loopback(policy, clock)
        members = [await client(auth_t, clock, None) for _ in range(2)]
        for i, m in enumerate(members):
            policy.allow_peer(str(m.transport.peer_id), f"machine-{i}")
        alice = await client(auth_t, clock, "password:alice:correct horse", host=ELSEWHERE)
        try:
            for m in members:
                await m.fetch()
            await alice.fetch()
            assert seen_from(auth_t, alice) == ELSEWHERE
            asleep = members[1]
            # its token ran out while it was away
            asleep.token = MembershipToken.issue(auth_t.identity, asleep.transport.peer_id, "machine-1", RUN, NOW - 1)
            halfway = asyncio.Event()
            flooding = asyncio.ensure_future(flood(auth_t, guesses_and_junk, halfway=halfway))
            await halfway.wait()
            renewed = await asyncio.gather(
                admitted(members[0].renew()),  # with its token
                admitted(asleep.renew()),  # no valid token: falls back to its allowlisted key
                admitted(alice.renew()))
            attack = await flooding
            assert renewed == ["token", "token", "token"], (renewed, attack)
            assert all(c.token.expires == NOW + TOKEN_LIFETIME for c in (*members, alice))
            assert "token" not in attack, attack
        finally:
            for c in (*members, alice):
                await c.transport.close()
            await auth_t.close()

    arun(main(), timeout=170)
