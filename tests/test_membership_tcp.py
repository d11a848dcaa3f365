"""Membership over real TCP on 127.0.0.1: the handshake admits members only, each refusal says why,
tokens come from the authority and are renewed, and members outlive an authority outage.

Time is an injected clock (`Clock`), never sleeps: tokens expire when a test moves the clock.
"""

from __future__ import annotations

import asyncio

import pytest

from potluck.core import compat
from potluck.core.errors import MembershipError, MembershipRefused, RemoteError
from potluck.membership import Authority, MembershipClient, Policy
from potluck.membership.client import RENEW_BEFORE
from potluck.net import Identity, TCPTransport
from potluck.net.membership import TOKEN_LIFETIME, MembershipGate, MembershipToken, RevocationList

NOW = 1_800_000_000.0
RUN = "run-a"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


async def echo(request, ctx):
    return request


async def transport(gate: MembershipGate | None = None, identity: Identity | None = None) -> TCPTransport:
    t = TCPTransport(identity or Identity.generate(), host="127.0.0.1", membership=gate)
    t.add_handler("echo", echo)
    await t.start()
    return t


async def member(authority: Identity, clock: Clock, *, token=None, run=RUN) -> TCPTransport:
    """A transport of the run that shows `token(identity)` (None: no token)."""
    identity = Identity.generate()
    issued = token(identity) if token is not None else None
    gate = MembershipGate(authority.peer_id, run, clock=clock, token=lambda: issued)
    return await transport(gate, identity)


def valid(authority: Identity, run: str = RUN, expires: float = NOW + 600):
    return lambda identity: MembershipToken.issue(authority, identity.peer_id, "m", run, expires)


@pytest.mark.timeout(30)
def test_members_with_valid_tokens_connect_and_call_both_ways(arun):
    async def main():
        authority, clock = Identity.generate(), Clock()
        a = await member(authority, clock, token=valid(authority))
        b = await member(authority, clock, token=valid(authority))
        try:
            assert await b.connect(a.addresses[0], timeout=5) == a.peer_id
            assert await b.call(a.peer_id, "echo", 1, timeout=5) == 1
            assert await a.call(b.peer_id, "echo", 2, timeout=5) == 2
        finally:
            await a.close()
            await b.close()
    arun(main())


REVOKED = object()
FORGER = Identity.generate()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, words", [
    ("none", "presented no membership token"),
    ("expired", "expired"),
    ("other peer", "issued to peer"),
    ("revoked", "was revoked"),
    ("forged", "not signed by this run's authority"),
    ("other run", "is for run 'run-b'"),
])
def test_dialer_without_a_valid_token_is_refused_and_told_why(arun, case, words):
    async def main():
        authority, clock = Identity.generate(), Clock()
        acceptor = await member(authority, clock, token=valid(authority))
        stranger = Identity.generate()
        tokens = {
            "none": None,
            "expired": valid(authority, expires=NOW - 1),
            "other peer": lambda _: MembershipToken.issue(authority, stranger.peer_id, "x", RUN, NOW + 600),
            "revoked": valid(authority),
            "forged": valid(FORGER),
            "other run": valid(authority, run="run-b"),
        }
        dialer = await member(authority, clock, token=tokens[case])
        if case == "revoked":
            acceptor.membership.update_revocations(
                RevocationList.issue(authority, RUN, 1, NOW + 600, [dialer.peer_id]))
        honest = await member(authority, clock, token=valid(authority))
        try:
            with pytest.raises(MembershipRefused, match=words) as info:
                await dialer.connect(acceptor.addresses[0], timeout=5)
            assert "refused this peer's membership" in str(info.value)
            assert not acceptor.is_connected(dialer.peer_id)
            # the refusing peer keeps serving members
            await honest.connect(acceptor.addresses[0], timeout=5)
            assert await honest.call(acceptor.peer_id, "echo", 3, timeout=5) == 3
        finally:
            for t in (acceptor, dialer, honest):
                await t.close()
    arun(main())


@pytest.mark.timeout(30)
def test_dialer_refuses_an_acceptor_without_a_valid_token(arun):
    async def main():
        authority, clock = Identity.generate(), Clock()
        impostor = await member(authority, clock, token=valid(FORGER))
        dialer = await member(authority, clock, token=valid(authority))
        try:
            with pytest.raises(MembershipRefused, match="not signed by this run's authority"):
                await dialer.connect(impostor.addresses[0], timeout=5)
        finally:
            await impostor.close()
            await dialer.close()
    arun(main())


@pytest.mark.timeout(30)
def test_runs_without_an_authority_admit_anyone_as_before(arun):
    async def main():
        a, b = await transport(), await transport()
        try:
            await b.connect(a.addresses[0], timeout=5)
            assert await b.call(a.peer_id, "echo", 4, timeout=5) == 4
        finally:
            await a.close()
            await b.close()
    arun(main())


async def authority_with(policy: Policy, clock: Clock) -> tuple[TCPTransport, Authority]:
    t = await transport()
    t.add_handler("secret", echo)
    return t, Authority(t, RUN, policy, clock=clock)


