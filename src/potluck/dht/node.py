"""`DHTNode`: the Kademlia protocol over a `Transport`: handlers, lookups, replication, upkeep.

It drives the plain-logic parts (`RoutingTable`, `Storage`, `Lookup`, validation) with real calls.
Everything runs on the transport's event loop; every call has a deadline, and every background
task belongs to the node, which cancels and awaits them all in `shutdown()`.

Replication and churn:
- a store goes to the `replicas` closest nodes found by a lookup (this node included when it is
  one of them and not in client mode);
- a get caches what it found on the closest node it asked that did not have it (Kademlia 2.3);
- when a node learns of a peer new to its routing table, it hands that peer the records for
  which the peer is now among the `replicas` closest nodes it knows (Kademlia 2.5), so records
  move to newcomers and survive the loss of older replicas;
- unresponsive peers are put aside with exponential backoff, and dropped from the routing table
  after repeated failures (at once if a fresher replacement is waiting).
Records are not republished by their holders: every potluck record is re-stored by its writer
before it expires (experts, groups and progress all announce themselves periodically).

Peer records (`dht.peer_records`): a node publishes its peer's signed record at start and re-signs
it every third of its lifetime, and serves as the transport's `PeerResolver`, so a dial to a peer
id with no known address looks the record up. The node's own RPCs never resolve (no recursion):
the peers it calls come with addresses in find answers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from potluck.core import compat
from potluck.core.bounded import drop_oldest
from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.errors import NetworkError, PeerUnreachable
from potluck.core.serialization import dumps
from potluck.dht import protocol
from potluck.dht.errors import BadRequest, DHTError, RecordRejected
from potluck.dht.key_kinds import KeyKinds
from potluck.dht.lookup import Answer, Backoff, Lookup, TargetResult
from potluck.dht.peer_records import (
    PEER_RECORD_TTL,
    PeerRecordValidator,
    is_peer_record_key,
    peer_record_from_bytes,
    peer_record_key,
)
from potluck.dht.records import Key, Record, key_id_of
from potluck.dht.routing import DEFAULT_BUCKET_SIZE, DEFAULT_DEPTH_MODULO, RoutingTable, node_id_of
from potluck.dht.storage import DEFAULT_MAX_STORAGE_BYTES, Storage, merge_records
from potluck.dht.validation import (
    CLOCK_SKEW_ALLOWANCE,
    DEFAULT_MAX_TTL,
    DEFAULT_MAX_VALUE_BYTES,
    Limits,
    RecordValidator,
    check_record,
    sign_record,
)
from potluck.metrics import peer_metrics, stopwatch
from potluck.net.address import Multiaddr
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.origins import UNKNOWN_ORIGIN, Origin, outside_subnet
from potluck.net.peer_record import PeerRecord
from potluck.net.transport import Transport

__all__ = ["DHTConfig", "DHTNode", "GetOutcome"]

logger = logging.getLogger(__name__)

# Kademlia's alpha: three requests in flight per lookup hide one slow peer without flooding.
DEFAULT_ALPHA = 3
# One DHT RPC: a live peer answers in milliseconds, even across continents (< 0.5 s); a peer
# silent this long is treated as failed and the lookup moves on.
RPC_TIMEOUT = 3.0
# A find that has not answered after this long stops holding up its lookup (which asks another
# peer instead; a late answer is still used). Live peers answer within a round trip, well under
# a second even between continents.
SLOW_AFTER = 1.0
# A whole store/get/lookup, when the caller gives no timeout: a lookup is a few RPC rounds, so
# this only bites when most of the network is unreachable.
OPERATION_TIMEOUT = 30.0
# The longest a node serves one DHT call, whatever its caller asks: every handler is local work on
# at most a few MiB (a store of 256 records), done in milliseconds; ten callers' RPC_TIMEOUT.
HANDLER_SECONDS = 30.0
# A store's lookup ends this share of the store's timeout early (at most one RPC timeout), so the
# store RPCs, one round trip, keep time for themselves: a lookup that ran to the deadline (slowed
# by unresponsive peers) left them 0 s, and a store through live peers failed.
STORE_RPC_SHARE = 0.25
# A store returns once a majority of each record's replicas (this node included) hold it, or,
# failing that, once one does and this long has passed since the store calls went out; the other
# calls finish in the background, each within its own RPC deadline. A live replica answers a store
# within a round trip (see SLOW_AFTER); waiting for every replica let one that answers finds but
# never stores hold every store for the whole RPC_TIMEOUT.
STORE_GRACE = 1.0
# Joining: reaching the initial peers and the first self-lookup.
BOOTSTRAP_TIMEOUT = 15.0
# Buckets with no news for this long get a lookup of a random id in their range (Kademlia uses an
# hour; potluck swarms churn faster). It also paces dropping expired records.
REFRESH_INTERVAL = 600.0
# Refresh lookups one upkeep round may start, so a long-idle node does not burst.
MAX_REFRESH_PER_ROUND = 8
# Consecutive failed calls after which a peer leaves the routing table even without a replacement
# (the Kademlia paper suggests about five with backoff; three keeps dead entries from lingering).
# Failed stores count on their own too (`DHTNode.store_backoff`): a prompt find answer does not
# clear them, so a peer that answers finds but never stores goes stale all the same.
STALE_AFTER_FAILURES = 3
# Background tasks (pings, caching stores, hand-offs) one node may run at once; beyond this new
# ones are skipped, so a flood of newcomers cannot grow memory without bound.
MAX_BACKGROUND_TASKS = 512
# Peers whose addresses we heard of but have not called yet (oldest forgotten first).
MAX_HEARSAY = 65536
# The voice (`Lookup`) of find answerers whose connection closed before their answer was read: their
# origin would come from the addresses they claim, so they all count as one subnet.
UNPLACED = "unplaced"
# Storing our peer record at start: one store traversal; past this, start goes on without it
# (the refresh retries), so a slow network delays joining by at most this much.
PUBLISH_TIMEOUT = 10.0


@dataclass(frozen=True)
class DHTConfig:
    """Tunables of a DHT node; every peer of a swarm should use the same limits."""

    bucket_size: int = DEFAULT_BUCKET_SIZE  # k
    depth_modulo: int = DEFAULT_DEPTH_MODULO  # b: bucket splitting (see routing.py)
    alpha: int = DEFAULT_ALPHA  # requests in flight per lookup target
    replicas: int | None = None  # nodes that store each record; None: bucket_size
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_ttl: float = DEFAULT_MAX_TTL
    max_storage_bytes: int = DEFAULT_MAX_STORAGE_BYTES
    rpc_timeout: float = RPC_TIMEOUT
    refresh_interval: float | None = REFRESH_INTERVAL  # None: no periodic upkeep
    cache_on_get: bool = True
    handoff: bool = True  # hand records to newcomers that become their closest nodes
    peer_record_ttl: float | None = PEER_RECORD_TTL  # None: publish no peer record (for DHT-only tests)

    @property
    def num_replicas(self) -> int:
        return self.replicas or self.bucket_size


@dataclass
class GetOutcome:
    """What a get found for one key: the winning records (a plain one, or dictionary entries)
    and the hop count at which they were first found (0: held locally)."""

    records: list[Record]
    hops: int | None


class _OwnRecord:
    """Our peer record as sent along our joining lookup, and how many nodes took it."""

    __slots__ = ("holders", "record")

    def __init__(self, record: Record):
        self.record = record
        self.holders = 0

    def answered(self, peer: PeerID, held: bool | str | None) -> None:
        if held is True:
            self.holders += 1
        elif isinstance(held, str):
            logger.warning("%s refused this peer's record: %s", peer, held)


@functools.lru_cache(maxsize=65536)
def _node_id(peer_id: PeerID) -> int:
    return node_id_of(peer_id)


class DHTNode:
    """One peer's Kademlia node. Create, `await start(initial_peers)`, `await shutdown()`."""

    def __init__(self, transport: Transport, config: DHTConfig | None = None,
                 validators: Sequence[RecordValidator] = (), clock: Clock = get_dht_time):
        self.transport = transport
        self.metrics = peer_metrics(transport)
        self.peer_id = transport.peer_id
        self.node_id = _node_id(self.peer_id)
        self.config = config or DHTConfig()
        self.limits = Limits(self.config.max_value_bytes, self.config.max_ttl)
        self.validators: list[RecordValidator] = [PeerRecordValidator(clock), KeyKinds(clock), *validators]
        self.now = clock
        self.routing = RoutingTable(self.node_id, self.config.bucket_size, self.config.depth_modulo)
        self.storage = Storage(self.config.max_storage_bytes)
        self.backoff = Backoff()
        # Failed store calls, cleared only by an answered store: a peer in this backoff is not
        # picked as a replica (see STALE_AFTER_FAILURES).
        self.store_backoff = Backoff()
        self._rng = random.Random(self.node_id)
        self._tasks: set[asyncio.Task] = set()
        # Store calls in flight, some outliving the store that sent them (STORE_GRACE): kept
        # apart from `_tasks` so they never crowd out its MAX_BACKGROUND_TASKS.
        self._store_calls: set[asyncio.Task] = set()
        self._pinging: set[PeerID] = set()
        self._newcomers: set[PeerID] = set()
        self._handoff_task: asyncio.Task | None = None
        # Addresses other nodes told us, by node id, handed to the transport only when we call
        # that peer: a lookup hears of hundreds of peers and calls a few dozen.
        self._hearsay: dict[int, tuple[Multiaddr, ...]] = {}
        self._upkeep_task: asyncio.Task | None = None
        self._republish_task: asyncio.Task | None = None
        self._readdress_task: asyncio.Task | None = None
        self._readdress_again = False  # our addresses changed again while republishing
        self._started = False
        self._closed = False

    @property
    def client_mode(self) -> bool:
        """Read live from the transport: a reachability check or a relay may change it."""
        return self.transport.client_mode

    # -- life cycle ---------------------------------------------------------------------------------
    async def start(self, initial_peers: Iterable[Multiaddr | str | PeerID] = (),
                    timeout: float = BOOTSTRAP_TIMEOUT) -> None:
        """Serve the DHT methods and join through `initial_peers` (raises PeerUnreachable if
        none of them answers)."""
        if self._started:
            return
        self._started = True
        for method, handler in ((protocol.PING, self._on_ping), (protocol.FIND, self._on_find),
                                (protocol.STORE, self._on_store)):
            self.transport.add_handler(method, handler, max_seconds=HANDLER_SECONDS)
        self.transport.set_resolver(self)
        if self.config.refresh_interval:
            self._upkeep_task = self._spawn(self._upkeep(self.config.refresh_interval))
        initial = list(initial_peers)
        publishes = self._publishes_peer_record()
        own = _OwnRecord(record) if publishes and (record := self._own_peer_record()) is not None else None
        if initial:
            await self._join(initial, timeout, own)
        if own is not None:
            self.storage.store(self.node_id, own.record, self.now())  # its closest holder: us
            if initial and not own.holders:  # nobody took it along the lookup: store it as usual
                await self.publish_peer_record(min(timeout, PUBLISH_TIMEOUT))
        if self.config.peer_record_ttl is not None:  # also while we have no address: we may get one
            self._republish_task = self._spawn(self._republish_forever(self.config.peer_record_ttl / 3))
            self.transport.watch_addresses(self._addresses_changed)

    async def bootstrap(self, initial_peers: Iterable[Multiaddr | str | PeerID],
                        timeout: float = BOOTSTRAP_TIMEOUT) -> None:
        """Ping the given peers, then look up our own id so the peers near us learn of us."""
        await self._join(initial_peers, timeout, None)

    async def _join(self, initial_peers: Iterable[Multiaddr | str | PeerID], timeout: float,
                    own: _OwnRecord | None) -> None:
        """`bootstrap`, sending `own` (our peer record) along the lookup: the lookup of our id
        visits the record's replicas (`key_id_of`), so it is stored with no extra calls."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        initial = list(initial_peers)
        results = await asyncio.gather(*(self._reach(p, deadline) for p in initial), return_exceptions=True)
        errors = [f"{p}: {r}" for p, r in zip(initial, results, strict=True) if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
        if len(errors) == len(initial):
            raise PeerUnreachable("could not join the DHT: no initial peer answered:\n  " + "\n  ".join(errors))
        for line in errors:
            logger.warning("initial DHT peer unreachable: %s", line)
        await self._lookup([self.node_id], values=False, stop_on_value=False, deadline=deadline, own=own)

    async def _reach(self, peer: Multiaddr | str | PeerID, deadline: float) -> None:
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        if not isinstance(peer, PeerID):
            addr = Multiaddr.parse(peer) if isinstance(peer, str) else peer
            peer = await self.transport.connect(addr, timeout)  # checks the /p2p/ id when given
        await self.ping(peer, timeout)

    async def shutdown(self) -> None:
        """Stop serving and cancel every background task (and wait for them)."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            for method in (protocol.PING, protocol.FIND, protocol.STORE):
                self.transport.remove_handler(method)
            if self.transport.resolver is self:
                self.transport.set_resolver(None)
            self.transport.unwatch_addresses(self._addresses_changed)
        tasks = [*self._tasks, *self._store_calls]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # A cancelled task keeps its CancelledError, whose traceback holds the task's frame and so
        # this node: dropped, a node shut down is freed without the cyclic GC.
        self._upkeep_task = self._republish_task = None

    async def wait_idle(self, timeout: float = OPERATION_TIMEOUT) -> None:
        """Wait until the background work started so far (hand-offs, caching stores, pings, the
        store calls a store left running) is done; for tests and orderly benchmarks. Raises
        TimeoutError after `timeout`."""
        async with compat.timeout(timeout):
            forever = (self._upkeep_task, self._republish_task)
            while pending := [t for t in (*self._tasks, *self._store_calls) if t not in forever]:
                await asyncio.wait(pending)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        if self._closed or len(self._tasks) >= MAX_BACKGROUND_TASKS:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._store_calls.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("DHT background task failed", exc_info=task.exception())

    def _mono(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def replicas(self) -> int:
        return self.config.num_replicas

    # -- peers ---------------------------------------------------------------------------------------
    def _learn(self, peer: PeerID) -> None:
        """A non-client peer with a known address answered or called us: it belongs in the table."""
        if peer == self.peer_id or not self.transport.addresses_of(peer):
            return
        if self.store_backoff.failures(peer) >= STALE_AFTER_FAILURES and self._store_blocked(peer):
            return  # answers, but fails every store: not named to others while in store backoff
        known = peer in self.routing
        oldest = self.routing.add_or_update(peer, _node_id(peer), self._mono())
        if oldest is not None and oldest not in self._pinging:
            self._pinging.add(oldest)
            if self._spawn(self._ping_oldest(oldest)) is None:
                self._pinging.discard(oldest)
        if not known and peer in self.routing:
            self._welcome(peer)

    def _peer_ok(self, peer: PeerID) -> None:
        self.backoff.succeeded(peer)
        self._learn(peer)

    def _peer_failed(self, peer: PeerID, store: bool = False) -> None:
        """`peer` did not answer a call; `store`: it was a store call, counted in `store_backoff`
        too, which finds answered in between do not clear."""
        failures = self.backoff.failed(peer, self._mono())
        if store:
            failures = max(failures, self.store_backoff.failed(peer, self._mono()))
        if peer in self.routing and (failures >= STALE_AFTER_FAILURES or self.routing.has_replacement(peer)):
            promoted = self.routing.remove(peer)
            if promoted is not None:
                self._welcome(promoted)

    def _introduce(self, peer: PeerID) -> None:
        """Give the transport what we heard of `peer`'s addresses, before calling it."""
        addrs = self._hearsay.pop(_node_id(peer), None)
        if addrs:
            self.transport.add_addresses(peer, addrs)

    def _usable(self, peer: PeerID) -> bool:
        return not self.backoff.blocked(peer, self._mono())

    def _store_blocked(self, peer: PeerID) -> bool:
        return self.store_backoff.blocked(peer, self._mono())

    async def _ping_oldest(self, peer: PeerID) -> None:
        """A bucket is full and a newcomer waits: keep the oldest entry only if it still answers."""
        try:
            await self.ping(peer, self.config.rpc_timeout)
        except (NetworkError, DHTError):
            if peer in self.routing:
                promoted = self.routing.remove(peer)
                if promoted is not None:
                    self._welcome(promoted)
        finally:
            self._pinging.discard(peer)

    async def ping(self, peer: PeerID, timeout: float | None = None) -> None:
        """Check that `peer` serves the DHT; raises a NetworkError if it does not answer."""
        try:
            self._introduce(peer)
            await self._request(peer, protocol.PING, protocol.PING_REQUEST, timeout or self.config.rpc_timeout)
        except (NetworkError, TimeoutError):
            self._peer_failed(peer)
            raise
        self._peer_ok(peer)

    async def _request(self, peer: PeerID, method: str, request: bytes, timeout: float) -> Any:
        """One DHT request to `peer`, its round trip (or failure) counted in the peer's metrics."""
        elapsed = stopwatch()
        name = method.removeprefix("dht.")
        try:
            response = await self.transport.call(peer, method, request, timeout=timeout, resolve=False)
        except Exception:
            self.metrics.dht_failures.inc(method=name)
            raise
        self.metrics.dht_seconds.observe(elapsed(), method=name)
        return response

    # -- handlers ------------------------------------------------------------------------------------
    def _caller(self, ctx: CallContext) -> None:
        if not ctx.remote.client_mode:
            self._learn(ctx.peer_id)

    async def _on_ping(self, request: Any, ctx: CallContext) -> bytes:
        protocol.read(protocol.Ping, request)
        self._caller(ctx)
        return protocol.PING_RESPONSE

    async def _on_find(self, request: Any, ctx: CallContext) -> bytes:
        find = protocol.read(protocol.FindRequest, request)
        self._caller(ctx)
        now = self.now()
        held = None if find.own_record is None else self._accept_own_record(find.own_record, ctx, now)
        peers: list[protocol.NearPeer] = []
        index: dict[PeerID, int] = {}
        results = []
        for target in find.ids:
            records = self.storage.get(target, now) if find.values else []
            indices = []
            if not (records and find.stop):
                for peer, node_id in self.routing.nearest(target, self.config.bucket_size, exclude=(ctx.peer_id,)):
                    if peer not in index:
                        addrs = self.transport.vouched_addresses_of(peer)  # never pass hints on
                        if not addrs:
                            continue
                        index[peer] = len(peers)
                        peers.append((peer, node_id, addrs))
                    indices.append(index[peer])
            results.append(protocol.FindResult(indices, records))
        return protocol.write(protocol.FindResponse(peers, results, held))

    async def _on_store(self, request: Any, ctx: CallContext) -> bytes:
        store = protocol.read(protocol.StoreRequest, request)
        self._caller(ctx)
        now = self.now()
        outcomes = [self._accept(record, now, ctx.peer_id, ctx.remote.origin) for record in store.records]
        return protocol.write(protocol.StoreResponse(outcomes))

    def _accept(self, record: Record, now: float, sender: PeerID, origin: Origin) -> bool | str:
        """Store a record another peer sent: True if held, False if a later one is, else why not.
        The storage charges it to `sender` unless it has an owner (see `Storage`'s per-source quota),
        under the subnet of `origin` (where `sender`'s connection comes from; `Storage`'s shares)."""
        key_id = key_id_of(record.key)
        if self.storage.holds(key_id, record, now):
            # Hand-offs and re-stores bring the same record from every replica: it passed
            # every rule when it was stored, so skip the signature checks (the costly part).
            return True
        try:
            check_record(record, self.limits, now, self.validators, skew=CLOCK_SKEW_ALLOWANCE)
            return self.storage.store(key_id, record, now, sender, origin)
        except RecordRejected as e:
            return f"{type(e).__name__}: {e}"

    def _accept_own_record(self, record: Record, ctx: CallContext, now: float) -> bool | str:
        """The caller's own peer record, sent along its joining lookup (see `protocol`)."""
        if record.key != peer_record_key(ctx.peer_id) or record.subkey is not None:
            return "RecordRejected: a find request carries only the caller's own peer record"
        return self._accept(record, now, ctx.peer_id, ctx.remote.origin)

    # -- lookups -------------------------------------------------------------------------------------
    async def _find(self, peer: PeerID, ids: list[int], values: bool, stop: bool, deadline: float,
                    own: _OwnRecord | None = None) -> tuple[dict[int, Answer], str | None]:
        """Ask `peer` about `ids`: its answer per id, and the subnet it answered from (see
        `_answerer_subnet`)."""
        timeout = max(0.0, min(self.config.rpc_timeout, deadline - self._mono()))
        self._introduce(peer)
        request = protocol.write(protocol.FindRequest(ids, values, stop, None if own is None else own.record))
        response = await self._request(peer, protocol.FIND, request, timeout)
        subnet = self._answerer_subnet(peer)  # at once, while the connection it answered on is open
        answer = protocol.read(protocol.FindResponse, response, n_ids=len(ids))
        if own is not None:
            own.answered(peer, answer.held)
        now = self.now()
        peers = answer.peers
        answers = {}
        for target, result in zip(ids, answer.results, strict=True):
            near = []
            for i in result.nearest:
                other, other_id, addrs = peers[i]
                if other_id == self.node_id or not addrs:
                    continue
                if other_id not in self._hearsay and not self.routing.has_node(other_id):
                    self._hearsay[other_id] = addrs
                near.append((other, other_id))
            answers[target] = Answer(near, [r for r in result.records if self._trust(r, target, now, peer)])
        drop_oldest(self._hearsay, MAX_HEARSAY)
        return answers, subnet

    def _answerer_subnet(self, peer: PeerID) -> str | None:
        """The subnet a lookup counts `peer`'s answers under: all ids of one subnet are one voice
        (`Lookup`; ids are free, addresses are not). None, a voice of its own, for our own network
        (loopback and private addresses: a lab or a test swarm on one host) and an open connection
        of unknown origin. A peer whose connection is already gone is placed under UNPLACED, all
        such answerers together: its origin would otherwise come from the addresses it claims."""
        if not self.transport.is_connected(peer):
            return UNPLACED
        origin = self.transport.peer_origin(peer)
        return None if origin == UNKNOWN_ORIGIN else outside_subnet(origin)

    def _trust(self, record: Record, target: int, now: float, source: PeerID) -> bool:
        """Check a record another node returned, exactly as if it were stored here."""
        if record.expiration_time <= now:
            return False
        try:
            if key_id_of(record.key) != target:
                raise RecordRejected("record key does not hash to the id that was asked for")
            check_record(record, self.limits, now, self.validators, skew=CLOCK_SKEW_ALLOWANCE)
        except RecordRejected as e:
            logger.debug("ignoring a record from %s: %s", source, e)
            return False
        return True

    async def _lookup(self, targets: list[int], *, values: bool, stop_on_value: bool,
                      deadline: float, own: _OwnRecord | None = None) -> dict[int, TargetResult]:
        """Run one iterative lookup for all `targets` (see lookup.py) until done or `deadline`;
        `own`: our peer record, sent along to every node asked (our joining lookup)."""
        k = self.config.bucket_size
        lookup = Lookup({t: self.routing.nearest(t, k) for t in targets}, k=k, alpha=self.config.alpha,
                        stop_on_value=stop_on_value, self_id=self.node_id, usable=self._usable)
        pending: dict[asyncio.Task, tuple[PeerID, list[int], float]] = {}  # -> (peer, ids, slow after)
        slow: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        try:
            while True:
                for peer, ids in lookup.next_requests().items():
                    for start in range(0, len(ids), protocol.MAX_FIND_IDS):
                        chunk = ids[start:start + protocol.MAX_FIND_IDS]
                        task = loop.create_task(self._find(peer, chunk, values, stop_on_value, deadline, own))
                        pending[task] = (peer, chunk, loop.time() + SLOW_AFTER)
                for task, (peer, chunk, _) in list(pending.items()):
                    if not lookup.still_needed(chunk):
                        task.cancel()
                        del pending[task]
                        if task in slow:
                            self._peer_failed(peer)  # gave it up after SLOW_AFTER without an answer
                now = loop.time()
                if not pending or now >= deadline:
                    break
                wake = min([deadline] + [t for task, (_, _, t) in pending.items() if task not in slow])
                done, _ = await asyncio.wait(pending, timeout=max(0.0, wake - now),
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    peer, chunk, _ = pending.pop(task)
                    slow.discard(task)
                    try:
                        answers, subnet = task.result()
                    except (NetworkError, DHTError, TimeoutError) as e:
                        logger.debug("find on %s failed: %s", peer, e)
                        lookup.on_failure(peer)
                        self._peer_failed(peer)
                    else:
                        lookup.on_response(peer, chunk, answers, subnet)
                        self._peer_ok(peer)
                now = loop.time()
                for task, (peer, chunk, slow_after) in pending.items():
                    if task not in slow and now >= slow_after:
                        slow.add(task)
                        lookup.on_slow(peer, chunk)
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return {t: lookup.result(t) for t in targets}

    async def find_nearest(self, target: int, count: int | None = None,
                           timeout: float = OPERATION_TIMEOUT) -> list[PeerID]:
        """The live peers closest to `target` (node-level; for tests and tools)."""
        result = await self._lookup([target], values=False, stop_on_value=False,
                                    deadline=self._mono() + timeout)
        return result[target].nearest[:count or self.config.bucket_size]

    # -- get and store ---------------------------------------------------------------------------------
    async def get_many(self, keys: Iterable[Key], latest: bool = False,
                       timeout: float = OPERATION_TIMEOUT) -> dict[Key, GetOutcome]:
        """Find the records of several keys in one traversal. With `latest`, ask every one of the
        closest nodes and merge what they hold; otherwise stop at the first node that has them."""
        deadline = self._mono() + timeout
        now = self.now()
        outcomes: dict[Key, GetOutcome] = {}
        searching: dict[int, list[Key]] = {}
        local: dict[int, list[Record]] = {}
        seen: set[Key] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            key_id = key_id_of(key)
            held = self.storage.get(key_id, now)
            if held and not latest:
                outcomes[key] = GetOutcome(held, 0)
            else:
                searching.setdefault(key_id, []).append(key)
                local[key_id] = held
        if not searching:
            return outcomes
        results = {}
        if len(self.routing):
            results = await self._lookup(list(searching), values=True, stop_on_value=not latest, deadline=deadline)
        for key_id, same_id_keys in searching.items():
            result = results.get(key_id)
            found = [r for _, records in (result.records if result else []) for r in records]
            merged = merge_records(found + local[key_id])
            hops = result.hops if result and result.hops is not None else (0 if local[key_id] else None)
            for key in same_id_keys:
                outcomes[key] = GetOutcome(merged, hops)
            if merged and result and self.config.cache_on_get and result.without_value:
                self._spawn(self._send_records(result.without_value[0], merged))
        return outcomes

    async def store_many(self, records: Sequence[Record], timeout: float = OPERATION_TIMEOUT) -> list[bool]:
        """Store validated (and, if owned, signed) records on the `replicas` closest nodes of
        their keys; one traversal for all keys. Element i: whether any replica holds record i.
        Returns once enough replicas hold each record (see `_await_replicas`); the other store
        calls go on in the background until their deadline."""
        deadline = self._mono() + timeout
        now = self.now()
        stored = [False] * len(records)
        by_key: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            if record.expiration_time > now:
                by_key.setdefault(key_id_of(record.key), []).append(i)
        if not by_key:
            return stored
        results = {}
        if len(self.routing):
            lookup_deadline = deadline - min(self.config.rpc_timeout, timeout * STORE_RPC_SHARE)
            results = await self._lookup(list(by_key), values=False, stop_on_value=False, deadline=lookup_deadline)
        plan: dict[PeerID, list[int]] = {}
        replicas = [0] * len(records)  # replicas each record went to, this node included
        held = [0] * len(records)  # of those, how many hold it
        for key_id, indices in by_key.items():
            # Not a peer whose stores keep failing (`store_backoff`): the next closest instead.
            nearest = [p for p in results[key_id].nearest if not self._store_blocked(p)] if key_id in results else []
            holders = [(p, _node_id(p) ^ key_id) for p in nearest[:self.replicas]]
            if not self.client_mode:
                holders.append((self.peer_id, self.node_id ^ key_id))
            for peer, _ in sorted(holders, key=lambda h: h[1])[:self.replicas]:
                for i in indices:
                    replicas[i] += 1
                if peer == self.peer_id:
                    for i in indices:
                        if self.storage.store(key_id, records[i], now):
                            stored[i] = True
                            held[i] += 1
                else:
                    plan.setdefault(peer, []).extend(indices)
        if plan:
            await self._await_replicas(records, plan, deadline, replicas, held, stored)
        return stored

    async def _await_replicas(self, records: Sequence[Record], plan: dict[PeerID, list[int]], deadline: float,
                              replicas: list[int], held: list[int], stored: list[bool]) -> None:
        """Send each peer of `plan` its records and count who holds what (`held`, `stored`) until
        every record is settled: all its calls answered, or a majority of its `replicas` hold it,
        or one does and STORE_GRACE has passed. Calls still running then go on in the background
        (`_store_calls`); a replica that answers finds but never stores must not hold up stores."""
        loop = asyncio.get_running_loop()
        calls: dict[asyncio.Task, list[int]] = {}
        unanswered = [0] * len(records)
        for peer, indices in plan.items():
            task = loop.create_task(self._store_on(peer, [records[i] for i in indices], deadline))
            self._store_calls.add(task)
            task.add_done_callback(self._task_done)
            calls[task] = indices
            for i in indices:
                unanswered[i] += 1
        grace_ends = loop.time() + STORE_GRACE
        sent = {i for indices in calls.values() for i in indices}

        def settled() -> bool:
            late = loop.time() >= grace_ends
            return all(unanswered[i] == 0 or held[i] > replicas[i] // 2 or (late and held[i] > 0) for i in sent)

        pending = set(calls)
        try:
            while pending and not settled():
                wait = max(0.0, grace_ends - loop.time()) if loop.time() < grace_ends else None
                done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    for i, ok in zip(calls[task], task.result(), strict=True):
                        unanswered[i] -= 1
                        if ok is True:
                            held[i] += 1
                            stored[i] = True
        except BaseException:
            for task in pending:
                task.cancel()
            raise
        if self._closed:  # shut down meanwhile: nobody would cancel them
            for task in pending:
                task.cancel()

    async def _store_on(self, peer: PeerID, records: Sequence[Record], deadline: float) -> list[bool | str]:
        """`_send_records`, logging refusals (also for a call that outlives its store)."""
        answers = await self._send_records(peer, records, deadline)
        for record, ok in zip(records, answers, strict=True):
            if isinstance(ok, str):
                logger.warning("%s refused a record for %r: %s", peer, record.key, ok)
        return answers

    async def _send_records(self, peer: PeerID, records: Sequence[Record],
                            deadline: float | None = None) -> list[bool | str]:
        """Store `records` on one peer; a failed call counts as refused (False) for each, and
        against the peer in `store_backoff`."""
        answers: list[bool | str] = []
        for start in range(0, len(records), protocol.MAX_STORE_RECORDS):
            chunk = list(records[start:start + protocol.MAX_STORE_RECORDS])
            timeout = self.config.rpc_timeout
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - self._mono()))
            try:
                self._introduce(peer)
                response = await self._request(peer, protocol.STORE, protocol.write(protocol.StoreRequest(chunk)),
                                               timeout)
                answers.extend(protocol.read(protocol.StoreResponse, response, n_records=len(chunk)).results)
            except (NetworkError, BadRequest, TimeoutError) as e:
                logger.debug("store on %s failed: %s", peer, e)
                self._peer_failed(peer, store=True)
                answers.extend([False] * (len(records) - start))
                break
            else:
                self.store_backoff.succeeded(peer)
                self._peer_ok(peer)
        return answers

    # -- peer records ----------------------------------------------------------------------------------
    def membership_token(self) -> bytes | None:
        """The token our owner-signed records carry in an authority-governed run (the transport's
        `membership` gate shows it in handshakes too); None otherwise."""
        gate = getattr(self.transport, "membership", None)
        return None if gate is None else gate.own_token()

    def _publishes_peer_record(self) -> bool:
        """Whether others can dial us (directly or through a relay): then they need our record."""
        return self.config.peer_record_ttl is not None and bool(self.transport.addresses)

    def _addresses_changed(self) -> None:
        """The transport's `watch_addresses` callback: republish our record at once (a relay
        reserved or lost), not at the next refresh, so that dials find the new addresses."""
        self._readdress_again = True
        if self._readdress_task is None or self._readdress_task.done():
            self._readdress_task = self._spawn(self._republish_addresses())

    async def _republish_addresses(self) -> None:
        while self._readdress_again:
            self._readdress_again = False
            await self.publish_peer_record()

    def _own_peer_record(self) -> Record | None:
        """Our peer record, signed and checked (where we listen, for `peer_record_ttl` seconds);
        None (and a warning) if our own rules refuse it."""
        assert self.config.peer_record_ttl is not None
        identity = self.transport.identity
        expiration = self.now() + self.config.peer_record_ttl
        signed = PeerRecord.sign(identity, self.transport.addresses, expiration)
        record = sign_record(Record(peer_record_key(self.peer_id), None, dumps(signed.to_wire()), expiration),
                             identity, self.membership_token())
        try:
            check_record(record, self.limits, self.now(), self.validators, skew=0.0)
        except RecordRejected as e:
            logger.warning("could not publish this peer's record: %s", e)
            return None
        return record

    async def publish_peer_record(self, timeout: float = PUBLISH_TIMEOUT) -> bool:
        """Sign and store our peer record; True if a replica holds it. Failures are logged, not
        raised: the refresh tries again."""
        if not self._publishes_peer_record() or (record := self._own_peer_record()) is None:
            return False
        try:
            stored = (await self.store_many([record], timeout))[0]
        except (NetworkError, DHTError) as e:
            logger.warning("could not publish this peer's record: %s", e)
            return False
        if not stored:
            logger.warning("no DHT node accepted this peer's record; it is retried in %.0f s",
                           self.config.peer_record_ttl / 3)
        return stored

    async def _republish_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.publish_peer_record()

    async def resolve_peer(self, peer_id: PeerID, timeout: float,
                           thorough: bool = False) -> tuple[PeerRecord, float] | None:
        """The transport's `PeerResolver`: `peer_id`'s valid signed record and its seconds to
        live, or None. The first copy found (a dial waits on this), unless `thorough`: the last
        one did not answer, so ask all of the key's closest nodes for the newest (a restarted
        peer's new record must beat stale copies cached on the way)."""
        key = peer_record_key(peer_id)
        outcome = (await self.get_many([key], latest=thorough, timeout=timeout))[key]
        now = self.now()
        best: PeerRecord | None = None
        for record in outcome.records:
            if record.subkey is not None or record.expiration_time <= now:
                continue
            try:
                parsed = peer_record_from_bytes(record.value)
            except Exception:  # noqa: BLE001 - checked on arrival already; skip anything odd
                continue
            if parsed.peer_id == peer_id and (best is None or parsed.expiration_time > best.expiration_time):
                best = parsed
        return None if best is None else (best, best.expiration_time - now)

    # -- hand-off and upkeep ---------------------------------------------------------------------------
    def _welcome(self, peer: PeerID) -> None:
        """A peer is new in our table: queue it for the records it is now responsible for."""
        if self.client_mode or not self.config.handoff or self._closed:
            return
        self._newcomers.add(peer)
        if self._handoff_task is None or self._handoff_task.done():
            self._handoff_task = self._spawn(self._hand_off())

    async def _hand_off(self) -> None:
        while self._newcomers:
            newcomers, self._newcomers = self._newcomers, set()
            fresh = [n for p in newcomers if (n := self.routing.node_id(p)) is not None]
            batches: dict[PeerID, list[Record]] = {}
            now = self.now()
            for key_id, key in self.storage.keys():
                if is_peer_record_key(key):
                    # Not handed off: a peer record sits at its owner's own id (`key_id_of`), so
                    # the owner, alive and holding it, is where every lookup of it ends; the
                    # owner's next re-store reaches newcomers. Handing it on made each join cost
                    # about k more stores.
                    continue
                # Cheap tests first (a node runs this for every key it holds at every join), each
                # two bisections: a peer with `replicas` known peers surely closer to the key than
                # itself is not one of its replicas, be it a newcomer or us.
                if all(self.routing.surely_closer(key_id, n ^ key_id) >= self.replicas for n in fresh):
                    continue
                mine = self.node_id ^ key_id
                if self.routing.surely_closer(key_id, mine) >= self.replicas:
                    continue
                records = self.storage.get(key_id, now)
                if not records:
                    continue
                nearest = self.routing.nearest(key_id, self.replicas)
                if len(nearest) >= self.replicas and all(n ^ key_id < mine for _, n in nearest):
                    continue  # we are no longer one of this key's replicas
                for peer, _ in nearest:
                    if peer in newcomers:
                        batches.setdefault(peer, []).extend(records)
            if batches:
                await asyncio.gather(*(self._send_records(peer, records) for peer, records in batches.items()))

    async def _upkeep(self, interval: float) -> None:
        """Drop expired records and refresh buckets nobody was seen in for `interval` seconds."""
        while True:
            await asyncio.sleep(interval)
            self.storage.remove_expired(self.now())
            stale = self.routing.stale_buckets(self._mono(), interval)[:MAX_REFRESH_PER_ROUND]
            if stale and len(self.routing):
                targets = [self.routing.random_id_in(b, self._rng) for b in stale]
                await self._lookup(targets, values=False, stop_on_value=False,
                                   deadline=self._mono() + OPERATION_TIMEOUT)
