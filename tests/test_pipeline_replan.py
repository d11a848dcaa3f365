"""Re-planning a `potluck pipeline run` (`planning.replan`, `pipeline.node`) and exclusive standby
claims: the rule itself, then nodes on the emulated network (virtual clock) that grow from one
cluster to two when late nodes arrive, and back to one when a node dies with no standby."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.messages import Ack
from potluck.pipeline.node import Claim
from potluck.pipeline.planning import RunPlan, checks, model_demand, plan_run, replan
from potluck.pipeline.profiling import NodeProfile, publish_profile
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm
from tests.test_pipeline_election import _until, make_node
from tests.test_pipeline_net import COSTS, LAYERS, make_layers

DEMAND = model_demand(COSTS, 8, 4)  # what one copy of the test model needs (micro-batch 8, bound 4)
HALF = int(DEMAND.memory * 0.55)  # two nodes hold the model, one cannot


def profiles(names: str, memory: int = HALF) -> list[NodeProfile]:
    return [NodeProfile(n, 1.0, memory) for n in names]


def test_the_replan_rule():
    one = plan_run(profiles("ab"), DEMAND)
    assert one.clusters == (("a", "b"),) and one.version == 1
    # nothing changed, or one late node that cannot hold a copy: keep the plan
    assert replan(one, [["a", "b"]], profiles("ab"), set(), DEMAND) is None
    assert replan(one, [["a", "b"]], profiles("abc"), set(), DEMAND) is None
    # two late nodes hold a copy: a second cluster
    grown = replan(one, [["a", "b"]], profiles("abcd"), set(), DEMAND)
    assert grown is not None and grown.version == 2 and len(grown.clusters) == 2 and not grown.standby
    assert checks(grown, {p.peer_id: p for p in profiles("abcd")}, DEMAND)
    # a cluster still names a dead member (its controller found no standby): re-plan over the live
    shrunk = replan(grown, [list(c) for c in grown.clusters], profiles("abc"), {"d"}, DEMAND)
    assert shrunk is not None and shrunk.version == 3 and len(shrunk.clusters) == 1 and shrunk.nodes == ["a", "b", "c"]
    # a dead node no layout names any more (recovered without it) is no reason
    assert replan(one, [["a", "b"]], profiles("abc"), {"d"}, DEMAND) is None
    # nobody left who can hold the model: nothing to re-plan to
    assert replan(one, [["a", "b"]], profiles("a"), {"b"}, DEMAND) is None
    # --clusters K is kept while the live nodes can form K, else as many as memory allows
    assert len(replan(grown, [["a", "b"], ["c", "d"]], profiles("abc"), {"d"}, DEMAND, 2).clusters) == 1
    # a plan is checked against the rule: another split of the same nodes is refused
    forged = RunPlan(2, (("a", "c"), ("b", "d")), ())
    assert forged != grown and not checks(forged, {p.peer_id: p for p in profiles("abcd")}, DEMAND)
    assert not checks(grown, {p.peer_id: p for p in profiles("abc")}, DEMAND)  # a profile is missing


@pytest.mark.timeout(60)
def test_a_standby_joins_the_first_cluster_that_claims_it():
    config = PipelineConfig("claims")

    async def main():
        net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
        ids = [str(p.transport.peer_id) for p in peers]
        standby, c0, c1, stranger = peers
        plan = RunPlan(1, ((ids[1],), (ids[2],)), (ids[0],))
        node = make_node(standby, config, plan, ids, HALF)
        method = RunNames(config.run_id).pipeline.claim

        async def claim(peer, version, cluster):
            reply = await peer.transport.call(standby.transport.peer_id, method, Claim(version, cluster).to_wire(),
                                              timeout=5)
            return Ack.from_wire(reply).ok

        both = await asyncio.gather(claim(c1, 1, "c1"), claim(c0, 1, "c0"))
        again = await claim(c1, 1, "c1"), await claim(c0, 1, "c0")
        stale = await claim(c0, 0 + 2, "c0")  # a version this node does not follow
        with pytest.raises(RemoteError, match="may not control 'c0'"):
            await claim(stranger, 1, "c0")
        await node.close()
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return both, again, stale

    both, again, stale = run_virtual(main())
    assert both == [True, False]  # first claim wins, the other cluster is refused
    assert again == (True, False) and stale is False


@pytest.mark.timeout(90)
def test_the_run_grows_a_cluster_for_late_nodes_and_replans_when_a_cluster_cannot_recover():
    """Nodes a, b plan one cluster (each holds half the model). Two more publish their profiles:
    the planner publishes version 2 with two clusters, the new one loading its layers from the old
    one. Then a node of the second cluster dies and nobody can replace it: version 3 has one
    cluster of the three live nodes, and it trains."""
    config = PipelineConfig("replan", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)

    async def main():
        net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        first, late = ids[:2], ids[2:]
        plan = RunPlan(1, (tuple(first),), ())
        nodes = {}
        fresh = {i: layer.state_dict() for i, layer in enumerate(make_layers(range(LAYERS)))}
        loaded: dict[str, list[bool]] = {}  # late node -> per layer of its first configure: not fresh

        def recorder(peer_id):
            def on_version(epoch, version, weights):
                if version == 0 and peer_id not in loaded:
                    worker = nodes[peer_id].worker
                    loaded[peer_id] = [any(not torch.equal(t, fresh[i][name]) for name, t in
                                           worker.layers[i].state_dict().items()) for i in sorted(worker.layers)]
            return on_version

        for peer_id in ids:
            node = make_node(by_id[peer_id], config, plan, ids, HALF, demand=DEMAND)
            if peer_id in late:
                node.worker.on_version = recorder(peer_id)
            await node.start()
            nodes[peer_id] = node
        for peer_id in first:
            await publish_profile(by_id[peer_id], config.run_id, NodeProfile(peer_id, 1.0, HALF))

        def on_version(version):
            return all(n.plan.version == version for p, n in nodes.items() if p in live)

        def trained(cluster, count):
            return any(n.worker.route is not None and n.worker.route.cluster == cluster and n.worker.route.last
                       and n.worker.stats.updates >= count for p, n in nodes.items() if p in live)

        live = set(ids)
        await _until(lambda: trained("c0", 20), 30, "the first cluster trains")
        updates_before = max(n.worker.stats.updates for n in nodes.values())
        for peer_id in late:
            await publish_profile(by_id[peer_id], config.run_id, NodeProfile(peer_id, 1.0, HALF))
        await _until(lambda: on_version(2), 30, "every node follows plan version 2")
        grown = nodes[ids[0]].plan
        await _until(lambda: trained("c0", updates_before + 10) and trained("c1", 10), 60,
                     "both clusters of version 2 train")
        victim = max(grown.clusters[1])
        live.discard(victim)
        net.crash(by_id[victim].transport.peer_id)
        await _until(lambda: on_version(3), 60, "every live node follows plan version 3")
        shrunk = nodes[ids[0]].plan
        updates = {p: n.worker.stats.updates for p, n in nodes.items()}
        await _until(lambda: any(n.worker.route is not None and n.worker.route.last and n.plan.version == 3
                                 and n.worker.stats.updates >= updates[p] + 20 for p, n in nodes.items() if p in live),
                     60, "the cluster of version 3 trains")
        for peer_id, node in nodes.items():
            if peer_id in live:
                await node.close()
                await by_id[peer_id].dht.ashutdown()
                await by_id[peer_id].transport.close()
        return first, late, grown, shrunk, victim, loaded

    first, late, grown, shrunk, victim, loaded = run_virtual(main())
    assert grown.version == 2 and len(grown.clusters) == 2 and sorted(grown.nodes) == sorted(first + late)
    assert shrunk.version == 3 and len(shrunk.clusters) == 1
    assert sorted(shrunk.nodes) == sorted(set(first + late) - {victim})
    # every late node that got layers in version 2 loaded trained weights from the first cluster
    assert loaded and all(all(flags) for flags in loaded.values()), loaded


@pytest.mark.timeout(60)
def test_a_new_node_takes_a_published_plan_only_if_its_nodes_run():
    """An earlier run's plan, left in the DHT under the same run id, is not adopted (its nodes do not
    answer); a plan whose nodes answer is, the newest version first."""
    from types import SimpleNamespace

    from potluck.cli.pipeline_run import RUNNING_WAIT, _running_plan
    from potluck.net.identity import Identity

    async def main():
        net, peers = await make_swarm(3, latency=0.002, bandwidth=None)
        me, *running = peers
        ids = [str(p.transport.peer_id) for p in running]
        gone = [str(Identity.generate().peer_id) for _ in range(2)]

        async def pong(request, ctx):
            return Ack().to_wire()

        for peer in running:
            peer.transport.add_handler(RunNames("r").pipeline.control, pong)
        node = SimpleNamespace(transport=me.transport, peer_id=str(me.transport.peer_id))
        old = RunPlan(3, (tuple(sorted(gone)),), ())
        live = RunPlan(1, (tuple(sorted(ids)),), ())
        newer = RunPlan(2, (tuple(sorted(ids)),), ())
        loop = asyncio.get_running_loop()
        started = loop.time()
        stale = await _running_plan(node, "r", {gone[0]: old, gone[1]: old})
        waited = loop.time() - started
        taken = await _running_plan(node, "r", {gone[0]: old, ids[0]: live, ids[1]: newer})
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return stale, waited, taken, newer

    stale, waited, taken, newer = run_virtual(main())
    assert stale is None and waited >= RUNNING_WAIT  # asked again for a while, then left alone
    assert taken == newer  # the newest plan whose nodes run


@pytest.mark.timeout(60)
def test_two_clusters_that_need_the_one_standby_at_once_do_not_both_take_it():
    """Two clusters of three that each need all three (a third of the model per node) lose a node
    each at the same moment; the plan has one standby. It joins one cluster only; the other cannot
    recover (here: no re-planning), and no layout names the standby twice."""
    config = PipelineConfig("one-standby", staleness_bound=4, average_every=0, message_timeout=5,
                            emulate_compute=True)
    third = 13_000  # 2 of the 6 equal layers per node (as in test_pipeline_election)

    async def main():
        net, peers = await make_swarm(7, latency=0.002, bandwidth=None)
        by_id = {str(p.transport.peer_id): p for p in peers}
        ids = sorted(by_id)
        plan = RunPlan(1, (tuple(ids[0:6:2]), tuple(ids[1:6:2])), (ids[6],))
        nodes = {}
        for peer_id in ids:
            node = make_node(by_id[peer_id], config, plan, ids, third)
            await node.start()
            nodes[peer_id] = node
        controllers = [nodes[min(c)] for c in plan.clusters]
        await _until(lambda: all(f"c{i}" in n.controllers and n.controllers[f"c{i}"].partition is not None
                                 for i, n in enumerate(controllers)), 20, "both clusters have their controller")
        victims = [max(c) for c in plan.clusters]
        for victim in victims:
            net.crash(by_id[victim].transport.peer_id)
        standby = nodes[ids[6]].worker
        await _until(lambda: standby.route is not None and standby.stats.updates >= 10, 30, "the standby trains")
        await asyncio.sleep(5)  # time for the other cluster to try, too
        stages = [[s.peer for s in n.controllers[f"c{i}"].stages] for i, n in enumerate(controllers)]
        claimed = nodes[ids[6]]._claimed
        for peer_id, node in nodes.items():
            if peer_id not in victims:
                await node.close()
                await by_id[peer_id].dht.ashutdown()
                await by_id[peer_id].transport.close()
        return stages, ids[6], claimed, standby.route.cluster

    stages, spare, claimed, joined = run_virtual(main())
    assert sum(spare in s for s in stages) == 1  # one cluster took it, the other did not
    assert claimed == (1, joined)