async def client_of(authority: TCPTransport, clock: Clock, credential=None, **kwargs) -> MembershipClient:
    t = TCPTransport(Identity.generate(), host="127.0.0.1")
    t.add_handler("echo", echo)
    c = MembershipClient(t, authority.addresses[0], credential, clock=clock, **kwargs)
    t.membership = c.gate
    await t.start()
    return c


@pytest.mark.timeout(60)
def test_authority_issues_tokens_by_policy_and_refuses_with_reasons(arun):
    async def main():
        clock = Clock()
        policy = Policy()
        code = policy.add_invite("guest")
        policy.add_user("bob", "hunter22")
        auth_t, authority = await authority_with(policy, clock)
        allowed = await client_of(auth_t, clock)
        policy.allow_peer(str(allowed.transport.peer_id), "ally")
        invited = await client_of(auth_t, clock, f"invite:{code}")
        user = await client_of(auth_t, clock, "password:bob:hunter22")
        stranger = await client_of(auth_t, clock)
        wrong = await client_of(auth_t, clock, "password:bob:nope")
        reused = await client_of(auth_t, clock, f"invite:{code}")
        clients = [allowed, invited, user, stranger, wrong, reused]
        try:
            assert (await allowed.fetch()).name == "ally"
            assert (await invited.fetch()).name == "guest"
            token = await user.fetch()
            assert (token.name, token.run_id, token.expires) == ("bob", RUN, NOW + TOKEN_LIFETIME)
            assert user.run_id == RUN
            with pytest.raises(MembershipError, match="not on the authority's allowlist"):
                await stranger.fetch()
            with pytest.raises(MembershipError, match="wrong user name or password"):
                await wrong.fetch()
            with pytest.raises(MembershipError, match="unknown or used up"):
                await reused.fetch()
            # a peer without a token reached the authority as a guest: it may ask for a token, nothing else
            with pytest.raises(RemoteError, match="serves only membership requests"):
                await stranger.transport.call(auth_t.peer_id, "secret", 1, timeout=5)
            # a member is admitted for real
            assert await user.transport.call(auth_t.peer_id, "secret", 5, timeout=5) == 5
            # and members reach each other with the tokens they fetched
            await invited.transport.connect(user.transport.addresses[0], timeout=5)
            assert await invited.transport.call(user.transport.peer_id, "echo", 6, timeout=5) == 6
            with pytest.raises(MembershipRefused, match="presented no membership token"):
                await stranger.transport.connect(user.transport.addresses[0], timeout=5)
        finally:
            for c in clients:
                await c.transport.close()
            await auth_t.close()
    arun(main())


@pytest.mark.timeout(30)
def test_the_configured_authority_address_is_dialed_and_checked(arun):
    """`fetch` connects to the authority address the user gave (so the transport vouches for it):
    a dead address, or another peer listening there, is a MembershipError saying so."""
    async def main():
        clock = Clock()
        auth_t, _ = await authority_with(Policy(), clock)
        impostor = await transport()
        gone = await transport()
        address = gone.addresses[0]
        await gone.close()
        t = await transport()
        try:
            dead = MembershipClient(t, address, None, clock=clock)
            with pytest.raises(MembershipError, match="cannot reach the authority"):
                await dead.fetch()
            # the authority's id at the impostor's address: the peer there cannot prove that id
            wrong = MembershipClient(t, f"{impostor.addresses[0].without_peer_id()}/p2p/{auth_t.peer_id}", None,
                                     clock=clock)
            with pytest.raises(MembershipError, match="cannot reach the authority"):
                await wrong.fetch()
        finally:
            for x in (t, impostor, auth_t):
                await x.close()
    arun(main())


@pytest.mark.timeout(60)
def test_password_guessing_is_rate_limited_per_name_and_origin(arun):
    async def main():
        clock = Clock()
        policy = Policy()
        policy.add_user("bob", "hunter22")
        auth_t, _ = await authority_with(policy, clock)
        guesser = await client_of(auth_t, clock, "password:bob:guess")
        try:
            for _ in range(5):
                with pytest.raises(MembershipError, match="wrong user name or password"):
                    await guesser.fetch()
            guesser.credential = guesser.credential.__class__("password", "bob", "hunter22")
            with pytest.raises(MembershipError, match="too many password attempts for this user name from 127.0.0.0/24"):
                await guesser.fetch()
            clock.now += 61
            assert (await guesser.fetch()).name == "bob"
        finally:
            await guesser.transport.close()
            await auth_t.close()
    arun(main())


