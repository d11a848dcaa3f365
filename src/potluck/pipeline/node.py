"""One machine's part of a planned run: its `StageWorker`, its cluster's controller role whenever
the election rule gives it to this node, and the run's re-planning.

Election rule (every node applies it alike, so no vote is needed): a cluster's controller is the
live member with the lowest peer id (the plan's members of that cluster before the standbys that
joined it), where the members are the stages of the cluster's newest layout in the DHT (the plan's
cluster before any layout is published) and "live" means it answers a `Ping` within the failure
timeout. Each member re-applies the rule every heartbeat, pinging only
the members below it; when the rule names it, it takes the role over. The controller's state is
recoverable from the DHT: its layout holds the epoch and the stages, the plan holds the standby
nodes. The new controller resumes from them and re-partitions without the members that do not
answer, one epoch later, so every stage then reports failures to it (`ClusterController.take_over`).
A controller that finds its cluster's layout at a newer epoch than its own (it was taken for dead,
e.g. cut off, and another member took over) steps down.
Layouts are read only from nodes the plan lets control that cluster (its members and standbys),
under the plan's version: a stranger's layout is ignored.

Standbys: the plan's, and nodes that joined after it (their profiles are in the DHT, they are not in
the plan); every election round gives them to the controllers this node holds. A controller takes
one only if the standby accepts its `Claim` (first claim of a plan version wins; the standby
refuses every other cluster's until the next version), so two clusters never take the same one.

Re-planning (`planning.replan`): the plan's live node with the lowest peer id is its planner. Every
heartbeat it pings the plan's nodes and the later ones; when the rule calls for it, it publishes
version v+1 (`plan_run` over the live nodes). Every node takes a newer plan published by a node of
its current plan once it has checked it (`planning.checks`), closes the controllers of the old one,
and publishes the new one. A cluster of the new plan starts when the old plan's live nodes have all
published the new version (or after ADOPT_TIMEOUT), so no old controller configures anyone any more;
its stages load their layers from the old plan's layouts, `PLAN_EPOCH_GAP` epochs past the newest,
configured from the last stage to the first.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from potluck.core import compat
from potluck.core.errors import NetworkError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.runner import run_in_thread
from potluck.core.wire import Int, Message, Text
from potluck.net.identity import PeerID
from potluck.pipeline.clustering import ModelDemand
from potluck.pipeline.layout import Layout
from potluck.pipeline.messages import MAX_COUNTER, Ack, Ping
from potluck.pipeline.partition import PartitionError
from potluck.pipeline.planning import (
    RunPlan,
    checks,
    cluster_id,
    cluster_index,
    fetch_plans,
    publish_plan,
    replan,
)
from potluck.pipeline.profiling import LayerCost, NodeProfile, fetch_profiles
from potluck.pipeline.recovery import FAILURE_TIMEOUT, HEARTBEAT, ClusterController, RecoveryEvent
from potluck.pipeline.stage import LossFn, MakeLayers, PipelineConfig, PipelineError, Source, StageWorker, call

__all__ = ["Claim", "PipelineNode"]

logger = logging.getLogger(__name__)

# At start every node waits this long for the plan's other nodes to answer (their workers to be
# up) before electing controllers, so a node still starting is not taken for dead.
START_TIMEOUT = 120.0
# Nodes that joined after the plan taken as standbys: a run has tens of nodes, not thousands.
MAX_LATE_NODES = 256
# The planner re-plans around a node that has not answered this many rounds in a row (one round a
# heartbeat, each waiting up to the failure timeout): its controller had that long to replace it.
REPLAN_MISSES = 10
# A new plan's clusters start once the old plan's live nodes publish it, or after this: a node that
# never does is slow or partitioned, and the epochs still refuse its old controllers' configures.
ADOPT_TIMEOUT = 30.0
# A new plan's first epoch is this far past the old plan's newest layout: room for the epochs an old
# controller may still have added while it stopped, so its configures are older and refused.
PLAN_EPOCH_GAP = 8
# A cluster id in a claim: "c<index>".
MAX_CLUSTER_ID_CHARS = 16
# Recoveries of controllers this node held and closed (stepped down, re-planned) that it still
# reports: a run has a few recoveries, not thousands.
MAX_PAST_RECOVERIES = 100
# Published plans remembered as checked (each check solves the clustering): a run sees a few
# versions; only the plan's nodes can make it check more, and the oldest are forgotten first.
MAX_JUDGED_PLANS = 64


class Claim(Message, what="standby claim"):
    """A controller asks a standby to join `cluster` under plan `version`; `Ack.ok` says whether it
    agreed (it agrees to one cluster per plan version)."""

    version: int = Int("version", 1, MAX_COUNTER)
    cluster: str = Text("cluster", MAX_CLUSTER_ID_CHARS)

    def validate(self, context: Mapping[str, Any]) -> None:
        if cluster_index(self.cluster) is None:
            raise self.refuse("'cluster' must name a cluster (c0, c1, ...)")


class PipelineNode:
    """This node's worker (configured by whichever node of the run controls its cluster), the
    controller roles the election rule gives it, and the run's re-planning."""

    def __init__(self, peer: PeerLike, config: PipelineConfig, plan: RunPlan, make_layers: MakeLayers,
                 num_layers: int, optimizer: Callable[[list[nn.Parameter]], Any], *,
                 source: Callable[[int], Source], costs: Sequence[LayerCost], shapes: Sequence[Sequence[int]],
                 profiles: dict[str, NodeProfile], reference_flops: float = 1.0, loss_fn: LossFn | None = None,
                 heartbeat: float = HEARTBEAT, failure_timeout: float = FAILURE_TIMEOUT,
                 demand: ModelDemand | None = None, clusters: int | None = None):
        """`source(rank)`: the micro-batches of cluster `rank` (used while this node is a first stage);
        `costs` measured on a node of `reference_flops` FLOP/s, the same on every node; `demand`
        (what one copy of the model needs) and `clusters` (as given to `plan_run`) enable
        re-planning: None, the plan is never changed."""
        self.peer = peer
        self.me = str(peer.transport.peer_id)
        self.config = config
        self.plan = plan
        self.previous: RunPlan | None = None  # the plan before `plan`: its layouts hold the layers
        self.costs, self.shapes, self.profiles = list(costs), [list(s) for s in shapes], profiles
        self.reference_flops = reference_flops
        self.heartbeat, self.failure_timeout = heartbeat, failure_timeout
        self.demand, self.clusters = demand, clusters
        self._sources: dict[str, Source] = {}
        self._source_factory = source
        # every node of the plan may be elected a controller (a standby may join either cluster)
        self.worker = StageWorker(peer, config, make_layers, optimizer, controller=plan.nodes,
                                  num_layers=num_layers, source=self._source, loss_fn=loss_fn)
        self.worker.directory.accept = self._accepts
        self.worker.may_configure = self._may_configure
        self.controllers: dict[str, ClusterController] = {}
        self._past: list[tuple[str, RecoveryEvent]] = []  # recoveries of controllers closed since
        self._claimed: tuple[int, str] | None = None  # (plan version, cluster) this node agreed to join
        self._missed: dict[str, int] = {}  # the planner's count of rounds each node did not answer
        self._judged: dict[str, bool] = {}  # published plans (as JSON) checked already: passed or not
        self._considered: tuple[Any, ...] | None = None  # what the planner's last `replan` call saw
        self._claim_method = RunNames(config.run_id).pipeline.claim
        peer.transport.add_handler(self._claim_method, self._on_claim)
        self._task: asyncio.Task | None = None
        self.ending = False  # see `end`

    def _source(self, mb: int) -> Any:
        cluster = self.worker.route.cluster
        if cluster not in self._sources:
            self._sources[cluster] = self._source_factory(int(cluster[1:]))
        return self._sources[cluster](mb)

    @staticmethod
    def _electable(plan: RunPlan, cluster: str) -> set[str]:
        """The nodes `plan` lets `cluster`'s election name its controller: its members and the
        standbys (none for a cluster the plan does not have)."""
        index = cluster_index(cluster)
        if index is None or index >= len(plan.clusters):
            return set()
        return {*plan.clusters[index], *plan.standby}

    @classmethod
    def _may_control(cls, plan: RunPlan, cluster: str, owner: str, layout: Layout) -> bool:
        """Whether `plan` lets `owner` publish `layout` for `cluster`: its version, and a node
        the cluster's election can name."""
        return layout.plan == plan.version and owner in cls._electable(plan, cluster)

    def _accepts(self, cluster: str, owner: str, layout: Layout) -> bool:
        return self._may_control(self.plan, cluster, owner, layout)

    def _may_configure(self, cluster: str, caller: str) -> bool:
        """Whether `caller` may configure this node's stage into `cluster`: under the current plan
        or the one before it, a node that cluster's election can name, with this node one too, or
        in no cluster of that plan (a node that came after it, which any cluster's recovery may
        take). Any node of the plan could, and one of another cluster took over a stage and shut
        its controller out."""
        for plan in (self.plan, self.previous):
            allowed = set() if plan is None else self._electable(plan, cluster)
            if caller in allowed and (self.me in allowed or self.me not in plan.nodes):
                return True
        return False

    def recoveries(self) -> list[tuple[str, RecoveryEvent]]:
        """(cluster, event) of every recovery made by a controller this node holds or held."""
        return [*self._past, *((cid, e) for cid, c in sorted(self.controllers.items()) for e in c.events)]

    async def _drop_controller(self, cid: str) -> None:
        controller = self.controllers.pop(cid)
        self._past = [*self._past, *((cid, e) for e in controller.events)][-MAX_PAST_RECOVERIES:]
        await controller.close()

    async def start(self) -> None:
        """Start the worker, wait for the plan's nodes to answer, then keep applying the rule."""
        self.worker.start()
        self._task = asyncio.ensure_future(self._run())

    def end(self) -> None:
        """The run is ending (every node was given the same --duration, and ends within moments of
        this one): from now on a node that stops answering has finished, not failed. No more
        elections, re-plans or recoveries; no standby is promoted or claimed; the stages train on
        and say nothing of neighbors that leave. Call on the event loop; `close` still ends it."""
        if self._task is not None:
            self._task.cancel()
        self.ending = self.worker.ending = True
        for controller in self.controllers.values():
            controller.ending = True

    async def close(self) -> None:
        self.peer.transport.remove_handler(self._claim_method)
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
        """One round: follow a newer plan, apply the rule over every cluster this node is a member
        of, and re-plan if this node is the planner and the rule calls for it."""
        if self.demand is not None:
            await self._follow()
        layouts = await self.worker.directory.fetch_layouts()
        for cid, controller in list(self.controllers.items()):
            if cid in layouts and layouts[cid].epoch > controller.epoch:  # another node took the role over
                logger.warning("%s steps down as controller of cluster %s: its layout is at epoch %d, past this "
                               "controller's %d", self.me[:8], cid, layouts[cid].epoch, controller.epoch)
                await self._drop_controller(cid)
        if self.controllers:
            self._refresh_standby(layouts, await self._late_profiles())
        for index, planned in enumerate(self.plan.clusters):
            cid = cluster_id(index)
            if cid in self.controllers:
                continue
            members = [s.peer for s in layouts[cid].stages] if cid in layouts else list(planned)
            if self.me not in members:
                continue
            # the plan's members of the cluster first: a standby that joined it does not take the
            # role (and re-configure every stage) while one of them is alive
            for candidate in sorted((m for m in members if m in self.plan.nodes), key=lambda m: (m not in planned, m)):
                if candidate == self.me:
                    await self._take_over(index, layouts)
                    break
                if await self._alive(candidate):
                    break  # a live member below this node holds the role
        if self.demand is not None:
            await self._plan_ahead(layouts)

    async def _take_over(self, index: int, layouts: dict[str, Layout]) -> None:
        cid = cluster_id(index)
        in_use = {s.peer for layout in layouts.values() for s in layout.stages}
        layout = layouts.get(cid)
        members = [s.peer for s in layout.stages] if layout else list(self.plan.clusters[index])
        controller = ClusterController(self.peer, self.config, cid, members, self.costs, self.shapes,
                                       profiles=self.profiles, reference_flops=self.reference_flops,
                                       standby=[p for p in self.plan.standby if p not in in_use],
                                       heartbeat=self.heartbeat, failure_timeout=self.failure_timeout,
                                       plan_version=self.plan.version, accept=self._accepts,
                                       claim=lambda peer: self._claim(peer, cid))
        self.controllers[cid] = controller
        alive = await asyncio.gather(*(self._alive(m) for m in members))
        dead = [m for m, ok in zip(members, alive, strict=True) if not ok]
        try:
            if layout:
                logger.warning("%s takes over as controller of cluster %s at epoch %d (lost: %s)", self.me[:8],
                               cid, layout.epoch, ", ".join(d[:8] for d in dead) or "none")
                await controller.take_over(layout, dead)
                return
            logger.info("%s controls cluster %s (plan version %d)", self.me[:8], cid, self.plan.version)
            elsewhere = await self._previous_holders(controller) if self.previous is not None else {}
            controller.members = [m for m in members if m not in dead]
            while True:
                try:
                    await controller.plan()
                    break
                except PartitionError:  # a planned member never came: a standby stands in
                    extra = await controller.take_standby()
                    if extra is None:
                        raise
                    controller.members.append(extra)
            await controller.start(elsewhere, in_order=self.previous is not None)
        except BaseException:
            del self.controllers[cid]
            await controller.close()
            raise

    async def _late_profiles(self) -> list[NodeProfile]:
        """Profiles in the DHT of nodes that are not in the plan (they joined after it)."""
        late = [p for p in await fetch_profiles(self.peer, self.config.run_id, self.config.model)
                if p.peer_id not in self.plan.nodes][:MAX_LATE_NODES]
        self.profiles.update({p.peer_id: p for p in late})
        return late

    def _refresh_standby(self, layouts: dict[str, Layout], late: list[NodeProfile]) -> None:
        """Give the controllers held here every node not in a layout: the plan's standbys and the
        nodes that joined later."""
        in_use = {s.peer for layout in layouts.values() for s in layout.stages}
        for controller in self.controllers.values():
            in_use.update(controller.members)
        spare = [p for p in [*self.plan.standby, *(p.peer_id for p in late)] if p not in in_use]
        for controller in self.controllers.values():
            controller.standby = list(spare)

    # -- standby claims ------------------------------------------------------------------------------
    async def _claim(self, peer: str, cluster: str) -> bool:
        try:
            reply = await call(self.peer.transport, peer, self._claim_method, Claim(self.plan.version, cluster),
                               self.failure_timeout)
            return Ack.from_wire(reply).ok
        except (NetworkError, TimeoutError):
            return False

    async def _on_claim(self, request: Any, ctx: Any) -> Any:
        """Agree to join the first cluster that claims this node under the current plan version."""
        claim = Claim.from_wire(request)
        if self.ending:
            return Ack(False).to_wire()  # a standby is not promoted while the run ends
        if str(ctx.peer_id) not in self._electable(self.plan, claim.cluster):
            # only that cluster's possible controllers (any node of the plan could claim this one
            # for a made-up cluster, and no real cluster could take it for that plan version)
            raise PipelineError(f"standby claim refused: {ctx.peer_id} may not control {claim.cluster!r}")
        mine = self.plan.cluster_of(self.me)
        if claim.version != self.plan.version or (mine is not None and cluster_id(mine) != claim.cluster):
            return Ack(False).to_wire()
        if self._claimed is None or self._claimed[0] < claim.version:
            self._claimed = (claim.version, claim.cluster)
        return Ack(self._claimed == (claim.version, claim.cluster)).to_wire()

    # -- re-planning ---------------------------------------------------------------------------------
    async def _plan_ahead(self, layouts: dict[str, Layout]) -> None:
        """If this node is the planner (the plan's live node with the lowest peer id), count who
        answers and publish the next version when `planning.replan` calls for it."""
        for node in sorted(self.plan.nodes):
            if node == self.me:
                break
            if await self._alive(node):
                return  # a live node below this one plans
        candidates = [*self.plan.nodes, *(p.peer_id for p in await self._late_profiles())]
        answered = await asyncio.gather(*(self._alive(p) for p in candidates if p != self.me))
        for node, ok in zip([p for p in candidates if p != self.me], answered, strict=True):
            self._missed[node] = 0 if ok else self._missed.get(node, 0) + 1
        live = [p for p in candidates if self._missed.get(p, 0) == 0 and p in self.profiles]
        dead = {p for p, missed in self._missed.items() if missed >= REPLAN_MISSES}
        members = [[s.peer for s in layouts[cluster_id(i)].stages] if cluster_id(i) in layouts else list(c)
                   for i, c in enumerate(self.plan.clusters)]
        situation = (self.plan.version, frozenset(live), frozenset(d for ms in members for d in ms if d in dead))
        if situation == self._considered:
            return  # nothing changed since the last round: the rule's answer is the same
        self._considered = situation
        new = await run_in_thread(replan, self.plan, members, [self.profiles[p] for p in live], dead,
                                  self.demand, self.clusters)
        if new is not None:
            logger.warning("%s re-plans the run: version %d, %d clusters, standby %d (dead: %s)", self.me[:8],
                           new.version, len(new.clusters), len(new.standby),
                           ", ".join(d[:8] for d in sorted(dead)) or "none")
            await self._adopt(new)

    async def _follow(self) -> None:
        """Take the newest plan that a node of the current plan published and that checks out."""
        newer = sorted(((plan.version, owner, plan) for owner, plan in (await fetch_plans(
            self.peer, self.config.run_id)).items() if plan.version > self.plan.version and owner in self.plan.nodes),
            key=lambda item: (-item[0], item[1]))
        for _, _, plan in newer:
            key = json.dumps(plan.to_wire(), sort_keys=True)
            if key not in self._judged:
                missing = [p for p in plan.nodes if p not in self.profiles]
                if missing:
                    self.profiles.update({p.peer_id: p for p in await fetch_profiles(self.peer, self.config.run_id,
                                                                                     self.config.model)
                                          if p.peer_id in missing})
                if len(self._judged) >= MAX_JUDGED_PLANS:
                    del self._judged[next(iter(self._judged))]
                self._judged[key] = await run_in_thread(checks, plan, self.profiles, self.demand, self.clusters)
                if not self._judged[key]:
                    logger.warning("plan version %d is not the rule applied to its nodes' profiles: ignored",
                                   plan.version)
            if self._judged[key]:
                await self._adopt(plan)
                return

    async def _adopt(self, plan: RunPlan) -> None:
        """Leave the current plan for `plan`: close its controllers, let the new plan's nodes
        configure this stage, and publish `plan` as this node's."""
        for cid in list(self.controllers):
            await self._drop_controller(cid)
        self.previous, self.plan = self.plan, plan
        self._missed.clear()
        self.worker.controllers = frozenset(PeerID.from_string(p) for p in plan.nodes)
        await publish_plan(self.peer, self.config.run_id, plan)
        logger.warning("%s follows plan version %d", self.me[:8], plan.version)

    async def _previous_holders(self, controller: ClusterController) -> dict[int, list[str]]:
        """Once the previous plan's live nodes publish the current one (or after ADOPT_TIMEOUT),
        {layer: nodes holding it in the previous plan's layouts}; sets the controller's first epoch
        PLAN_EPOCH_GAP past their newest."""
        previous, version = self.previous, self.plan.version
        waiting = [p for p in previous.nodes if p != self.me]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADOPT_TIMEOUT
        while waiting and loop.time() < deadline:
            published = await fetch_plans(self.peer, self.config.run_id)
            alive = await asyncio.gather(*(self._alive(p) for p in waiting))
            waiting = [p for p, ok in zip(waiting, alive, strict=True)
                       if ok and (p not in published or published[p].version < version)]
            if waiting:
                await asyncio.sleep(self.heartbeat)
        old = await self.worker.directory.fetch_layouts(
            accept=lambda cluster, owner, layout: self._may_control(previous, cluster, owner, layout))
        controller.epoch = max((layout.epoch for layout in old.values()), default=0) + PLAN_EPOCH_GAP
        named = sorted({span.peer for layout in old.values() for span in layout.stages})
        alive = dict(zip(named, await asyncio.gather(*(self._alive(p) for p in named)), strict=True))
        holders: dict[int, list[str]] = {}
        for _, layout in sorted(old.items()):
            for span in layout.stages:
                if alive[span.peer]:
                    for i in range(span.start, span.end):
                        holders.setdefault(i, []).append(span.peer)
        return holders
