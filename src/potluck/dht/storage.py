"""A node's local records: expiration, subkey dictionaries, the "later expiration wins" rule,
and a byte budget that evicts the records expiring soonest. Plain logic: callers pass `now`.

Rules for a store at one key:
- a record replaces the one it competes with (same key and subkey) only if it expires later;
  at equal expiration the larger value bytes win, so every node settles on the same record
  whatever order stores arrive in; an identical record is accepted and changes nothing;
- a plain value and a dictionary compete on the dictionary's latest expiration; at a tie the
  dictionary wins, and dictionary entries expiring before the best plain value seen are dropped
  (so the result is `merge_records` of everything received, whatever the arrival order);
- expired records are gone: never returned, and dropped lazily.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator

from potluck.dht.records import Key, Record, Subkey

__all__ = ["Storage", "merge_records"]

# What Python spends per stored record beyond its bytes (objects, dict slots, heap entry); counted
# against the budget so that a flood of tiny records cannot use unbounded memory.
ENTRY_OVERHEAD_BYTES = 256
# 128 MiB: thousands of directory records per peer with room to spare on a volunteer's machine.
DEFAULT_MAX_STORAGE_BYTES = 128 * 2**20
# One key's dictionary (all subkeys together): 1 MiB bounds what one find answer may carry per
# key (so a 32-key answer stays far below the 64 MiB frame limit) and holds thousands of entries.
DEFAULT_MAX_KEY_BYTES = 2**20
# The expiration heap is rebuilt when stale entries outnumber live ones by this factor.
HEAP_COMPACT_FACTOR = 2


def _beats(new: Record, held: Record) -> bool:
    """The deterministic order between competing records: later expiration, then larger value."""
    return (new.expiration_time, new.value) > (held.expiration_time, held.value)


def _same(a: Record, b: Record) -> bool:
    return a.expiration_time == b.expiration_time and a.value == b.value


def _cost(record: Record) -> int:
    return record.stored_bytes() + ENTRY_OVERHEAD_BYTES


class _Slot:
    """What one key holds: a plain record or a dictionary of subkey records."""

    __slots__ = ("bytes", "floor", "key", "plain", "subkeys")

    def __init__(self, key: Key):
        self.key = key
        self.plain: Record | None = None
        self.subkeys: dict[Subkey, Record] = {}
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


class Storage:
    """Records held by one node, keyed by key id."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_STORAGE_BYTES, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES):
        self.max_bytes = max_bytes
        self.max_key_bytes = max_key_bytes
        self.total_bytes = 0
        self._slots: dict[int, _Slot] = {}
        self._heap: list[tuple[float, int, int, Subkey | None, Record]] = []  # soonest expiry first
        self._seq = itertools.count()
        self._entries = 0

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

    def key_ids(self) -> list[int]:
        """The ids of every key held (some may have expired but not been dropped yet)."""
        return list(self._slots)

    def items(self, now: float) -> Iterator[tuple[int, list[Record]]]:
        """(key id, live records) for every key held."""
        for key_id in list(self._slots):
            records = self.get(key_id, now)
            if records:
                yield key_id, records

    # -- writing ------------------------------------------------------------------------------------
    def store(self, key_id: int, record: Record, now: float) -> bool:
        """Apply one record under the module's rules; True if it is now held."""
        if record.expiration_time <= now:
            return False
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
        delta = _cost(record) - sum(_cost(r) for r in removed)
        slot_bytes = slot.bytes if slot is not None else 0
        if slot_bytes + delta > self.max_key_bytes:
            if slot is None or record.subkey is None:
                return False
            if not self._evict_from_key(key_id, slot, slot_bytes + delta - self.max_key_bytes, record,
                                        exclude=removed):
                return False
        if self.total_bytes + delta > self.max_bytes:
            if not self._evict_soonest(self.total_bytes + delta - self.max_bytes, record, removed):
                return False
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
        slot.bytes += _cost(record)
        self.total_bytes += _cost(record)
        self._entries += 1
        heapq.heappush(self._heap, (record.expiration_time, next(self._seq), key_id, record.subkey, record))
        self._maybe_compact()
        return True

    def remove_expired(self, now: float) -> int:
        """Drop every expired record; returns how many."""
        dropped = 0
        while self._heap and self._heap[0][0] <= now:
            _, _, key_id, subkey, record = heapq.heappop(self._heap)
            slot = self._slots.get(key_id)
            if slot is not None and slot.current(subkey) is record:
                self._forget(key_id, slot, record)
                dropped += 1
        return dropped

    # -- internals ----------------------------------------------------------------------------------
    def _forget(self, key_id: int, slot: _Slot, record: Record) -> None:
        if record.subkey is None:
            slot.plain = None
        else:
            del slot.subkeys[record.subkey]
        slot.bytes -= _cost(record)
        self.total_bytes -= _cost(record)
        self._entries -= 1
        if slot.plain is None and not slot.subkeys:
            del self._slots[key_id]

    def _drop_expired_in(self, key_id: int, slot: _Slot, now: float) -> None:
        for record in [r for r in slot.entries() if r.expiration_time <= now]:
            self._forget(key_id, slot, record)

    def _evict_from_key(self, key_id: int, slot: _Slot, needed: int, newcomer: Record,
                        exclude: Iterable[Record]) -> bool:
        """Free `needed` bytes within one key's dictionary, soonest expiry first, only among
        entries expiring before the newcomer. All or nothing."""
        skip = {id(r) for r in exclude}
        victims, freed = [], 0
        for record in sorted(slot.subkeys.values(), key=lambda r: r.expiration_time):
            if freed >= needed or record.expiration_time >= newcomer.expiration_time:
                break
            if id(record) not in skip:
                victims.append(record)
                freed += _cost(record)
        if freed < needed:
            return False
        for record in victims:
            self._forget(key_id, slot, record)
        return True

    def _evict_soonest(self, needed: int, newcomer: Record, replaced: list[Record]) -> bool:
        """Free `needed` bytes node-wide, soonest expiry first, only among records expiring before
        the newcomer (and not those it replaces, already counted). All or nothing."""
        skip = {id(r) for r in replaced}
        popped, victims, freed = [], [], 0
        while self._heap and freed < needed:
            item = heapq.heappop(self._heap)
            expiration, _, key_id, subkey, record = item
            slot = self._slots.get(key_id)
            if slot is None or slot.current(subkey) is not record:
                continue  # stale heap entry
            popped.append(item)
            if expiration >= newcomer.expiration_time:
                break
            if id(record) in skip:
                continue
            victims.append((key_id, slot, record))
            freed += _cost(record)
        if freed < needed:
            for item in popped:
                heapq.heappush(self._heap, item)
            return False
        for key_id, slot, record in victims:
            if slot.current(record.subkey) is record:
                self._forget(key_id, slot, record)
        for item in popped:  # survivors (e.g. the replaced record) keep their heap entries
            _, _, key_id, subkey, record = item
            slot = self._slots.get(key_id)
            if slot is not None and slot.current(subkey) is record:
                heapq.heappush(self._heap, item)
        return True

    def _maybe_compact(self) -> None:
        if len(self._heap) > HEAP_COMPACT_FACTOR * self._entries + 1024:
            self._heap = [item for item in self._heap
                          if (slot := self._slots.get(item[2])) is not None and slot.current(item[3]) is item[4]]
            heapq.heapify(self._heap)


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
