"""The authority's service: a peer presents a credential (or its current token) and gets a token.

One unary method, `membership.token`. A request is `{"cred": {"kind", "name", "secret"}}` for a
first token, or `{"renew": <token bytes>}` to renew a token that is still valid (the connection
has already proved the caller's peer id, which the token must name). The answer is
`{"token": <token bytes>}` (`TokenGrant`); a refusal is a `MembershipError` the caller sees with its text.

Only password attempts are rationed, per origin and per user name (`membership.admission`): an
allowlisted key is proved by the connection itself and an invite code cannot be guessed, so
neither is ever refused because strangers are guessing passwords, and renewals are checked by
their token's signature. Password checks run in threads, a bounded number at a time, so a flood
of them cannot stall the event loop or take all the memory. A password login of a new peer id
beyond its user name's `max_identities` replaces the name's oldest identity (`Policy.take_identity`):
the authority re-signs its revocation list at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import MalformedMessage, MembershipError, PotluckError
from potluck.core.names import RunNames, check_run_id
from potluck.core.wire import Bytes, Message, Nested
from potluck.dht.records import owner_marker
from potluck.membership.admission import PasswordChecks, PasswordLimits
from potluck.membership.policy import Credential, IdentityReplaced, Policy
from potluck.membership.records import MembershipRecordValidator
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.membership import (
    MAX_TOKEN_BYTES,
    REVOCATION_LIFETIME,
    TOKEN_LIFETIME,
    GuestHandlers,
    MembershipGate,
    MembershipToken,
    RevocationList,
)
from potluck.net.origins import Origin, origin_of
from potluck.net.transport import Transport

__all__ = [
    "Authority", "TOKEN_METHOD", "TokenGrant", "TokenRequest", "authority_gate", "caller_origin", "revocation_key",
]

logger = logging.getLogger(__name__)

TOKEN_METHOD = "membership.token"
# How often the authority re-signs and re-publishes its revocation list (well within its lifetime,
# so a list stays in the DHT while the authority is up and a revocation spreads within minutes).
REVOCATION_REPUBLISH = 300.0


def authority_gate(authority: PeerID, run_id: str, clock: Clock = get_dht_time) -> MembershipGate:
    """The authority's own handshake check: members as usual, and tokenless peers as guests that
    may only call TOKEN_METHOD. Pass it to the transport before it starts (`potluck authority` does)."""
    return MembershipGate(authority, run_id, clock=clock, guest_methods={TOKEN_METHOD})


def revocation_key(run_id: str, authority: PeerID | str) -> str:
    """The DHT key of a run's revocation list; owner-marked, so only the authority can write it."""
    return RunNames(run_id).revoked(owner_marker(authority))


class TokenRequest(Message, what="token request"):
    """A first request (`credential`) or a renewal (`renew`: the caller's current token bytes,
    read by the authority, which says why it cannot renew them)."""

    credential: Credential | None = Nested("cred", Credential, default=None)
    renew: bytes | None = Bytes("renew", MAX_TOKEN_BYTES, default=None)

    def validate(self, context: Any) -> None:
        if (self.credential is None) == (self.renew is None):
            raise self.refuse("a dict with exactly one of 'cred' or 'renew'")


class TokenGrant(Message, what="token answer"):
    """The authority's answer: the caller's new token."""

    token: MembershipToken = Nested(message=MembershipToken)


def caller_origin(ctx: CallContext) -> Origin:
    """Where a caller comes from (`net.origins`). A relayed caller counts under "relayed": the
    connection does not say through which relay, and in a governed run relays serve members only."""
    if ctx.remote is not None and ctx.remote.relayed:
        return Origin.relayed("*")
    return origin_of(None if ctx.remote is None else ctx.remote.observed)


