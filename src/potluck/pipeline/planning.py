"""Planning a run from the DHT: which nodes form which cluster, and who stands by.

`potluck pipeline run` starts the same command on every machine; each node publishes its profile,
and once the run's nodes are in, every node computes the plan itself by one deterministic rule:
`form_clusters` over the profiles sorted by peer id, with layer costs every node derives alike from
the model (`model_costs`: FLOPs and bytes counted, not timed, since timings differ between
machines). Each node publishes the plan it computed (a `RunPlan` with a version) under its own
signed subkey of `{run_id}.pipeline.plan`, so anyone can check that the nodes agree (`disagreeing`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from potluck.core.errors import MalformedMessage
from potluck.core.peer_like import PeerLike
from potluck.core.wire import int_field, list_field, list_value, wire_map
from potluck.dht.records import own_subkey, owned_entries
from potluck.pipeline.clustering import ModelDemand, form_clusters
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_COUNTER, peer_text
from potluck.pipeline.partition import STATE_FACTOR
from potluck.pipeline.profiling import LayerCost, NodeProfile

__all__ = ["RunPlan", "cluster_id", "disagreeing", "fetch_plans", "model_costs", "model_demand", "plan_run",
           "publish_plan"]

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


@dataclass(frozen=True)
class RunPlan:
    """Clusters (peer ids, sorted) and standby nodes of a run; `version` grows with each re-plan."""

    version: int
    clusters: tuple[tuple[str, ...], ...]
    standby: tuple[str, ...]

    @property
    def nodes(self) -> list[str]:
        return [*(m for c in self.clusters for m in c), *self.standby]

    def cluster_of(self, peer: str) -> int | None:
        return next((c for c, members in enumerate(self.clusters) if peer in members), None)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "clusters": [list(c) for c in self.clusters], "standby": list(self.standby)}

    @classmethod
    def from_wire(cls, msg: Any) -> RunPlan:
        what = "run plan"
        msg = wire_map(msg, what)
        clusters = tuple(tuple(peer_text(p, "clusters", what) for p in list_value(c, "clusters", what, MAX_PLAN_NODES))
                         for c in list_field(msg, "clusters", what, MAX_CLUSTERS))
        standby = tuple(peer_text(p, "standby", what) for p in list_field(msg, "standby", what, MAX_PLAN_NODES))
        nodes = [*(m for c in clusters for m in c), *standby]
        if len(set(nodes)) != len(nodes) or not all(clusters):
            raise MalformedMessage(what, "every node must appear once, and every cluster must have a node")
        return cls(int_field(msg, "version", what, 0, MAX_COUNTER), clusters, standby)


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


def _key(run_id: str) -> str:
    return f"{run_id}.pipeline.plan"


async def publish_plan(peer: PeerLike, run_id: str, plan: RunPlan, ttl: float = PLAN_TTL) -> bool:
    """Publish the plan this node computed, under its own signed subkey."""
    dht = peer.dht
    return await dht.astore(_key(run_id), plan.to_wire(), dht.get_time() + ttl,
                            subkey=own_subkey(peer.transport.peer_id))


async def fetch_plans(peer: PeerLike, run_id: str) -> dict[str, RunPlan]:
    """{peer id: the plan it published}; unsigned and malformed entries skipped."""
    found = await peer.dht.aget(_key(run_id), latest=True)
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
