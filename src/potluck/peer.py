"""`potluck.Peer`: one participant of a swarm: identity, transport, and the DHT (`peer.dht`).

A Peer starts at once, runs its networking on the process's shared event loop, and offers a
synchronous API for user code. Several Peers may live in one process. Its DHT publishes the peer's
signed address record (`potluck.net.peer_record`), so others reach it knowing only its id, and
resolves the ids this peer calls in the same way.

In an authority-governed run (`authority=`), the peer first gets a membership token from the
authority, shows it in every handshake, renews it in the background, and admits only peers whose
tokens check out (`potluck.membership`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import MembershipError, MembershipRefused, PeerUnreachable
from potluck.core.runner import acquire_runner, release_runner
from potluck.dht import DHT, DHTConfig
from potluck.membership import Credential, MembershipClient, MembershipToken, parse_authority
from potluck.membership.records import MembershipRecordValidator
from potluck.net.address import Multiaddr
from potluck.net.identity import Identity, PeerID
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long start-up may take to reach the initial peers before giving up with a clear error.
BOOTSTRAP_TIMEOUT = 15.0


class Peer:
    """A participant in a swarm. Use as a context manager or call `shutdown()`.

    Args:
        initial_peers: addresses (`/ip4/.../tcp/.../p2p/...`) of peers already in the swarm.
        host, port: where to listen (port 0 picks a free one).
        client_mode: do not listen; only dial out (for peers behind NAT or a firewall).
        identity_path: key file; created on first use so the peer id survives restarts.
        insecure: plain TCP without TLS, for trusted clusters only (ids are still verified).
        announce: addresses to advertise instead of the listening ones (e.g. behind port forwarding).
        transport: a ready transport (e.g. from `potluck.net.EmulatedNetwork`); replaces TCP.
        dht_config: DHT limits and tunables (`potluck.dht.DHTConfig`).
        clock: the DHT's time source; an emulated swarm on the virtual clock passes
            `potluck.core.dht_time.event_loop_clock()` (see `Peer.create`). Membership tokens
            expire on this clock too.
        authority: the run's authority, as its address (`/ip4/.../tcp/.../p2p/<id>`) or its peer
            id (then one of `initial_peers` must be the authority). The peer fetches a token at
            start (MembershipError if refused) and admits only peers with valid tokens.
        credential: what to show the authority: `"peer"` (an allowlisted key, the default),
            `"invite:CODE"`, `"password:NAME:PASSWORD"`, or a `potluck.membership.Credential`.
    """

    def __init__(self, initial_peers: Iterable[str] = (), host: str = "0.0.0.0", port: int = 0,
                 client_mode: bool = False, identity_path: str | None = None, *,
                 insecure: bool = False, announce: list[str] | None = None,
                 transport: Transport | None = None, startup_timeout: float = BOOTSTRAP_TIMEOUT,
                 dht_config: DHTConfig | None = None, clock: Clock = get_dht_time,
                 authority: str | None = None, credential: str | Credential | None = None, **transport_options: Any):
        self._setup(initial_peers, host=host, port=port, client_mode=client_mode, identity_path=identity_path,
                    insecure=insecure, announce=announce, transport=transport, dht_config=dht_config,
                    clock=clock, authority=authority, credential=credential, **transport_options)
        try:
            self._runner.run(self._start(startup_timeout), timeout=startup_timeout + 5)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    async def create(cls, initial_peers: Iterable[str] = (), *,
                     startup_timeout: float = BOOTSTRAP_TIMEOUT, **options: Any) -> Peer:
        """`Peer(...)` (same options) for code that runs on potluck's event loop, which cannot
        block on it: e.g. a scenario under `potluck.core.virtual_time`. Close with `ashutdown()`."""
        self = cls.__new__(cls)
        self._setup(initial_peers, **options)
        if not self._runner.in_loop_thread():
            await self.ashutdown()
            raise RuntimeError("Peer.create() runs on potluck's event loop; elsewhere use Peer(...)")
        try:
            await asyncio.wait_for(self._start(startup_timeout), startup_timeout + 5)
        except BaseException:
            await self.ashutdown()
            raise
        return self

    def _setup(self, initial_peers: Iterable[str] = (), host: str = "0.0.0.0", port: int = 0,
               client_mode: bool = False, identity_path: str | None = None, *, insecure: bool = False,
               announce: list[str] | None = None, transport: Transport | None = None,
               dht_config: DHTConfig | None = None, clock: Clock = get_dht_time, authority: str | None = None,
               credential: str | Credential | None = None, **transport_options: Any) -> None:
        self.initial_peers = [Multiaddr.parse(a) if isinstance(a, str) else a for a in initial_peers]
        if authority is not None:  # refuse bad arguments before anything is started
            parse_authority(authority)
            credential = credential if isinstance(credential, Credential) else Credential.parse(credential)
            if transport is not None and not hasattr(transport, "membership"):
                raise MembershipError(f"{type(transport).__name__} does not check membership tokens; "
                                      "authority-governed runs need TCPTransport or EmulatedTransport")
        identity = Identity.load_or_create(identity_path) if identity_path else Identity.generate()
        if transport is None:
            transport = TCPTransport(identity, host=host, port=port, client_mode=client_mode,
                                     insecure=insecure, announce=announce, **transport_options)
        self.transport = transport
        self._runner = acquire_runner()
        self.dht = DHT(transport, config=dht_config, clock=clock, runner=self._runner)
        self._membership: MembershipClient | None = None
        if authority is not None:
            self._membership = MembershipClient(transport, authority, credential, dht=self.dht, clock=clock)
            transport.membership = self._membership.gate  # type: ignore[attr-defined] - checked above
            self.dht.add_validator(MembershipRecordValidator(self._membership.gate))
        self._alive = True

    async def _start(self, timeout: float) -> None:
        await self.transport.start()
        if self._membership is not None:
            await self._join_run()
        if not self.initial_peers:
            await self.dht.astart(timeout)
            self._start_membership()
            return
        results = await asyncio.gather(*(self.transport.connect(a, timeout) for a in self.initial_peers),
                                       return_exceptions=True)
        errors = [f"{a}: {r}" for a, r in zip(self.initial_peers, results, strict=True)
                  if isinstance(r, BaseException)]
        if len(errors) == len(self.initial_peers):
            if any(isinstance(r, MembershipRefused) for r in results):
                raise MembershipRefused("no initial peer admitted this peer to the run:\n  " + "\n  ".join(errors))
            raise PeerUnreachable("could not reach any initial peer; check the addresses and that "
                                  "those peers are running:\n  " + "\n  ".join(errors))
        for line in errors:
            logger.warning("initial peer unreachable: %s", line)
        reached = [r for r in results if isinstance(r, PeerID)]
        await self.dht.astart(timeout, initial_peers=reached)
        self._start_membership()

    async def _join_run(self) -> None:
        """Get the first membership token (the authority's address from `authority` or from the
        initial peers); MembershipError says why not."""
        client = self._membership
        assert client is not None
        if client.authority_address is None:
            for addr in self.initial_peers:
                if addr.peer_id == client.authority:
                    client.authority_address = addr.without_peer_id()
        if client.authority_address is None and not self.transport.addresses_of(client.authority):
            raise MembershipError(f"no address for the authority {client.authority}: pass its full address "
                                  "(`--authority /ip4/.../tcp/.../p2p/<id>`, as `potluck authority` prints it) "
                                  "or list it among the initial peers")
        token = await client.fetch()
        logger.info("member of run %r as %r until %.0f", token.run_id, token.name, token.expires)

    def _start_membership(self) -> None:
        if self._membership is not None:
            self._membership.start()

    @property
    def membership(self) -> MembershipToken | None:
        """This peer's current membership token (None outside an authority-governed run)."""
        return None if self._membership is None else self._membership.token

    @property
    def peer_id(self) -> str:
        """This peer's id: the text form of its public key."""
        return str(self.transport.peer_id)

    @property
    def addresses(self) -> list[str]:
        """Addresses other peers can use as `initial_peers` (empty in client mode)."""
        return [str(a) for a in self.transport.addresses]

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the peer's event loop without waiting (background work)."""
        return self._runner.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the peer's event loop and wait for it (the synchronous facade)."""
        return self._runner.run(coro, timeout)

    def call(self, peer_id: str | PeerID, method: str, request: Any = None, timeout: float = 30.0) -> Any:
        """Call `method` on another peer and return the response."""
        pid = PeerID.from_string(peer_id) if isinstance(peer_id, str) else peer_id
        return self.run(self.transport.call(pid, method, request, timeout=timeout), timeout + 1)

    def shutdown(self) -> None:
        """Close every connection and release the event loop; safe to call twice."""
        if not self._alive:
            return
        self._alive = False
        try:
            if self._runner.is_running:
                if getattr(self, "_membership", None) is not None:
                    self._runner.run(self._membership.stop(), timeout=10)
                self._runner.run(self.dht.ashutdown(), timeout=10)
                self._runner.run(self.transport.close(), timeout=10)
        finally:
            release_runner()

    async def ashutdown(self) -> None:
        """The async twin of `shutdown`, for code on the event loop. The loop itself stays up:
        whoever called `acquire_runner()` outside it holds it."""
        if not self._alive:
            return
        self._alive = False
        try:
            if getattr(self, "_membership", None) is not None:
                await self._membership.stop()
            await self.dht.ashutdown()
            await self.transport.close()
        finally:
            release_runner()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Peer({self.peer_id}, addresses={self.addresses})"