class Authority:
    """Serves `membership.token` on `transport` for `run_id`, signing with the transport's own key
    (the authority's peer id is its public key). With a `dht`, publishes the revocation list."""

    def __init__(self, transport: Transport, run_id: str, policy: Policy, *,
                 policy_path: str | os.PathLike[str] | None = None, dht: Any = None,
                 clock: Clock = get_dht_time, token_lifetime: float = TOKEN_LIFETIME):
        try:
            check_run_id(run_id)  # it names the run's keys (`RunNames`) and is in every token
        except ValueError as e:
            raise MembershipError(f"an authority needs a valid run id: {e}") from None
        self.transport = transport
        self.identity = transport.identity
        self.run_id = run_id
        self.policy = policy
        self.policy_path = policy_path
        self.dht = dht
        self.clock = clock
        self.token_lifetime = token_lifetime
        self.limits = PasswordLimits(clock, known_name=lambda name: name in self.policy.users)
        self.password_checks = PasswordChecks()
        self._version = 0  # of the last revocation list signed: each one newer than the last
        self._publisher: asyncio.Task | None = None
        self._store: asyncio.Task | None = None  # storing a changed revocation list in the DHT
        self._store_again = False
        # Peers without a token may connect, but may only ask for one (`net.membership.GuestHandlers`).
        # A transport built with `authority_gate` (so it was guarded from its first connection) keeps it.
        gate = getattr(transport, "membership", None)
        if not isinstance(gate, MembershipGate) or gate.authority != transport.peer_id or gate.run_id != run_id:
            gate = authority_gate(transport.peer_id, run_id, clock)
        self.gate = gate
        transport.membership = gate
        transport.add_handler(TOKEN_METHOD, self._serve)
        if dht is not None:
            dht.add_validator(MembershipRecordValidator(self.gate))

    @property
    def peer_id(self) -> PeerID:
        return self.transport.peer_id

    def revocations(self) -> RevocationList:
        """A freshly signed list of the policy's revoked peers (and replaced identities whose tokens
        have not expired); the version is the time in ms (so it grows across restarts of the
        authority too), and always above the last one's."""
        now = self.clock()
        self._version = max(self._version + 1, int(now * 1000))
        return RevocationList.issue(self.identity, self.run_id, self._version, now + REVOCATION_LIFETIME,
                                    self.policy.revoked_peers(now))

    async def publish_revocations(self) -> RevocationList:
        """Sign the current list and store it in the DHT (if any); returns it."""
        revocations = self.revocations()
        self.gate.update_revocations(revocations)
        self.close_revoked()
        if self.dht is not None:
            await self.dht.astore(revocation_key(self.run_id, self.peer_id), revocations.to_wire(),
                                  revocations.expires)
        return revocations

    async def revoke(self, peer_id: PeerID | str) -> RevocationList:
        """Void `peer_id`'s tokens: no renewal from now on, and peers refuse it once they read the list."""
        self.policy.revoke(str(peer_id))
        self._save()
        return await self.publish_revocations()

    def close_revoked(self) -> int:
        """Close our connections with revoked peers (they may reconnect only as guests, and get no
        token); returns how many."""
        revocations = self.gate.revocations
        closed = 0
        for conn in self.transport.open_connections():
            if revocations is not None and revocations.is_revoked(conn.peer_id):
                conn.close("membership revoked by the authority")
                closed += 1
        return closed

    def start_publishing(self) -> None:
        """Publish the revocation list now and every REVOCATION_REPUBLISH seconds until `stop`."""
        if self._publisher is None:
            self._publisher = asyncio.ensure_future(self._publish_forever())

    async def stop(self) -> None:
        self.transport.remove_handler(TOKEN_METHOD)
        for task in (self._publisher, self._store):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._publisher = self._store = None

    def _revocations_changed(self) -> None:
        """Replaced identities: adopt the new list here at once (the authority's own handshakes and
        renewals), close their connections, and store it in the DHT in the background (one store
        at a time; a change during one is stored after it)."""
        self.gate.update_revocations(self.revocations())
        self.close_revoked()
        if self.dht is None:
            return
        if self._store is not None and not self._store.done():
            self._store_again = True
            return
        self._store = asyncio.ensure_future(self._store_revocations())

    async def _store_revocations(self) -> None:
        while True:
            self._store_again = False
            try:
                await self.publish_revocations()
            except PotluckError as e:
                logger.warning("could not publish the revocation list (members read it at the next "
                               "republish): %s", e)
            if not self._store_again:
                return

    async def _publish_forever(self) -> None:
        while True:
            try:
                await self.publish_revocations()
            except PotluckError as e:
                logger.warning("could not publish the revocation list (retrying in %g s): %s", REVOCATION_REPUBLISH, e)
            await asyncio.sleep(REVOCATION_REPUBLISH)

    def _save(self) -> None:
        if self.policy_path is not None:
            self.policy.save(self.policy_path)

    def issue(self, peer_id: PeerID, name: str, expires: float | None = None) -> MembershipToken:
        """A token for `peer_id` as `name`, until `expires` (default: a token lifetime from now)."""
        if expires is None:
            expires = self.clock() + self.token_lifetime
        return MembershipToken.issue(self.identity, peer_id, name, self.run_id, expires)

    async def _serve(self, request: object, ctx: CallContext) -> dict:
        parsed = TokenRequest.from_wire(request)
        if parsed.renew is not None:
            return self._renew(parsed.renew, ctx)
        credential = parsed.credential
        assert credential is not None
        peer_id = ctx.peer_id
        try:
            if credential.kind == "password":
                name = await self._check_password(credential, ctx)
                now = self.clock()
                expires = now + self.token_lifetime
                listed = str(peer_id) in self.policy.replaced  # a replaced identity taking a place back
                replaced = self.policy.take_identity(name, peer_id, expires, now)
                self._save()
                if replaced:
                    logger.info("%s logged in as %s from a new peer id, which replaces %s", peer_id, name,
                                ", ".join(replaced))
            else:  # an allowlisted key or an invite: nothing to guess, a look-up to check
                name, changed = self.policy.admit(peer_id, credential)
                expires = self.clock() + self.token_lifetime
                listed, replaced = self.policy.readmit(peer_id), []
                if listed or changed:
                    self._save()
            if listed or replaced:
                self._revocations_changed()
        except MembershipError as e:
            logger.info("refused a token to %s: %s", peer_id, e)
            raise
        logger.info("issued a token to %s (%s)", name, peer_id)
        return self._answer(self.issue(peer_id, name, expires), ctx)

    async def _check_password(self, credential: Credential, ctx: CallContext) -> str:
        """The user name the password proves; TooManyAttempts (before any scrypt) over a limit of
        `membership.admission`, MembershipError if wrong."""
        origin = caller_origin(ctx)
        self.limits.check(origin, credential.name)
        self.password_checks.claim(origin, ctx.peer_id)  # an attempt refused here costs nothing: not counted
        self.limits.count(origin, credential.name)
        name, _ = await self.password_checks.run(origin, ctx.peer_id, self.policy.admit, ctx.peer_id, credential)
        self.limits.logged_in(name, origin)
        return name

    def _renew(self, wire: bytes, ctx: CallContext) -> dict:
        """A new token for the caller's still valid one (not counted: the token's signature is the proof)."""
        peer_id, now = ctx.peer_id, self.clock()
        try:
            current = MembershipToken.from_wire(wire)
        except MalformedMessage as e:
            raise MembershipError(f"cannot renew: {e}; request a new token with a credential") from None
        current.verify(self.peer_id, peer_id, now, run_id=self.run_id)
        if str(peer_id) in self.policy.revoked:
            raise MembershipError(f"the membership of {current.name!r} ({peer_id}) was revoked by the authority; "
                                  "ask the run's organizers to restore it")
        expires = now + self.token_lifetime
        try:
            if self.policy.renew_identity(current.name, peer_id, expires, now):
                self._save()
        except IdentityReplaced as e:
            logger.info("refused to renew the token of %s (%s): %s", current.name, peer_id, e)
            raise
        logger.info("renewed the token of %s (%s)", current.name, peer_id)
        return self._answer(self.issue(peer_id, current.name, expires), ctx)

    def _answer(self, token: MembershipToken, ctx: CallContext) -> dict:
        """The token, after making the caller's connection a member's: it came as a guest."""
        self.gate.present(ctx.peer_id, token.to_wire())
        if isinstance(ctx.connection.handlers, GuestHandlers):
            ctx.connection.handlers = self.transport.handlers
        return TokenGrant(token).to_wire()
