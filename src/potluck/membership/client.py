"""A member's side: get a token from the authority, keep it fresh, follow the revocation list.

`MembershipClient.fetch()` asks the authority once (a clear MembershipError if it refuses);
`run()` then renews the token RENEW_BEFORE its expiry (with the current token as the proof, so an
invite is not needed twice) and reads the authority's revocation list from the DHT. If a newer
login of the same user name replaced this identity (`IdentityReplaced`), it stops renewing and says
so once: logging in again would only take the place back from the other peer of that name. `token` is
the current token, what the transport shows in its HELLO through the `MembershipGate`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import (
    MalformedMessage,
    MembershipError,
    NetworkError,
    PotluckError,
    RemoteError,
)
from potluck.membership.authority import TOKEN_METHOD, TokenGrant, TokenRequest, revocation_key
from potluck.membership.policy import Credential, IdentityReplaced
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.membership import PRESENT_METHOD, MembershipGate, MembershipToken, RevocationList
from potluck.net.transport import Transport

__all__ = ["AuthorityUnreachable", "MembershipClient", "RENEW_BEFORE", "RETRY_INTERVAL", "parse_authority"]

logger = logging.getLogger(__name__)

# Renew this long before the token expires: a quarter of TOKEN_LIFETIME, so an authority that is
# down (restart, network trouble) for up to 15 minutes costs no member its place.
RENEW_BEFORE = 900.0
# After a failed renewal or revocation-list read, try again this much later: often enough that a
# short outage is bridged well within RENEW_BEFORE, rarely enough not to hammer a recovering authority.
RETRY_INTERVAL = 30.0
# How often members read the revocation list: a revocation reaches every member within minutes.
REVOCATION_REFRESH = 120.0
# How long one call to the authority may take (a password check is ~50 ms, queued behind others).
REQUEST_TIMEOUT = 20.0
# How long showing a renewed token to one connected peer may take; a peer that does not answer
# in time keeps our old token until it expires and then drops the connection (we redial).
PRESENT_TIMEOUT = 10.0


class AuthorityUnreachable(MembershipError):
    """The authority could not be asked (down, or the connection to it failed): it refused nothing."""


def parse_authority(authority: str | PeerID | Multiaddr) -> tuple[PeerID, Multiaddr | None]:
    """The authority's peer id (its public key) and its address, if given one."""
    if isinstance(authority, PeerID):
        return authority, None
    if isinstance(authority, Multiaddr):
        addr = authority
    elif authority.startswith("/"):
        addr = Multiaddr.parse(authority)
    else:
        return PeerID.from_string(authority), None
    if addr.peer_id is None:
        raise MembershipError(f"the authority address {authority} must end in /p2p/<authority peer id>: the id is "
                              "the authority's public key, which signs every token")
    return addr.peer_id, addr.without_peer_id()


