"""Cluster layouts in the DHT: which peer holds which layers, read by rings and by recovery.

Key `{run_id}.pipeline.layout`: each cluster's controller writes its cluster's layout under its own
signed subkey `{cluster id}[owner:<its peer id>]` (an owned key kind, `dht.key_kinds`), so nobody
can write a layout in another node's name, and a reader knows who wrote each one. A reader keeps,
per cluster, the newest layout (plan version, then epoch) among those it accepts: under `potluck
pipeline run` only those written by a node the run's plan lets control that cluster
(`pipeline.node`), so a stranger's layout naming itself is ignored; under `launch_run` any signed one.
A `Layout` lists a `Span` (peer id, first layer, end layer) per stage; ring members in other
clusters, and nodes that must fetch lost layers, dial the peers by id (the transport finds their
addresses through their signed peer records in the DHT).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from potluck.core.errors import MalformedMessage
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.wire import Field, Int, List, Message, int_value
from potluck.dht.records import own_subkey, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.wire import PeerIdField
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_COUNTER, MAX_LAYER_INDEX, MAX_STAGES

__all__ = ["Accept", "Layout", "LayoutDirectory", "Span"]

logger = logging.getLogger(__name__)

# Layouts in the DHT expire after this unless republished (the controller republishes at half).
LAYOUT_TTL = 120.0
# Signed entries read per fetch: a run's clusters, each written by its few successive controllers
# (an entry lives LAYOUT_TTL); more is someone flooding the key, and parsing is bounded by this.
MAX_LAYOUT_ENTRIES = 4 * MAX_CLUSTERS
# A cluster id is short text ("c0"); a longer subkey prefix is not a layout.
MAX_CLUSTER_ID_CHARS = 64


class Span(NamedTuple):
    """One stage of a layout: `peer` holds layers [start, end)."""

    peer: str
    start: int
    end: int


class SpanField(Field):
    """A `Span` on the wire: [peer id, start, end], a non-empty range of layers."""

    encodes = True
    peer = PeerIdField(text=True)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Span:
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise MalformedMessage(what, f"{key!r} entries must be [peer id, start, end]")
        peer, start, end = value
        start = int_value(start, key, what, 0, MAX_LAYER_INDEX)
        return Span(self.peer.check(peer, key, what, context), start, int_value(end, key, what, start + 1,
                                                                                 MAX_LAYER_INDEX + 1))

    def encode(self, value: Span) -> list:
        return list(value)


class Layout(Message, what="layout"):
    """One cluster's stages in `epoch`, under version `plan` of the run's plan."""

    epoch: int = Int("epoch", 0, MAX_COUNTER)
    stages: tuple[Span, ...] = List("stages", SpanField(), MAX_STAGES)
    plan: int = Int("plan", 1, MAX_COUNTER, default=1)


# Whether a reader takes `layout` of cluster `cluster`, written by `owner` (peer id text).
Accept = Callable[[str, str, Layout], bool]


def _entry_names(subkey: Any) -> tuple[str, str] | None:
    """(cluster id, owner) of a layout entry's subkey `{cluster}[owner:<id>]`; None if it is not one."""
    if not isinstance(subkey, str) or "[" not in subkey:
        return None
    cluster, marker = subkey[:subkey.index("[")], subkey[subkey.index("["):]
    owner = subkey_owner(marker)
    if owner is None or not 0 < len(cluster) <= MAX_CLUSTER_ID_CHARS:
        return None
    return cluster, str(owner)


class LayoutDirectory:
    """Every cluster's layout, in the DHT of `peer`; also who they name (`lists`), which is how a
    stage tells the run's nodes (ring members, nodes fetching layers) from strangers."""

    def __init__(self, peer: PeerLike, run_id: str, accept: Accept | None = None):
        """`accept`: which signed layouts to read (None: all); `potluck pipeline run` sets it to its plan's rule."""
        self.peer = peer
        self.dht = peer.dht
        self.key = RunNames(run_id).pipeline.layout
        self.accept = accept
        self._listed: frozenset[PeerID] = frozenset()  # every peer of the newest layouts read
        self._started = 0  # reads of the layouts started so far
        self._newest = 0  # the number (in start order) of the newest-started read that completed
        self._reading = asyncio.Lock()

    async def publish(self, cluster_id: str, layout: Layout) -> None:
        """Store `layout` under this node's own signed subkey for `cluster_id`."""
        subkey = f"{cluster_id}{own_subkey(self.peer.transport.peer_id)}"
        await self.dht.astore(self.key, layout.to_wire(), self.dht.get_time() + LAYOUT_TTL, subkey=subkey)

    async def fetch(self) -> dict[str, list[Span]]:
        """{cluster id: its stages}, malformed layouts skipped."""
        return {cluster: list(layout.stages) for cluster, layout in (await self.fetch_layouts()).items()}

    async def fetch_layouts(self, accept: Accept | None = None) -> dict[str, Layout]:
        """{cluster id: its newest accepted layout (plan version, then epoch; ties: the lowest
        writer)}; malformed layouts skipped. `accept` replaces the directory's rule for this read
        (which then does not change `lists`)."""
        own_rule = accept is None
        accept = self.accept if own_rule else accept
        if own_rule:
            self._started += 1
        number = self._started
        found = await self.dht.aget(self.key, latest=True)
        best: dict[str, tuple[tuple[int, int], str, Layout]] = {}
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, entry in list(entries.items())[:MAX_LAYOUT_ENTRIES]:
            names = _entry_names(subkey)
            if names is None:
                continue
            cluster, owner = names
            try:
                layout = Layout.from_wire(entry.value)
            except MalformedMessage as e:
                logger.warning("layout for cluster %r from %s ignored: %s", cluster, owner[:8], e)
                continue
            if accept is not None and not accept(cluster, owner, layout):
                continue
            rank = (layout.plan, layout.epoch)
            held = best.get(cluster)
            if held is None or rank > held[0] or (rank == held[0] and owner < held[1]):
                best[cluster] = (rank, owner, layout)
        layouts = {cluster: layout for cluster, (_, _, layout) in sorted(best.items())[:MAX_CLUSTERS]}
        if not own_rule:
            return layouts
        if number > self._newest:
            self._newest = number
            self._listed = frozenset(PeerID.from_string(s.peer) for layout in layouts.values() for s in layout.stages)
        return layouts

    async def lists(self, peer: PeerID) -> bool:
        """Whether a cluster's layout names `peer`. A peer not in the layouts read last is looked up
        again in the DHT (one read at a time, shared by the callers waiting for it), so a node a
        controller has just published is found; a stranger costs at most one DHT read at a time."""
        if peer in self._listed:
            return True
        asked_after = self._started
        async with self._reading:
            if self._newest <= asked_after:  # no read begun since we asked has completed: read now
                await self.fetch()
        return peer in self._listed
