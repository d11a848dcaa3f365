"""Planning a run from the DHT: which nodes form which cluster, and who stands by.

`potluck pipeline run` starts the same command on every machine; each node publishes its profile,
and once the run's nodes are in, every node computes the plan itself by one deterministic rule:
`form_clusters` over the profiles sorted by peer id, with layer costs every node derives alike from
the model (`model_costs`: FLOPs and bytes counted, not timed, since timings differ between
machines). Each node publishes the plan it computed (a `RunPlan` with a version) under its own
signed subkey of `RunNames(run_id).pipeline.plan`, so anyone can check that the nodes agree (`disagreeing`).

Re-planning (`replan`): when a cluster still names a member that has been dead for a while (its
controller could not replace it: no standby left, or every member died), or when the nodes in no
cluster could hold another copy of the model and the plan over the live nodes has more clusters,
version v+1 is `plan_run` over the live nodes' profiles. Whoever computes it, anyone can check it
(`checks`): it must equal the rule applied to the profiles of the nodes it names.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from potluck.core.errors import MalformedMessage
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.wire import Int, List, Message
from potluck.dht.records import own_subkey, owned_entries
from potluck.net.wire import PeerIdField
from potluck.pipeline.clustering import ClusteringError, ModelDemand, form_clusters
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_COUNTER
from potluck.pipeline.partition import STATE_FACTOR
from potluck.pipeline.profiling import LayerCost, NodeProfile

__all__ = ["RunPlan", "checks", "cluster_id", "cluster_index", "disagreeing", "fetch_plans", "model_costs",
           "model_demand", "plan_run", "publish_plan", "replan"]

logger = logging.getLogger(__name__)

# A plan lives as long as a profile (profiling.PROFILE_TTL); nodes republish theirs with it.
PLAN_TTL = 300.0
# Nodes in one plan: a pipeline run has tens of nodes, not thousands.
MAX_PLAN_NODES = 4096
# FLOPs of one sample's forward and backward per weight (a multiply-add forward, two backward).
FLOPS_PER_PARAM = 6


def cluster_id(index: int) -> str:
    """The name of cluster `index` in layouts and controller methods."""
    return f"c{index}"


def cluster_index(name: str) -> int | None:
    """The index `cluster_id` gave `name`; None for any other text."""
    digits = name[1:]
    if not name.startswith("c") or not digits.isdigit() or len(digits) > 6 or cluster_id(int(digits)) != name:
        return None
    return int(digits)


class RunPlan(Message, what="run plan"):
    """Clusters (peer ids, sorted) and standby nodes of a run; `version` grows with each re-plan."""

    version: int = Int("version", 0, MAX_COUNTER)
    clusters: tuple[tuple[str, ...], ...] = List("clusters", List(None, PeerIdField(text=True), MAX_PLAN_NODES),
                                                  MAX_CLUSTERS)
    standby: tuple[str, ...] = List("standby", PeerIdField(text=True), MAX_PLAN_NODES)

    @property
    def nodes(self) -> list[str]:
        return [*(m for c in self.clusters for m in c), *self.standby]

    def cluster_of(self, peer: str) -> int | None:
        return next((c for c, members in enumerate(self.clusters) if peer in members), None)

    def validate(self, context: Mapping[str, Any]) -> None:
        nodes = self.nodes
        if len(set(nodes)) != len(nodes) or not all(self.clusters):
            raise self.refuse("every node must appear once, and every cluster must have a node")


def model_costs(layers: Sequence[nn.Module], sample: torch.Tensor) -> list[LayerCost]:
    """Per-sample cost of each layer, counted rather than timed so every node gets the same numbers:
    seconds = FLOPs on a 1-FLOP/s node (weights x FLOPS_PER_PARAM, plus one per output element),
    weight bytes, output bytes. `sample`: one micro-batch of inputs."""
    costs, x = [], sample[:1]
    with torch.no_grad():
        for layer in layers:
            out = layer(x)
            params = sum(p.numel() for p in layer.parameters())
            costs.append(LayerCost(float(FLOPS_PER_PARAM * params + out[0].numel()),
                                   sum(p.numel() * p.element_size() for p in layer.parameters()),
                                   out[0].numel() * out.element_size()))
            x = out
    return costs


def model_demand(costs: Sequence[LayerCost], micro_batch: int, staleness_bound: int,
                 reference_flops: float = 1.0) -> ModelDemand:
    """What one copy of the model needs (as `potluck pipeline plan` counts it); `costs` measured on a
    node of `reference_flops` (1.0 for `model_costs`)."""
    params = sum(c.param_bytes for c in costs)
    memory = params * (STATE_FACTOR + 2) + sum(c.activation_bytes for c in costs) * micro_batch * staleness_bound
    return ModelDemand(work=sum(c.seconds for c in costs) * reference_flops,
                       activation_bytes=max(c.activation_bytes for c in costs), memory=memory)


def plan_run(profiles: Sequence[NodeProfile], demand: ModelDemand, clusters: int | None = None,
             version: int = 1) -> RunPlan:
    """The plan every node computes from the same profiles: a pure function of its inputs."""
    found = form_clusters(sorted(profiles, key=lambda p: p.peer_id), demand, clusters)
    return RunPlan(version, tuple(tuple(sorted(c)) for c in found.clusters), tuple(sorted(found.standby)))


def replan(plan: RunPlan, members: Sequence[Sequence[str]], live: Sequence[NodeProfile], dead: Collection[str],
           demand: ModelDemand, clusters: int | None = None) -> RunPlan | None:
    """Version `plan.version + 1`, or None if the rule keeps `plan`. `members`: each cluster's
    members now (its layout's stages; the plan's before one is published); `live`: the profiles of
    the nodes that answer (the plan's and later ones); `dead`: nodes that have not answered for a
    while. Re-plan when (a) a cluster still names a dead member, or (b) the nodes in no cluster
    hold a copy of the model's memory and the plan over `live` has more clusters than `plan`.
    `clusters` is kept while `live` can form that many; else as many as memory allows."""
    broken = any(m in dead for ms in members for m in ms)
    busy = {m for ms in members for m in ms}
    if not broken and sum(p.memory for p in live if p.peer_id not in busy) < demand.memory:
        return None  # no new cluster fits: skip the solver
    try:
        new = plan_run(live, demand, clusters, plan.version + 1)
    except ClusteringError:
        if clusters is None:
            return None
        try:
            new = plan_run(live, demand, None, plan.version + 1)
        except ClusteringError:
            return None
    return new if (broken and new.clusters) or len(new.clusters) > len(plan.clusters) else None


def checks(plan: RunPlan, profiles: dict[str, NodeProfile], demand: ModelDemand, clusters: int | None = None) -> bool:
    """Whether `plan` (a re-plan, version > 1) is the rule applied to the profiles of the nodes it
    names, as `replan` computes it."""
    try:
        found = [profiles[p] for p in plan.nodes]
    except KeyError:
        return False
    for count in ([clusters, None] if clusters is not None else [None]):
        try:
            if plan_run(found, demand, count, plan.version) == plan:
                return True
        except ClusteringError:
            continue
    return False


async def publish_plan(peer: PeerLike, run_id: str, plan: RunPlan, ttl: float = PLAN_TTL) -> bool:
    """Publish the plan this node computed, under its own signed subkey."""
    dht = peer.dht
    return await dht.astore(RunNames(run_id).pipeline.plan, plan.to_wire(), dht.get_time() + ttl,
                            subkey=own_subkey(peer.transport.peer_id))


async def fetch_plans(peer: PeerLike, run_id: str) -> dict[str, RunPlan]:
    """{peer id: the plan it published}; unsigned and malformed entries skipped."""
    found = await peer.dht.aget(RunNames(run_id).pipeline.plan, latest=True)
    plans: dict[str, RunPlan] = {}
    for owner, value in owned_entries(found)[:MAX_PLAN_NODES]:
        try:
            plans[str(owner)] = RunPlan.from_wire(value)
        except MalformedMessage as e:
            logger.warning("skipping the plan of %s: %s", str(owner)[:8], e)
    return plans


def disagreeing(mine: RunPlan, published: dict[str, RunPlan]) -> list[str]:
    """The nodes of `mine` that published a different plan of the same version."""
    return sorted(p for p, plan in published.items() if p in mine.nodes and plan.version == mine.version
                  and plan != mine)
