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
The controller's state is in the DHT: its layout names the epoch and the stages. Under
`potluck pipeline run` another member takes the role over when the controller's node dies
(`pipeline.node`: the live member with the lowest peer id) and resumes from the layout
(`take_over`). Under `harness.launch_run` nobody does: the cluster stops, the others go on.

Callers are checked: a failure report is taken only from a member of this cluster (anyone else's
is refused with an error), and the stages take `Configure` only from their controller, whose peer
id they are created with (`StageWorker(controller=...)`). A new layout is published before its
stages are configured, so the nodes they fetch layers from already find them in the layouts
(holders give weights only to nodes the layouts name).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.pipeline.layout import LAYOUT_TTL, Accept, Layout, LayoutDirectory, Span
from potluck.pipeline.messages import (
    Ack,
    Configure,
    FailureReport,
    GetStats,
    Ping,
    Route,
    StageReport,
)
from potluck.pipeline.partition import Partition, PartitionError, Stage, partition_layers
from potluck.pipeline.profiling import LayerCost, NodeProfile
from potluck.pipeline.stage import PipelineConfig, PipelineError, call

__all__ = ["ClusterController", "RecoveryEvent"]

logger = logging.getLogger(__name__)

# Heartbeats: a ping every HEARTBEAT seconds must be answered within FAILURE_TIMEOUT. A stage busy
# with a long computation still answers (handlers run on the event loop, compute in threads).
HEARTBEAT = 1.0
FAILURE_TIMEOUT = 3.0
# Configuring a stage may include fetching its weights from another cluster.
CONFIGURE_TIMEOUT = 60.0


@dataclass
class RecoveryEvent:
    dead: str
    detected_at: float   # loop time
    recovered_at: float
    epoch: int
    stages: list[Span]
    fetched_from: dict[int, str] = field(default_factory=dict)  # layer -> other cluster's node


