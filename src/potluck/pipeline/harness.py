"""Start a whole pipeline run over ready peers: workers on every node, one controller per
cluster. Used by the demo, the benchmark and the tests; a deployment does the same per node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from potluck.core import compat
from potluck.core.peer_like import PeerLike
from potluck.pipeline.partition import boundary_shapes
from potluck.pipeline.profiling import LayerCost, NodeProfile, profile_layers
from potluck.pipeline.recovery import ClusterController
from potluck.pipeline.stage import LossFn, MakeLayers, PipelineConfig, Source, StageWorker

__all__ = ["PipelineRun", "RemoteNode", "controller_host", "launch_run"]


@dataclass(frozen=True)
class RemoteNode:
    """A node whose `StageWorker` runs in another process (or machine), in the same swarm: known
    by its peer id (the transport finds its address through its signed peer record in the DHT)."""

    peer_id: str


def _peer_id(node: PeerLike | RemoteNode) -> str:
    return node.peer_id if isinstance(node, RemoteNode) else str(node.transport.peer_id)


def controller_host(nodes: Sequence[PeerLike | RemoteNode], members: Sequence[int]) -> str | None:
    """The peer id of the node that runs the controller of a cluster of `members` (node indices):
    its first local node; None if it has none."""
    return next((_peer_id(nodes[i]) for i in members if not isinstance(nodes[i], RemoteNode)), None)


@dataclass
class PipelineRun:
    workers: dict[str, StageWorker]
    controllers: list[ClusterController]
    clusters: list[list[str]]
    extra: dict[str, Any] = field(default_factory=dict)

    def worker_of(self, cluster: int, stage: int) -> StageWorker:
        peer = self.controllers[cluster].stages[stage].peer
        return self.workers[peer]

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> None:
        """Wait until `condition()` holds, re-checking whenever a worker makes progress;
        TimeoutError after `timeout` seconds (of the loop's clock)."""
        events = [w.progressed for w in self.workers.values()]
        async with compat.timeout(timeout):
            while True:
                for event in events:
                    event.clear()
                if condition():
                    return
                waiters = [asyncio.ensure_future(e.wait()) for e in events]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()

    async def close(self) -> None:
        for c in self.controllers:
            await c.close()
        await asyncio.gather(*(w.close() for w in self.workers.values()))


async def launch_run(nodes: Sequence[PeerLike | RemoteNode], clusters: Sequence[Sequence[int]], config: PipelineConfig,
                     make_layers: MakeLayers, num_layers: int, optimizer: Callable[[list[nn.Parameter]], Any], *,
                     sample: torch.Tensor, sources: Sequence[Source], loss_fn: LossFn | None = None,
                     costs: Sequence[LayerCost] | None = None, profiles: dict[str, NodeProfile] | None = None,
                     standby: Sequence[Sequence[int]] = (), reference_flops: float = 1.0,
                     heartbeat: float = 1.0, failure_timeout: float = 3.0,
                     prepare: Callable[[StageWorker], None] | None = None,
                     scheduler: Callable[[Any], Any] | None = None) -> PipelineRun:
    """`nodes[i]` = the peer of node i, or a `RemoteNode` whose worker runs elsewhere; all in one
    swarm (one DHT), through which every node finds the others' addresses by peer id;
    `clusters[c]` = node indices of cluster c;
    `prepare(worker)` runs on each worker before it is configured (hooks, tracing).
    Cluster c's controller runs on its first local member (`controller_host`): a `RemoteNode`'s
    worker must be created with that node's peer id as its `controller`."""
    layers = make_layers(list(range(num_layers)))
    shapes = boundary_shapes(layers, list(sample.shape[1:]))
    if costs is None:
        costs = await asyncio.get_running_loop().run_in_executor(None, profile_layers, layers, sample)
    del layers
    workers: dict[str, StageWorker] = {}
    controllers = []
    # a cluster's layout is read only from its controller's node
    hosts = {f"c{c}": controller_host(nodes, members) for c, members in enumerate(clusters)}

    def accept(cluster: str, owner: str, layout: Any) -> bool:
        return hosts.get(cluster) == owner
    for c, members in enumerate(clusters):
        spare = list(standby[c]) if c < len(standby) else []
        host = next((i for i in members if not isinstance(nodes[i], RemoteNode)), None)
        if host is None:
            raise ValueError(f"cluster {c} needs a local node to run its controller")
        controller_id = controller_host(nodes, members)
        for i in [*members, *spare]:
            if isinstance(nodes[i], RemoteNode):
                continue  # its process runs its own worker (created with `controller_host`'s id)
            worker = StageWorker(nodes[i], config, make_layers, optimizer, controller=controller_id,
                                 num_layers=num_layers, source=sources[c], loss_fn=loss_fn, scheduler=scheduler)
            worker.directory.accept = accept
            if prepare is not None:
                prepare(worker)
            worker.start()
            workers[worker.peer_id] = worker
        controllers.append(ClusterController(
            nodes[host], config, f"c{c}", [_peer_id(nodes[i]) for i in members], costs, shapes,
            profiles=profiles, reference_flops=reference_flops,
            standby=[_peer_id(nodes[i]) for i in spare], heartbeat=heartbeat, failure_timeout=failure_timeout,
            accept=accept))
    for controller in controllers:
        await controller.plan()
    for controller in controllers:
        await controller.start()
    return PipelineRun(workers, controllers, [[_peer_id(nodes[i]) for i in m] for m in clusters])
