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
- when the node as a whole is full, expired records are dropped, then bytes are freed from the
  source holding the most (counting the newcomer's; at a tie, the newcomer's own source),
  soonest-expiring first. Records of the newcomer's own source go only if they expire before it
  (a refusal otherwise, exactly the quota rule); a larger source pays whatever its records'
  expiration. So a flooder's records displace only the flooder's, and an honest source's records
  survive while any bigger source exists.
Every store is all or nothing: either every eviction it needs is possible, or nothing changes.
Costs: O(log n) per record stored or evicted (a heap per source, one of all records by expiry,
one of sources by bytes, all with lazy deletion and compaction); nothing is kept per source once
it holds nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator

from potluck.dht.errors import NotOwner
from potluck.dht.records import Key, Record, Subkey, owners_of
from potluck.net.identity import PeerID

__all__ = ["Source", "Storage", "merge_records"]

# Who a record is charged to: its owner or the peer that sent it; None: this node itself.
Source = PeerID | None

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
# The expiration heaps are rebuilt when stale entries outnumber live ones by this factor.
HEAP_COMPACT_FACTOR = 2

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
    with lazy deletion). Dropped as soon as its last record goes."""

    __slots__ = ("bytes", "count", "heap")

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0
        self.heap: list[_Item] = []


class Storage:
    """Records held by one node, keyed by key id."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_STORAGE_BYTES, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
                 max_source_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.max_key_bytes = max_key_bytes
        self.max_source_bytes = max_bytes // SOURCE_QUOTA_DIVISOR if max_source_bytes is None else max_source_bytes
        self.total_bytes = 0
        self._slots: dict[int, _Slot] = {}
        self._sources: dict[Source, _Source] = {}
        self._seq = itertools.count()
        self._entries = 0
        self._heap_entries = 0  # in every source's heap together, stale ones included
        self._expiry: list[_Item] = []  # every record, soonest expiry first (lazy deletion, as above)
        # Sources by bytes, largest first: (-bytes, order, source). Lazy: a source's bytes may have
        # shrunk since its entry was pushed (an entry is exact only while -bytes equals its bytes),
        # but every source always has an entry at least its bytes, so an exact top is the largest.
        self._largest: list[tuple[int, int, Source]] = []
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

    # -- writing ------------------------------------------------------------------------------------
    def store(self, key_id: int, record: Record, now: float, source: Source = None) -> bool:
        """Apply one record under the module's rules; True if it is now held. `source`: the peer
        that sent it (None: this node's own store); it is charged to its owner if it has one."""
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
        victims = self._plan_evictions(key_id, slot, record, charged, removed, cost)
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
            state = self._sources[charged] = _Source()
        state.bytes += cost
        state.count += 1
        item = (record.expiration_time, seq, key_id, record.subkey)
        heapq.heappush(state.heap, item)
        self._heap_entries += 1
        heapq.heappush(self._expiry, item)
        heapq.heappush(self._largest, (-state.bytes, next(self._order), charged))
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
        if state.count == 0:  # nothing is kept per source once it holds nothing
            self._heap_entries -= len(state.heap)
            del self._sources[source]
        if slot.plain is None and not slot.subkeys:
            del self._slots[key_id]

    def _drop_expired_in(self, key_id: int, slot: _Slot, now: float) -> None:
        for record in [r for r in slot.entries() if r.expiration_time <= now]:
            self._forget(key_id, slot, record)

    def _plan_evictions(self, key_id: int, slot: _Slot | None, record: Record, charged: Source,
                        removed: list[Record], cost: int) -> list[tuple[int, Record]] | None:
        """What must go for `record` (costing `cost`) to fit every budget (the key's, its source's,
        the node's); None if it cannot. Changes nothing: heap entries looked at are put back."""
        delta = cost - sum(_cost(r) for r in removed) if removed else cost
        if self._fits(slot, record, charged, cost, delta):
            return []  # the common case: nothing to evict, no plan to make
        skip = {id(r) for r in removed}  # already counted as going
        victims: list[tuple[int, Record]] = []
        after: dict[Source, int] = {}  # each touched source's bytes once the store is done
        popped: list[tuple[_Source, _Item]] = []
        taken: list[tuple[int, int, Source]] = []  # entries of `_largest` looked at

        def held(source: Source) -> int:
            if source not in after:
                state = self._sources.get(source)
                after[source] = state.bytes if state is not None else 0
            return after[source]

        def evict(victim_key: int, victim: Record, source: Source) -> int:
            skip.add(id(victim))
            victims.append((victim_key, victim))
            after[source] = held(source) - _cost(victim)
            return _cost(victim)

        def next_of(source: Source) -> tuple[_Item, Record] | None:
            """The source's soonest-expiring live record not already going, popped (to be put back)."""
            state = self._sources.get(source)
            while state is not None and state.heap:
                item = heapq.heappop(state.heap)
                self._heap_entries -= 1
                victim = self._live(item)
                if victim is None:
                    continue  # stale: dropped for good
                popped.append((state, item))
                if id(victim) not in skip:
                    return item, victim
            return None

        def finish(ok: bool) -> list[tuple[int, Record]] | None:
            going = {id(v) for _, v in victims} if ok else set()
            for entry in taken:  # still at least their sources' bytes (evictions only shrink them)
                heapq.heappush(self._largest, entry)
            for state, item in popped:  # survivors keep their heap entries
                victim = self._live(item)
                if victim is not None and id(victim) not in going:
                    heapq.heappush(state.heap, item)
                    self._heap_entries += 1
            return victims if ok else None

        held(charged)
        after[charged] += cost
        for old in removed:
            old_source = slot.meta[old.subkey][1]
            after[old_source] = held(old_source) - _cost(old)
        # One key's dictionary.
        slot_bytes = slot.bytes if slot is not None else 0
        if slot_bytes + delta > self.max_key_bytes:
            if slot is None or record.subkey is None:
                return None
            needed, freed = slot_bytes + delta - self.max_key_bytes, 0
            for entry in sorted(slot.subkeys.values(), key=lambda r: r.expiration_time):
                if freed >= needed or entry.expiration_time >= record.expiration_time:
                    break
                if id(entry) not in skip:
                    freed += evict(key_id, entry, slot.meta[entry.subkey][1])
            if freed < needed:
                return None
            delta -= freed
        # The source's quota (not for this node's own unowned records).
        if charged is not None and after[charged] > self.max_source_bytes:
            while after[charged] > self.max_source_bytes:
                found = next_of(charged)
                if found is None or found[0][0] >= record.expiration_time:
                    return finish(False)
                delta -= evict(found[0][2], found[1], charged)
        # The node: the largest source pays (its own records only if they expire before the newcomer).
        needed = self.total_bytes + delta - self.max_bytes
        if needed > 0:
            # Sources this store already changed compete with their bytes after it; any other comes
            # from `_largest`, whose entries looked at are put back.
            order = self._order
            touched = [(-b, 0 if source == charged else 1, next(order), source) for source, b in after.items()]
            heapq.heapify(touched)
            while needed > 0:
                other = self._largest_untouched(after, taken)
                if touched and (other is None or (touched[0][0], touched[0][1]) <= (other[0], 1)):
                    _, mine, _, source = heapq.heappop(touched)
                elif other is not None:
                    heapq.heappop(self._largest)
                    taken.append(other)
                    source, mine = other[2], 1
                    held(source)
                else:
                    return finish(False)
                found = next_of(source)
                if found is None:
                    if mine == 0:
                        return finish(False)
                    continue  # nothing left to take (what remains is already going)
                item, victim = found
                if mine == 0 and item[0] >= record.expiration_time:
                    return finish(False)
                needed -= evict(item[2], victim, source)
                if after[source] > 0:
                    heapq.heappush(touched, (-after[source], mine, next(order), source))
        return finish(True)

    def _fits(self, slot: _Slot | None, record: Record, charged: Source, cost: int, delta: int) -> bool:
        """Whether `record` fits every budget as things are (the source's without counting what it
        replaces: a conservative test; the full plan decides when it says no)."""
        if (slot.bytes if slot is not None else 0) + delta > self.max_key_bytes:
            return False
        if self.total_bytes + delta > self.max_bytes:
            return False
        if charged is None:
            return True
        state = self._sources.get(charged)
        return (state.bytes if state is not None else 0) + cost <= self.max_source_bytes

    def _largest_untouched(self, after: dict[Source, int], taken: list) -> tuple[int, int, Source] | None:
        """The top of `_largest` once exact and of a source not in `after` (None if there is none).
        Stale entries are replaced by exact ones; entries of sources in `after` go to `taken`."""
        heap = self._largest
        while heap:
            entry = heap[0]
            state = self._sources.get(entry[2])
            if state is None:
                heapq.heappop(heap)  # the source holds nothing any more
            elif -entry[0] != state.bytes:
                heapq.heapreplace(heap, (-state.bytes, next(self._order), entry[2]))
            elif entry[2] in after:
                taken.append(heapq.heappop(heap))
            else:
                return entry
        return None

    def _maybe_compact(self) -> None:
        if self._heap_entries > HEAP_COMPACT_FACTOR * self._entries + 1024:
            for state in self._sources.values():
                state.heap = [item for item in state.heap if self._live(item) is not None]
                heapq.heapify(state.heap)
            self._heap_entries = sum(len(state.heap) for state in self._sources.values())
        if len(self._expiry) > HEAP_COMPACT_FACTOR * self._entries + 1024:
            self._expiry = [item for item in self._expiry if self._live(item) is not None]
            heapq.heapify(self._expiry)
        if len(self._largest) > HEAP_COMPACT_FACTOR * len(self._sources) + 1024:
            self._largest = [(-state.bytes, next(self._order), source) for source, state in self._sources.items()]
            heapq.heapify(self._largest)


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
