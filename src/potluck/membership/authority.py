"""The authority's service: a peer presents a credential (or its current token) and gets a token.

One unary method, `membership.token`. A request is `{"cred": {"kind", "name", "secret"}}` for a
first token, or `{"renew": <token bytes>}` to renew a token that is still valid (the connection
has already proved the caller's peer id, which the token must name). The answer is
`{"token": <token bytes>}`; a refusal is a `MembershipError` the caller sees with its text.

Credential attempts are rate-limited per peer id and in total (a peer id costs nothing to make, so
the total limit is what stops online password guessing); password checks run in a thread, one at a
time, so a flood of them cannot stall the event loop or take all the memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import MalformedMessage, MembershipError, PotluckError
from potluck.core.wire import bytes_field, text_field, wire_map
from potluck.dht.records import owner_marker
from potluck.membership.policy import MAX_SECRET_CHARS, Credential, Policy
from potluck.membership.records import MembershipRecordValidator
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.membership import (
    MAX_NAME_CHARS,
    MAX_TOKEN_BYTES,
    REVOCATION_LIFETIME,
    TOKEN_LIFETIME,
    GuestHandlers,
    MembershipGate,
    MembershipToken,
    RevocationList,
)
from potluck.net.transport import Transport

__all__ = ["Authority", "TOKEN_METHOD", "TokenRequest", "authority_gate", "revocation_key"]

logger = logging.getLogger(__name__)

TOKEN_METHOD = "membership.token"
WHAT = "token request"
# Credential checks one peer id may ask for per window: a person retyping a password needs a few;
# a guesser gets 5 a minute from each id (and the total cap below across all ids).
MAX_ATTEMPTS_PER_PEER = 5
# Credential checks all peers together may ask for per window: 120 a minute is far more than a
# run's members need (each renews about once an hour) and keeps online guessing to ~170,000 a day,
# against scrypt-hashed passwords that must be longer than that to be worth anything.
MAX_ATTEMPTS_TOTAL = 120
ATTEMPT_WINDOW = 60.0
# Peer ids whose recent attempts are remembered (oldest forgotten first): bounds the limiter's memory.
MAX_TRACKED_PEERS = 10_000
# How often the authority re-signs and re-publishes its revocation list (well within its lifetime,
# so a list stays in the DHT while the authority is up and a revocation spreads within minutes).
REVOCATION_REPUBLISH = 300.0


def authority_gate(authority: PeerID, run_id: str, clock: Clock = get_dht_time) -> MembershipGate:
    """The authority's own handshake check: members as usual, and tokenless peers as guests that
    may only call TOKEN_METHOD. Pass it to the transport before it starts (`potluck authority` does)."""
    return MembershipGate(authority, run_id, clock=clock, guest_methods={TOKEN_METHOD})


def revocation_key(run_id: str, authority: PeerID | str) -> str:
    """The DHT key of a run's revocation list; owner-marked, so only the authority can write it."""
    return f"{run_id}.membership.revoked{owner_marker(authority)}"


@dataclass(frozen=True)
class TokenRequest:
    """A first request (`credential`) or a renewal (`renew`: the caller's current token bytes)."""

    credential: Credential | None = None
    renew: bytes | None = None

    def to_wire(self) -> dict:
        if self.renew is not None:
            return {"renew": self.renew}
        assert self.credential is not None
        return {"cred": self.credential.to_wire()}

    @classmethod
    def from_wire(cls, obj: object) -> TokenRequest:
        msg = wire_map(obj, WHAT)
        if len(msg) != 1 or not ({"cred"} >= set(msg) or {"renew"} >= set(msg)):
            raise MalformedMessage(WHAT, "a dict with exactly one of 'cred' or 'renew'")
        if "renew" in msg:
            return cls(renew=bytes_field(msg, "renew", WHAT, MAX_TOKEN_BYTES))
        cred = wire_map(msg["cred"], WHAT)
        if set(cred) != {"kind", "name", "secret"}:
            raise MalformedMessage(WHAT, "'cred' must be a dict with 'kind', 'name' and 'secret'")
        kind = cred["kind"]
        if kind not in ("peer", "invite", "password"):
            raise MalformedMessage(WHAT, "'cred.kind' must be 'peer', 'invite' or 'password'")
        name = text_field(cred, "name", WHAT + " 'cred'", MAX_NAME_CHARS)
        secret = text_field(cred, "secret", WHAT + " 'cred'", MAX_SECRET_CHARS)
        return cls(credential=Credential(kind, name, secret))


