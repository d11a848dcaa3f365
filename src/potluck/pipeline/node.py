"""One machine's part of a planned run: its `StageWorker`, and its cluster's controller role
whenever the election rule gives it to this node.

Election rule (every node applies it alike, so no vote is needed): a cluster's controller is the
live member with the lowest peer id, where the members are the stages of the cluster's newest
layout in the DHT (the plan's cluster before any layout is published) and "live" means it answers
a `Ping` within the failure timeout. Each member re-applies the rule every heartbeat, pinging only
the members below it; when the rule names it, it takes the role over. The controller's state is
recoverable from the DHT: its layout holds the epoch and the stages, the plan holds the standby
nodes. The new controller resumes from them and re-partitions without the members that do not
answer, one epoch later, so every stage then reports failures to it (`ClusterController.take_over`).

Nodes that join after the plan was made (their profiles are in the DHT, they are not in the plan)
are standbys: every election round adds them to the standby lists of the controllers this node
holds, so a recovery that needs a node takes one. They are never elected (the stages take
`configure` only from the plan's nodes), so a cluster whose planned members all died stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from potluck.core import compat
from potluck.core.errors import NetworkError
from potluck.core.peer_like import PeerLike
from potluck.pipeline.layout import Layout
from potluck.pipeline.messages import Ping
from potluck.pipeline.partition import PartitionError
from potluck.pipeline.planning import RunPlan, cluster_id
from potluck.pipeline.profiling import LayerCost, NodeProfile, fetch_profiles
from potluck.pipeline.recovery import FAILURE_TIMEOUT, HEARTBEAT, ClusterController
from potluck.pipeline.stage import LossFn, MakeLayers, PipelineConfig, Source, StageWorker, call

__all__ = ["PipelineNode"]

logger = logging.getLogger(__name__)

# At start every node waits this long for the plan's other nodes to answer (their workers to be
# up) before electing controllers, so a node still starting is not taken for dead.
START_TIMEOUT = 120.0
# Nodes that joined after the plan taken as standbys: a run has tens of nodes, not thousands.
MAX_LATE_NODES = 256


class PipelineNode:
    """This node's worker (configured by whichever node of the run controls its cluster) and the
    controller roles the election rule gives it."""

    def __init__(self, peer: PeerLike, config: PipelineConfig, plan: RunPlan, make_layers: MakeLayers,
                 num_layers: int, optimizer: Callable[[list[nn.Parameter]], Any], *,
                 source: Callable[[int], Source], costs: Sequence[LayerCost], shapes: Sequence[Sequence[int]],
                 profiles: dict[str, NodeProfile], reference_flops: float = 1.0, loss_fn: LossFn | None = None,
                 heartbeat: float = HEARTBEAT,
                 failure_timeout: float = FAILURE_TIMEOUT):
        """`source(rank)`: the micro-batches of cluster `rank` (used while this node is a first stage);
        `costs` measured on a node of `reference_flops` FLOP/s, the same on every node."""
        self.peer = peer
        self.me = str(peer.transport.peer_id)
        self.config = config
        self.plan = plan
        self.costs, self.shapes, self.profiles = list(costs), [list(s) for s in shapes], profiles
        self.reference_flops = reference_flops
        self.heartbeat, self.failure_timeout = heartbeat, failure_timeout
        self._sources: dict[str, Source] = {}
        self._source_factory = source
        # every node of the plan may be elected a controller (a standby may join either cluster)
        self.worker = StageWorker(peer, config, make_layers, optimizer, controller=plan.nodes,
                                  num_layers=num_layers, source=self._source, loss_fn=loss_fn)
        self.controllers: dict[str, ClusterController] = {}
        self._task: asyncio.Task | None = None

    def _source(self, mb: int) -> Any:
        cluster = self.worker.route.cluster
        if cluster not in self._sources:
            self._sources[cluster] = self._source_factory(int(cluster[1:]))
        return self._sources[cluster](mb)

    async def start(self) -> None:
        """Start the worker, wait for the plan's nodes to answer, then keep applying the rule."""
        self.worker.start()
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for controller in self.controllers.values():
            await controller.close()
        await self.worker.close()

    async def _alive(self, peer: str) -> bool:
        try:
            await call(self.peer.transport, peer, self.worker.ctl_method, Ping(), self.failure_timeout)
            return True
        except (NetworkError, TimeoutError):
            return False

    async def _run(self) -> None:
        others = [p for p in self.plan.nodes if p != self.me]
        try:
            async with compat.timeout(START_TIMEOUT):
                while not all(await asyncio.gather(*(self._alive(p) for p in others))):
                    await asyncio.sleep(self.heartbeat)
        except TimeoutError:
            logger.warning("not every node of the plan answered within %.0f s; electing controllers anyway",
                           START_TIMEOUT)
        while True:
            try:
                await self.elect()
            except Exception:  # noqa: BLE001 - a failed round must not end the election; the next one retries
                logger.exception("controller election round failed")
            await asyncio.sleep(self.heartbeat)

    async def elect(self) -> None:
        """One round of the rule over every cluster this node is a member of."""
        layouts = await self.worker.directory.fetch_layouts()
        if self.controllers:
            await self._refresh_standby(layouts)
        for index, planned in enumerate(self.plan.clusters):
            cid = cluster_id(index)
            if cid in self.controllers:
                continue
            members = [s.peer for s in layouts[cid].stages] if cid in layouts else list(planned)
            if self.me not in members:
                continue
            for candidate in sorted(m for m in members if m in self.plan.nodes):
                if candidate == self.me:
                    await self._take_over(index, layouts)
                    break
                if await self._alive(candidate):
                    break  # a live member below this node holds the role

    async def _take_over(self, index: int, layouts: dict[str, Layout]) -> None:
        cid = cluster_id(index)
        in_use = {s.peer for layout in layouts.values() for s in layout.stages}
        layout = layouts.get(cid)
        members = [s.peer for s in layout.stages] if layout else list(self.plan.clusters[index])
        controller = ClusterController(self.peer, self.config, cid, members, self.costs, self.shapes,
                                       profiles=self.profiles, reference_flops=self.reference_flops,
                                       standby=[p for p in self.plan.standby if p not in in_use],
                                       heartbeat=self.heartbeat, failure_timeout=self.failure_timeout)
        self.controllers[cid] = controller
        alive = await asyncio.gather(*(self._alive(m) for m in members))
        dead = [m for m, ok in zip(members, alive, strict=True) if not ok]
        try:
            if layout:
                logger.warning("%s takes over as controller of cluster %s at epoch %d (lost: %s)", self.me[:8],
                               cid, layout.epoch, ", ".join(d[:8] for d in dead) or "none")
                await controller.take_over(layout, dead)
            else:
                logger.info("%s controls cluster %s", self.me[:8], cid)
                controller.members = [m for m in members if m not in dead]
                while True:
                    try:
                        await controller.plan()
                        break
                    except PartitionError:  # a planned member never came: a standby stands in
                        if not controller.standby:
                            raise
                        controller.members.append(controller.standby.pop(0))
                await controller.start()
        except BaseException:
            del self.controllers[cid]
            await controller.close()
            raise

    async def _refresh_standby(self, layouts: dict[str, Layout]) -> None:
        """Give the controllers held here every node not in a layout: the plan's standbys and the
        nodes that joined later (profiles in the DHT, not in the plan)."""
        late = [p for p in await fetch_profiles(self.peer, self.config.run_id)
                if p.peer_id not in self.plan.nodes][:MAX_LATE_NODES]
        self.profiles.update({p.peer_id: p for p in late})
        in_use = {s.peer for layout in layouts.values() for s in layout.stages}
        for controller in self.controllers.values():
            in_use.update(controller.members)
        spare = [p for p in [*self.plan.standby, *(p.peer_id for p in late)] if p not in in_use]
        for controller in self.controllers.values():
            controller.standby = list(spare)
