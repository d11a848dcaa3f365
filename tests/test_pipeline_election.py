"""Controller election and takeover (`pipeline.node`) over the emulated network, on the virtual clock:
the live member with the lowest peer id controls each cluster; when its node crashes, the next
takes over from the layout in the DHT and the cluster trains on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
import torch

from potluck.core.virtual_time import run_virtual
from potluck.pipeline.node import PipelineNode
from potluck.pipeline.partition import boundary_shapes
from potluck.pipeline.planning import RunPlan, cluster_id
from potluck.pipeline.profiling import NodeProfile
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm
from tests.test_pipeline_net import COSTS, LAYERS, WIDTH, make_layers, source_for


async def _until(condition, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


def make_node(peer, config: PipelineConfig, plan: RunPlan, profiled: Iterable[str], memory: int = 2**40,
              **kwargs) -> PipelineNode:
    """A node of the test model (SGD, emulated compute) that knows a profile of `memory` bytes for each
    of `profiled`; quick heartbeats and failure detection."""
    return PipelineNode(peer, config, plan, make_layers, LAYERS, lambda p: torch.optim.SGD(p, lr=0.05),
                        source=source_for, costs=COSTS, shapes=boundary_shapes(make_layers(range(LAYERS)), [WIDTH]),
                        profiles={p: NodeProfile(p, 1.0, memory) for p in profiled}, heartbeat=0.5,
                        failure_timeout=1.0, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silent", [False, True], ids=["reset", "silent"])
def test_the_next_member_takes_the_controller_role_over_when_its_node_crashes(silent):
    config = PipelineConfig("elect", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)

    async def main():
        net, peers = await make_swarm(6, latency=0.002, bandwidth=None)
        ids = sorted(str(p.transport.peer_id) for p in peers)
        plan = RunPlan(1, (tuple(ids[0::2]), tuple(ids[1::2])), ())
        by_id = {str(p.transport.peer_id): p for p in peers}
        nodes = {}
        for peer_id, peer in by_id.items():
            node = make_node(peer, config, plan, ids)
            await node.start()
            nodes[peer_id] = node

        def controllers():
            return {c: p for p, n in nodes.items() if p in live for c in n.controllers}

        def last_stage(c):
            return next(n.worker for p, n in nodes.items() if p in live and n.worker.route is not None
                        and n.worker.route.cluster == cluster_id(c) and n.worker.route.last)

        live = set(ids)
        await _until(lambda: controllers() == {"c0": min(plan.clusters[0]), "c1": min(plan.clusters[1])}, 20,
                     "the lowest peer id of each cluster controls it")
        await _until(lambda: all(last_stage(c).stats.updates >= 20 for c in (0, 1)), 30, "both clusters train")
        victim = min(plan.clusters[0])
        live.discard(victim)
        net.crash(by_id[victim].transport.peer_id, silent=silent)
        await _until(lambda: controllers() == {"c0": sorted(plan.clusters[0])[1], "c1": min(plan.clusters[1])},
                     10, "the next member takes cluster 0 over")
        new = nodes[sorted(plan.clusters[0])[1]].controllers["c0"]
        await _until(lambda: new.events, 10, "the new controller re-partitions without the dead node")
        updates = last_stage(0).stats.updates
        await _until(lambda: last_stage(0).stats.updates >= updates + 20, 30, "cluster 0 trains on")
        stages = [s.peer for s in new.stages]
        for peer_id in live:
            await nodes[peer_id].close()
        for p in peers:
            if str(p.transport.peer_id) in live:
                await p.dht.ashutdown()
                await p.transport.close()
        return victim, new.events[0], stages, plan

    victim, event, stages, plan = run_virtual(main())
    assert event.dead == victim and victim not in stages
    assert sorted(stages) == sorted(plan.clusters[0])[1:]
    assert event.fetched_from  # the dead node's layers came from cluster 1


@pytest.mark.timeout(60)
def test_a_node_that_joins_after_the_plan_is_a_standby_a_recovery_takes():
    """Six planned nodes in two clusters of three, no standby; each holds a third of the model, so a
    cluster that loses one needs another node: the seventh, which published its profile after the
    plan was made."""
    from potluck.pipeline.profiling import publish_profile
    config = PipelineConfig("late", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)
    memory = 13_000  # 2 of the 6 equal layers (6,256 bytes each at 4 in flight, 2 stashes) per node

    async def main():
        net, peers = await make_swarm(7, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        late = ids[3]  # a peer id in the middle: the plan is not simply the lowest ids
        planned = [p for p in ids if p != late]
        plan = RunPlan(1, (tuple(planned[0::2]), tuple(planned[1::2])), ())
        nodes = {}
        for peer_id in ids:
            node = make_node(by_id[peer_id], config, plan, planned, memory)
            await node.start()
            nodes[peer_id] = node
        await publish_profile(by_id[late], "late", NodeProfile(late, 1.0, memory))
        c0 = plan.clusters[0]
        await _until(lambda: "c0" in nodes[min(c0)].controllers, 20, "cluster 0 has its controller")
        controller = nodes[min(c0)].controllers["c0"]
        await _until(lambda: controller.standby == [late], 10, "the late node is cluster 0's standby")
        victim = max(c0)
        net.crash(by_id[victim].transport.peer_id)
        await _until(lambda: controller.events, 10, "cluster 0 recovers")
        worker = nodes[late].worker
        await _until(lambda: worker.route is not None and worker.stats.updates >= 10, 30, "the late node trains")
        stages = [s.peer for s in controller.stages]
        for peer_id, node in nodes.items():
            if peer_id != victim:
                await node.close()
                await by_id[peer_id].dht.ashutdown()
                await by_id[peer_id].transport.close()
        return stages, victim, late, c0

    stages, victim, late, c0 = run_virtual(main())
    assert late in stages and victim not in stages and len(stages) == 3
    assert set(stages) - {late} == set(c0) - {victim}


@pytest.mark.timeout(60)
def test_a_planned_node_that_never_comes_is_replaced_by_a_standby_at_the_start():
    config = PipelineConfig("absent", staleness_bound=4, average_every=0, message_timeout=5, emulate_compute=True)
    memory = 13_000  # a third of the model per node: the cluster needs three

    async def main():
        net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        absent = ids[1]
        plan = RunPlan(1, (tuple(ids[:3]),), (ids[3],))
        net.crash(by_id[absent].transport.peer_id)
        nodes = {}
        for peer_id in ids:
            if peer_id == absent:
                continue
            node = make_node(by_id[peer_id], config, plan, ids, memory)
            await node.start()
            nodes[peer_id] = node
        await _until(lambda: "c0" in nodes[ids[0]].controllers, 200, "the cluster has its controller")
        controller = nodes[ids[0]].controllers["c0"]
        standby = nodes[ids[3]].worker
        await _until(lambda: standby.route is not None and standby.stats.updates >= 10, 30, "the standby trains")
        stages = [s.peer for s in controller.stages]
        for peer_id, node in nodes.items():
            await node.close()
            await by_id[peer_id].dht.ashutdown()
            await by_id[peer_id].transport.close()
        return stages, ids

    stages, ids = run_virtual(main())
    assert sorted(stages) == [ids[0], ids[2], ids[3]]


@pytest.mark.timeout(60)
def test_a_controller_steps_down_when_its_clusters_layout_is_newer_than_its_epoch():
    """Split brain: a member that took the role over (here: a layout of a newer epoch published by
    the next member) supersedes the controller, which closes its controller instead of pinging on;
    the rule then gives the role back to the lowest live member, which resumes from that layout."""
    from potluck.pipeline.layout import Layout, LayoutDirectory
    config = PipelineConfig("split", staleness_bound=4, average_every=0, message_timeout=5, emulate_compute=True)

    async def main():
        net, peers = await make_swarm(3, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        plan = RunPlan(1, (tuple(ids),), ())
        nodes = {}
        for peer_id in ids:
            node = make_node(by_id[peer_id], config, plan, ids)
            await node.start()
            nodes[peer_id] = node
        first = nodes[ids[0]]
        await _until(lambda: "c0" in first.controllers and first.controllers["c0"].partition is not None, 20,
                     "the lowest peer id controls the cluster")
        old = first.controllers["c0"]
        newer = Layout(old.epoch + 3, tuple(old.stages))
        await LayoutDirectory(by_id[ids[1]], config.run_id).publish("c0", newer)
        await _until(lambda: first.controllers.get("c0") is not old, 10, "the superseded controller steps down")
        await _until(lambda: "c0" in first.controllers, 10, "the rule gives the role back")
        epoch = first.controllers["c0"].epoch
        for peer_id, node in nodes.items():
            await node.close()
            await by_id[peer_id].dht.ashutdown()
            await by_id[peer_id].transport.close()
        return old, newer, epoch

    old, newer, epoch = run_virtual(main())
    assert old._monitor is not None and old._monitor.done()  # closed, no longer pinging
    assert epoch > newer.epoch  # resumed from the newer layout, one epoch later


@pytest.mark.timeout(60)
def test_a_run_that_ends_takes_finished_nodes_for_finished_not_for_failures(caplog):
    """Every node ends (`PipelineNode.end`, as `pipeline run --duration` does before its end), then
    one stops: nobody recovers, re-plans or promotes the standby, and nothing is warned of."""
    config = PipelineConfig("ending", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)

    async def main():
        net, peers = await make_swarm(7, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        plan = RunPlan(1, (tuple(ids[0:6:2]), tuple(ids[1:6:2])), (ids[6],))
        nodes = {}
        for peer_id in ids:
            nodes[peer_id] = make_node(by_id[peer_id], config, plan, ids)
            await nodes[peer_id].start()
        workers = [nodes[p].worker for p in plan.clusters[0]]
        await _until(lambda: all(w.route is not None for w in workers) and workers[0].stats.updates >= 10, 30,
                     "cluster 0 trains")
        caplog.clear()
        for node in nodes.values():
            node.end()
        finished = max(plan.clusters[0])
        await nodes[finished].close()
        await by_id[finished].dht.ashutdown()
        await by_id[finished].transport.close()
        await asyncio.sleep(10)
        events = [e for p, n in nodes.items() if p != finished for _, e in n.recoveries()]
        standby = nodes[ids[6]].worker.route
        for peer_id, node in nodes.items():
            if peer_id != finished:
                await node.close()
                await by_id[peer_id].dht.ashutdown()
                await by_id[peer_id].transport.close()
        return events, standby, [n.plan for n in nodes.values()], plan

    with caplog.at_level("WARNING", logger="potluck.pipeline"):
        events, standby, plans, plan = run_virtual(main())
    assert events == [] and standby is None and all(p == plan for p in plans)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("potluck.pipeline")] == []
