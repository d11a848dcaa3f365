"""Cluster control and recovery: who holds which stage, failure detection, re-partitioning.

A `ClusterController` (run by one node of each cluster, usually the first stage's) partitions
the model over the cluster's members, configures their `StageWorker`s and publishes the layout
in the DHT (`LayoutDirectory`), where the rings find it. It then watches the members: a
heartbeat every `heartbeat` seconds with a `failure_timeout` deadline, plus immediate reports
from workers whose sends fail. So a dead node is noticed within heartbeat + failure_timeout.

Recovery (beyond Ravnest, which has none): drop the dead node, re-partition over the survivors
(adding a standby node if they cannot hold the model), and configure every member for a new
*epoch*. Survivors keep the layers they still hold; layers nobody in the cluster has any more
are loaded from the node holding them in another cluster (the matching ring member), fresh only
if no cluster has them. Micro-batches in flight at the failure are dropped; training resumes.
Limit: the controller itself is not replicated; if its node dies, its cluster stops and the
other clusters go on (their rings re-form without it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.net.identity import PeerID
from potluck.net.transport import Transport
from potluck.pipeline.partition import Partition, PartitionError, Stage, partition_layers
from potluck.pipeline.profiling import LayerCost, NodeProfile
from potluck.pipeline.stage import PipelineConfig, PipelineError, call

__all__ = ["ClusterController", "LayoutDirectory", "RecoveryEvent"]

logger = logging.getLogger(__name__)

# Heartbeats: a ping every HEARTBEAT seconds must be answered within FAILURE_TIMEOUT. A stage busy
# with a long computation still answers (handlers run on the event loop, compute in threads).
HEARTBEAT = 1.0
FAILURE_TIMEOUT = 3.0
# Configuring a stage may include fetching its weights from another cluster.
CONFIGURE_TIMEOUT = 60.0
# Addresses kept per peer from a layout (a peer gains nothing by listing more).
MAX_ADDRESSES = 8
# Layouts in the DHT expire after this unless republished (the controller republishes at half).
LAYOUT_TTL = 120.0


class LayoutDirectory:
    """Every cluster's layout, in the DHT: key `{run_id}.pipeline.layout`, subkey = cluster id.

    A layout lists (peer id, first layer, end layer) per stage and the stages' addresses, so ring
    members in other clusters, and nodes that must fetch lost layers, can dial each other.
    """

    def __init__(self, dht: Any, run_id: str):
        self.dht = dht
        self.key = f"{run_id}.pipeline.layout"
        self.addresses: dict[str, list[str]] = {}  # from the last fetch

    async def publish(self, cluster_id: str, epoch: int, stages: Sequence[tuple[str, int, int]],
                      addresses: dict[str, list[str]] | None = None) -> None:
        value = {"epoch": epoch, "stages": [[p, a, b] for p, a, b in stages], "addresses": addresses or {}}
        await self.dht.astore(self.key, value, self.dht.get_time() + LAYOUT_TTL, subkey=cluster_id)

    async def fetch(self) -> dict[str, list[tuple[str, int, int]]]:
        found = await self.dht.aget(self.key, latest=True)
        layouts: dict[str, list[tuple[str, int, int]]] = {}
        if found is None or not isinstance(found.value, dict):
            return layouts
        for cluster, entry in found.value.items():
            try:
                layouts[str(cluster)] = [(str(p), int(a), int(b)) for p, a, b in entry.value["stages"]]
                for peer, addrs in dict(entry.value.get("addresses") or {}).items():
                    self.addresses[str(peer)] = [str(a) for a in list(addrs)[:MAX_ADDRESSES]]
            except (KeyError, TypeError, ValueError, AttributeError):
                logger.warning("malformed layout for cluster %r ignored", cluster)
        return layouts


@dataclass
class RecoveryEvent:
    dead: str
    detected_at: float   # loop time
    recovered_at: float
    epoch: int
    stages: list[tuple[str, int, int]]
    fetched_from: dict[int, str] = field(default_factory=dict)  # layer -> other cluster's node


class ClusterController:
    """Partitions, configures and heals one cluster."""

    def __init__(self, transport: Transport, config: PipelineConfig, cluster_id: str, members: Sequence[str],
                 costs: Sequence[LayerCost], shapes: Sequence[Sequence[int]], directory: LayoutDirectory, *,
                 profiles: dict[str, NodeProfile] | None = None, reference_flops: float = 1.0,
                 standby: Sequence[str] = (), heartbeat: float = HEARTBEAT, failure_timeout: float = FAILURE_TIMEOUT):
        self.transport = transport
        self.config = config
        self.cluster_id = cluster_id
        self.members = list(members)
        self.standby = list(standby)
        self.costs = list(costs)
        self.shapes = [list(s) for s in shapes]  # shapes[i]: per-sample input of layer i; shapes[-1]: output
        self.directory = directory
        self.profiles = profiles or {}
        self.reference_flops = reference_flops
        self.heartbeat = heartbeat
        self.failure_timeout = failure_timeout
        self.epoch = 0
        self.partition: Partition | None = None
        self.events: list[RecoveryEvent] = []
        self.dead: set[str] = set()
        self._lock = asyncio.Lock()
        self._monitor: asyncio.Task | None = None
        self._recoveries: set[asyncio.Task] = set()
        self._ctl = f"{config.run_id}.pipe.ctl"
        # one controller per cluster; several may share a node, so the method names the cluster
        self._report_method = f"{config.run_id}.pipe.cluster.{cluster_id}"
        transport.add_handler(self._report_method, self._on_report)

    @property
    def stages(self) -> list[tuple[str, int, int]]:
        return [(s.peer_id, s.start, s.end) for s in self.partition.stages] if self.partition else []

    def _profile(self, peer: str) -> NodeProfile:
        return self.profiles.get(peer) or NodeProfile(peer, self.reference_flops, 2**62)

    async def plan(self) -> None:
        """Partition and publish the layout without starting anything: starting clusters publish
        first, so their stages' first ring rounds already see every cluster."""
        self.partition = partition_layers(self.costs, [self._profile(m) for m in self.members], self.reference_flops,
                                          in_flight=self.config.staleness_bound)
        await self.directory.publish(self.cluster_id, self.epoch, self.stages, self._addresses(self.members))

    async def start(self) -> None:
        """Partition over the members, configure them, publish the layout, start watching."""
        async with self._lock:
            await self._apply(self.members, {}, {})
        self._monitor = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        self.transport.remove_handler(self._report_method)
        tasks = [*self._recoveries, *([self._monitor] if self._monitor else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _apply(self, members: list[str], holders: dict[int, str], elsewhere: dict[int, list[str]]) -> None:
        """Partition over `members` and configure them. A stage that gets a layer it does not hold
        loads it from `holders[layer]` (its holder in this cluster before, still alive: the freshest
        weights), else from `elsewhere[layer]` (holders in other clusters)."""
        self.partition = partition_layers(self.costs, [self._profile(m) for m in members], self.reference_flops,
                                          in_flight=self.config.staleness_bound)
        self.members = [s.peer_id for s in self.partition.stages]
        stages = self.partition.stages
        me = str(self.transport.peer_id)
        addresses = self._addresses([*self.members, me])
        for peers in elsewhere.values():
            for p in peers:
                addresses.setdefault(p, self.directory.addresses.get(p, []))

        def sources(s: Stage) -> dict[str, list[str]]:
            return {str(i): ([holders[i]] if i in holders else []) + elsewhere.get(i, [])
                    for i in range(s.start, s.end) if holders.get(i) != s.peer_id}

        async def configure(index: int) -> None:
            s = stages[index]
            route = {"epoch": self.epoch, "cluster": self.cluster_id, "stage": index, "start": s.start, "end": s.end,
                     "prev": stages[index - 1].peer_id if index > 0 else None,
                     "next": stages[index + 1].peer_id if index + 1 < len(stages) else None,
                     "in_shape": self.shapes[s.start], "out_shape": self.shapes[s.end],
                     "controller": me, "report_method": self._report_method,
                     "compute_seconds": sum(c.seconds for c in self.costs[s.start:s.end]) * self.reference_flops
                     / self._profile(s.peer_id).flops,
                     "sources": sources(s),
                     "addresses": addresses}
            await call(self.transport, s.peer_id, self._ctl, {"op": "configure", "route": route}, CONFIGURE_TIMEOUT)
        async with compat.TaskGroup() as group:
            for i in range(len(stages)):
                group.create_task(configure(i))
        await self.directory.publish(self.cluster_id, self.epoch, self.stages, self._addresses(self.members))

    def _addresses(self, peers: Sequence[str]) -> dict[str, list[str]]:
        """Where each of `peers` can be dialed, as this node knows it."""
        me = str(self.transport.peer_id)
        return {p: [str(a) for a in (self.transport.addresses if p == me
                                     else self.transport.addresses_of(PeerID.from_string(p)))] for p in peers}

    async def _alive(self, peer: str) -> bool:
        try:
            await call(self.transport, peer, self._ctl, {"op": "ping"}, self.failure_timeout)
            return True
        except (NetworkError, TimeoutError):
            return False

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        published = loop.time()
        while True:
            await asyncio.sleep(self.heartbeat)
            members = list(self.members)
            alive = await asyncio.gather(*(self._alive(m) for m in members))
            dead = [m for m, ok in zip(members, alive, strict=True) if not ok]
            if dead:
                await self._recover_logged(dead, loop.time())
            elif loop.time() - published > LAYOUT_TTL / 2:
                published = loop.time()
                await self.directory.publish(self.cluster_id, self.epoch, self.stages, self._addresses(self.members))

    async def _on_report(self, request: Any, ctx: Any) -> Any:
        if not isinstance(request, dict) or request.get("op") != "failure" or not isinstance(request.get("peer"), str):
            raise PipelineError("cluster report must be {'op': 'failure', 'peer': <peer id>, 'epoch': int}")
        peer = request["peer"]
        if request.get("epoch") == self.epoch and peer in self.members and not await self._alive(peer):
            # recovery outlives this call (it re-configures the reporter too): the controller owns it
            task = asyncio.ensure_future(self._recover_logged([peer], asyncio.get_running_loop().time()))
            self._recoveries.add(task)
            task.add_done_callback(self._recoveries.discard)
        return {"ok": True}

    async def _recover_logged(self, dead: Sequence[str], detected_at: float) -> None:
        try:
            await self.recover(dead, detected_at)
        except (PotluckError, NetworkError, TimeoutError) as e:
            logger.error("cluster %s could not recover from the loss of %s: %s", self.cluster_id,
                         ", ".join(d[:8] for d in dead), e)

    async def recover(self, dead: Sequence[str], detected_at: float) -> RecoveryEvent | None:
        """Re-partition without `dead`, loading layers the cluster lost from other clusters."""
        async with self._lock:
            dead = [d for d in dead if d in self.members]
            if not dead:
                return None
            self.dead.update(dead)
            lost = {i for p, a, b in self.stages if p in dead for i in range(a, b)}
            survivors = [m for m in self.members if m not in dead]
            self.epoch += 1
            layouts = await self.directory.fetch()
            elsewhere: dict[int, list[str]] = {}
            for cluster, stages in sorted(layouts.items()):
                if cluster == self.cluster_id:
                    continue
                for p, a, b in stages:
                    for i in range(a, b):
                        if p not in self.dead:
                            elsewhere.setdefault(i, []).append(p)
            while True:
                holders = {i: p for p, a, b in self.stages if p not in self.dead for i in range(a, b)}
                try:
                    await self._apply(survivors, holders, elsewhere)
                    break
                except PartitionError:
                    if not self.standby:
                        raise
                    survivors.append(self.standby.pop(0))
                except (NetworkError, TimeoutError, PotluckError, compat.ExceptionGroup) as e:
                    # a member failed while being configured: drop whoever is dead now, try again
                    alive = await asyncio.gather(*(self._alive(m) for m in survivors))
                    newly = [m for m, ok in zip(survivors, alive, strict=True) if not ok]
                    if not newly:
                        raise PotluckError(f"re-partitioning cluster {self.cluster_id} failed: {e}") from None
                    self.dead.update(newly)
                    survivors = [m for m in survivors if m not in newly]
                    self.epoch += 1
            event = RecoveryEvent(", ".join(dead), detected_at, asyncio.get_running_loop().time(), self.epoch,
                                  self.stages, {i: elsewhere[i][0] for i in sorted(lost) if i in elsewhere})
            self.events.append(event)
            logger.warning("cluster %s recovered from the loss of %s: epoch %d, stages %s", self.cluster_id,
                           event.dead[:8], self.epoch, [(p[:8], a, b) for p, a, b in self.stages])
            return event

    async def stats(self) -> list[dict[str, Any]]:
        """Each member's counters (busy seconds, updates, staleness...), in stage order."""
        async def one(peer: str) -> dict[str, Any]:
            try:
                reply = await call(self.transport, peer, self._ctl, {"op": "stats"}, self.failure_timeout)
                return dict(reply, peer=peer)
            except (NetworkError, TimeoutError):
                return {"peer": peer, "dead": True}
        return list(await asyncio.gather(*(one(p) for p in self.members)))
