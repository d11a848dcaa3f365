"""Kademlia routing: 160-bit ids, XOR distance, k-buckets that split, and a replacement cache.

Plain logic over ids and peer ids: no I/O and no clock of its own (callers pass `now`), so every
rule is unit-tested without a network. The node that owns a table decides when to ping.

Splitting rule (Kademlia paper, section 4.2, with b = `depth_modulo`): a full bucket splits if its
range holds our own id, or if its depth is not a multiple of b. The second clause keeps up to 2^b
buckets for every b bits of distance, so each lookup step gains about b bits and a lookup takes
about log_{2^b}(N) hops instead of log_2(N).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from potluck.core.bounded import drop_oldest
from potluck.net.identity import PeerID

__all__ = ["ID_BITS", "ID_BYTES", "KBucket", "RoutingTable", "id_from_bytes", "id_to_bytes", "node_id_of"]

# SHA-1 gives 160-bit ids, as in the Kademlia paper; ids only need to be uniform, not secret.
ID_BITS = 160
ID_BYTES = ID_BITS // 8
# Kademlia's k: 20 keeps a bucket alive through hours of churn in the paper's measurements.
DEFAULT_BUCKET_SIZE = 20
# Kademlia's b (paper, section 4.2); hivemind uses 5 as well.
DEFAULT_DEPTH_MODULO = 5


def node_id_of(peer_id: PeerID) -> int:
    """A peer's DHT id: SHA-1 of its public key, so nobody picks where they sit in the id space."""
    return int.from_bytes(hashlib.sha1(peer_id.to_bytes()).digest(), "big")


def id_to_bytes(node_id: int) -> bytes:
    return node_id.to_bytes(ID_BYTES, "big")


def id_from_bytes(data: bytes) -> int:
    if len(data) != ID_BYTES:
        raise ValueError(f"a DHT id is {ID_BYTES} bytes, got {len(data)}")
    return int.from_bytes(data, "big")


