"""Expert uids on a grid, their announcements in the DHT, and the beam search that finds them.

An uid is a name and grid coordinates: `ffn.3.14` is expert (3, 14) of grid `ffn`. A server
announces each expert under three kinds of DHT keys, all with the same expiration:
- the uid itself -> where the expert is served (`RemoteExpert` looks it up),
- each grid prefix (`ffn.`, `ffn.3.`) with the next coordinate as the subkey, so a client can
  list which coordinates below a prefix have a live expert in one lookup per prefix.
A server that dies stops refreshing and its records expire; nothing has to be deleted.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from potluck.core.errors import MalformedMessage
from potluck.core.wire import wire_map
from potluck.dht import DHT
from potluck.net.identity import PeerID
from potluck.net.wire import peer_id_value

__all__ = ["ExpertLocation", "GridDirectory", "announce_experts", "beam_search", "grid_prefix", "parse_uid",
           "read_location"]

logger = logging.getLogger(__name__)

# Grid coordinates are small non-negative ints; a larger grid than this is a typo, not a model.
MAX_GRID_SIZE = 1 << 20
# Prefix lookups in flight per beam-search round (per sample, the best frontier entries).
DEFAULT_BEAM_SIZE = 4
# Characters of a uid read from the DHT that a log line repeats.
MAX_LOGGED_UID = 200


@dataclass(frozen=True)
class ExpertLocation:
    """Where one expert is served: the serving peer's id. Its addresses come from the peer's own
    signed record, which the transport looks up when it dials (`potluck.net.peer_record`).

    Its wire form is the DHT record a server stores under the uid and under the last grid prefix."""

    uid: str
    peer_id: PeerID

    def to_wire(self) -> dict:
        return {"peer": str(self.peer_id)}

    @classmethod
    def from_wire(cls, uid: str, msg: Any) -> ExpertLocation:
        """The record found under `uid` (or under its grid prefix); MalformedMessage if it is not one."""
        what = "expert record"
        return cls(uid, peer_id_value(wire_map(msg, what).get("peer"), "peer", what))


def read_location(uid: str, value: object) -> ExpertLocation | None:
    """A DHT value as an `ExpertLocation`; None (and a debug log) if it is malformed: anyone can
    write to the DHT, so garbage is skipped, not raised."""
    try:
        return ExpertLocation.from_wire(uid, value)
    except MalformedMessage as e:
        logger.debug("skipping the expert record of %s: %s", uid[:MAX_LOGGED_UID], e)
        return None


def parse_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """Split `ffn.3.14` into ("ffn", (3, 14)): the trailing integer parts are the coordinates."""
    if not isinstance(uid, str) or not uid or uid != uid.strip() or ".." in uid or uid.endswith("."):
        raise ValueError(f"malformed expert uid {uid!r}: expected a name and coordinates like 'ffn.3.14'")
    parts = uid.split(".")
    coords: list[int] = []
    while parts and parts[-1].isdigit():
        coords.insert(0, int(parts.pop()))
    if not parts:
        raise ValueError(f"malformed expert uid {uid!r}: it needs a name before the coordinates")
    return ".".join(parts), tuple(coords)


def grid_prefix(name: str, coords: Sequence[int] = ()) -> str:
    """The DHT key listing the next coordinate below `coords`: grid_prefix("ffn", [3]) == "ffn.3."."""
    return ".".join([name.rstrip("."), *map(str, coords)]) + "."


def announcement_items(locations: Iterable[ExpertLocation], expiration: float) -> list[tuple]:
    """The DHT (key, value, expiration, subkey) items that announce these experts."""
    items: list[tuple] = []
    for loc in locations:
        name, coords = parse_uid(loc.uid)
        value = loc.to_wire()
        items.append((loc.uid, value, expiration, None))
        for depth, coord in enumerate(coords):
            last = depth == len(coords) - 1
            items.append((grid_prefix(name, coords[:depth]), value if last else 1, expiration, coord))
    return items


async def announce_experts(dht: DHT, locations: Iterable[ExpertLocation], expiration: float,
                           timeout: float) -> int:
    """Store (or refresh) the announcements; returns how many items at least one node accepted."""
    items = announcement_items(locations, expiration)
    if not items:
        return 0
    stored = await dht.astore_many(items, timeout=timeout)
    return sum(stored)


# A grid prefix's live entries: coordinate -> the expert there (last dimension) or None (an
# inner dimension: some expert lives below it).
Children = dict[int, "ExpertLocation | None"]
Fetch = Callable[[list[str]], Awaitable[dict[str, Children]]]


class GridDirectory:
    """Reads grid prefixes from the DHT with a short cache, so a batch's searches share lookups."""

    def __init__(self, dht: DHT, cache_seconds: float, timeout: float):
        self.dht = dht
        self.cache_seconds = cache_seconds
        self.timeout = timeout
        self._cache: dict[str, tuple[float, Children]] = {}

    async def children(self, keys: list[str]) -> dict[str, Children]:
        """{prefix: {coordinate: location or None}} of unexpired entries for each prefix key.

        An entry whose value is a map is an expert's record (`ExpertLocation`), skipped if
        malformed; any other value marks an inner coordinate (its value is not used)."""
        now = self.dht.get_time()
        found = {k: entry[1] for k in keys if (entry := self._cache.get(k)) and now - entry[0] < self.cache_seconds}
        missing = [k for k in keys if k not in found]
        if missing:
            results = await self.dht.aget_many(missing, latest=True, timeout=self.timeout)
            for key in missing:
                result = results.get(key)
                entries: Children = {}
                if result is not None and isinstance(result.value, dict):
                    for sub, item in result.value.items():
                        if isinstance(sub, int) and 0 <= sub < MAX_GRID_SIZE and item.expiration_time > now:
                            if not isinstance(item.value, Mapping):
                                entries[sub] = None
                            elif (location := read_location(f"{key}{sub}", item.value)) is not None:
                                entries[sub] = location
                found[key] = entries
                self._cache[key] = (now, entries)
        return found

    def forget(self) -> None:
        self._cache.clear()


