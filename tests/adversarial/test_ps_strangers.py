"""A parameter server's parameters belong to its run's workers (issue 14: a stranger pushed 3e38
into an async server, and every later step trained on garbage). Now a peer that is not a
registered worker of the run is refused, with a reason, before its request is even parsed; a
registered worker's push of absurd size (its norm overflows float32, or it is far above the
recent pushes) is refused too; the parameters stay as they were and the workers keep training.

The swarm runs on the emulated network under the virtual clock; the stranger is one more peer of
the same swarm, authenticated like everyone else (the transport proves its peer id), but unknown
to the run.
"""

from __future__ import annotations

import pytest
import torch

from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.ps import PSClient, ServerConfig, start_parameter_servers
from potluck.ps.simulation import RUN_ID, EmulatedPeer, PSSimulation

BATCH = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def batches(index: int):
    generator = torch.Generator().manual_seed(index)
    teacher = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))

    def next_batch():
        x = torch.randn(BATCH, 8, generator=generator)
        return x, (x @ teacher).argmax(1)
    return next_batch


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def unchanged(before: list[torch.Tensor], params) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


async def refused(transport, server, verb: str, request) -> str:
    with pytest.raises(RemoteError) as info:
        await transport.call(server, RunNames(RUN_ID).ps_shard(0, verb), request, timeout=5)
    assert info.value.remote_type in ("PSInputError", "MalformedMessage"), info.value
    return str(info.value)


@pytest.mark.timeout(60)
def test_a_strangers_push_is_refused_and_absurd_pushes_of_a_worker_too():
    async def scenario():
        sim = await PSSimulation.start(make_model, sgd, ServerConfig(consistency="async", num_workers=2), [0.01, 0.01],
                                       offload=False)
        stranger = await EmulatedPeer.start(sim.network, None, sim.workers[0])
        try:
            server, ps = sim.server_peers[0].transport.peer_id, sim.primary
            grads = [torch.full_like(p, 3e38) for p in ps.params]
            before, step = snapshot(ps.params), ps.step
            errors = {}
            # 1. the stranger: its push (of 3e38) is refused before it is parsed, and so are its
            #    pull and its attempt to register (both seats are taken by the run's two workers).
            errors["push"] = await refused(stranger.transport, server, "push", {"step": step, "grads": grads})
            errors["junk"] = await refused(stranger.transport, server, "push", "junk")
            errors["pull"] = await refused(stranger.transport, server, "pull", {})
            errors["register"] = await refused(stranger.transport, server, "register", {})
            assert unchanged(before, ps.params) and ps.step == step
            assert stranger.transport.peer_id not in ps.workers

            # 2. a registered worker: 3e38 (the norm's square overflows float32) and inf are refused.
            worker = sim.clients[0]
            with pytest.raises(RemoteError, match="gradient norm .* is above") as info:
                await worker.apush(grads)
            errors["huge"] = str(info.value)
            errors["inf"] = await refused(worker.transport, server, "push", {
                "step": step, "grads": [torch.full_like(p, float("inf")) for p in ps.params]})
            assert unchanged(before, ps.params) and ps.step == step

            # 3. the honest workers keep training ...
            await sim.run(batches, lambda: sim.applied() >= 40)
            assert ps.step >= 40 and all(bool(torch.isfinite(p).all()) for p in ps.params)
            # ... and once the server knows the scale of their pushes, one 1000 times larger is refused.
            scale = [torch.ones_like(p) * 1e3 for p in ps.params]
            normal = [p.grad if p.grad is not None else torch.zeros_like(p) for p in sim.clients[1].params]
            before, step = snapshot(ps.params), ps.step
            with pytest.raises(RemoteError, match="times the median norm") as info:
                await sim.clients[1].apush([g * s for g, s in zip(normal, scale, strict=True)])
            errors["outlier"] = str(info.value)
            assert unchanged(before, ps.params) and ps.step == step
            await sim.clients[1].apush(normal)  # the same worker, with its real gradient: served
            assert ps.step == step + 1 and ps.refused_pushes == 2
            return errors, str(stranger.transport.peer_id)
        finally:
            await stranger.close()
            await sim.close()
    errors, stranger = run_virtual(scenario())
    where = f"peer {stranger} is not a registered worker of run 'sim', shard 0"
    for verb in ("push", "junk", "pull", "register"):
        assert where in errors[verb], (verb, errors[verb])
    assert "all 2 worker seats are taken" in errors["register"]
    assert "its square overflows float32" in errors["huge"]
    assert "has non-finite values" in errors["inf"]
    assert "times the median norm" in errors["outlier"]


@pytest.mark.timeout(60)
def test_a_server_given_the_runs_workers_refuses_everyone_else_even_before_they_all_registered():
    """With `workers=` nobody can take a free seat by registering first."""
    async def scenario():
        from potluck.net.emulated import EmulatedNetwork

        network = EmulatedNetwork(latency=0.001)
        first = await EmulatedPeer.start(network, None, None)
        peers = [first] + [await EmulatedPeer.start(network, None, first) for _ in range(3)]
        server_peer, honest, late, stranger = peers
        try:
            model = make_model()
            workers = [honest.transport.peer_id, late.transport.peer_id]
            servers, layout = start_parameter_servers(
                [server_peer], RUN_ID, list(model.parameters()), sgd,
                ServerConfig(consistency="async", num_workers=2, registration_timeout=0.5), offload=False,
                workers=workers)
            ps, server = servers[0], server_peer.transport.peer_id
            errors = [await refused(stranger.transport, server, verb, {})
                      for verb in ("register", "pull")]  # a free seat would be there without the list
            client = PSClient(honest, RUN_ID, layout, make_model().parameters())
            await client.aregister()
            await client.apush([torch.ones_like(p) for p in client.params])
            errors.append(await refused(stranger.transport, server, "push",
                                        {"step": 1, "grads": [torch.ones_like(p) for p in ps.params]}))
            late_client = PSClient(late, RUN_ID, layout, make_model().parameters())  # listed: no registration needed
            await late_client.apush([torch.ones_like(p) for p in late_client.params])
            return errors, ps.step, str(stranger.transport.peer_id)
        finally:
            for peer in peers:
                await peer.close()
    errors, step, stranger = run_virtual(scenario())
    assert step == 2
    for error in errors:
        assert f"peer {stranger} is not a registered worker of run 'sim', shard 0" in error, error
        assert "fixed list of 2 workers" in error
