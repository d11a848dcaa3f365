"""Strangers calling a pipeline's stages (issue 14: a stranger's `configure` was accepted, so it
could name itself a stage's neighbour and read its weights, and `end=200000` built 200,000 layers).
Each attack below was accepted before; now each is refused with an error that says what and why,
and the honest pipeline trains on. One cluster of three stages on the emulated network; the
stranger is a fourth peer of the same swarm (it has a DHT, an authenticated id, and can call
every stage by id), but no stage of the run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.harness import PipelineRun, launch_run
from potluck.pipeline.messages import Activation, Configure, FailureReport, GetLayers, Gradient, Route
from potluck.pipeline.profiling import LayerCost
from potluck.pipeline.ring import PartKey, RingPart
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm

LAYERS = 6
WIDTH = 16
COSTS = [LayerCost(1e-3, 1000, WIDTH * 4)] * LAYERS  # equal layers: each of 3 stages gets 2
EVIL_MB = 10**9  # the micro-batch id the stranger's data uses


class CountingLayers:
    """`make_layers` that records every layer index it is asked to build; layers past the model are
    tiny, so code that builds them anyway (the old code) fails on the test's assertion rather than
    on memory."""

    def __init__(self) -> None:
        self.built: list[int] = []

    def __call__(self, indices: Any) -> list[nn.Module]:
        out: list[nn.Module] = []
        for i in indices:
            self.built.append(i)
            torch.manual_seed(1000 + i)
            if i >= LAYERS:
                out.append(nn.Linear(1, 1, bias=False))
            else:
                out.append(nn.Linear(WIDTH, 4) if i == LAYERS - 1 else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
        return out


def source(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(mb)
    x = torch.randn(8, WIDTH, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()


class Scene:
    """A running pipeline (one cluster, stages 0-2), its controller, and a stranger's transport."""

    def __init__(self, peers: list, run: PipelineRun, layers: CountingLayers):
        self.peers, self.run, self.layers = peers, run, layers
        self.controller = run.controllers[0]
        self.stranger = peers[-1].transport
        self.names = RunNames(self.controller.config.run_id).pipeline

    def stage(self, index: int):
        return self.run.worker_of(0, index)

    async def trains(self, updates: int, timeout: float = 30) -> None:
        """Every stage does `updates` more optimizer steps (within `timeout` of the virtual clock)."""
        workers = [self.stage(i) for i in range(3)]
        base = [w.stats.updates for w in workers]
        try:
            await self.run.wait_until(lambda: all(w.stats.updates >= b + updates for w, b in zip(workers, base)),
                                      timeout)
        except TimeoutError:
            raise AssertionError(f"the honest pipeline did not do {updates} more updates in {timeout} s") from None

    async def close(self) -> None:
        await self.run.close()
        for p in self.peers:
            await p.dht.ashutdown()
            await p.transport.close()


async def scene(name: str, **config: Any) -> Scene:
    net, peers = await make_swarm(4, latency=0.002, bandwidth=None)
    layers = CountingLayers()

    def prepare(worker) -> None:
        worker.trace = []  # (kind, micro-batch, version) of every forward and backward

    run = await launch_run(peers[:3], [[0, 1, 2]], PipelineConfig(name, staleness_bound=2, **config), layers,
                           LAYERS, lambda p: torch.optim.SGD(p, lr=0.05), sample=torch.zeros(2, WIDTH),
                           sources=[source], costs=COSTS, prepare=prepare)
    return Scene(peers, run, layers)


def evil_route(s: Scene, target) -> Route:
    """What the stranger wants `target` to be: the whole model, a newer epoch, the stranger as
    its previous stage (so it receives the gradients) and as the source of every layer."""
    me = str(s.stranger.peer_id)
    return Route(epoch=target.route.epoch + 1, cluster="c0", stage=1, start=0, end=LAYERS, prev_peer=me,
                 next_peer=target.route.next_peer, in_shape=(WIDTH,), out_shape=target.route.out_shape,
                 controller=me, report_method=None, sources={i: (me,) for i in range(LAYERS)})


@pytest.mark.timeout(60)
def test_a_strangers_configure_is_refused_and_the_stage_is_unchanged():
    async def main():
        s = await scene("configure")
        target = s.stage(1)
        await s.trains(3)
        route, layers, built = target.route, dict(target.layers), len(s.layers.built)
        with pytest.raises(RemoteError, match="configure refused: .*controller") as refused:
            await s.stranger.call(target.transport.peer_id, s.names.control,
                                  Configure(evil_route(s, target)).to_wire(), timeout=10)
        # what the stage holds and obeys is what the controller gave it: same route, same layers
        assert target.route is route and target.layers == layers
        assert len(s.layers.built) == built  # nothing built for the stranger
        await s.trains(10)
        assert target.route is route and not s.controller.events
        await s.close()
        return str(refused.value)

    error = run_virtual(main())
    assert "not from" in error and len(error) < 400


