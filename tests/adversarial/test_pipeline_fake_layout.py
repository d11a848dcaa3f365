"""A stranger publishing a cluster's layout (issue 17: `{run}.pipeline.layout` held one unsigned
subkey per cluster that anyone could overwrite). A layout naming the stranger as the cluster's
only stage, with a far newer epoch, made every reader take it: rings would average with the
stranger, stages would send it their weights (they give them to nodes the layouts name), and the
election would look for the cluster's controller among its members. Now a layout is stored only
under its writer's own signed subkey, and `potluck pipeline run`'s nodes read a cluster's layout
only from a node the plan lets control that cluster: the plain record is refused by the DHT, the
signed one ignored, and the cluster trains on with its own layout."""

from __future__ import annotations

import pytest

from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht import RecordRejected
from potluck.pipeline.layout import LAYOUT_TTL, Layout, LayoutDirectory, Span
from potluck.pipeline.messages import GetLayers
from potluck.pipeline.planning import RunPlan
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm
from tests.test_pipeline_election import _until, make_node
from tests.test_pipeline_net import LAYERS


@pytest.mark.timeout(60)
def test_a_strangers_layout_is_not_read_and_earns_it_no_weights():
    config = PipelineConfig("fake-layout", staleness_bound=4, average_every=0, message_timeout=5,
                            emulate_compute=True)

    async def main():
        net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
        stranger, peers = peers[0], peers[1:]
        ids = sorted(str(p.transport.peer_id) for p in peers)
        plan = RunPlan(1, (tuple(ids),), ())
        nodes = []
        for peer in peers:
            node = make_node(peer, config, plan, ids)
            await node.start()
            nodes.append(node)
        workers = [n.worker for n in nodes]
        await _until(lambda: all(w.route is not None for w in workers), 20, "the cluster is configured")
        last = next(w for w in workers if w.route.last)
        await _until(lambda: last.stats.updates >= 10, 30, "the cluster trains")

        me = str(stranger.transport.peer_id)
        fake = Layout(10**6, (Span(me, 0, LAYERS),))
        dht = stranger.dht
        key = RunNames(config.run_id).pipeline.layout
        # the old form: a plain subkey named after the cluster, expiring after the controller's entry
        try:
            plain_stored = await dht.astore(key, {**fake.to_wire(), "plan": 1}, dht.get_time() + LAYOUT_TTL + 60,
                                            subkey="c0")
        except RecordRejected:
            plain_stored = False
        # the new form, signed by the stranger: its own entry for cluster c0
        await LayoutDirectory(stranger, config.run_id).publish("c0", fake)

        read = [await w.directory.fetch_layouts() for w in workers]
        listed = [await w.directory.lists(stranger.transport.peer_id) for w in workers]
        refusals = []
        for w in workers:
            try:
                await stranger.transport.call(w.transport.peer_id, w.ctl_method, GetLayers((0,)).to_wire(),
                                              timeout=5)
                refusals.append(None)
            except RemoteError as e:
                refusals.append(str(e))
        updates = last.stats.updates
        await _until(lambda: last.stats.updates >= updates + 10, 30, "the cluster trains on")
        controllers = {n.me: sorted(n.controllers) for n in nodes}
        for node in nodes:
            await node.close()
        for p in [stranger, *peers]:
            await p.dht.ashutdown()
            await p.transport.close()
        return ids, me, plain_stored, read, listed, refusals, controllers

    ids, me, plain_stored, read, listed, refusals, controllers = run_virtual(main())
    assert not plain_stored  # the DHT refuses an unsigned layout entry
    for layouts in read:
        assert sorted(s.peer for s in layouts["c0"].stages) == ids and layouts["c0"].epoch < 10**6
    assert listed == [False] * len(ids)
    assert all(r is not None and "get_layers refused" in r for r in refusals), refusals
    assert controllers == {ids[0]: ["c0"], ids[1]: [], ids[2]: []}  # the lowest id still controls