class MembershipClient:
    """Holds this peer's token for `authority`'s run and keeps it valid (see the module docstring)."""

    def __init__(self, transport: Transport, authority: str | PeerID | Multiaddr, credential: Credential | str | None,
                 *, run_id: str | None = None, dht: Any = None, clock: Clock = get_dht_time,
                 renew_before: float = RENEW_BEFORE, retry_interval: float = RETRY_INTERVAL,
                 revocation_refresh: float = REVOCATION_REFRESH):
        self.transport = transport
        self.authority, self.authority_address = parse_authority(authority)
        self.credential = credential if isinstance(credential, Credential) else Credential.parse(credential)
        self.dht = dht
        self.clock = clock
        self.renew_before = renew_before
        self.retry_interval = retry_interval
        self.revocation_refresh = revocation_refresh
        self.token: MembershipToken | None = None
        # Why the authority will not renew this identity's token (a newer login of its name took
        # its place); set once, after which renewals are not tried again.
        self.replaced: IdentityReplaced | None = None
        self._said_replaced = False
        self.gate = MembershipGate(self.authority, run_id, clock=clock, token=lambda: self.token)
        self._task: asyncio.Task | None = None
        self._next_revocation_read = 0.0
        # Set each time the background loop renewed the token and showed it to connected peers.
        self.renewed = asyncio.Event()
        transport.add_handler(PRESENT_METHOD, self._on_present)

    @property
    def run_id(self) -> str | None:
        return self.gate.run_id

    async def fetch(self) -> MembershipToken:
        """Get a first token with the credential; MembershipError says why the authority refused."""
        if self.authority_address is not None and not self.transport.is_connected(self.authority):
            await self._connect_authority(self.authority_address)
        return await self._request(TokenRequest(credential=self.credential))

    async def _connect_authority(self, address: Multiaddr) -> None:
        """Dial the authority at the address the user configured: it must prove the authority's id
        there, and the transport then keeps that address as vouched (later renewals redial it)."""
        try:
            await self.transport.connect(address.with_peer_id(self.authority), REQUEST_TIMEOUT)
        except MembershipError:
            raise
        except NetworkError as e:
            raise MembershipError(f"cannot reach the authority {self.authority} at {address}: {e}; check --authority "
                                  "(its full address, /ip4/.../tcp/.../p2p/<id>) and that it runs") from None

    async def renew(self) -> MembershipToken:
        """Exchange the current (still valid) token for a fresh one; falls back to the credential if
        the authority refuses the renewal, unless it says a newer login of our user name replaced
        us (IdentityReplaced). If it cannot be reached, that is the error (the loop retries): a
        credential login then could only take a place back that the renewal would have been refused."""
        if self.replaced is not None:
            raise self.replaced
        if self.token is not None and self.clock() < self.token.expires:
            try:
                return await self._request(TokenRequest(renew=self.token.to_wire()))
            except IdentityReplaced as e:
                self.replaced = e
                raise
            except AuthorityUnreachable:
                raise
            except MembershipError as e:
                logger.info("renewal refused (%s); presenting the credential again", e)
        return await self._request(TokenRequest(credential=self.credential))

    async def renew_if_due(self) -> bool:
        """Renew if the token expires within `renew_before`, and show the new token to every
        connected peer; True if it did. Errors propagate."""
        if self.token is not None and self.clock() < self.token.expires - self.renew_before:
            return False
        await self.renew()
        await self.present()
        return True

    async def present(self) -> None:
        """Show our current token to every connected peer, so open connections outlive the old one."""
        token = self.token
        peers = [p for p in self.transport.connected_peers() if p != self.authority]
        if token is None or not peers:
            return
        wire = token.to_wire()
        results = await asyncio.gather(*(self.transport.call(p, PRESENT_METHOD, wire, timeout=PRESENT_TIMEOUT)
                                         for p in peers), return_exceptions=True)
        for peer, result in zip(peers, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("could not show the renewed token to %s: %s", peer, result)

    def sweep(self) -> int:
        """Close connections of peers that are no longer members (expired without renewal, or
        revoked); returns how many were closed."""
        closed = 0
        for conn in self.transport.open_connections():
            if conn.peer_id == self.transport.peer_id:
                continue
            reason = self.gate.still_admitted(conn.peer_id, conn.remote.token)
            if reason is not None:
                logger.info("closing the connection with %s: %s", conn.peer_id, reason)
                conn.close(f"membership ended: {reason}")
                self.gate.forget(conn.peer_id)
                closed += 1
        return closed

    async def _on_present(self, request: object, ctx: CallContext) -> None:
        self.gate.present(ctx.peer_id, request)

    async def refresh_revocations(self) -> bool:
        """Read the authority's revocation list from the DHT; True if a newer one was adopted."""
        if self.dht is None or self.run_id is None:
            return False
        found = await self.dht.aget(revocation_key(self.run_id, self.authority), latest=True)
        if found is None:
            return False
        try:
            revocations = RevocationList.from_wire(found.value)
        except MalformedMessage as e:
            logger.warning("ignoring a malformed revocation list in the DHT: %s", e)
            return False
        return self.gate.update_revocations(revocations)

    def start(self) -> None:
        """Keep the token fresh and the revocation list current in the background, until `stop`."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self.transport.remove_handler(PRESENT_METHOD)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            wait = self.retry_interval
            try:
                if await self.renew_if_due():
                    self.renewed.set()
                if self.token is not None:
                    wait = max(1.0, min(self.token.expires - self.renew_before - self.clock(), self.revocation_refresh))
            except IdentityReplaced as e:
                if not self._said_replaced:  # once, not at every retry
                    self._said_replaced = True
                    logger.error("the membership token will not be renewed: %s", e)
            except PotluckError as e:
                left = (self.token.expires - self.clock()) if self.token else 0.0
                logger.warning("could not renew the membership token (%.0f s left; retrying in %g s): %s",
                               left, self.retry_interval, e)
            if self.clock() >= self._next_revocation_read:
                try:
                    await self.refresh_revocations()
                    self._next_revocation_read = self.clock() + self.revocation_refresh
                except PotluckError as e:
                    logger.info("could not read the revocation list: %s", e)
            self.sweep()
            await asyncio.sleep(min(wait, self.revocation_refresh))

    async def _request(self, request: TokenRequest) -> MembershipToken:
        try:
            answer = await self.transport.call(self.authority, TOKEN_METHOD, request.to_wire(), timeout=REQUEST_TIMEOUT)
        except RemoteError as e:
            if e.remote_type == "IdentityReplaced":
                raise IdentityReplaced(f"the authority {self.authority} will not renew this peer's token: "
                                       f"{str(e).removeprefix('remote IdentityReplaced: ')}") from None
            if e.remote_type in ("MembershipError", "PolicyError", "MalformedMessage", "TooManyAttempts"):
                raise MembershipError(f"the authority {self.authority} refused a token: "
                                      f"{str(e).removeprefix(f'remote {e.remote_type}: ')}") from None
            raise MembershipError(f"the authority {self.authority} failed to issue a token: {e}") from None
        except NetworkError as e:
            raise AuthorityUnreachable(f"cannot reach the authority {self.authority} for a membership token: {e}; "
                                  "check --authority (its full address, /ip4/.../tcp/.../p2p/<id>) and that it "
                                  "runs") from None
        try:
            token = TokenGrant.from_wire(answer).token
        except MalformedMessage as e:
            raise MembershipError(f"the authority sent an unreadable token: {e}") from None
        token.verify(self.authority, self.transport.peer_id, self.clock(), run_id=self.gate.run_id)
        if self.gate.run_id is None:
            self.gate.run_id = token.run_id
        self.token = token
        return token
