"""A node's local records: expiration, subkey dictionaries, the "later expiration wins" rule,
and a byte budget shared fairly among the peers records come from. Plain logic: callers pass `now`.

Rules for a store at one key:
- a record replaces the one it competes with (same key and subkey) only if it expires later;
  at equal expiration the larger value bytes win, so every node settles on the same record
  whatever order stores arrive in; an identical record is accepted and changes nothing;
- a plain value and a dictionary compete on the dictionary's latest expiration; at a tie the
  dictionary wins, and dictionary entries expiring before the best plain value seen are dropped
  (so the result is `merge_records` of everything received, whatever the arrival order);
- expired records are gone: never returned, and dropped lazily.

Budgets (issue 14: one peer sent 2,304 records of 65 KB in 0.8 s and the old node-wide "evict the
soonest-expiring" rule threw out every honest record a node held):
- one key's dictionary holds at most `max_key_bytes`; a new entry may push out the key's entries
  expiring soonest, only ones expiring before it;
- each *source* holds at most `max_source_bytes`; a store that would put its source over it first
  evicts that source's own records, soonest-expiring first and only ones expiring before the
  newcomer, or is refused. A record's source is its owner when its key or subkey names one
  (`owners_of`: the owner signed it), else the peer that sent it (`source`; None for this node's
  own stores, which are not held to the quota: the node's user is trusted with its own memory).
  Owned records are charged to their owner, not to whoever brought them, because hand-offs,
  replication and caching on get forward other peers' owned records: charging the forwarder
  would make an honest replica that hands a newcomer thousands of others' records hit its quota;
- each source is charged under the *subnet* (/24, /48: `net.origins`) its first record came from
  (the sender's), and each subnet holds at most `max_subnet_bytes` (a quarter of the node): peer
  ids cost nothing, addresses do (issue 29: a thousand made-up ids of one host, each under its
  quota, filled a node, and then honest sources holding more than one record each paid first). A
  store that would put its subnet over its share frees bytes within that subnet, as below;
- when the node as a whole is full, expired records are dropped, then bytes are freed from the
  subnet holding the most, from its source holding the most (each counting the newcomer's; at a
  tie, the newcomer's own), soonest-expiring first. Records of the newcomer's own source go only if
  they expire before it (a refusal otherwise, exactly the quota rule); a larger source pays
  whatever its records' expiration. So a flooder's records displace only the flooder's (and its
  subnet's), and an honest subnet's records survive while any bigger subnet exists. Where every
  peer shares one subnet (a test swarm on one machine) this is the largest source, as before.
Every store is all or nothing: either every eviction it needs is possible, or nothing changes.
Costs: O(log n) per record stored or evicted (a heap per source, one of all records by expiry, one
of subnets by bytes and one per subnet of its sources by bytes, all with lazy deletion and
compaction); nothing is kept per source or subnet once it holds nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from potluck.dht.errors import NotOwner
from potluck.dht.records import Key, Record, Subkey, owners_of
from potluck.net.identity import PeerID
from potluck.net.origins import Origin

__all__ = ["Source", "Storage", "merge_records"]

# Who a record is charged to: its owner or the peer that sent it; None: this node itself.
Source = PeerID | None
# The subnet a source's records are charged under (`Origin.subnet`); None: this node itself.
Subnet = str | None

# What Python spends per stored record beyond its bytes (objects, dict slots, heap entry); counted
# against the budget so that a flood of tiny records cannot use unbounded memory.
ENTRY_OVERHEAD_BYTES = 256
# 128 MiB: thousands of directory records per peer with room to spare on a volunteer's machine.
DEFAULT_MAX_STORAGE_BYTES = 128 * 2**20
# One key's dictionary (all subkeys together): 1 MiB bounds what one find answer may carry per
# key (so a 32-key answer stays far below the 64 MiB frame limit) and holds thousands of entries.
DEFAULT_MAX_KEY_BYTES = 2**20
# One source's share of the node: an eighth, so it takes at least eight peer identities to fill a
# node at all (and even then the largest source is evicted first, not the honest ones). An honest
# peer's own records on one node are a few records of at most 64 KiB each, far below it; 16 MiB
# of the default budget still holds hundreds of unowned records a single peer hands off.
SOURCE_QUOTA_DIVISOR = 8
DEFAULT_MAX_SOURCE_BYTES = DEFAULT_MAX_STORAGE_BYTES // SOURCE_QUOTA_DIVISOR
# One subnet's share (/24, /48: one party's block, however many ids it makes up): a quarter, two
# sources' worth, so it takes at least four subnets to fill a node (and then the largest pays
# first). Never below one source's quota.
SUBNET_QUOTA_DIVISOR = 4
# The expiration heaps are rebuilt when stale entries outnumber live ones by this factor.
HEAP_COMPACT_FACTOR = 2

# What `_Plan`'s searches for the largest subnet or source return when there is none (None is a
# subnet and a source: this node's own).
_NOTHING: Any = object()
# A heap entry: (expiration, sequence number of the store, key id, subkey). It is live while the
# slot of `key id` holds, at `subkey`, the record stored with that sequence number.
_Item = tuple[float, int, int, Subkey | None]


def _beats(new: Record, held: Record) -> bool:
    """The deterministic order between competing records: later expiration, then larger value."""
    return (new.expiration_time, new.value) > (held.expiration_time, held.value)


def _same(a: Record, b: Record) -> bool:
    return a.expiration_time == b.expiration_time and a.value == b.value


def _cost(record: Record) -> int:
    return record.stored_bytes() + ENTRY_OVERHEAD_BYTES


def source_of(record: Record, sender: Source) -> Source:
    """Who a record is charged to: its owner if its key or subkey names one, else its sender."""
    try:
        owner = owners_of(record.key, record.subkey)
    except NotOwner:  # never validly signed, so never from a remote peer: charge who stored it
        return sender
    return owner if owner is not None else sender


class _Slot:
    """What one key holds: a plain record or a dictionary of subkey records."""

    __slots__ = ("bytes", "floor", "key", "meta", "plain", "subkeys")

    def __init__(self, key: Key):
        self.key = key
        self.plain: Record | None = None
        self.subkeys: dict[Subkey, Record] = {}
        # For each held record (subkey None: the plain one): its store's sequence number, its source.
        self.meta: dict[Subkey | None, tuple[int, Source]] = {}
        self.bytes = 0
        # The expiration of the best plain record the dictionary displaced or outlived: entries
        # expiring before it are refused, exactly as if that plain record were still competing.
        self.floor = -math.inf

    def entries(self) -> Iterator[Record]:
        if self.plain is not None:
            yield self.plain
        yield from self.subkeys.values()

    def current(self, subkey: Subkey | None) -> Record | None:
        return self.plain if subkey is None else self.subkeys.get(subkey)


class _Source:
    """What one source holds: its bytes, its record count and its records by expiration (a heap
    with lazy deletion), and the subnet it is charged under. Dropped as soon as its last record goes."""

    __slots__ = ("bytes", "count", "heap", "subnet")

    def __init__(self, subnet: Subnet) -> None:
        self.bytes = 0
        self.count = 0
        self.heap: list[_Item] = []
        self.subnet = subnet


class _Subnet:
    """What one subnet's sources hold together, and its sources by bytes, largest first (a lazy
    heap: (-bytes, order, source), as `Storage._largest` for subnets). Dropped with its last source."""

    __slots__ = ("bytes", "largest", "sources")

    def __init__(self) -> None:
        self.bytes = 0
        self.sources = 0
        self.largest: list[tuple[int, int, Source]] = []


class Storage:
    """Records held by one node, keyed by key id."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_STORAGE_BYTES, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
                 max_source_bytes: int | None = None, max_subnet_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.max_key_bytes = max_key_bytes
        self.max_source_bytes = max_bytes // SOURCE_QUOTA_DIVISOR if max_source_bytes is None else max_source_bytes
        self.max_subnet_bytes = (max(self.max_source_bytes, max_bytes // SUBNET_QUOTA_DIVISOR)
                                 if max_subnet_bytes is None else max_subnet_bytes)
        self.total_bytes = 0
        self._slots: dict[int, _Slot] = {}
        self._sources: dict[Source, _Source] = {}
        self._subnets: dict[Subnet, _Subnet] = {}
        self._seq = itertools.count()
        self._entries = 0
        self._heap_entries = 0  # in every source's heap together, stale ones included
        self._expiry: list[_Item] = []  # every record, soonest expiry first (lazy deletion, as above)
        # Subnets by bytes, largest first: (-bytes, order, subnet). Lazy: a subnet's bytes may have
        # shrunk since its entry was pushed (an entry is exact only while -bytes equals its bytes),
        # but every subnet always has an entry at least its bytes, so an exact top is the largest.
        # Each subnet keeps its sources the same way (`_Subnet.largest`).
        self._largest: list[tuple[int, int, Subnet]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        """Number of keys held (some may have expired but not been dropped yet)."""
        return len(self._slots)

    # -- reading ------------------------------------------------------------------------------------
    def get(self, key_id: int, now: float) -> list[Record]:
        """Live records of a key: [plain] or its dictionary entries; [] if none."""
        slot = self._slots.get(key_id)
        if slot is None:
            return []
        self._drop_expired_in(key_id, slot, now)
        return list(slot.entries())

    def holds(self, key_id: int, record: Record, now: float) -> bool:
        """Whether this very record (every field equal) is held and live: a store of it again
        changes nothing, so it needs no second validation."""
        slot = self._slots.get(key_id)
        held = slot.current(record.subkey) if slot is not None else None
        return held is not None and held.expiration_time > now and held == record

    def keys(self) -> list[tuple[int, Key]]:
        """(id, key) of every key held (some may have expired but not been dropped yet)."""
        return [(key_id, slot.key) for key_id, slot in self._slots.items()]

    def items(self, now: float) -> Iterator[tuple[int, list[Record]]]:
        """(key id, live records) for every key held."""
        for key_id in list(self._slots):
            records = self.get(key_id, now)
            if records:
                yield key_id, records

    def bytes_by_source(self) -> dict[Source, int]:
        """Bytes charged to each source holding anything (expired records not yet dropped included)."""
        return {source: state.bytes for source, state in self._sources.items()}

    def bytes_by_subnet(self) -> dict[Subnet, int]:
        """Bytes charged to each subnet holding anything (expired records not yet dropped included)."""
        return {subnet: state.bytes for subnet, state in self._subnets.items()}

    def _subnet_of(self, source: Source, origin: Origin | None) -> Subnet:
        """Where `source`'s records are charged: where its first held record came from (a source
        keeps one subnet while it holds anything), else `origin`'s subnet; a source given no
        origin (a caller that knows none) is a subnet of its own; this node's own stores, None."""
        state = self._sources.get(source)
        if state is not None:
            return state.subnet
        if source is None:
            return None
        return origin.subnet if origin is not None else f"peer:{source}"

    # -- writing ------------------------------------------------------------------------------------
    def store(self, key_id: int, record: Record, now: float, source: Source = None,
              origin: Origin | None = None) -> bool:
        """Apply one record under the module's rules; True if it is now held. `source`: the peer
        that sent it (None: this node's own store); it is charged to its owner if it has one.
        `origin`: where the sender's connection comes from (see `_subnet_of`)."""
        if record.expiration_time <= now:
            return False
        cost = _cost(record)
        if self.total_bytes + cost > self.max_bytes:
            self.remove_expired(now)  # before anyone live is evicted
        slot = self._slots.get(key_id)
        if slot is not None:
            self._drop_expired_in(key_id, slot, now)
            slot = self._slots.get(key_id)
        removed: list[Record] = []  # what the new record displaces
        floor = slot.floor if slot is not None else -math.inf
        if record.subkey is None:
            if slot is not None and slot.subkeys:
                if record.expiration_time <= max(r.expiration_time for r in slot.subkeys.values()):
                    # The dictionary stays, but this plain record shadows its older entries.
                    slot.floor = max(slot.floor, record.expiration_time)
                    for old in [r for r in slot.subkeys.values() if r.expiration_time < slot.floor]:
                        self._forget(key_id, slot, old)
                    return False
                removed = list(slot.subkeys.values())
            elif slot is not None and slot.plain is not None:
                if _same(record, slot.plain):
                    return True
                if not _beats(record, slot.plain):
                    return False
                removed = [slot.plain]
        else:
            if slot is not None and slot.plain is not None:
                if record.expiration_time < slot.plain.expiration_time:
                    return False
                removed = [slot.plain]
                floor = slot.plain.expiration_time
            elif slot is not None:
                if record.expiration_time < slot.floor:
                    return False
                held = slot.subkeys.get(record.subkey)
                if held is not None:
                    if _same(record, held):
                        return True
                    if not _beats(record, held):
                        return False
                    removed = [held]
        charged = source_of(record, source)
        subnet = self._subnet_of(charged, origin)
        victims = self._plan_evictions(key_id, slot, record, charged, subnet, removed, cost)
        if victims is None:
            return False
        for victim_key, victim in victims:
            victim_slot = self._slots[victim_key]
            self._forget(victim_key, victim_slot, victim)
        for old in removed:
            current = self._slots.get(key_id)
            if current is not None and current.current(old.subkey) is old:
                self._forget(key_id, current, old)
        slot = self._slots.get(key_id)  # forgetting or eviction may have emptied and dropped it
        if slot is None:
            slot = self._slots[key_id] = _Slot(record.key)
        if record.subkey is None:
            slot.plain = record
            slot.floor = -math.inf
        else:
            slot.subkeys[record.subkey] = record
            slot.floor = max(slot.floor, floor)
        seq = next(self._seq)
        slot.meta[record.subkey] = (seq, charged)
        slot.bytes += cost
        self.total_bytes += cost
        self._entries += 1
        state = self._sources.get(charged)
        if state is None:
            state = self._sources[charged] = _Source(subnet)
        group = self._subnets.get(state.subnet)
        if group is None:
            group = self._subnets[state.subnet] = _Subnet()
        if state.count == 0:
            group.sources += 1
        state.bytes += cost
        state.count += 1
        group.bytes += cost
        item = (record.expiration_time, seq, key_id, record.subkey)
        heapq.heappush(state.heap, item)
        self._heap_entries += 1
        heapq.heappush(self._expiry, item)
        heapq.heappush(group.largest, (-state.bytes, next(self._order), charged))
        heapq.heappush(self._largest, (-group.bytes, next(self._order), state.subnet))
        self._maybe_compact()
        return True

    def remove_expired(self, now: float) -> int:
        """Drop every expired record; returns how many."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            item = heapq.heappop(self._expiry)
            record = self._live(item)
            if record is not None:
                self._forget(item[2], self._slots[item[2]], record)
                dropped += 1
        return dropped

    # -- internals ----------------------------------------------------------------------------------
    def _live(self, item: _Item) -> Record | None:
        """The record a heap entry stands for, if it is still held."""
        _, seq, key_id, subkey = item
        slot = self._slots.get(key_id)
        if slot is None:
            return None
        meta = slot.meta.get(subkey)
        return slot.current(subkey) if meta is not None and meta[0] == seq else None

    def _forget(self, key_id: int, slot: _Slot, record: Record) -> None:
        if record.subkey is None:
            slot.plain = None
        else:
            del slot.subkeys[record.subkey]
        _, source = slot.meta.pop(record.subkey)
        cost = _cost(record)
        slot.bytes -= cost
        self.total_bytes -= cost
        self._entries -= 1
        state = self._sources[source]
        state.bytes -= cost
        state.count -= 1
        group = self._subnets[state.subnet]
        group.bytes -= cost
        if state.count == 0:  # nothing is kept per source (or subnet) once it holds nothing
            self._heap_entries -= len(state.heap)
            del self._sources[source]
            group.sources -= 1
            if group.sources == 0:
                del self._subnets[state.subnet]
        if slot.plain is None and not slot.subkeys:
            del self._slots[key_id]

    def _drop_expired_in(self, key_id: int, slot: _Slot, now: float) -> None:
        for record in [r for r in slot.entries() if r.expiration_time <= now]:
            self._forget(key_id, slot, record)

    def _plan_evictions(self, key_id: int, slot: _Slot | None, record: Record, charged: Source, subnet: Subnet,
                        removed: list[Record], cost: int) -> list[tuple[int, Record]] | None:
        """What must go for `record` (costing `cost`, charged to `charged` under `subnet`) to fit
        every budget (the key's, its source's, its subnet's, the node's); None if it cannot.
        Changes nothing: heap entries looked at are put back."""
        delta = cost - sum(_cost(r) for r in removed) if removed else cost
        if self._fits(slot, record, charged, subnet, cost, delta):
            return []  # the common case: nothing to evict, no plan to make
        return _Plan(self, record, charged, subnet).make(key_id, slot, removed, cost, delta)

    def _fits(self, slot: _Slot | None, record: Record, charged: Source, subnet: Subnet, cost: int,
              delta: int) -> bool:
        """Whether `record` fits every budget as things are (its source's and subnet's without
        counting what it replaces: a conservative test; the full plan decides when it says no)."""
        if (slot.bytes if slot is not None else 0) + delta > self.max_key_bytes:
            return False
        if self.total_bytes + delta > self.max_bytes:
            return False
        if charged is None:
            return True
        state, group = self._sources.get(charged), self._subnets.get(subnet)
        return ((state.bytes if state is not None else 0) + cost <= self.max_source_bytes
                and (group.bytes if group is not None else 0) + cost <= self.max_subnet_bytes)

    def _maybe_compact(self) -> None:
        if self._heap_entries > HEAP_COMPACT_FACTOR * self._entries + 1024:
            for state in self._sources.values():
                state.heap = [item for item in state.heap if self._live(item) is not None]
                heapq.heapify(state.heap)
            self._heap_entries = sum(len(state.heap) for state in self._sources.values())
        if len(self._expiry) > HEAP_COMPACT_FACTOR * self._entries + 1024:
            self._expiry = [item for item in self._expiry if self._live(item) is not None]
            heapq.heapify(self._expiry)
        if len(self._largest) > HEAP_COMPACT_FACTOR * len(self._subnets) + 1024:
            self._largest = [(-group.bytes, next(self._order), subnet) for subnet, group in self._subnets.items()]
            heapq.heapify(self._largest)
        for group in self._subnets.values():
            if len(group.largest) > HEAP_COMPACT_FACTOR * group.sources + 64:
                # Every source of the subnet has an entry (one is pushed with each store): rebuild
                # from the sources its entries name that are still charged under it.
                named = {entry[2] for entry in group.largest}
                group.largest = [(-state.bytes, next(self._order), source) for source in named
                                 if (state := self._sources.get(source)) is not None
                                 and self._subnets.get(state.subnet) is group]
                heapq.heapify(group.largest)

class _Plan:
    """One store's plan of evictions (`Storage._plan_evictions`): what each source and subnet it
    touches would hold after it, the victims so far, and the heap entries looked at (put back by
    `finish`). Changes nothing in the storage until the store commits the victims."""

    def __init__(self, storage: Storage, record: Record, charged: Source, subnet: Subnet):
        self.storage, self.record, self.charged, self.subnet = storage, record, charged, subnet
        self.victims: list[tuple[int, Record]] = []
        self.skip: set[int] = set()  # ids of records already going (replaced or evicted)
        self.freed = 0
        self.after: dict[Source, int] = {}  # each touched source's bytes once the store is done
        self.after_subnet: dict[Subnet, int] = {}  # each touched subnet's
        self.popped: list[tuple[_Source, _Item]] = []  # entries of source heaps looked at
        self.taken: list[tuple[list, tuple]] = []  # entries of the lazy largest heaps looked at
        self.exhausted: set[Source] = set()  # sources with nothing left to give
        self.exhausted_subnets: set[Subnet] = set()
        # The touched ones by bytes after the store (lazy: an entry is valid while it matches):
        # (-bytes, 0 for the newcomer's own else 1, order, subnet or source).
        self.touched_subnets: list[tuple[int, int, int, Subnet]] = []
        self.touched_sources: dict[Subnet, list[tuple[int, int, int, Source]]] = {}

    def make(self, key_id: int, slot: _Slot | None, removed: list[Record], cost: int,
             delta: int) -> list[tuple[int, Record]] | None:
        storage, record, charged, subnet = self.storage, self.record, self.charged, self.subnet
        self.skip = {id(r) for r in removed}
        self.add(charged, cost)
        for old in removed:
            self.add(slot.meta[old.subkey][1], -_cost(old))  # type: ignore[union-attr] - removed ones are in it
        # One key's dictionary: the subnet holding the most of it pays first (see _key_victims).
        slot_bytes = slot.bytes if slot is not None else 0
        if slot_bytes + delta > storage.max_key_bytes:
            if slot is None or record.subkey is None:
                return None
            victims = self._key_victims(slot, slot_bytes + delta - storage.max_key_bytes, cost)
            if victims is None:
                return self.finish(False)
            for entry in victims:
                self.evict(key_id, entry, slot.meta[entry.subkey][1])
        # The source's quota (not for this node's own unowned records).
        if charged is not None:
            while self.after[charged] > storage.max_source_bytes:
                found = self.next_of(charged)
                if found is None or found[0][0] >= record.expiration_time:
                    return self.finish(False)
                self.evict(found[0][2], found[1], charged)
        # The subnet's share: its largest source pays (its own records only if they expire before the newcomer).
        if subnet is not None:
            while self.after_subnet[subnet] > storage.max_subnet_bytes:
                if self.free_one(subnet) != "evicted":
                    return self.finish(False)
        # The node: the largest subnet pays, from its largest source.
        while storage.total_bytes + delta - self.freed > storage.max_bytes:
            largest = self.largest_subnet()
            if largest is _NOTHING:
                return self.finish(False)
            outcome = self.free_one(largest)
            if outcome == "refused":
                return self.finish(False)
            if outcome == "empty":
                self.exhausted_subnets.add(largest)
        return self.finish(True)

    def free_one(self, subnet: Subnet) -> str:
        """Evict one record from `subnet`'s largest source: "evicted"; "empty" if the subnet has
        nothing left to give; "refused" if its largest is the newcomer's own source and it holds
        nothing expiring before the newcomer (the store is refused, as by the quota rule)."""
        while True:
            source = self.largest_source(subnet)
            if source is _NOTHING:
                return "empty"
            found = self.next_of(source)
            if found is None:
                if source == self.charged:
                    return "refused"
                self.exhausted.add(source)
                continue
            if source == self.charged and found[0][0] >= self.record.expiration_time:
                return "refused"
            self.evict(found[0][2], found[1], source)
            return "evicted"

    # -- what the store would leave ---------------------------------------------------------------------
    def subnet_of(self, source: Source) -> Subnet:
        return self.subnet if source == self.charged else self.storage._sources[source].subnet

    def add(self, source: Source, nbytes: int) -> None:
        storage = self.storage
        subnet = self.subnet_of(source)
        if source not in self.after:
            state = storage._sources.get(source)
            self.after[source] = state.bytes if state is not None else 0
        if subnet not in self.after_subnet:
            group = storage._subnets.get(subnet)
            self.after_subnet[subnet] = group.bytes if group is not None else 0
        self.after[source] += nbytes
        self.after_subnet[subnet] += nbytes
        order = storage._order
        heapq.heappush(self.touched_subnets, (-self.after_subnet[subnet], 0 if subnet == self.subnet else 1,
                                              next(order), subnet))
        heapq.heappush(self.touched_sources.setdefault(subnet, []),
                       (-self.after[source], 0 if source == self.charged else 1, next(order), source))

    def _key_victims(self, slot: _Slot, needed: int, cost: int) -> list[Record] | None:
        """Entries of a full key's dictionary to evict so that `needed` bytes are freed for the
        newcomer (None: it cannot be stored). The subnet holding the most of the key, the newcomer
        counted under its own, loses its soonest-expiring entry first; the newcomer's own subnet
        only entries expiring before it. By expiry alone, identities of one subnet with the key
        kind's longest lifetimes pushed out every honest entry of a key (declarations, progress,
        donors) and kept new ones out."""
        storage, record = self.storage, self.record
        by_subnet: dict[Subnet, list[Record]] = {}
        held: dict[Subnet, int] = {self.subnet: cost}
        for entry in slot.subkeys.values():
            if id(entry) in self.skip:
                continue
            state = storage._sources.get(slot.meta[entry.subkey][1])
            subnet = state.subnet if state is not None else None
            by_subnet.setdefault(subnet, []).append(entry)
            held[subnet] = held.get(subnet, 0) + _cost(entry)
        for entries in by_subnet.values():
            entries.sort(key=lambda r: r.expiration_time, reverse=True)  # soonest last: popped first
        victims, freed = [], 0
        while freed < needed:
            holders = [s for s in held if by_subnet.get(s)]  # (None: this node's own records)
            if not holders:
                return None
            subnet = max(holders, key=held.__getitem__)
            entry = by_subnet[subnet].pop()
            if subnet == self.subnet and entry.expiration_time >= record.expiration_time:
                return None
            victims.append(entry)
            freed += _cost(entry)
            held[subnet] -= _cost(entry)
        return victims

    def evict(self, key_id: int, victim: Record, source: Source) -> int:
        self.skip.add(id(victim))
        self.victims.append((key_id, victim))
        cost = _cost(victim)
        self.freed += cost
        self.add(source, -cost)
        return cost

    def next_of(self, source: Source) -> tuple[_Item, Record] | None:
        """The source's soonest-expiring live record not already going, popped (to be put back)."""
        storage = self.storage
        state = storage._sources.get(source)
        while state is not None and state.heap:
            item = heapq.heappop(state.heap)
            storage._heap_entries -= 1
            victim = storage._live(item)
            if victim is None:
                continue  # stale: dropped for good
            self.popped.append((state, item))
            if id(victim) not in self.skip:
                return item, victim
        return None

    # -- the largest --------------------------------------------------------------------------------------
    def largest_subnet(self) -> Subnet:
        """The subnet holding the most after the store (not one found empty), or _NOTHING."""
        storage = self.storage
        touched = self.touched_subnets
        while touched and (self.after_subnet[touched[0][3]] != -touched[0][0]
                           or touched[0][3] in self.exhausted_subnets):
            heapq.heappop(touched)
        other = self._untouched(storage._largest, lambda n: storage._subnets[n].bytes if n in storage._subnets
                                else None, self.after_subnet)
        return self._pick(touched, other, storage._largest, lambda n: self.after_subnet.setdefault(
            n, storage._subnets[n].bytes))

    def largest_source(self, subnet: Subnet) -> Source:
        """The source of `subnet` holding the most after the store (not one found empty), or _NOTHING."""
        storage = self.storage
        touched = self.touched_sources.get(subnet, [])
        while touched and (self.after[touched[0][3]] != -touched[0][0] or touched[0][3] in self.exhausted):
            heapq.heappop(touched)
        group = storage._subnets.get(subnet)
        heap = group.largest if group is not None else []

        def bytes_of(source: Source) -> int | None:
            state = storage._sources.get(source)
            return state.bytes if state is not None and state.subnet == subnet else None

        def touch(source: Source) -> None:
            self.add(source, 0)

        other = self._untouched(heap, bytes_of, self.after)
        return self._pick(touched, other, heap, touch)

    def _untouched(self, heap: list, bytes_of: Any, touched: dict) -> tuple | None:
        """The top of a lazy largest heap once exact and not touched (None if there is none).
        Entries of what is gone are dropped, inexact ones replaced by exact ones, touched ones taken
        (put back by `finish`)."""
        while heap:
            entry = heap[0]
            held = bytes_of(entry[2])
            if held is None:
                heapq.heappop(heap)
            elif -entry[0] != held:
                heapq.heapreplace(heap, (-held, next(self.storage._order), entry[2]))
            elif entry[2] in touched:
                self.taken.append((heap, heapq.heappop(heap)))
            else:
                return entry
        return None

    def _pick(self, touched: list, other: tuple | None, heap: list, touch: Any) -> Any:
        """The larger of the touched top and the untouched top (a tie to the touched one), or _NOTHING."""
        if touched and (other is None or (touched[0][0], touched[0][1]) <= (other[0], 1)):
            return touched[0][3]
        if other is None:
            return _NOTHING
        self.taken.append((heap, heapq.heappop(heap)))
        touch(other[2])
        return other[2]

    def finish(self, ok: bool) -> list[tuple[int, Record]] | None:
        storage = self.storage
        going = {id(v) for _, v in self.victims} if ok else set()
        for heap, entry in self.taken:  # still at least what they stand for (evictions only shrink)
            heapq.heappush(heap, entry)
        for state, item in self.popped:  # survivors keep their heap entries
            victim = storage._live(item)
            if victim is not None and id(victim) not in going:
                heapq.heappush(state.heap, item)
                storage._heap_entries += 1
        return self.victims if ok else None


def merge_records(records: Iterable[Record]) -> list[Record]:
    """Combine what several replicas returned for one key, by the same rules as `Storage`:
    the best plain record, or the best record per subkey, whichever wins."""
    plain: Record | None = None
    subkeys: dict[Subkey, Record] = {}
    for record in records:
        if record.subkey is None:
            if plain is None or _beats(record, plain):
                plain = record
        else:
            held = subkeys.get(record.subkey)
            if held is None or _beats(record, held):
                subkeys[record.subkey] = record
    if subkeys and (plain is None or max(r.expiration_time for r in subkeys.values()) >= plain.expiration_time):
        if plain is not None:
            subkeys = {s: r for s, r in subkeys.items() if r.expiration_time >= plain.expiration_time}
        return list(subkeys.values())
    return [plain] if plain is not None else []