@pytest.mark.timeout(60)
def test_a_renewed_token_keeps_a_long_running_peer_connected(arun):
    async def main():
        clock = Clock()
        policy = Policy()
        auth_t, _ = await authority_with(policy, clock)
        a, b, lapsed = [await client_of(auth_t, clock) for _ in range(3)]
        for i, c in enumerate((a, b, lapsed)):
            policy.allow_peer(str(c.transport.peer_id), f"m{i}")
            await c.fetch()
        try:
            await b.transport.connect(a.transport.addresses[0], timeout=5)
            await lapsed.transport.connect(a.transport.addresses[0], timeout=5)
            first_expiry = b.token.expires
            for hour in range(1, 4):  # three lifetimes: each renewal is shown to the connected peer
                clock.now = NOW + hour * TOKEN_LIFETIME - RENEW_BEFORE + 1
                assert await b.renew_if_due()
                assert not await b.renew_if_due()  # not due again right away
            assert b.token.expires > first_expiry + 2 * TOKEN_LIFETIME
            assert a.sweep() == 1  # only `lapsed`, whose token expired long ago, is dropped
            assert a.transport.is_connected(b.transport.peer_id)
            assert not a.transport.is_connected(lapsed.transport.peer_id)
            assert await b.transport.call(a.transport.peer_id, "echo", 7, timeout=5) == 7
            assert await a.transport.call(b.transport.peer_id, "echo", 8, timeout=5) == 8
        finally:
            for c in (a, b, lapsed):
                await c.transport.close()
            await auth_t.close()
    arun(main())


@pytest.mark.timeout(60)
def test_the_background_loop_renews_before_expiry_and_shows_the_new_token(arun):
    async def main():
        clock = Clock()
        policy = Policy()
        auth_t, _ = await authority_with(policy, clock)
        a, b = await client_of(auth_t, clock), await client_of(auth_t, clock)
        for c in (a, b):
            policy.allow_peer(str(c.transport.peer_id), "m")
            await c.fetch()
        await b.transport.connect(a.transport.addresses[0], timeout=5)
        old = b.token
        clock.now = old.expires - RENEW_BEFORE + 1  # due: the loop renews on its first pass
        b.start()
        try:
            async with compat.timeout(20):
                await b.renewed.wait()
            assert b.token.expires > old.expires
            clock.now = old.expires + 1
            assert a.sweep() == 0  # a saw the renewed token on the open connection
            assert await a.transport.call(b.transport.peer_id, "echo", 11, timeout=5) == 11
        finally:
            await b.stop()
            for c in (a, b):
                await c.transport.close()
            await auth_t.close()
    arun(main())


@pytest.mark.timeout(60)
def test_an_authority_that_goes_down_does_not_stop_members_with_valid_tokens(arun):
    async def main():
        clock = Clock()
        policy = Policy()
        auth_t, _ = await authority_with(policy, clock)
        a, b = await client_of(auth_t, clock), await client_of(auth_t, clock)
        for c in (a, b):
            policy.allow_peer(str(c.transport.peer_id), "m")
            await c.fetch()
        await auth_t.close()
        try:
            clock.now += TOKEN_LIFETIME - RENEW_BEFORE + 1  # renewal is due, but the authority is gone
            with pytest.raises(MembershipError, match="cannot reach the authority"):
                await a.renew_if_due()
            await b.transport.connect(a.transport.addresses[0], timeout=5)
            assert await b.transport.call(a.transport.peer_id, "echo", 9, timeout=5) == 9
            assert a.sweep() == 0 and b.sweep() == 0
            clock.now = a.token.expires + 1  # only once the tokens run out are members cut off
            assert a.sweep() == 1
            with pytest.raises(MembershipRefused, match="expired"):
                await b.transport.connect(a.transport.addresses[0], timeout=5)
        finally:
            await a.transport.close()
            await b.transport.close()
    arun(main())


@pytest.mark.timeout(60)
def test_a_second_login_of_a_name_replaces_the_first_and_the_first_is_told_what_to_do(arun):
    from potluck.membership import IdentityReplaced

    async def main():
        clock = Clock()
        policy = Policy()
        policy.add_user("bob", "hunter22")
        auth_t, authority = await authority_with(policy, clock)
        first, second = [await client_of(auth_t, clock, "password:bob:hunter22") for _ in range(2)]
        try:
            await first.fetch()
            clock.now += 10
            await second.fetch()  # bob's new machine: at most 1 live identity, so it replaces `first`
            assert authority.gate.revocations.is_revoked(first.transport.peer_id)
            assert not auth_t.is_connected(first.transport.peer_id)  # cut off at the authority at once
            async with compat.timeout(10):
                while first.transport.is_connected(auth_t.peer_id):  # until `first` sees the close
                    await asyncio.sleep(0.01)
            with pytest.raises(IdentityReplaced) as info:
                await first.renew()
            assert "\n" not in str(info.value)
            assert "replaced by a newer login of 'bob'" in str(info.value) and "stop this peer" in str(info.value)
            assert second.gate.update_revocations(authority.gate.revocations)  # as members read it from the DHT
            with pytest.raises(MembershipRefused, match="was revoked"):
                await first.transport.connect(second.transport.addresses[0], timeout=5)
            # its owner may still take the place back on purpose, with the password
            first.replaced = None
            clock.now += 10
            await first.fetch()
            assert not authority.gate.revocations.is_revoked(first.transport.peer_id)
            assert authority.gate.revocations.is_revoked(second.transport.peer_id)
            assert await first.transport.call(auth_t.peer_id, "secret", 1, timeout=5) == 1
            with pytest.raises(IdentityReplaced):
                await second.renew()
        finally:
            for c in (first, second):
                await c.transport.close()
            await auth_t.close()
    arun(main())