@pytest.mark.timeout(60)
def test_an_absurd_layer_range_is_refused_when_parsed_whoever_sends_it():
    async def main():
        s = await scene("absurd")
        target = s.stage(1)
        built = len(s.layers.built)
        honest = s.controller.transport
        errors = []
        # within MAX_STAGE_LAYERS (4096) but past the model (accepted before: built 4000 or 64 layers),
        # and the observed end=200000
        for start, end in [(196_000, 200_000), (0, 64), (0, 200_000)]:
            bad = dict(target.route.to_wire(), epoch=target.route.epoch + 1, start=start, end=end, sources={})
            for caller in (honest, s.stranger):  # the controller itself cannot ask for it either
                with pytest.raises(RemoteError, match="past the model's 6 layers") as refused:
                    await caller.call(target.transport.peer_id, s.names.control,
                                      {"op": "configure", "route": bad}, timeout=10)
                errors.append(str(refused.value))
        assert len(s.layers.built) == built and max(s.layers.built) < LAYERS  # no layer past the model
        route = target.route
        await s.trains(5)
        assert target.route is route
        await s.close()
        return errors

    for error in run_virtual(main()):
        assert "MalformedMessage" in error and "route" in error  # refused at parse time, before anything else


@pytest.mark.timeout(60)
def test_a_strangers_activations_and_gradients_are_refused_while_the_pipeline_trains():
    async def main():
        s = await scene("data")
        first, middle, last = s.stage(0), s.stage(1), s.stage(2)
        await s.trains(3)
        _, y = source(7)
        epoch = middle.route.epoch
        activation = Activation(epoch, EVIL_MB, {"data": torch.full((8, WIDTH), 100.0)}, y).to_wire()
        # the pipeline drained, so what refuses the stranger is who it is, not a queue full of honest work
        first.schedule.injection_paused = True
        await s.run.wait_until(lambda: all(w.idle for w in (first, middle, last)), 30)
        for stage in (middle, last):
            with pytest.raises(RemoteError, match="activation refused: .*previous stage"):
                await s.stranger.call(stage.transport.peer_id, s.names.forward, activation, timeout=10)
        # nor does it wait for an epoch the stage has not reached: that would hold the call open
        ahead = Activation(epoch + 1, EVIL_MB, {"data": torch.zeros(8, WIDTH)}, y).to_wire()
        with pytest.raises(RemoteError, match=f"epoch {epoch + 1} refused: .*newer epoch"):
            await s.stranger.call(middle.transport.peer_id, s.names.forward, ahead, timeout=10)
        first.schedule.injection_paused = False
        first._wake.set()
        # a gradient for a micro-batch the first stage has sent on and awaits: only the next stage's counts
        await s.run.wait_until(lambda: bool(first._saved), 30)
        waiting = next(iter(first._saved))
        gradient = Gradient(epoch, waiting, {"data": torch.full((8, WIDTH), 1e6)}).to_wire()
        with pytest.raises(RemoteError, match="gradient refused: .*next stage"):
            await s.stranger.call(first.transport.peer_id, s.names.backward, gradient, timeout=10)
        with pytest.raises(RemoteError, match="gradient refused: .*next stage"):
            await s.stranger.call(middle.transport.peer_id, s.names.backward, gradient, timeout=10)
        await s.trains(20)  # nothing honest was lost: every micro-batch of the honest stages went through
        stats = [(w.stats.expired, [t for t in w.trace if t[1] == EVIL_MB]) for w in (first, middle, last)]
        await s.close()
        return stats

    for expired, evil in run_virtual(main()):
        assert expired == 0 and evil == []  # no honest micro-batch expired; the stranger's was never computed


@pytest.mark.timeout(60)
def test_a_stranger_cannot_read_a_stages_weights():
    async def main():
        s = await scene("weights")
        target = s.stage(1)
        await s.trains(3)
        held = tuple(sorted(target.layers))
        with pytest.raises(RemoteError, match="get_layers refused"):
            await s.stranger.call(target.transport.peer_id, s.names.control, GetLayers(held).to_wire(), timeout=10)
        await s.trains(5)
        await s.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_strangers_ring_data_and_failure_reports_are_refused():
    async def main():
        s = await scene("ring", average_every=2)
        target = s.stage(1)
        await s.trains(3)
        me, them = str(s.stranger.peer_id), str(target.transport.peer_id)
        part = RingPart(PartKey(target.ring.round, 2, 4, 0, f"{me},{them}", 0, 0), torch.zeros(1000)).to_wire()
        with pytest.raises(RemoteError, match="ring part refused"):
            await s.stranger.call(target.transport.peer_id, s.names.ring, part, timeout=10)
        assert not target.ring._mailbox
        # a failure report naming a live member only costs a ping, but it is a member's call
        report = FailureReport(them, s.controller.epoch).to_wire()
        with pytest.raises(RemoteError, match="failure report refused"):
            await s.stranger.call(s.controller.transport.peer_id, s.names.report("c0"), report, timeout=10)
        await s.trains(5)
        assert not s.controller.events
        await s.close()

    run_virtual(main())
