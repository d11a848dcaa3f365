"""`DHT`: the user-facing directory (`peer.dht`): Python values in, Python values out.

Values are encoded with `potluck.core.serialization.dumps` (tensors, dicts, lists, numbers, text)
and checked against every rule before anything is sent, so a bad store fails at the caller with a
clear error. Synchronous methods run on the peer's event loop through its runner; the `a...`
twins are for code already on the loop (and for swarms of emulated DHTs in one loop).
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from potluck.core.dht_time import Clock, get_dht_time
from potluck.core.runner import LoopRunner
from potluck.core.serialization import dumps, loads
from potluck.dht.node import BOOTSTRAP_TIMEOUT, OPERATION_TIMEOUT, DHTConfig, DHTNode
from potluck.dht.records import Key, Record, Subkey, ValueWithExpiration
from potluck.dht.validation import MAX_VALUE_TENSORS, RecordValidator, check_names, check_record, sign_record
from potluck.net.address import Multiaddr
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

__all__ = ["DHT"]

T = TypeVar("T")

# Extra seconds the synchronous facade waits beyond an operation's own timeout, so the operation
# reports its own (clearer) error first.
SYNC_GRACE = 5.0

StoreItem = tuple[Key, Any, float] | tuple[Key, Any, float, Subkey | None]


class DHT:
    """A Kademlia DHT node with expiring values, subkeys, owner-signed records and limits.

    Keys are `str` or `bytes` (a str and its UTF-8 bytes are different keys); subkeys are `str`,
    `bytes` or `int`. Expiration times are DHT time (`potluck.get_dht_time()` + a TTL).

    Args:
        transport: the peer's transport (TCP or emulated); the DHT serves its methods on it.
        initial_peers: addresses or peer ids to join through (at `astart`).
        config: limits and tunables (`DHTConfig`).
        validators: extra record rules, e.g. `SchemaValidator({"expert.": ExpertInfo})`.
        clock: the DHT time source; emulated swarms pass `event_loop_clock()`.
        runner: the loop runner that the synchronous methods submit to (a Peer passes its own).
    """

    def __init__(self, transport: Transport, *, initial_peers: Iterable[Multiaddr | str | PeerID] = (),
                 config: DHTConfig | None = None, validators: Sequence[RecordValidator] = (),
                 clock: Clock = get_dht_time, runner: LoopRunner | None = None):
        self.node = DHTNode(transport, config, validators, clock)
        self._initial_peers = list(initial_peers)
        self._runner = runner

    @classmethod
    async def create(cls, transport: Transport, **kwargs: Any) -> DHT:
        """Build and start a DHT on the running loop (the transport must be started)."""
        dht = cls(transport, **kwargs)
        await dht.astart()
        return dht

    async def astart(self, timeout: float = BOOTSTRAP_TIMEOUT,
                     initial_peers: Iterable[Multiaddr | str | PeerID] | None = None) -> None:
        """Serve the DHT and join through the initial peers (these, or the constructor's)."""
        await self.node.start(self._initial_peers if initial_peers is None else initial_peers, timeout)

    async def ashutdown(self) -> None:
        await self.node.shutdown()

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    def add_validator(self, validator: RecordValidator) -> None:
        """Apply one more record rule (e.g. a `SchemaValidator`) to everything stored or found."""
        self.node.validators.append(validator)

    def get_time(self) -> float:
        """Now, in this DHT's time (what expiration times are compared with)."""
        return self.node.now()

    # -- async API ----------------------------------------------------------------------------------
    async def astore(self, key: Key, value: Any, expiration_time: float, subkey: Subkey | None = None, *,
                     timeout: float = OPERATION_TIMEOUT) -> bool:
        """Store `value` under `key` (or under `subkey` in key's dictionary) until `expiration_time`.

        True if at least one of the key's closest nodes now holds it; False if they all hold a
        record that expires later (or this one has already expired). Raises `RecordRejected`
        (`ValueTooLarge`, `ExpirationTooFar`, `NotOwner`) before sending if a rule is broken.
        """
        return (await self.astore_many([(key, value, expiration_time, subkey)], timeout=timeout))[0]

    async def astore_many(self, items: Iterable[StoreItem], *, timeout: float = OPERATION_TIMEOUT) -> list[bool]:
        """Store several `(key, value, expiration_time[, subkey])` items in one traversal."""
        records = [self._prepare(*item) for item in items]
        return await self.node.store_many(records, timeout)

    async def aget(self, key: Key, latest: bool = False, *,
                   timeout: float = OPERATION_TIMEOUT) -> ValueWithExpiration | None:
        """The value stored under `key`, or None. For a key with subkeys, `.value` is a dict
        {subkey: ValueWithExpiration}. `latest=True` asks all of the key's closest nodes and
        returns the newest value (merged dictionary) instead of the first one found."""
        return (await self.aget_many([key], latest, timeout=timeout))[key]

    async def aget_many(self, keys: Iterable[Key], latest: bool = False, *,
                        timeout: float = OPERATION_TIMEOUT) -> dict[Key, ValueWithExpiration | None]:
        """`aget` for several keys in one traversal; returns {key: value or None}."""
        keys = list(keys)
        for key in keys:
            check_names(key, None)
        outcomes = await self.node.get_many(keys, latest, timeout)
        return {key: _decode(outcomes[key].records) for key in keys}

    # -- sync API -----------------------------------------------------------------------------------
    def store(self, key: Key, value: Any, expiration_time: float, subkey: Subkey | None = None, *,
              timeout: float = OPERATION_TIMEOUT) -> bool:
        """Blocking `astore`."""
        return self._run(self.astore(key, value, expiration_time, subkey, timeout=timeout), timeout)

    def store_many(self, items: Iterable[StoreItem], *, timeout: float = OPERATION_TIMEOUT) -> list[bool]:
        """Blocking `astore_many`."""
        return self._run(self.astore_many(list(items), timeout=timeout), timeout)

    def get(self, key: Key, latest: bool = False, *, timeout: float = OPERATION_TIMEOUT) -> ValueWithExpiration | None:
        """Blocking `aget`."""
        return self._run(self.aget(key, latest, timeout=timeout), timeout)

    def get_many(self, keys: Iterable[Key], latest: bool = False, *,
                 timeout: float = OPERATION_TIMEOUT) -> dict[Key, ValueWithExpiration | None]:
        """Blocking `aget_many`."""
        return self._run(self.aget_many(list(keys), latest, timeout=timeout), timeout)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if self._runner is None:
            coro.close()
            raise RuntimeError("this DHT has no runner (it was built on a bare transport); "
                               "use the async methods (astore, aget, ...) on its event loop")
        return self._runner.run(coro, timeout + SYNC_GRACE)

    # -- encoding -----------------------------------------------------------------------------------
    def _prepare(self, key: Key, value: Any, expiration_time: float, subkey: Subkey | None = None) -> Record:
        """Encode, sign if owned, and check one item exactly as the receiving nodes will."""
        check_names(key, subkey)
        if isinstance(expiration_time, bool) or not isinstance(expiration_time, (int, float)):
            raise TypeError(f"expiration_time must be a number (DHT time), got {type(expiration_time).__name__}")
        record = Record(key, subkey, dumps(value), float(expiration_time))
        record = sign_record(record, self.node.transport.identity, self.node.membership_token())
        check_record(record, self.node.limits, self.node.now(), self.node.validators, skew=0.0)
        return record


def _decode(records: list[Record]) -> ValueWithExpiration | None:
    if not records:
        return None
    if len(records) == 1 and records[0].subkey is None:
        return ValueWithExpiration(loads(records[0].value, max_buffers=MAX_VALUE_TENSORS), records[0].expiration_time)
    entries = {r.subkey: ValueWithExpiration(loads(r.value, max_buffers=MAX_VALUE_TENSORS), r.expiration_time)
               for r in records}
    return ValueWithExpiration(entries, max(r.expiration_time for r in records))