class AttemptLimiter:
    """Sliding-window counts of credential attempts, per peer id and in total."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self._per_peer: OrderedDict[PeerID, deque[float]] = OrderedDict()
        self._total: deque[float] = deque()

    def attempt(self, peer_id: PeerID) -> None:
        """Count one attempt; MembershipError if the peer (or everybody) is over the limit."""
        now = self.clock()
        horizon = now - ATTEMPT_WINDOW
        while self._total and self._total[0] <= horizon:
            self._total.popleft()
        times = self._per_peer.pop(peer_id, None) or deque()
        while times and times[0] <= horizon:
            times.popleft()
        self._per_peer[peer_id] = times
        while len(self._per_peer) > MAX_TRACKED_PEERS:
            self._per_peer.popitem(last=False)
        if len(times) >= MAX_ATTEMPTS_PER_PEER:
            raise MembershipError(f"too many credential attempts from this peer id: at most {MAX_ATTEMPTS_PER_PEER} "
                                  f"per {ATTEMPT_WINDOW:g} s; wait a minute and check the credential")
        if len(self._total) >= MAX_ATTEMPTS_TOTAL:
            raise MembershipError("the authority is receiving too many credential attempts; retry in a minute")
        times.append(now)
        self._total.append(now)


class Authority:
    """Serves `membership.token` on `transport` for `run_id`, signing with the transport's own key
    (the authority's peer id is its public key). With a `dht`, publishes the revocation list."""

    def __init__(self, transport: Transport, run_id: str, policy: Policy, *,
                 policy_path: str | os.PathLike[str] | None = None, dht: Any = None,
                 clock: Clock = get_dht_time, token_lifetime: float = TOKEN_LIFETIME):
        MembershipToken.issue(transport.identity, transport.peer_id, "check", run_id, 0.0)  # refuse a bad run id now
        self.transport = transport
        self.identity = transport.identity
        self.run_id = run_id
        self.policy = policy
        self.policy_path = policy_path
        self.dht = dht
        self.clock = clock
        self.token_lifetime = token_lifetime
        self.limiter = AttemptLimiter(clock)
        self._kdf_lock = asyncio.Lock()  # one scrypt at a time: 16 MiB and ~50 ms each
        self._publisher: asyncio.Task | None = None
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
        """A freshly signed list of the policy's revoked peers; the version is the time in ms, so
        it grows across restarts of the authority too."""
        now = self.clock()
        return RevocationList.issue(self.identity, self.run_id, int(now * 1000), now + REVOCATION_LIFETIME,
                                    self.policy.revoked_peers())

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
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
            self._publisher = None

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

    def issue(self, peer_id: PeerID, name: str) -> MembershipToken:
        return MembershipToken.issue(self.identity, peer_id, name, self.run_id, self.clock() + self.token_lifetime)

    async def _serve(self, request: object, ctx: CallContext) -> dict:
        parsed = TokenRequest.from_wire(request)
        peer_id = ctx.peer_id
        if parsed.renew is not None:
            try:
                current = MembershipToken.from_wire(parsed.renew)
            except MalformedMessage as e:
                raise MembershipError(f"cannot renew: {e}; request a new token with a credential") from None
            revoked = RevocationList.issue(self.identity, self.run_id, 0, self.clock() + 1, self.policy.revoked_peers())
            current.verify(self.peer_id, peer_id, self.clock(), run_id=self.run_id, revocations=revoked)
            token = self.issue(peer_id, current.name)
            logger.info("renewed the token of %s (%s)", current.name, peer_id)
            return self._answer(token, ctx)
        assert parsed.credential is not None
        self.limiter.attempt(peer_id)
        try:
            if parsed.credential.kind == "password":
                async with self._kdf_lock:
                    name, changed = await asyncio.to_thread(self.policy.admit, peer_id, parsed.credential)
            else:
                name, changed = self.policy.admit(peer_id, parsed.credential)
        except MembershipError as e:
            logger.info("refused a token to %s: %s", peer_id, e)
            raise
        if changed:
            self._save()
        logger.info("issued a token to %s (%s)", name, peer_id)
        return self._answer(self.issue(peer_id, name), ctx)

    def _answer(self, token: MembershipToken, ctx: CallContext) -> dict:
        """The token, after making the caller's connection a member's: it came as a guest."""
        self.gate.present(ctx.peer_id, token.to_wire())
        if isinstance(ctx.connection.handlers, GuestHandlers):
            ctx.connection.handlers = self.transport.handlers
        return {"token": token.to_wire()}