class ClusterController:
    """Partitions, configures and heals one cluster."""

    def __init__(self, peer: PeerLike, config: PipelineConfig, cluster_id: str, members: Sequence[str],
                 costs: Sequence[LayerCost], shapes: Sequence[Sequence[int]], *,
                 profiles: dict[str, NodeProfile] | None = None, reference_flops: float = 1.0,
                 standby: Sequence[str] = (), heartbeat: float = HEARTBEAT, failure_timeout: float = FAILURE_TIMEOUT,
                 plan_version: int = 1, accept: Accept | None = None,
                 claim: Callable[[str], Awaitable[bool]] | None = None):
        """`plan_version`: the run plan's version its layouts are published under; `accept`: which
        layouts it reads (`LayoutDirectory`); `claim(peer)`: whether a standby agrees to join this
        cluster (None: every standby does), so two clusters never take the same one."""
        self.peer = peer
        self.transport = transport = peer.transport
        self.config = config
        self.cluster_id = cluster_id
        self.members = list(members)
        self.standby = list(standby)
        self.costs = list(costs)
        self.shapes = [tuple(s) for s in shapes]  # shapes[i]: per-sample input of layer i; shapes[-1]: output
        self.directory = LayoutDirectory(peer, config.run_id, accept)
        self.plan_version = plan_version
        self.claim = claim
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
        # The run is ending (`PipelineNode.end`): members that stop answering have finished, and
        # no standby is promoted for them.
        self.ending = False
        names = RunNames(config.run_id).pipeline
        self._ctl = names.control
        # one controller per cluster; several may share a node, so the method names the cluster
        self._report_method = names.report(cluster_id)
        transport.add_handler(self._report_method, self._on_report)

    @property
    def stages(self) -> list[Span]:
        return [Span(s.peer_id, s.start, s.end) for s in self.partition.stages] if self.partition else []

    def _profile(self, peer: str) -> NodeProfile:
        return self.profiles.get(peer) or NodeProfile(peer, self.reference_flops, 2**62)

    async def plan(self) -> None:
        """Partition and publish the layout without starting anything: starting clusters publish
        first, so their stages' first ring rounds already see every cluster."""
        self.partition = partition_layers(self.costs, [self._profile(m) for m in self.members], self.reference_flops,
                                          in_flight=self.config.staleness_bound)
        await self._publish()

    async def _publish(self) -> None:
        await self.directory.publish(self.cluster_id, Layout(self.epoch, tuple(self.stages), self.plan_version))

    async def take_standby(self) -> str | None:
        """The next standby that accepts to join this cluster (`claim`), taken off the list; None
        if none is left."""
        while self.standby:
            peer = self.standby.pop(0)
            if self.claim is None or await self.claim(peer):
                return peer
        return None

    async def start(self, elsewhere: dict[int, list[str]] | None = None, in_order: bool = False) -> None:
        """Partition over the members, configure them, publish the layout, start watching.
        `elsewhere`: {layer: nodes holding it} to load layers from (a re-planned run's previous
        clusters); `in_order`: configure the stages one by one from the last, so that no stage
        sends to one still in an older epoch (a re-plan may put stages epochs apart)."""
        async with self._lock:
            await self._apply(self.members, {}, elsewhere or {}, in_order)
        self._monitor = asyncio.ensure_future(self._watch())

    async def take_over(self, layout: Layout, dead: Sequence[str]) -> None:
        """Continue a cluster whose controller died, from its newest `layout` (epoch and stages):
        re-partition without `dead` (at least the old controller's node), one epoch later, so every
        stage is re-configured with this node as its controller; then watch."""
        self.epoch = layout.epoch
        self.partition = Partition([Stage(s.peer, s.start, s.end) for s in layout.stages], 0.0, [])
        self.members = [s.peer for s in layout.stages]
        if not await self.recover(dead, asyncio.get_running_loop().time()):
            async with self._lock:  # nobody lost (the old controller left the cluster): re-configure alone
                self.epoch += 1
                await self._apply(self.members, {i: s.peer for s in self.stages for i in range(s.start, s.end)}, {})
        self._monitor = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        self.transport.remove_handler(self._report_method)
        tasks = [*self._recoveries, *([self._monitor] if self._monitor else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _apply(self, members: list[str], holders: dict[int, str], elsewhere: dict[int, list[str]],
                     in_order: bool = False) -> None:
        """Partition over `members` and configure them. A stage that gets a layer it does not hold
        loads it from `holders[layer]` (its holder in this cluster before, still alive: the freshest
        weights), else from `elsewhere[layer]` (holders in other clusters)."""
        self.partition = partition_layers(self.costs, [self._profile(m) for m in members], self.reference_flops,
                                          in_flight=self.config.staleness_bound)
        self.members = [s.peer_id for s in self.partition.stages]
        stages = self.partition.stages
        me = str(self.transport.peer_id)

        def sources(s: Stage) -> dict[int, tuple[str, ...]]:
            return {i: tuple(([holders[i]] if i in holders else []) + elsewhere.get(i, []))
                    for i in range(s.start, s.end) if holders.get(i) != s.peer_id}

        async def configure(index: int) -> None:
            s = stages[index]
            route = Route(epoch=self.epoch, cluster=self.cluster_id, stage=index, start=s.start, end=s.end,
                          prev_peer=stages[index - 1].peer_id if index > 0 else None,
                          next_peer=stages[index + 1].peer_id if index + 1 < len(stages) else None,
                          in_shape=self.shapes[s.start], out_shape=self.shapes[s.end],
                          controller=me, report_method=self._report_method,
                          compute_seconds=sum(c.seconds for c in self.costs[s.start:s.end]) * self.reference_flops
                          / self._profile(s.peer_id).flops,
                          sources=sources(s))
            Ack.from_wire(await call(self.transport, s.peer_id, self._ctl, Configure(route), CONFIGURE_TIMEOUT))
        await self._publish()  # first: a stage fetching layers is given them only once the layouts name it
        if in_order:
            for i in reversed(range(len(stages))):
                await configure(i)
            return
        async with compat.TaskGroup() as group:
            for i in range(len(stages)):
                group.create_task(configure(i))

    async def _alive(self, peer: str) -> bool:
        try:
            await call(self.transport, peer, self._ctl, Ping(), self.failure_timeout)
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
            if dead and not self.ending:
                await self._recover_logged(dead, loop.time())
            elif loop.time() - published > LAYOUT_TTL / 2:
                published = loop.time()
                await self._publish()

    async def _on_report(self, request: Any, ctx: Any) -> Any:
        report = FailureReport.from_wire(request)
        if str(ctx.peer_id) not in self.members:
            raise PipelineError(f"failure report refused: cluster {self.cluster_id} takes reports only from its "
                                f"members, not from {ctx.peer_id}")
        if (not self.ending and report.epoch == self.epoch and report.peer in self.members
                and not await self._alive(report.peer)):
            # recovery outlives this call (it re-configures the reporter too): the controller owns it
            task = asyncio.ensure_future(self._recover_logged([report.peer], asyncio.get_running_loop().time()))
            self._recoveries.add(task)
            task.add_done_callback(self._recoveries.discard)
        return Ack().to_wire()

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
            lost = {i for s in self.stages if s.peer in dead for i in range(s.start, s.end)}
            survivors = [m for m in self.members if m not in dead]
            self.epoch += 1
            layouts = await self.directory.fetch()
            elsewhere: dict[int, list[str]] = {}
            for cluster, stages in sorted(layouts.items()):
                if cluster == self.cluster_id:
                    continue
                for span in stages:
                    for i in range(span.start, span.end):
                        if span.peer not in self.dead:
                            elsewhere.setdefault(i, []).append(span.peer)
            while True:
                holders = {i: s.peer for s in self.stages if s.peer not in self.dead for i in range(s.start, s.end)}
                try:
                    await self._apply(survivors, holders, elsewhere)
                    break
                except PartitionError:
                    extra = await self.take_standby()
                    if extra is None:
                        raise
                    survivors.append(extra)
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
                           event.dead[:8], self.epoch, [(s.peer[:8], s.start, s.end) for s in self.stages])
            return event

    async def stats(self) -> dict[str, StageReport | None]:
        """Each member's counters (busy seconds, updates, staleness...), in stage order; None for a
        member that does not answer (or answers nonsense)."""
        async def one(peer: str) -> StageReport | None:
            try:
                return StageReport.from_wire(await call(self.transport, peer, self._ctl, GetStats(),
                                                        self.failure_timeout))
            except (NetworkError, TimeoutError):  # MalformedMessage is a NetworkError
                return None
        members = list(self.members)
        return dict(zip(members, await asyncio.gather(*(one(p) for p in members)), strict=True))
