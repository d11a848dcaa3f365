"""A pipeline node must not be able to control a cluster it could never be elected for.

Every node of a run's plan was accepted as a stage's controller and as a standby's claimant: an
ordinary member of cluster c1 configured a stage of c0 at a far epoch, naming itself controller
and previous stage (so the real controller's next configure was refused as superseded, for
good), and claimed the run's standby for a made-up cluster (so no real cluster could take it for
that plan version). Both now require a member or a standby of the cluster named (the nodes its
election can name), with the configured stage one of them too."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.messages import Ack, Configure
from potluck.pipeline.node import Claim
from potluck.pipeline.planning import RunPlan
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm
from tests.test_pipeline_election import _until, make_node


@pytest.mark.timeout(120)
def test_a_member_of_another_cluster_cannot_configure_a_stage():
    config = PipelineConfig("xcluster", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)

    async def main():
        _, peers = await make_swarm(6, latency=0.002, bandwidth=None)
        ids = sorted(str(p.transport.peer_id) for p in peers)
        plan = RunPlan(1, (tuple(ids[0::2]), tuple(ids[1::2])), ())
        by_id = {str(p.transport.peer_id): p for p in peers}
        nodes = {pid: make_node(peer, config, plan, ids) for pid, peer in by_id.items()}
        for node in nodes.values():
            await node.start()
        try:
            c0, c1 = plan.clusters
            await _until(lambda: "c0" in nodes[min(c0)].controllers and "c1" in nodes[min(c1)].controllers, 20,
                         "controllers")
            await _until(lambda: all(nodes[p].worker.route is not None for p in ids), 20, "configured")
            victim, attacker = max(c0), max(c1)
            old = nodes[victim].worker.route
            hostile = dataclasses.replace(old, epoch=old.epoch + 10_000, controller=attacker,
                                          prev_peer=attacker if old.prev_peer else None)
            control = RunNames(config.run_id).pipeline.control
            with pytest.raises(RemoteError, match="may not control"):
                await by_id[attacker].transport.call(by_id[victim].transport.peer_id, control,
                                                     Configure(hostile).to_wire(), timeout=10)
            assert nodes[victim].worker.route.epoch < old.epoch + 10_000
            await asyncio.sleep(1)
            real = dataclasses.replace(nodes[victim].worker.route, epoch=nodes[victim].worker.route.epoch + 1)
            await by_id[min(c0)].transport.call(by_id[victim].transport.peer_id, control, Configure(real).to_wire(),
                                                timeout=10)  # its own controller still configures it
        finally:
            for node in nodes.values():
                await node.close()
    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_standby_cannot_be_claimed_for_a_cluster_the_claimant_cannot_control():
    config = PipelineConfig("claim", staleness_bound=4, emulate_compute=True)

    async def main():
        _, peers = await make_swarm(5, latency=0.002, bandwidth=None)
        ids = sorted(str(p.transport.peer_id) for p in peers)
        by_id = {str(p.transport.peer_id): p for p in peers}
        standby = ids[4]
        plan = RunPlan(1, ((ids[0], ids[1]), (ids[2], ids[3])), (standby,))
        make_node(by_id[standby], config, plan, ids)  # its claim handler is all that is used
        claim = RunNames(config.run_id).pipeline.claim
        target = by_id[standby].transport.peer_id
        for bogus in ("c99", "c0"):  # a made-up cluster, and one the claimant (a member of c1) is not in
            with pytest.raises(RemoteError, match="may not control"):
                await by_id[ids[3]].transport.call(target, claim, Claim(1, bogus).to_wire(), timeout=5)
        agreed = await by_id[ids[0]].transport.call(target, claim, Claim(1, "c0").to_wire(), timeout=5)
        assert Ack.from_wire(agreed).ok  # c0's controller takes it
    run_virtual(main())
