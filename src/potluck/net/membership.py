"""Membership tokens and revocation lists: who belongs to an authority-governed run.

A run's authority is a peer whose Ed25519 key (its peer id) signs two kinds of statement:

- a `MembershipToken` `{peer_id, name, run_id, expires}`: "this peer id may take part in this run
  until then". A peer shows it in its handshake (and in its DHT records); anyone who knows the
  authority's peer id checks it without asking the authority.
- a `RevocationList` `{run_id, version, expires, revoked peer ids}`: tokens of these peers are void
  before they expire. The authority publishes it in the DHT; a higher version replaces a lower one.

`MembershipGate` is what a transport consults in its handshake. This module knows nothing of the
DHT or of how tokens are obtained (`potluck.membership`); it imports only `core`, `net.identity` and
`net.wire`.

Both statements are packed `core.wire.Message`s: bytes of a msgpack map with exactly the declared
keys, carried and stored as they were made. Each signature covers a label (so a token signature
can never pass for a handshake, record or revocation one) and every other field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgpack

from potluck.core.bounded import drop_oldest
from potluck.core.errors import MalformedMessage, MembershipError, MembershipRefused
from potluck.core.names import MAX_RUN_ID_CHARS
from potluck.core.wire import Bytes, Field, Int, Message, Number, list_value
from potluck.net.identity import SIGNATURE_BYTES, Identity, PeerID
from potluck.net.wire import PeerIdField, peer_id_value

__all__ = [
    "MAX_NAME_CHARS", "MAX_REVOKED_PEERS", "MAX_TOKEN_BYTES", "PRESENT_METHOD", "GuestHandlers", "MembershipGate",
    "MembershipToken", "RevocationList", "TOKEN_LIFETIME", "require_member",
]

# The method a member calls on its connected peers to show a renewed token.
PRESENT_METHOD = "membership.present"
# Domain separation labels for the authority's two kinds of signature.
TOKEN_LABEL = "potluck/membership-token/1"
REVOCATION_LABEL = "potluck/revocation-list/1"
# A token travels in every HELLO and DHT record: 1 KiB (the DHT's `records.MAX_TOKEN_BYTES`) is
# three times what the largest valid token takes (32 + 64 bytes of key and signature, the names).
MAX_TOKEN_BYTES = 1024
# A member's display name (a user name, or what the allowlist calls it): a label for logs.
MAX_NAME_CHARS = 64
# Peer ids one revocation list may hold: 1024 x 32 bytes is 32 KiB, so the whole signed list fits
# in one DHT value (at most 64 KiB, `dht.validation.DEFAULT_MAX_VALUE_BYTES`). A run that revokes
# more should rotate its authority key.
MAX_REVOKED_PEERS = 1024
MAX_REVOCATION_BYTES = 40 * 1024
# Renewed tokens a gate remembers (oldest forgotten first): one per connected peer, and far more
# peers than one peer is connected to; a forgotten one only means its handshake token is used.
MAX_PRESENTED_TOKENS = 4096

# How long a token is valid. Short enough that a revoked peer that somehow misses the revocation
# list (or a leaked token) is locked out within the hour; long enough that peers ride out an
# authority restart or outage (they renew RENEW_BEFORE ahead, see `potluck.membership`).
TOKEN_LIFETIME = 3600.0
# How long a published revocation list is valid; the authority re-signs it well before.
REVOCATION_LIFETIME = 3600.0


class Label(Field):
    """Text a person reads (a member's name, a run id): 1 to `max_chars` printable characters."""

    def __init__(self, key: str | None = None, max_chars: int = MAX_NAME_CHARS, **options: Any):
        super().__init__(key, **options)
        self.max_chars = max_chars

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> str:
        if not isinstance(value, str):
            raise MalformedMessage(what, f"{key!r} must be a string")
        if not value or len(value) > self.max_chars or not value.isprintable():
            raise MalformedMessage(what, f"{key!r} must be 1 to {self.max_chars} printable characters")
        return value


class RevokedPeers(Field):
    """At most MAX_REVOKED_PEERS peer ids (their key bytes), sorted and without repeats (so a set
    has one wire form, the one signed); read as a frozenset."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> frozenset[PeerID]:
        raw = list_value(value, key, what, MAX_REVOKED_PEERS)
        peers = frozenset(peer_id_value(item, key, what, raw=True) for item in raw)
        if len(peers) != len(raw) or raw != sorted(raw):
            raise MalformedMessage(what, f"{key!r} must be sorted and without repeats (as `issue` writes it)")
        return peers

    def encode(self, value: Iterable[PeerID]) -> list[bytes]:
        return sorted(p.to_bytes() for p in value)


class MembershipToken(Message, what="membership token", packed=MAX_TOKEN_BYTES):
    """The authority's signed statement that `peer_id` (known as `name`) may take part in
    `run_id` until `expires` (seconds since the epoch, the DHT clock). `from_wire` checks types
    and sizes only; `verify` checks the rest."""

    peer_id: PeerID = PeerIdField("peer", raw=True)
    name: str = Label()
    run_id: str = Label("run", MAX_RUN_ID_CHARS)
    expires: float = Number("exp", signed=True)
    signature: bytes = Bytes("sig", SIGNATURE_BYTES, exact=True)

    @staticmethod
    def _signed_bytes(peer_id: PeerID, name: str, run_id: str, expires: float) -> bytes:
        return msgpack.packb([TOKEN_LABEL, peer_id.to_bytes(), name, run_id, float(expires)], use_bin_type=True)

    @classmethod
    def issue(cls, authority: Identity, peer_id: PeerID, name: str, run_id: str, expires: float) -> MembershipToken:
        """Sign a token (the authority's side); refuses fields another peer would refuse."""
        unsigned = cls.from_wire(cls(peer_id, name, run_id, expires, bytes(SIGNATURE_BYTES)).to_wire())
        signature = authority.sign(cls._signed_bytes(unsigned.peer_id, unsigned.name, unsigned.run_id,
                                                     unsigned.expires))
        return dataclasses.replace(unsigned, signature=signature)

    def verify(self, authority: PeerID, peer_id: PeerID, now: float, *, run_id: str | None = None,
               revocations: RevocationList | None = None) -> None:
        """Raise MembershipError saying what is wrong unless this token, signed by `authority`,
        lets `peer_id` take part in `run_id` (any run if None) at time `now`."""
        if not authority.verify(self.signature, self._signed_bytes(self.peer_id, self.name, self.run_id,
                                                                   self.expires)):
            raise MembershipError(f"the membership token of {self.name!r} is not signed by this run's "
                                  f"authority {authority} (forged, or issued by another authority); "
                                  "get a token from the run's authority (`--authority`)")
        if self.peer_id != peer_id:
            raise MembershipError(f"the membership token was issued to peer {self.peer_id}, not to {peer_id}; "
                                  "a token only admits the peer id it names: request one for this identity")
        if run_id is not None and self.run_id != run_id:
            raise MembershipError(f"the membership token is for run {self.run_id!r}, not {run_id!r}; "
                                  f"get a token from the authority of run {run_id!r}")
        if now >= self.expires:
            raise MembershipError(f"the membership token of {self.name!r} expired {now - self.expires:.0f} s ago; "
                                  "the peer must renew it with the authority (is the authority reachable? "
                                  "are both clocks right?)")
        if revocations is not None and revocations.is_revoked(self.peer_id):
            raise MembershipError(f"the membership of {self.name!r} ({self.peer_id}) was revoked by the "
                                  "authority (by the organizers, or replaced by a newer login of that user name): "
                                  "stop this peer if another of that name runs, else ask the run's organizers")

    def __repr__(self) -> str:
        return f"MembershipToken({self.name!r}, {self.peer_id!r}, run={self.run_id!r}, expires={self.expires:.0f})"


class RevocationList(Message, what="revocation list", packed=MAX_REVOCATION_BYTES):
    """The authority's signed list of peers whose tokens are void, version `version`, valid until
    `expires`. A peer keeps the highest valid version it has seen. `from_wire` checks types and
    sizes; `verify` checks the signature and validity."""

    run_id: str = Label("run", MAX_RUN_ID_CHARS)
    version: int = Int("ver", 0, 2**63)
    expires: float = Number("exp", signed=True)
    revoked: frozenset[PeerID] = RevokedPeers()
    signature: bytes = Bytes("sig", SIGNATURE_BYTES, exact=True)

    @staticmethod
    def _signed_bytes(run_id: str, version: int, expires: float, revoked: list[bytes]) -> bytes:
        return msgpack.packb([REVOCATION_LABEL, run_id, version, float(expires), revoked], use_bin_type=True)

    @staticmethod
    def _ordered(revoked: Iterable[PeerID]) -> list[bytes]:
        return sorted(p.to_bytes() for p in revoked)

    @classmethod
    def issue(cls, authority: Identity, run_id: str, version: int, expires: float,
              revoked: Iterable[PeerID]) -> RevocationList:
        revoked = frozenset(revoked)
        if len(revoked) > MAX_REVOKED_PEERS:
            raise cls.refuse(f"'revoked' lists {len(revoked)} peers; at most {MAX_REVOKED_PEERS} "
                             "(rotate the authority key to start a fresh run)")
        unsigned = cls.from_wire(cls(run_id, int(version), expires, revoked, bytes(SIGNATURE_BYTES)).to_wire())
        signature = authority.sign(cls._signed_bytes(unsigned.run_id, unsigned.version, unsigned.expires,
                                                     cls._ordered(revoked)))
        return dataclasses.replace(unsigned, signature=signature)

    def is_revoked(self, peer_id: PeerID) -> bool:
        return peer_id in self.revoked

    def verify(self, authority: PeerID, run_id: str | None, now: float) -> None:
        """Raise MembershipError unless `authority` signed this list for `run_id` and it is current."""
        if not authority.verify(self.signature, self._signed_bytes(self.run_id, self.version, self.expires,
                                                                   self._ordered(self.revoked))):
            raise MembershipError(f"the revocation list is not signed by the authority {authority} (forged)")
        if run_id is not None and self.run_id != run_id:
            raise MembershipError(f"the revocation list is for run {self.run_id!r}, not {run_id!r}")
        if now >= self.expires:
            raise MembershipError(f"the revocation list (version {self.version}) expired "
                                  f"{now - self.expires:.0f} s ago")


class MembershipGate:
    """What a transport of an authority-governed run checks in every handshake, and what it shows.

    `check` admits a remote peer id with the token bytes it presented, or raises MembershipRefused
    saying why. The authority itself needs no token. `guest_methods` are the only methods served
    on a connection whose peer has no valid token (the authority's token request), or none.
    """

    def __init__(self, authority: PeerID, run_id: str | None, *, clock: Callable[[], float],
                 token: Callable[[], MembershipToken | None] = lambda: None,
                 guest_methods: Iterable[str] = ()):
        self.authority = authority
        self.run_id = run_id
        self.clock = clock
        self._token = token
        self.guest_methods = frozenset(guest_methods)
        self.revocations: RevocationList | None = None
        self._presented: dict[PeerID, MembershipToken] = {}  # renewed tokens shown on open connections

    def own_token(self) -> bytes | None:
        """The token bytes this peer shows in its HELLO (None while it has none)."""
        token = self._token()
        return None if token is None else token.to_wire()

    def update_revocations(self, revocations: RevocationList) -> bool:
        """Adopt `revocations` if the authority signed it for this run and it is newer than ours."""
        try:
            revocations.verify(self.authority, self.run_id, self.clock())
        except MembershipError:
            return False
        if self.revocations is not None and revocations.version <= self.revocations.version:
            return False
        self.revocations = revocations
        return True

    def verify(self, remote: PeerID, token: MembershipToken | None) -> None:
        """Raise MembershipError unless `remote` is the authority or `token` admits it now."""
        if remote == self.authority:
            return
        if token is None:
            raise MembershipError(f"peer {remote} presented no membership token, and this run is governed by "
                                  f"the authority {self.authority}; start it with `--authority` and a credential")
        token.verify(self.authority, remote, self.clock(), run_id=self.run_id, revocations=self.revocations)

    def check(self, remote: PeerID, token_bytes: object) -> MembershipToken | None:
        """The remote's verified token (None for the authority); MembershipRefused if it has none
        that admits it."""
        try:
            token = None if token_bytes is None else MembershipToken.from_wire(token_bytes)
            self.verify(remote, token)
        except MalformedMessage as e:
            raise MembershipRefused(f"peer {remote} presented an unreadable membership token ({e}); "
                                    "it must request a fresh one from the authority") from None
        except MembershipError as e:
            raise MembershipRefused(str(e)) from None
        return token

    def current(self, remote: PeerID, handshake_token: object) -> MembershipToken | None:
        """The newest token `remote` has shown us: the later-expiring of the one it presented
        after renewing and the one from this connection's handshake."""
        presented = self._presented.get(remote)
        try:
            shaken = None if handshake_token is None else MembershipToken.from_wire(handshake_token)
        except MalformedMessage:
            shaken = None
        if presented is None or (shaken is not None and shaken.expires > presented.expires):
            return shaken
        return presented

    def present(self, remote: PeerID, token_bytes: object) -> None:
        """Accept a renewed token `remote` shows on an open connection; MembershipError if it does
        not admit `remote` (the old token stays until it expires)."""
        try:
            token = MembershipToken.from_wire(token_bytes)
        except MalformedMessage as e:
            raise MembershipError(f"unreadable membership token: {e}") from None
        self.verify(remote, token)
        self._presented.pop(remote, None)
        self._presented[remote] = token
        drop_oldest(self._presented, MAX_PRESENTED_TOKENS)

    def forget(self, remote: PeerID) -> None:
        self._presented.pop(remote, None)

    def still_admitted(self, remote: PeerID, handshake_token: object) -> str | None:
        """None if `remote` is still a member by the newest token it showed; else why not."""
        try:
            self.verify(remote, self.current(remote, handshake_token))
        except MembershipError as e:
            return str(e)
        return None


def require_member(gate: MembershipGate | None, peer: PeerID, handshake_token: object, service: str) -> None:
    """In an authority-governed run (`gate` set), refuse `peer` unless the newest token it showed
    (in its handshake, or presented since) still admits it: the services that spend this peer's
    resources on others (a relay's reservations and circuits, dial-backs) serve members only,
    whatever admitted the connection (a guest of the authority, a token that has since expired or
    been revoked). Raises MembershipError saying so."""
    if gate is None:
        return
    why = gate.still_admitted(peer, handshake_token)
    if why is not None:
        raise MembershipError(f"{service} serves members of this run only: {why}")


class GuestHandlers:
    """The handlers a connection without a valid token may use: only the gate's guest methods
    (the authority's token request); other calls are refused with a MembershipError naming why."""

    def __init__(self, handlers: Any, allowed: frozenset[str], reason: str):
        self.unary = _Only(handlers.unary, allowed, _refuse_unary(reason))
        self.stream = _Only(handlers.stream, allowed, _refuse_stream(reason))
        self.unary_seconds = handlers.unary_seconds
        self.stream_seconds = handlers.stream_seconds


class _Only:
    def __init__(self, handlers: dict, allowed: frozenset[str], refusal: Callable):
        self._handlers, self._allowed, self._refusal = handlers, allowed, refusal

    def get(self, method: str) -> Callable | None:
        return self._handlers.get(method) if method in self._allowed else self._refusal


def _refuse_unary(reason: str) -> Callable:
    async def refuse(request: object, ctx: object) -> None:
        raise MembershipError(f"this peer serves only membership requests to peers without a valid token: {reason}")
    return refuse


def _refuse_stream(reason: str) -> Callable:
    async def refuse(stream: object, ctx: object) -> None:
        raise MembershipError(f"this peer serves only membership requests to peers without a valid token: {reason}")
    return refuse