async def beam_search(fetch: Fetch, name: str, scores: Sequence[Sequence[Sequence[float]]], k: int,
                      beam_size: int = DEFAULT_BEAM_SIZE) -> list[list[tuple[float, ExpertLocation]]]:
    """The k best-scoring live experts for each sample, best first.

    `scores[d][b][i]` is sample b's score for coordinate i of grid dimension d; an expert's score is
    the sum over dimensions. Best-first search: a prefix's priority is its partial score plus the
    best possible score of the remaining dimensions (an upper bound), so an expert leaves the
    frontier only when nothing unexplored can beat it: the result is the exact top k among the
    experts the DHT lists as alive. Each round looks up the `beam_size` best open prefixes of every
    sample in one batched DHT request; with few dead experts that is one round per dimension.
    """
    dims = len(scores)
    batch = len(scores[0]) if dims else 0
    tails = []  # tails[b][d]: best possible sum of dimensions d.. for sample b
    for b in range(batch):
        best = [max(scores[d][b]) for d in range(dims)]
        tails.append([sum(best[d:]) for d in range(dims + 1)])
    # frontier entries: (-priority, tiebreak, coords, location or None while incomplete)
    frontiers: list[list] = [[(-tails[b][0], (), (), None)] for b in range(batch)]
    results: list[list[tuple[float, ExpertLocation]]] = [[] for _ in range(batch)]
    children: dict[str, Children] = {}
    while True:
        wanted: dict[int, list[tuple]] = {}
        for b in range(batch):
            frontier, result = frontiers[b], results[b]
            while frontier and len(result) < k and frontier[0][3] is not None:
                neg, _, _, location = heapq.heappop(frontier)
                result.append((-neg, location))
            if len(result) >= k or not frontier:
                continue
            picked = []
            while frontier and len(picked) < beam_size and frontier[0][3] is None:
                picked.append(heapq.heappop(frontier))
            wanted[b] = picked
        if not wanted:
            return results
        keys = sorted({grid_prefix(name, entry[2]) for picked in wanted.values() for entry in picked} - set(children))
        if keys:
            children.update(await fetch(keys))
        for b, picked in wanted.items():
            for _, _, coords, _ in picked:
                depth = len(coords)
                partial = sum(scores[d][b][c] for d, c in enumerate(coords))
                prefix = grid_prefix(name, coords)
                for coord, value in children.get(prefix, {}).items():
                    if coord >= len(scores[depth][b]):
                        continue  # outside this layer's grid
                    score = partial + scores[depth][b][coord]
                    new = (*coords, coord)
                    location = None
                    if depth + 1 == dims:
                        if not isinstance(value, ExpertLocation):
                            continue  # an inner entry where an expert should be
                        location = value
                    priority = score + tails[b][depth + 1]
                    if not math.isfinite(priority):
                        continue
                    heapq.heappush(frontiers[b], (-priority, new, new, location))
