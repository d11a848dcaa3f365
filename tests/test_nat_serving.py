"""Serving from behind NAT beyond experts and state (issue 16): parameter-server shards and pipeline
stages, on the emulated network under the virtual clock. The serving peers sit behind symmetric
("edm") NATs, so no hole punch can take the traffic off the relays: all of it crosses a relay."""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.net.emulated import EmulatedNetwork
from potluck.pipeline.harness import launch_run
from potluck.pipeline.stage import PipelineConfig
from potluck.ps import PSClient, ServerConfig, start_parameter_servers
from potluck.ps.worker import train_worker
from tests.emulated_swarm import run_on_shared_runner
from tests.test_nat_swarm import natted_peer, public_peers, shutdown
from tests.test_pipeline_net import COSTS, LAYERS, WIDTH, make_layers, source_for


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def batches(index: int):
    generator = torch.Generator().manual_seed(index)

    def next_batch():
        x = torch.randn(8, 16, generator=generator)
        return x, (x[:, :4].argmax(dim=1))
    return next_batch


@pytest.mark.timeout(60)
def test_parameter_server_shards_behind_nat_serve_workers_through_relays():
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.005, seed=11)
        peers = await public_peers(network, 3, relays=2)
        servers_at = [await natted_peer(network, peers[:3], nat="edm") for _ in range(2)]
        worker_peers = [peers[2], await natted_peer(network, peers[:3], nat="edm")]
        everyone = peers + servers_at + worker_peers[1:]
        try:
            assert all(p.transport.reachability == "relayed" for p in servers_at + worker_peers[1:])
            servers, layout = start_parameter_servers(
                servers_at, "nat-ps", list(make_mlp().parameters()),
                lambda p: torch.optim.SGD(p, 0.1), ServerConfig("sync", num_workers=2), offload=False)
            models = [make_mlp() for _ in worker_peers]
            clients = [PSClient(p, "nat-ps", layout, m.parameters()) for p, m in zip(worker_peers, models)]
            await asyncio.gather(*(c.aregister() for c in clients))
            steps = 20
            done = await asyncio.wait_for(asyncio.gather(*(
                train_worker(c, m, batches(i), steps, offload=False)
                for i, (c, m) in enumerate(zip(clients, models)))), 120)
            assert done == [steps, steps]
            assert [s.step for s in servers] == [steps, steps]  # each shard applied every round
            await asyncio.gather(*(c.apull() for c in clients))
            for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert torch.equal(a, b)
            assert not all(torch.equal(a, b) for a, b in zip(models[0].parameters(), make_mlp().parameters()))
            natted_worker = worker_peers[1].transport
            for server in servers_at:  # both ends NATed (symmetric): only the relays carry them
                links = [c for c in natted_worker.open_connections() if c.peer_id == server.transport.peer_id]
                assert links and all(c.relayed for c in links)
            for server in servers:
                server.shutdown()
        finally:
            await shutdown(everyone)
    run_on_shared_runner(scenario())


@pytest.mark.timeout(60)
def test_pipeline_stages_behind_nat_train_through_relays():
    """One Ravnest cluster of three stages, the last two behind symmetric NATs: activations and
    gradients to and between them cross the relays, and the pipeline learns."""
    async def scenario() -> None:
        network = EmulatedNetwork(latency=0.002, seed=13)
        peers = await public_peers(network, 3, relays=2)
        natted = [await natted_peer(network, peers[:3], nat="edm") for _ in range(2)]
        nodes = [peers[2], *natted]
        run_ = None
        try:
            run_ = await launch_run(nodes, [[0, 1, 2]], PipelineConfig("stale", staleness_bound=3),
                                    make_layers, LAYERS, lambda p: torch.optim.SGD(p, lr=0.5),
                                    sample=torch.zeros(2, WIDTH), sources=[source_for(0)], costs=COSTS)
            last = run_.worker_of(0, 2)
            await run_.wait_until(lambda: last.stats.updates >= 150, 60)
            losses = list(last.stats.losses)
            first, final = sum(losses[:30]) / 30, sum(losses[-30:]) / 30
            assert final < 0.8 * first, (first, final)
            links = [c for c in natted[0].transport.open_connections() if c.peer_id == natted[1].transport.peer_id]
            assert links and all(c.relayed for c in links)  # stage 1 -> stage 2 through a relay
        finally:
            if run_ is not None:
                await run_.close()
            await shutdown(peers + natted)
    run_on_shared_runner(scenario())
