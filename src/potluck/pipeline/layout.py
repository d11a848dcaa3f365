"""Cluster layouts in the DHT: which peer holds which layers, read by rings and by recovery.

Key `{run_id}.pipeline.layout`, one subkey per cluster, written by the cluster's controller.
A `Layout` lists a `Span` (peer id, first layer, end layer) per stage; ring members in other
clusters, and nodes that must fetch lost layers, dial the peers by id (the transport finds their
addresses through their signed peer records in the DHT).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from potluck.core.errors import MalformedMessage
from potluck.core.peer_like import PeerLike
from potluck.core.wire import int_field, int_value, list_field, wire_map
from potluck.net.identity import PeerID
from potluck.pipeline.messages import (
    MAX_CLUSTERS,
    MAX_COUNTER,
    MAX_LAYER_INDEX,
    MAX_STAGES,
    peer_text,
)

__all__ = ["Layout", "LayoutDirectory", "Span"]

logger = logging.getLogger(__name__)

# Layouts in the DHT expire after this unless republished (the controller republishes at half).
LAYOUT_TTL = 120.0


class Span(NamedTuple):
    """One stage of a layout: `peer` holds layers [start, end)."""

    peer: str
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """One cluster's stages in `epoch`."""

    epoch: int
    stages: tuple[Span, ...]

    def to_wire(self) -> dict:
        return {"epoch": self.epoch, "stages": [list(s) for s in self.stages]}

    @classmethod
    def from_wire(cls, msg: Any) -> Layout:
        what = "layout"
        msg = wire_map(msg, what)
        stages = []
        for entry in list_field(msg, "stages", what, MAX_STAGES):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise MalformedMessage(what, "'stages' entries must be [peer id, start, end]")
            peer, start, end = entry
            start = int_value(start, "stages", what, 0, MAX_LAYER_INDEX)
            stages.append(Span(peer_text(peer, "stages", what), start,
                               int_value(end, "stages", what, start + 1, MAX_LAYER_INDEX + 1)))
        return cls(int_field(msg, "epoch", what, 0, MAX_COUNTER), tuple(stages))


class LayoutDirectory:
    """Every cluster's layout, in the DHT of `peer`; also who they name (`lists`), which is how a
    stage tells the run's nodes (ring members, nodes fetching layers) from strangers."""

    def __init__(self, peer: PeerLike, run_id: str):
        self.dht = peer.dht
        self.key = f"{run_id}.pipeline.layout"
        self._listed: frozenset[PeerID] = frozenset()  # every peer of the newest layouts read
        self._started = 0  # reads of the layouts started so far
        self._newest = 0  # the number (in start order) of the newest-started read that completed
        self._reading = asyncio.Lock()

    async def publish(self, cluster_id: str, layout: Layout) -> None:
        await self.dht.astore(self.key, layout.to_wire(), self.dht.get_time() + LAYOUT_TTL, subkey=cluster_id)

    async def fetch(self) -> dict[str, list[Span]]:
        """{cluster id: its stages}, malformed layouts skipped."""
        return {cluster: list(layout.stages) for cluster, layout in (await self.fetch_layouts()).items()}

    async def fetch_layouts(self) -> dict[str, Layout]:
        """{cluster id: its layout (epoch and stages)}, malformed layouts skipped."""
        self._started += 1
        number = self._started
        found = await self.dht.aget(self.key, latest=True)
        layouts: dict[str, Layout] = {}
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for cluster, entry in list(entries.items())[:MAX_CLUSTERS]:
            try:
                layouts[str(cluster)] = Layout.from_wire(entry.value)
            except MalformedMessage as e:
                logger.warning("layout for cluster %r ignored: %s", str(cluster)[:64], e)
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