class KBucket:
    """Peers whose ids fall in [lower, upper): live entries oldest-seen first, plus replacements."""

    __slots__ = ("depth", "last_updated", "lower", "nodes", "replacements", "upper")

    def __init__(self, lower: int, upper: int, depth: int, now: float):
        self.lower, self.upper, self.depth = lower, upper, depth
        self.nodes: OrderedDict[PeerID, int] = OrderedDict()  # least recently seen first
        self.replacements: OrderedDict[PeerID, int] = OrderedDict()  # most recent last
        self.last_updated = now

    def covers(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def __repr__(self) -> str:
        return f"KBucket(depth={self.depth}, nodes={len(self.nodes)}, replacements={len(self.replacements)})"


class RoutingTable:
    """This node's view of the network: which peers it knows, organised by distance."""

    def __init__(self, own_id: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                 depth_modulo: int = DEFAULT_DEPTH_MODULO, now: float = 0.0):
        if bucket_size < 1 or depth_modulo < 1:
            raise ValueError("bucket_size and depth_modulo must be >= 1")
        self.own_id = own_id
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self.buckets: list[KBucket] = [KBucket(0, 1 << ID_BITS, 0, now)]
        self._lowers: list[int] = [0]
        self._ids: dict[PeerID, int] = {}  # every live entry: peer -> node id
        self._peers: dict[int, PeerID] = {}  # the same, node id -> peer (int keys hash fast)
        self._sorted: list[int] = []  # the same node ids, ascending (for `nearest`)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._ids

    def __iter__(self) -> Iterator[PeerID]:
        return iter(self._ids)

    def has_node(self, node_id: int) -> bool:
        return node_id in self._peers

    def node_id(self, peer_id: PeerID) -> int | None:
        return self._ids.get(peer_id)

    def bucket_for(self, node_id: int) -> KBucket:
        return self.buckets[bisect.bisect_right(self._lowers, node_id) - 1]

    def add_or_update(self, peer_id: PeerID, node_id: int, now: float) -> PeerID | None:
        """Record that `peer_id` answered or called us.

        Returns None when the peer is now in the table (or was seen again). When its bucket is full
        and may not split, the peer waits in the replacement cache and the least recently seen
        entry is returned: the caller should ping it and `remove` it if it does not answer
        (Kademlia keeps old peers, which are the likeliest to stay).
        """
        if node_id == self.own_id:
            return None
        while True:
            bucket = self.bucket_for(node_id)
            if peer_id in bucket.nodes:
                bucket.nodes.move_to_end(peer_id)
                bucket.last_updated = now
                return None
            if len(bucket.nodes) < self.bucket_size:
                bucket.nodes[peer_id] = node_id
                bucket.replacements.pop(peer_id, None)
                self._ids[peer_id] = node_id
                self._peers[node_id] = peer_id
                bisect.insort(self._sorted, node_id)
                bucket.last_updated = now
                return None
            if not self._may_split(bucket):
                bucket.replacements.pop(peer_id, None)
                bucket.replacements[peer_id] = node_id
                drop_oldest(bucket.replacements, self.bucket_size)
                return next(iter(bucket.nodes))
            self._split(bucket)

    def _may_split(self, bucket: KBucket) -> bool:
        if bucket.upper - bucket.lower <= 1:
            return False
        return bucket.covers(self.own_id) or bucket.depth % self.depth_modulo != 0

    def _split(self, bucket: KBucket) -> None:
        middle = (bucket.lower + bucket.upper) // 2
        left = KBucket(bucket.lower, middle, bucket.depth + 1, bucket.last_updated)
        right = KBucket(middle, bucket.upper, bucket.depth + 1, bucket.last_updated)
        for table in ("nodes", "replacements"):
            for peer_id, node_id in getattr(bucket, table).items():
                getattr(left if node_id < middle else right, table)[peer_id] = node_id
        index = self.buckets.index(bucket)
        self.buckets[index:index + 1] = [left, right]
        self._lowers[index:index + 1] = [left.lower, right.lower]

    def remove(self, peer_id: PeerID) -> PeerID | None:
        """Drop a peer that stopped answering; the freshest replacement takes its place.
        Returns the promoted replacement, if any."""
        node_id = self._ids.pop(peer_id, None)
        if node_id is None:
            for bucket in self.buckets:
                bucket.replacements.pop(peer_id, None)
            return None
        del self._peers[node_id]
        del self._sorted[bisect.bisect_left(self._sorted, node_id)]
        bucket = self.bucket_for(node_id)
        del bucket.nodes[peer_id]
        if not bucket.replacements:
            return None
        promoted, promoted_id = bucket.replacements.popitem(last=True)
        bucket.nodes[promoted] = promoted_id
        self._ids[promoted] = promoted_id
        self._peers[promoted_id] = promoted
        bisect.insort(self._sorted, promoted_id)
        return promoted

    def has_replacement(self, peer_id: PeerID) -> bool:
        node_id = self._ids.get(peer_id)
        return node_id is not None and bool(self.bucket_for(node_id).replacements)

    def nearest(self, target: int, count: int, exclude: Iterable[PeerID] = ()) -> list[tuple[PeerID, int]]:
        """The `count` known peers closest to `target` by XOR distance, closest first.

        The ids within XOR distance 2^s of `target` are exactly those of the aligned block of 2^s
        ids that holds `target`, a contiguous slice of the sorted ids: a binary search over s finds
        the smallest block with enough peers, and only that block is ranked (lookups, find
        answers and hand-offs call this all the time)."""
        excluded = [self._ids[p] for p in exclude if p in self._ids]
        want = count + len(excluded)
        ids = self._sorted
        block = ids
        if len(ids) > want and target >> ID_BITS == 0:  # (an id out of range: rank everyone)
            low, high = 0, ID_BITS  # the block of 2^ID_BITS ids (everyone) is big enough
            while low < high:
                s = (low + high) // 2
                start = target >> s << s
                if bisect.bisect_left(ids, start + (1 << s)) - bisect.bisect_left(ids, start) >= want:
                    high = s
                else:
                    low = s + 1
            start = target >> low << low
            block = ids[bisect.bisect_left(ids, start):bisect.bisect_left(ids, start + (1 << low))]
        closest = sorted(block, key=target.__xor__)[:want]
        if excluded:
            closest = [i for i in closest if i not in excluded][:count]
        return [(self._peers[i], i) for i in closest]

    def surely_closer(self, target: int, distance: int) -> int:
        """A lower bound on how many known peers are closer to `target` than `distance`, in two
        bisections: those in the aligned block around `target` of the largest power of two not
        above `distance` (every id there is closer)."""
        bits = distance.bit_length() - 1
        if bits < 0:
            return 0
        start = target >> bits << bits
        return bisect.bisect_left(self._sorted, start + (1 << bits)) - bisect.bisect_left(self._sorted, start)

    def stale_buckets(self, now: float, interval: float) -> list[KBucket]:
        """Buckets nobody in them was seen for `interval` seconds: look up an id there to refresh."""
        return [b for b in self.buckets if now - b.last_updated >= interval]

    @staticmethod
    def random_id_in(bucket: KBucket, rng: random.Random) -> int:
        return rng.randrange(bucket.lower, bucket.upper)
