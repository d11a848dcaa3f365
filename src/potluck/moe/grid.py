"""Expert uids on a grid, their announcements in the DHT, and the beam search that finds them.

An uid is a name and grid coordinates: `ffn.3.14` is expert (3, 14) of grid `ffn`. A server
announces each expert under these DHT keys, all with the same expiration, every entry owner-signed
by the server (so nobody can overwrite or squat another server's announcement):
- the uid itself, a dictionary with one entry per server under `own_subkey(server)` -> where the
  expert is served (`RemoteExpert` looks it up, `locate`),
- each grid prefix (`ffn.`, `ffn.3.`) with the subkey `f"{next coordinate}{owner_marker(server)}"`,
  so a client can list which coordinates below a prefix have a live expert in one lookup per prefix.
Readers take the server from the subkey's owner marker (the DHT checked its signature), skip
entries of any other form, and skip an expert record that names a peer other than its signer.
When several servers announce the same expert, the newest announcement (latest expiration, then
the smallest peer id) is used; an announcement expiring more than `ANNOUNCE_HORIZON` ahead is
skipped, so nobody wins every choice for a day by announcing itself with a day's lifetime.
A server that dies stops refreshing and its records expire; nothing has to be deleted.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from potluck.core.errors import MalformedMessage
from potluck.core.wire import FromContext, Message
from potluck.dht import DHT, ValueWithExpiration
from potluck.dht.records import own_subkey, owner_marker, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.wire import PeerIdField

__all__ = ["ExpertLocation", "GridDirectory", "announce_experts", "beam_search", "cell_subkey", "grid_prefix",
           "locate", "parse_cell", "parse_uid", "read_location"]

logger = logging.getLogger(__name__)

# Grid coordinates are small non-negative ints; a larger grid than this is a typo, not a model.
MAX_GRID_SIZE = 1 << 20
# Prefix lookups in flight per beam-search round (per sample, the best frontier entries).
DEFAULT_BEAM_SIZE = 4
# Announcements expiring further ahead than this are skipped by readers: servers re-announce every
# few seconds with a lifetime of 30 s by default (`moe.server.DEFAULT_ANNOUNCE_TTL`), so an hour is
# far past any honest one, and "newest wins" cannot be won for longer by announcing further ahead.
ANNOUNCE_HORIZON = 3600.0
# Characters of a uid read from the DHT that a log line repeats.
MAX_LOGGED_UID = 200


class ExpertLocation(Message, what="expert record"):
    """Where one expert is served: the serving peer's id. Its addresses come from the peer's own
    signed record, which the transport looks up when it dials (`potluck.net.peer_record`).

    Its wire form is the DHT record a server stores under the uid and under the last grid prefix;
    the uid is the key it was found under (`uid=` when read)."""

    uid: str = FromContext("uid")
    peer_id: PeerID = PeerIdField("peer")


def read_location(uid: str, value: object) -> ExpertLocation | None:
    """A DHT value as an `ExpertLocation`; None (and a debug log) if it is malformed: anyone can
    write to the DHT, so garbage is skipped, not raised."""
    try:
        return ExpertLocation.from_wire(value, uid=uid)
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


def cell_subkey(coord: int, server: PeerID) -> str:
    """The subkey under which `server`, and only it, lists coordinate `coord` below a grid prefix."""
    return f"{int(coord)}{owner_marker(server)}"


def parse_cell(subkey: object) -> tuple[int, PeerID] | None:
    """(coordinate, server) of a grid prefix's subkey written by `cell_subkey`; None for any other
    form (an unsigned coordinate, a marker naming nobody, a malformed coordinate)."""
    if not isinstance(subkey, str):
        return None
    head, marker, _ = subkey.partition("[owner:")
    if not marker or not head.isascii() or not head.isdigit() or len(head) > 7:
        return None
    coord = int(head)
    server = subkey_owner(subkey[len(head):])
    if server is None or not 0 <= coord < MAX_GRID_SIZE or subkey != cell_subkey(coord, server):
        return None
    return coord, server


def announcement_items(locations: Iterable[ExpertLocation], expiration: float) -> list[tuple]:
    """The DHT (key, value, expiration, subkey) items that announce these experts (each location's
    peer must be the announcing peer: the DHT refuses entries signed for anyone else)."""
    items: list[tuple] = []
    for loc in locations:
        name, coords = parse_uid(loc.uid)
        value = loc.to_wire()
        items.append((loc.uid, value, expiration, own_subkey(loc.peer_id)))
        for depth, coord in enumerate(coords):
            last = depth == len(coords) - 1
            items.append((grid_prefix(name, coords[:depth]), value if last else 1, expiration,
                          cell_subkey(coord, loc.peer_id)))
    return items


def _current(expiration: float, now: float) -> bool:
    """An announcement readers use: not expired, and not further ahead than ANNOUNCE_HORIZON."""
    return now < expiration <= now + ANNOUNCE_HORIZON


def _newest(candidates: Iterable[tuple[float, ExpertLocation]]) -> ExpertLocation | None:
    """The location announced last (latest expiration; ties: the smallest peer id)."""
    best = min(candidates, key=lambda c: (-c[0], str(c[1].peer_id)), default=None)
    return None if best is None else best[1]


def _signed_location(uid: str, server: PeerID, value: object) -> ExpertLocation | None:
    """`value` as the location `server` signed, or None if malformed or naming another peer."""
    location = read_location(uid, value)
    if location is not None and location.peer_id != server:
        logger.debug("skipping an expert record of %s signed by %s for %s", uid[:MAX_LOGGED_UID], server,
                     location.peer_id)
        return None
    return location


def locate(uid: str, found: ValueWithExpiration | None, now: float) -> ExpertLocation | None:
    """Where `uid` is served, from what the DHT holds under the uid (`DHT.aget(uid)`): the newest
    unexpired entry a server signed about itself (within `ANNOUNCE_HORIZON`); None if there is none."""
    if found is None or not isinstance(found.value, dict):
        return None
    candidates = []
    for subkey, entry in found.value.items():
        server = subkey_owner(subkey)
        if server is None or not _current(entry.expiration_time, now):
            continue
        location = _signed_location(uid, server, entry.value)
        if location is not None:
            candidates.append((entry.expiration_time, location))
    return _newest(candidates)


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
        malformed or if it names a peer other than the entry's signer; any other value marks an
        inner coordinate (its value is not used). Only entries under `cell_subkey` subkeys count;
        a coordinate with several servers' records gets the newest."""
        now = self.dht.get_time()
        found = {k: entry[1] for k in keys if (entry := self._cache.get(k)) and now - entry[0] < self.cache_seconds}
        missing = [k for k in keys if k not in found]
        if missing:
            results = await self.dht.aget_many(missing, latest=True, timeout=self.timeout)
            for key in missing:
                result = results.get(key)
                inner: set[int] = set()
                experts: dict[int, list[tuple[float, ExpertLocation]]] = {}
                if result is not None and isinstance(result.value, dict):
                    for sub, item in result.value.items():
                        cell = parse_cell(sub)
                        if cell is None or not _current(item.expiration_time, now):
                            continue
                        coord, server = cell
                        if not isinstance(item.value, Mapping):
                            inner.add(coord)
                        elif (location := _signed_location(f"{key}{coord}", server, item.value)) is not None:
                            experts.setdefault(coord, []).append((item.expiration_time, location))
                entries: Children = {coord: None for coord in inner}
                entries.update((coord, _newest(found_here)) for coord, found_here in experts.items())
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
