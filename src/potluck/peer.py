"""`potluck.Peer`: one participant of a swarm: identity, transport, and the DHT (`peer.dht`).

A Peer starts at once, runs its networking on the process's shared event loop, and offers a
synchronous API for user code. Several Peers may live in one process. Its DHT publishes the peer's
signed address record (`potluck.net.peer_record`), so others reach it knowing only its id, and
resolves the ids this peer calls in the same way.

In an authority-governed run (`authority=`), the peer first gets a membership token from the
authority, shows it in every handshake, renews it in the background, and admits only peers whose
tokens check out (`potluck.membership`).

Reachability (issue 16): by default a peer asks its initial peers to dial it back
(`net.reachability`). Found private (behind NAT or a firewall), it runs as a client unless it
holds a relay reservation (`nat.relays`), with which it publishes circuit addresses and can serve.
It checks again every RECHECK_INTERVAL (a port forwarded or closed, a new router) and moves between
public and private/relayed, taking or releasing relay reservations. `reachability_summary` says in
one sentence what the latest check found and what the user can do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import MembershipError, MembershipRefused, PeerUnreachable
from potluck.core.runner import CallerThread, acquire_runner, release_runner
from potluck.dht import DHT, DHTConfig
from potluck.membership import Credential, MembershipClient, MembershipToken, parse_authority
from potluck.membership.records import MembershipRecordValidator
from potluck.metrics import MetricsServer, peer_metrics, serve_metrics
from potluck.nat import RelayAnnouncer, RelayReservations
from potluck.net.address import Multiaddr
from potluck.net.connection import TransportStats
from potluck.net.emulated import EmulatedTransport
from potluck.net.identity import Identity, PeerID
from potluck.net.reachability import (
    CHECK_PEERS,
    DIALBACK,
    DIALBACK_CALL_TIMEOUT,
    DialbackService,
    ReachabilityReport,
    check_reachability,
)
from potluck.net.relay import RelayLimits, RelayService
from potluck.net.tcp import TCPTransport
from potluck.net.transport import Transport

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long start-up may take to reach the initial peers before giving up with a clear error.
BOOTSTRAP_TIMEOUT = 15.0
# How long start-up waits for the first relay reservation of a peer found private, so that a
# server started right after (ExpertServer) has an address; the search goes on after that.
FIRST_RELAY_TIMEOUT = 10.0
# What the reachability check and the first reservation may add to start-up, beyond the above.
NAT_STARTUP_SECONDS = DIALBACK_CALL_TIMEOUT + FIRST_RELAY_TIMEOUT
# How often a peer re-checks its reachability: a port forward opened or closed, or a router
# replaced, is noticed within minutes, and each check costs CHECK_PEERS peers one dial-back.
RECHECK_INTERVAL = 600.0
# Sooner while no server answered (verdict unknown, or nobody to ask yet): what the peer assumed
# meanwhile may be wrong, and a false "public" leaves it unreachable.
RECHECK_UNKNOWN_INTERVAL = 60.0


class Peer:
    """A participant in a swarm. Use as a context manager or call `shutdown()`.

    Args:
        initial_peers: addresses (`/ip4/.../tcp/.../p2p/...`) of peers already in the swarm.
        host, port: where to listen (port 0 picks a free one).
        client_mode: None (the default): check at start (and every RECHECK_INTERVAL) whether others
            can dial this peer, and run as a client if not (unless a relay is found). True: force
            client mode (never listen; only dial out). False: listen and announce without checking.
        relay: also serve as a relay for peers behind NAT (`net.relay.RelayService`), announced
            in the DHT; only while this peer is publicly reachable. True: with the default caps
            (`net.relay.RelayLimits`, a full relay); a `RelayLimits`: those, e.g.
            `RelayLimits.limited()` for a relay that only carries what a hole punch needs.
        identity_path: key file; created on first use so the peer id survives restarts.
        insecure: plain TCP without TLS, for trusted clusters only (ids are still verified).
        announce: addresses to advertise instead of the listening ones (e.g. behind port forwarding).
        transport: a ready transport (e.g. from `potluck.net.EmulatedNetwork`); replaces TCP. It is
            used as built (`client_mode` does not apply), except that an emulated transport with a
            NAT model (`nat=`) gets the reachability check.
        dht_config: DHT limits and tunables (`potluck.dht.DHTConfig`).
        clock: the DHT's time source; an emulated swarm on the virtual clock passes
            `potluck.core.dht_time.event_loop_clock()` (see `Peer.create`). Membership tokens
            expire on this clock too.
        authority: the run's authority, as its address (`/ip4/.../tcp/.../p2p/<id>`) or its peer
            id (then one of `initial_peers` must be the authority). The peer fetches a token at
            start (MembershipError if refused) and admits only peers with valid tokens.
        credential: what to show the authority: `"peer"` (an allowlisted key, the default),
            `"invite:CODE"`, `"password:NAME:PASSWORD"`, or a `potluck.membership.Credential`.
        metrics_port: serve this peer's Prometheus metrics (`potluck.metrics.PeerMetrics`) at
            http://host:metrics_port/metrics (0 picks a port: `metrics_url`); None: not served.
    """

    def __init__(self, initial_peers: Iterable[str] = (), host: str = "0.0.0.0", port: int = 0,
                 client_mode: bool | None = None, identity_path: str | None = None, *,
                 insecure: bool = False, announce: list[str] | None = None,
                 transport: Transport | None = None, startup_timeout: float = BOOTSTRAP_TIMEOUT,
                 dht_config: DHTConfig | None = None, clock: Clock = get_dht_time,
                 authority: str | None = None, credential: str | Credential | None = None,
                 relay: bool | RelayLimits = False, metrics_port: int | None = None, **transport_options: Any):
        self._setup(initial_peers, host=host, port=port, client_mode=client_mode, identity_path=identity_path,
                    insecure=insecure, announce=announce, transport=transport, dht_config=dht_config,
                    clock=clock, authority=authority, credential=credential, relay=relay,
                    metrics_port=metrics_port, **transport_options)
        try:
            self._runner.run(self._start(startup_timeout), timeout=startup_timeout + 5 + NAT_STARTUP_SECONDS)
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
            await asyncio.wait_for(self._start(startup_timeout), startup_timeout + 5 + NAT_STARTUP_SECONDS)
        except BaseException:
            await self.ashutdown()
            raise
        return self

    def _setup(self, initial_peers: Iterable[str] = (), host: str = "0.0.0.0", port: int = 0,
               client_mode: bool | None = None, identity_path: str | None = None, *, insecure: bool = False,
               announce: list[str] | None = None, transport: Transport | None = None,
               dht_config: DHTConfig | None = None, clock: Clock = get_dht_time, authority: str | None = None,
               credential: str | Credential | None = None, relay: bool | RelayLimits = False,
               metrics_port: int | None = None,
               **transport_options: Any) -> None:
        self.initial_peers = [Multiaddr.parse(a) if isinstance(a, str) else a for a in initial_peers]
        if authority is not None:  # refuse bad arguments before anything is started
            parse_authority(authority)
            credential = credential if isinstance(credential, Credential) else Credential.parse(credential)
            if transport is not None and not hasattr(transport, "membership"):
                raise MembershipError(f"{type(transport).__name__} does not check membership tokens; "
                                      "authority-governed runs need TCPTransport or EmulatedTransport")
        identity = Identity.load_or_create(identity_path) if identity_path else Identity.generate()
        # Whether to run the reachability check (see `client_mode` and `transport` above).
        self._check = client_mode is None and (
            transport is None or isinstance(transport, EmulatedTransport) and transport.nat is not None)
        if transport is None:
            transport = TCPTransport(identity, host=host, port=port, client_mode=bool(client_mode),
                                     insecure=insecure, announce=announce, **transport_options)
        self.transport = transport
        self._relay = relay
        self._metrics_at = None if metrics_port is None else (host, metrics_port)
        self._metrics_server: MetricsServer | None = None
        self._relay_service: RelayService | None = None
        self._announcer: RelayAnnouncer | None = None
        self._reservations: RelayReservations | None = None
        self._recheck_task: asyncio.Task | None = None
        self._initial_ids: list[PeerID] = []  # initial peers reached: the first servers of re-checks
        self.reachability_summary = ""
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
        if self._metrics_at is not None:
            registry = peer_metrics(self.transport).registry
            self._metrics_server = await serve_metrics(registry.exposition, *self._metrics_at)
            logger.info("serving Prometheus metrics at %s", self._metrics_server.url)
        if not self.transport.forced_client:
            self.transport.services.setdefault(DIALBACK, DialbackService(self.transport)).start()
        if self._membership is not None:
            await self._join_run()
        if not self.initial_peers:
            await self.dht.astart(timeout)
            self._start_membership()
            await self._start_nat(None)
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
        reached = self._initial_ids = [r for r in results if isinstance(r, PeerID)]
        report = await self._check_reachability(reached) if self._check else None
        await self.dht.astart(timeout, initial_peers=reached)
        if report is not None and report.verdict == "unknown":
            # Too few initial peers answered (often there is only one): ask DHT neighbours too.
            node = self.dht.node
            more = [p for p, _ in node.routing.nearest(node.node_id, CHECK_PEERS, exclude=report.asked)]
            if more:
                report = await self._check_reachability(more, report)
        self._start_membership()
        await self._start_nat(report)

    async def _check_reachability(self, servers: list[PeerID],
                                  earlier: ReachabilityReport | None = None) -> ReachabilityReport:
        report = await check_reachability(self.transport, servers)
        if earlier is not None:
            report = earlier.combine(report)
        if report.verdict == "private":
            self.transport.set_public(False)
            # Our handshakes so far said we were public: redo them, so that nobody keeps us in a
            # routing table or dials us at addresses that do not work.
            self._redo_handshakes("this peer turned out not to be reachable; reconnecting as a client")
        return report

    def _redo_handshakes(self, why: str, idle_only: bool = False) -> None:
        """Close connections whose handshake told our old reachability (client mode or not);
        `idle_only` spares those in use, which keep the old one until they close."""
        for conn in self.transport.open_connections():
            if not idle_only or conn.idle:
                conn.close(why)

    async def _start_nat(self, report: ReachabilityReport | None) -> None:
        """After the DHT is up: relay reservations if private, the relay service if asked."""
        transport = self.transport
        if report is not None and report.verdict == "private":
            await self._reserve_relays()
        if self._relay:
            if transport.reachability == "public":
                await self._start_relay()
            else:
                logger.warning("not serving as a relay: this peer is not publicly reachable")
        self.reachability_summary = self._describe(report)
        if transport.reachability == "private" and not transport.forced_client:
            logger.warning(self.reachability_summary)
        else:
            logger.info(self.reachability_summary)
        if self._check:
            unknown = report is None or report.verdict == "unknown"
            self._recheck_task = asyncio.ensure_future(self._recheck_forever(unknown))

    async def _reserve_relays(self) -> None:
        self._reservations = RelayReservations(self.transport, self.dht)
        self._reservations.start()
        await self._reservations.wait_first(FIRST_RELAY_TIMEOUT)

    async def _start_relay(self) -> None:
        if self._relay_service is None:
            limits = self._relay if isinstance(self._relay, RelayLimits) else RelayLimits()
            self._relay_service = RelayService(self.transport, limits)
            self._relay_service.start()
            self._announcer = RelayAnnouncer(self.transport, self.dht)
            await self._announcer.start()

    async def _recheck_forever(self, unknown: bool) -> None:
        while True:
            await asyncio.sleep(RECHECK_UNKNOWN_INTERVAL if unknown else RECHECK_INTERVAL)
            unknown = (await self.recheck_reachability()).verdict == "unknown"

    async def recheck_reachability(self) -> ReachabilityReport:
        """Check again (the initial peers, then DHT neighbours, as servers) and follow the verdict:
        public <-> private or relayed. No answer changes nothing. Runs every RECHECK_INTERVAL."""
        node = self.dht.node
        servers = [*self._initial_ids, *(p for p, _ in node.routing.nearest(node.node_id, CHECK_PEERS))]
        report = await check_reachability(self.transport, servers)
        before = self.transport.reachability
        if report.verdict == "public" and before != "public":
            self.transport.set_public(True)
            if self._reservations is not None:
                await self._reservations.release()
                self._reservations = None
            self._redo_handshakes("this peer is publicly reachable now; reconnecting as a server", idle_only=True)
            if self._relay:
                await self._start_relay()
        elif report.verdict == "private" and before == "public":
            self.transport.set_public(False)
            self._redo_handshakes("this peer is not reachable any more; reconnecting as a client", idle_only=True)
            await self._reserve_relays()
        if report.verdict != "unknown":  # else the summary still tells what we assume, and why
            self.reachability_summary = self._describe(report)
        if self.transport.reachability != before:
            logger.warning("Reachability changed from %s to %s: %s", before, self.transport.reachability,
                           self.reachability_summary)
        return report

    def _describe(self, report: ReachabilityReport | None) -> str:
        """One plain sentence: what the latest check found about our reachability, and what to do."""
        t = self.transport
        shown = ", ".join(str(a) for a in t.listen_addresses[:2]) or "its listening address"
        ports = sorted({str(a.port) for a in t.listen_addresses if a.port is not None})
        port = f"TCP port {'/'.join(ports)}" if ports else "its port"
        if t.forced_client:
            return "Client mode (as asked): this peer only dials out; it can train but not serve others."
        if not self._check:
            return f"Listening at {shown} (reachability not checked)."
        if report is None:
            return (f"No initial peers to check reachability with: assuming others can connect to {shown}; "
                    f"behind NAT, forward {port} to this machine.")
        asked = len(report.asked)
        if report.verdict == "public":
            # what others reached is the address to give other machines (behind a port forward, not
            # the one we listen at)
            reached = ", ".join(str(a.with_peer_id(t.peer_id)) for a in report.reached[:2])
            return f"Publicly reachable at {reached}: {report.answers} of {asked} peers asked connected back."
        if report.verdict == "unknown":
            return (f"Could not tell whether this peer is reachable ({report.answers} of {asked} peers asked "
                    f"answered the check): assuming others can connect to {shown}.")
        seen = f"; others see this machine as {', '.join(report.observed_hosts[:2])}" if report.observed_hosts else ""
        if t.reachability == "relayed":
            relays = ", ".join(str(r) for r in self._reservations.relays) if self._reservations else ""
            return (f"Behind NAT or a firewall (no peer could connect back to {shown}{seen}): reachable through "
                    f"relay {relays}; for direct connections, open or forward {port} to this machine.")
        return (f"Behind NAT or a firewall (no peer could connect back to {shown}{seen}) and no relay found, so this "
                f"peer runs in client mode (it can train but not serve): open or forward {port} to this "
                "machine, or run a relay (`potluck peer --relay`) on a public machine.")

    async def _close_nat(self) -> None:
        if self._recheck_task is not None:
            self._recheck_task.cancel()
            await asyncio.gather(self._recheck_task, return_exceptions=True)
        for part in (self._reservations, self._announcer):
            if part is not None:
                await part.close()
        if self._relay_service is not None:
            self._relay_service.close()
        dialback = self.transport.services.pop(DIALBACK, None)
        if dialback is not None:
            dialback.close()

    async def _close_metrics(self) -> None:
        if self._metrics_server is not None:
            await self._metrics_server.close()
            self._metrics_server = None

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
    def metrics_url(self) -> str | None:
        """Where this peer serves its Prometheus metrics (`metrics_port`); None if it does not."""
        return None if self._metrics_server is None else self._metrics_server.url

    @property
    def initial_peer_ids(self) -> list[PeerID]:
        """The ids of the initial peers this peer reached when it started: those the user chose to
        join through (a ps worker asks them which runs they serve)."""
        return list(self._initial_ids)

    @property
    def peer_id(self) -> str:
        """This peer's id: the text form of its public key."""
        return str(self.transport.peer_id)

    @property
    def addresses(self) -> list[str]:
        """Addresses other peers can use as `initial_peers` (empty in client mode)."""
        return [str(a) for a in self.transport.addresses]

    @property
    def stats(self) -> TransportStats:
        """Bytes this peer sent and received on the wire so far (`transport.stats`, live)."""
        return self.transport.stats

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the peer's event loop without waiting (background work)."""
        return self._runner.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, caller: CallerThread | None = None) -> T:
        """Run a coroutine on the peer's event loop and wait for it (the synchronous facade);
        `caller`: lend the waiting thread to the coroutine's blocking work (`CallerThread`)."""
        return self._runner.run(coro, timeout, caller)

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
                self._runner.run(self._close_nat(), timeout=10)
                self._runner.run(self._close_metrics(), timeout=10)
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
            await self._close_nat()
            await self._close_metrics()
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
