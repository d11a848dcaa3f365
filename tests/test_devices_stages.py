"""Pipeline stages and parameter-server workers with models in another dtype than the wire's
float32 (bfloat16 here; `scripts/gpu_check.py` runs the same on CUDA): what crosses the wire goes
through host copies (`core.staging.to_host`), what arrives goes to the module's device and dtype,
read from its parameters (`core.staging.module_place`), and the results are those of training
the same model in one process.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.core.staging import module_place, to_host
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.harness import launch_run
from potluck.pipeline.profiling import LayerCost
from potluck.pipeline.stage import PipelineConfig
from potluck.ps import ServerConfig, start_parameter_servers
from potluck.ps.worker import PSClient, train_worker
from tests.emulated_swarm import make_swarm

LAYERS, WIDTH, BATCH, UPDATES, LR = 4, 16, 8, 6, 0.05
DATA_X = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(3))
DATA_Y = torch.randint(0, WIDTH, (64,), generator=torch.Generator().manual_seed(4))


def make_layers(indices) -> list[torch.nn.Module]:
    out = []
    for i in indices:
        torch.manual_seed(100 + i)
        layer = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
        out.append(layer.to(torch.bfloat16))
    return out


def source(cluster: int):
    def draw(mb: int):
        idx = torch.randint(0, 64, (BATCH,), generator=torch.Generator().manual_seed(1000 * cluster + mb))
        return DATA_X[idx], DATA_Y[idx]
    return draw


def sgd(params):
    return torch.optim.SGD(params, LR)


def train_alone(cluster: int) -> list[torch.Tensor]:
    model = torch.nn.Sequential(*make_layers(range(LAYERS)))
    opt = sgd(model.parameters())
    draw = source(cluster)
    for mb in range(UPDATES):
        x, y = draw(mb)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_module_place_and_host_copies():
    assert module_place(torch.nn.Linear(2, 2).to(torch.bfloat16)) == (torch.device("cpu"), torch.bfloat16)
    assert module_place(torch.nn.Linear(2, 2, device="meta")) == (torch.device("meta"), torch.float32)
    assert module_place(torch.nn.ReLU()) == (torch.device("cpu"), torch.float32)
    t = torch.randn(3, 4).to(torch.bfloat16).t()
    same, copied = to_host([t]), to_host([t], copy=True)  # copy: the queued-copy path devices take
    assert same[0] is not t and same[0].data_ptr() == t.data_ptr()
    assert copied[0].data_ptr() != t.data_ptr() and torch.equal(copied[0], t) and copied[0].dtype == torch.bfloat16


@pytest.mark.timeout(60)
def test_bfloat16_pipeline_stages_train_as_one_process_and_ring_average_in_float32():
    """Two clusters of two bfloat16 stages, one micro-batch in flight (sequential SGD): each
    stage's weights after UPDATES updates equal the one-process model's; then a ring round leaves
    both clusters at the float32 mean rounded once to bfloat16."""
    torch.set_num_threads(1)
    config = PipelineConfig("bf16-pipe", staleness_bound=1)
    snapshots: dict[tuple[str, int], list[torch.Tensor]] = {}

    def prepare(worker):
        def on_version(epoch, version, weights):
            snapshots[(worker.peer_id, version)] = [w.detach().clone() for w in weights.values()]
        worker.on_version = on_version

    async def main():
        net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
        run = await launch_run(peers, [[0, 1], [2, 3]], config, make_layers, LAYERS, sgd,
                               sample=DATA_X[:2], sources=[source(0), source(1)],
                               costs=[LayerCost(1e-3, 4096, 512)] * LAYERS, prepare=prepare)
        firsts = [run.worker_of(c, 0) for c in range(2)]
        await run.wait_until(lambda: all(w.stats.updates >= UPDATES for w in firsts), 30)
        for w in firsts:
            w.schedule.injection_paused = True
        await run.wait_until(lambda: all(w.idle for w in run.workers.values()), 30)
        routes = {(c, s): (run.worker_of(c, s).peer_id, run.worker_of(c, s).route) for c in range(2) for s in range(2)}
        before = {key: [p.detach().clone() for p in run.worker_of(*key).module.parameters()] for key in routes}
        applied = await asyncio.gather(*(w.average_round() for w in run.workers.values()))
        after = {key: [p.detach().clone() for p in run.worker_of(*key).module.parameters()] for key in routes}
        await run.close()
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return routes, before, after, applied

    routes, before, after, applied = run_virtual(main())
    assert all(applied)
    for c in range(2):
        alone = train_alone(c)
        for s in range(2):
            peer_id, route = routes[(c, s)]
            per_layer = 2  # weight and bias
            expected = alone[route.start * per_layer:route.end * per_layer]
            got = snapshots[(peer_id, UPDATES)]
            assert all(g.dtype == torch.bfloat16 for g in got)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=0, atol=0)
    for s in range(2):
        assert any(not torch.equal(a, b) for a, b in zip(before[(0, s)], before[(1, s)], strict=True))
        for a0, a1, b0, b1 in zip(after[(0, s)], after[(1, s)], before[(0, s)], before[(1, s)], strict=True):
            assert a0.dtype == torch.bfloat16 and torch.equal(a0, a1)
            torch.testing.assert_close(a0, ((b0.float() + b1.float()) / 2).bfloat16(), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_bfloat16_ps_worker_pushes_host_copies_and_trains_as_one_process():
    """A bfloat16 model behind two shard servers (sync, one worker): the servers keep host
    copies in the model's dtype and the worker's model ends where one process's SGD does."""
    torch.set_num_threads(1)

    def make_model():
        return torch.nn.Sequential(*make_layers(range(2)))

    async def main():
        net, peers = await make_swarm(3, latency=0.002, bandwidth=None)
        model = make_model()
        servers, layout = start_parameter_servers(peers[:2], "bf16-ps", list(model.parameters()), sgd,
                                                  ServerConfig(consistency="sync", num_workers=1), offload=False)
        client = PSClient(peers[2], "bf16-ps", layout, model.parameters(), timeout=10)
        await client.aregister()
        draw = source(0)
        batches = iter(draw(mb) for mb in range(UPDATES))
        done = await train_worker(client, model, lambda: (lambda x, y: (x.bfloat16(), y))(*next(batches)),
                                  UPDATES, offload=False)
        server_params = [p.detach().clone() for s in servers for p in s.params]
        for server in servers:
            server.shutdown()
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return done, model, server_params

    done, model, server_params = run_virtual(main())
    assert done == UPDATES
    reference = make_model()
    opt = sgd(reference.parameters())
    draw = source(0)
    for mb in range(UPDATES):
        x, y = draw(mb)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x.bfloat16()), y).backward()
        opt.step()
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in server_params)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=0, atol=0)
