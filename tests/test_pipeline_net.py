"""Ravnest pipeline over the emulated network: exact stashing, staleness, rings, recovery, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn
from torch.func import functional_call

from potluck.core import compat
from potluck.core.errors import RemoteError
from potluck.core.names import RunNames
from potluck.core.virtual_time import run_virtual
from potluck.pipeline.harness import launch_run
from potluck.pipeline.layout import Span
from potluck.pipeline.messages import Ack, Activation, Ping
from potluck.pipeline.profiling import LayerCost
from potluck.pipeline.ring import RingAllReduce, Segment, ring_segments
from potluck.pipeline.stage import PipelineConfig
from tests.emulated_swarm import make_swarm

LAYERS = 6
WIDTH = 16
COSTS = [LayerCost(1e-3, 1000, WIDTH * 4)] * LAYERS  # equal layers: 3 nodes get 2 each


def make_layers(indices):
    out = []
    for i in indices:
        torch.manual_seed(1000 + i)
        last = i == LAYERS - 1
        out.append(nn.Linear(WIDTH, 4) if last else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
    return out


def source_for(cluster: int):
    def source(mb: int):
        g = torch.Generator().manual_seed(cluster * 100_003 + mb)
        x = torch.randn(8, WIDTH, generator=g)
        return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return source


async def until(run, condition, timeout: float, what: str) -> None:
    """Wait until `condition()` holds, woken by the workers' progress, with a deadline (virtual clock)."""
    try:
        await run.wait_until(condition, timeout)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


async def start(n_clusters: int, config: PipelineConfig, nodes_per_cluster: int = 3, latency: float = 0.002,
                standby: int = 0, lr: float = 0.05, **kwargs):
    total = n_clusters * (nodes_per_cluster + standby)
    net, peers = await make_swarm(total, latency=latency, bandwidth=None)
    size = nodes_per_cluster + standby
    clusters = [list(range(c * size, c * size + nodes_per_cluster)) for c in range(n_clusters)]
    spares = [list(range(c * size + nodes_per_cluster, (c + 1) * size)) for c in range(n_clusters)]
    run = await launch_run(peers, clusters, config, make_layers, LAYERS, lambda p: torch.optim.SGD(p, lr=lr),
                           sample=torch.zeros(2, WIDTH), sources=[source_for(c) for c in range(n_clusters)],
                           costs=COSTS, standby=spares, **kwargs)
    return net, peers, run


async def stop(peers, run) -> None:
    await run.close()
    for p in peers:
        await p.dht.ashutdown()
        await p.transport.close()


@pytest.mark.timeout(60)
def test_backward_uses_the_weights_of_its_forward_exactly():
    """Every update of every stage equals a reference computation that uses, for each micro-batch,
    the weight versions its forward saw at each stage (recorded), so stashing is exact."""
    versions: dict[tuple[int, int], dict] = {}
    config = PipelineConfig("stash", staleness_bound=4, update_frequency=2)

    recorded: dict[str, dict] = {}

    def prepare(worker):
        worker.trace = []
        recorded[worker.peer_id] = {}
        worker.on_version = lambda epoch, v, params: recorded[worker.peer_id].__setitem__(
            v, {k: t.detach().clone() for k, t in params.items()})

    async def main():
        net, peers, run = await start(1, config, prepare=prepare)
        workers = [run.worker_of(0, s) for s in range(3)]
        await until(run, lambda: workers[0].stats.updates >= 15, 30, "stage 0 made 15 updates")
        traces = [list(w.trace) for w in workers]
        for s, w in enumerate(workers):
            for v, params in list(recorded[w.peer_id].items()):
                versions[(s, v)] = params
        routes = [(w.route.start, w.route.end) for w in workers]
        await stop(peers, run)
        return traces, routes

    traces, routes = run_virtual(main())
    forward_version = [{mb: v for kind, mb, v in t if kind == "forward"} for t in traces]
    stage_modules = [nn.Sequential(*make_layers(range(a, b))) for a, b in routes]
    lag = 0
    checked = 0
    for s in range(3):
        backwards = [(mb, v) for kind, mb, v in traces[s] if kind == "backward"]
        for k in range(len(backwards) // 2):
            group = backwards[2 * k: 2 * k + 2]
            if (s, k + 1) not in versions or any(mb not in fv for mb, _ in group for fv in forward_version):
                break  # the run was stopped before everything this update needs was recorded
            grad = None
            for mb, v in group:
                lag = max(lag, k - v)
                assert v == forward_version[s][mb]
                x, y = source_for(0)(mb)
                params = [{n: t.clone().requires_grad_() for n, t in versions[(t_, forward_version[t_][mb])].items()}
                          for t_ in range(3)]
                h = x
                for t_ in range(3):
                    h = functional_call(stage_modules[t_], params[t_], (h,))
                loss = nn.functional.cross_entropy(h, y)
                g = torch.autograd.grad(loss, list(params[s].values()))
                grad = g if grad is None else [a + b for a, b in zip(grad, g)]
            expected = {n: w - 0.05 * gr / 2 for (n, w), gr in zip(versions[(s, k)].items(), grad)}
            for n, value in versions[(s, k + 1)].items():
                assert torch.allclose(value, expected[n], atol=1e-6, rtol=1e-5), (s, k, n)
            checked += 1
    assert checked >= 20
    assert lag >= 1  # micro-batches really did run on stale versions, so stashing mattered


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["none", "fp16", "blockwise8"])
def test_staleness_never_exceeds_the_bound_and_compressed_links_still_learn(codec):
    config = PipelineConfig("stale", staleness_bound=3, update_frequency=1, compression=codec)

    async def main():
        net, peers, run = await start(1, config, lr=0.5)
        workers = [run.worker_of(0, s) for s in range(3)]
        await until(run, lambda: workers[0].stats.updates >= 150, 30, "150 updates")
        stats = [w.report() for w in workers]
        losses = list(workers[2].stats.losses)
        await stop(peers, run)
        return stats, losses

    stats, losses = run_virtual(main())
    assert stats[0].max_in_flight == 3  # the bound is reached (zero bubble needs it)...
    assert all(s.max_in_flight <= 3 for s in stats)  # ...and never exceeded anywhere
    assert all(s.max_version_lag <= 3 for s in stats)
    first, last = sum(losses[:30]) / 30, sum(losses[-30:]) / 30
    assert last < 0.8 * first, (first, last)  # it learns through (de)compressed activations and gradients


async def ring_swarm(n: int):
    """`n` peers of one swarm (they find each other by id through the DHT) that answer the rings'
    "r.ping" probe."""
    net, peers = await make_swarm(n, latency=0.001, bandwidth=50e6)

    async def ping(request, ctx):
        return {"ok": True}
    for a in peers:
        a.transport.add_handler("r.ping", ping)
    return net, peers


def _vectors(n: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


@pytest.mark.timeout(60)
def test_multi_ring_allreduce_gives_the_exact_mean_per_stage():

    async def main():
        net, peers = await ring_swarm(7)
        ids = [str(p.transport.peer_id) for p in peers]
        rings = {i: RingAllReduce(p, "r", "r.ping", part_bytes=4096)  # several parts per chunk
                 for i, p in zip(ids, peers)}
        # three clusters split differently: segments, and a ring of 3 among them
        layouts = {"c0": [Span(ids[0], 0, 2), Span(ids[1], 2, 4), Span(ids[2], 4, 6)],
                   "c1": [Span(ids[3], 0, 3), Span(ids[4], 3, 6)],
                   "c2": [Span(ids[5], 0, 4), Span(ids[6], 4, 6)]}
        segments = ring_segments(layouts)
        data = {(s, m): v for s in segments for m, v in zip(s.members, _vectors(len(s.members), 10_007, s.start))}
        jobs = [rings[m].allreduce(0, s, data[(s, m)], timeout=30) for s in segments for m in s.members]
        results = await asyncio.gather(*jobs)  # every ring at once
        for p in peers:
            await p.dht.ashutdown()
            await p.transport.close()
        return segments, data, results

    segments, data, results = run_virtual(main())
    it = iter(results)
    for s in segments:
        exact = torch.stack([data[(s, m)] for m in s.members]).double().mean(0)
        outs = [next(it) for _ in s.members]
        for out, members in outs:
            assert members == list(s.members)
            assert torch.equal(out, outs[0][0])  # bit-identical on every member
            assert torch.allclose(out.double(), exact, atol=1e-6)


@pytest.mark.timeout(60)
def test_ring_reforms_without_a_member_that_dies_mid_round():
    async def main():
        net, peers = await ring_swarm(3)
        ids = [str(p.transport.peer_id) for p in peers]
        rings = [RingAllReduce(p, "r", "r.ping") for p in peers]
        seg = Segment(0, 1, tuple(ids))
        vecs = _vectors(3, 5000, 7)
        a = asyncio.ensure_future(rings[0].allreduce(0, seg, vecs[0], timeout=30))
        b = asyncio.ensure_future(rings[1].allreduce(0, seg, vecs[1], timeout=30))
        async with compat.timeout(10):
            while not rings[1]._mailbox:  # A's first part reached B: the round is under way
                await rings[1]._arrived.wait()
        net.crash(peers[2].transport.peer_id)  # C dies before sending anything
        (ra, ma), (rb, mb) = await asyncio.gather(a, b)
        for p in peers[:2]:
            await p.dht.ashutdown()
            await p.transport.close()
        return ra, rb, ma, vecs

    ra, rb, members, vecs = run_virtual(main())
    assert len(members) == 2
    assert torch.equal(ra, rb)
    assert torch.allclose(ra, (vecs[0] + vecs[1]) / 2, atol=1e-6)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("silent", [False, True], ids=["reset", "silent"])
def test_node_killed_mid_run_cluster_recovers_its_stage_from_the_other_cluster(silent):
    """A killed process (connections reset) or a machine gone silent (only deadlines notice)."""
    # emulated compute (16 ms per micro-batch per stage, virtual) keeps the pipeline from doing
    # thousands of real steps while deadlines run out on the virtual clock
    config = PipelineConfig("heal", staleness_bound=4, average_every=5, ring_timeout=20, message_timeout=5,
                            emulate_compute=True)

    async def main():
        net, peers, run = await start(2, config, heartbeat=0.5, failure_timeout=1.0)
        c0 = run.controllers[0]
        victim_peer, a, b = c0.stages[1]
        other = {p: (s, e) for p, s, e in run.controllers[1].stages}
        w0 = run.worker_of(0, 0)
        w1 = run.worker_of(1, 0)
        await until(run, lambda: w0.stats.updates >= 20 and w0.stats.rounds >= 2, 30, "training and averaging")
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        net.crash(run.workers[victim_peer].transport.peer_id, silent=silent)
        await until(run, lambda: c0.events, 10, "the failure is detected and the cluster recovers")
        event = c0.events[0]
        updates = w0.stats.updates
        updates_other = w1.stats.updates
        await until(run, lambda: w0.stats.updates >= updates + 20, 30, "cluster 0 trains again")
        await until(run, lambda: w1.stats.updates >= updates_other + 20, 30, "cluster 1 kept training")
        applied = {p: w.stats.rounds_applied for p, w in run.workers.items() if p != victim_peer}
        await until(run, lambda: all(run.workers[p].stats.rounds_applied >= n + 2 for p, n in applied.items()), 60,
                    "every surviving stage averages again (rings re-formed on the new layout)")
        survivors = [p for p, _, _ in c0.stages]
        await stop([p for p in peers if str(p.transport.peer_id) != victim_peer], run)
        return event, killed_at, victim_peer, (a, b), other, survivors

    event, killed_at, victim, (a, b), other, survivors = run_virtual(main())
    assert event.detected_at - killed_at <= 0.5 + 1.0 + 0.1  # heartbeat + failure deadline
    assert victim not in survivors and len(survivors) == 2
    assert event.stages[0].start == 0 and event.stages[-1].end == LAYERS
    assert set(event.fetched_from) == set(range(a, b))  # every lost layer came from the other cluster
    for layer, holder in event.fetched_from.items():
        first, end = other[holder]
        assert first <= layer < end


@pytest.mark.timeout(60)
def test_bad_messages_get_clear_errors_and_the_stage_keeps_serving():
    config = PipelineConfig("bad", staleness_bound=2)

    async def main():
        net, peers, run = await start(1, config)
        c0 = run.controllers[0]
        target = run.worker_of(0, 1)
        # bad input from the peers allowed to send each method (strangers: tests/adversarial):
        # activations from the previous stage, gradients from the next, control from the controller
        attacker = run.worker_of(0, 2).transport
        names = RunNames("bad").pipeline
        senders = {names.forward: run.worker_of(0, 0).transport, names.backward: attacker, names.control: c0.transport}
        pid = target.transport.peer_id
        epoch = target.route.epoch
        route = target.route.to_wire()
        errors = []
        # (method, request, what the error must say)
        bad = [
            (names.forward, "not a dict", "activation: not a map"),
            (names.forward, {"epoch": epoch, "mb": -1}, "'mb'"),
            (names.forward, {"epoch": epoch, "mb": 10**9, "x": {"name": "none", "bogus": 1}, "y": torch.zeros(2)},
             "activation"),
            (names.forward, {"epoch": epoch, "mb": 10**9, "x": {"data": torch.zeros(2, WIDTH + 1)},
                          "y": torch.zeros(2)}, "shape"),  # wrong shape
            (names.forward, {"epoch": epoch, "mb": 10**9, "x": {"data": torch.zeros(5000, WIDTH)},
                          "y": torch.zeros(5000)}, "shape"),  # oversized micro-batch
            (names.forward, {"epoch": epoch, "mb": 10**9, "x": {"data": torch.zeros(2, WIDTH, dtype=torch.int32)},
                          "y": torch.zeros(2)}, "floating"),  # wrong dtype
            (names.forward, {"epoch": epoch, "mb": 10**9, "x": {"data": torch.zeros(2, WIDTH)}, "y": [0, 1]},
             "'y'"),  # labels not a tensor
            (names.backward, {"epoch": epoch, "mb": 10**9, "g": {"data": torch.zeros(2, WIDTH)}}, "not waiting"),
            (names.control, {"op": "format_disk"}, "'op'"),
            (names.control, {"op": "get_layers", "layers": [0]}, "does not hold"),  # stage 0's
            (names.control, {"op": "get_layers", "layers": [99]}, "'layers'"),  # past the model's 6
            (names.control, {"op": "configure", "route": dict(route, start=4, end=7)}, "past the model's 6 layers"),
            (names.control, {"op": "get_layers", "layers": list(range(5000))}, "'layers'"),
            (names.control, {"op": "configure", "route": dict(route, end=200000)}, "'end'"),  # builds no 200k layers
            (names.control, {"op": "configure", "route": dict(route, next="not a peer")}, "'next'"),
        ]
        for method, request, _ in bad:
            with pytest.raises(RemoteError) as info:
                await senders[method].call(pid, method, request, timeout=5)
            errors.append(str(info.value))
        with pytest.raises(RemoteError) as info:  # the controller's method too
            await attacker.call(c0.transport.peer_id, names.report("c0"), {"op": "failure", "peer": 7}, timeout=5)
        errors.append(str(info.value))
        # a report naming a live peer is checked and ignored
        assert await attacker.call(c0.transport.peer_id, names.report("c0"),
                                   {"op": "failure", "peer": str(pid), "epoch": epoch}, timeout=5) == Ack().to_wire()
        w0 = run.worker_of(0, 0)
        before = w0.stats.updates
        await until(run, lambda: w0.stats.updates >= before + 10, 30, "training goes on")
        assert Ack.from_wire(await attacker.call(pid, names.control, Ping().to_wire(), timeout=5)) == Ack()
        assert not c0.events  # nobody was declared dead
        assert target.route.end - target.route.start == 2  # the refused route was not taken
        await stop(peers, run)
        return [expected for _, _, expected in bad], errors

    expected, errors = run_virtual(main())
    for want, error in zip(expected, errors):
        assert want in error, (want, error)
    assert "MalformedMessage" in errors[0] and "cluster report" in errors[-1] and "'peer'" in errors[-1]
    assert all(len(e) < 400 for e in errors)


@pytest.mark.timeout(60)
def test_lost_micro_batches_expire_instead_of_stalling_the_pipeline():
    """Every 7th activation is swallowed by its receiver: without expiry the first stage's
    in-flight slots would fill with micro-batches whose gradient never comes, and training stop."""
    config = PipelineConfig("lossy", staleness_bound=3, micro_batch_timeout=1.0)

    def prepare(worker):
        honest = worker._on_forward

        async def lossy(request, ctx):
            if Activation.from_wire(request).micro_batch % 7 == 3:
                return {"ok": True}  # acknowledged, then lost
            return await honest(request, ctx)
        worker.transport.add_handler(worker.fwd_method, lossy)

    async def main():
        net, peers, run = await start(1, config, prepare=prepare)
        first = run.worker_of(0, 0)
        await until(run, lambda: first.stats.updates >= 60, 60, "training goes on past lost micro-batches")
        stats = first.stats.expired, first.stash.versions_held, first.schedule.max_in_flight
        await stop(peers, run)
        return stats

    expired, versions_held, max_in_flight = run_virtual(main())
    assert expired >= 60 // 7 - 1
    assert max_in_flight <= 3 and versions_held <= 4  # expired micro-batches released their stashed weights


@pytest.mark.timeout(60)
def test_standby_takes_the_place_of_a_dead_node_when_survivors_cannot_hold_the_model():
    from potluck.pipeline.profiling import NodeProfile
    config = PipelineConfig("standby", staleness_bound=4, average_every=5, message_timeout=5)

    async def main():
        net, peers = await make_swarm(8, latency=0.002, bandwidth=None)
        # a layer needs 1000 B x (4 state + 2 stashes) + 64 B x 4 in flight = 6256 B: two fit per node
        profiles = {str(p.transport.peer_id): NodeProfile(str(p.transport.peer_id), 1.0, 13000) for p in peers}
        run = await launch_run(peers, [[0, 1, 2], [4, 5, 6]], config, make_layers,
                               LAYERS, lambda p: torch.optim.SGD(p, lr=0.05), sample=torch.zeros(2, WIDTH),
                               sources=[source_for(0), source_for(1)], costs=COSTS, standby=[[3], [7]],
                               profiles=profiles, heartbeat=0.5, failure_timeout=1.0)
        c0 = run.controllers[0]
        standby = c0.standby[0]
        await until(run, lambda: run.worker_of(0, 0).stats.updates >= 20, 30, "training")
        victim = c0.stages[1].peer
        net.crash(run.workers[victim].transport.peer_id)
        await until(run, lambda: c0.events, 10, "recovery")
        workers = [run.workers[p] for p, _, _ in c0.stages]
        base = [w.stats.backwards for w in workers]
        await until(run, lambda: all(w.stats.backwards >= b + 20 for w, b in zip(workers, base)), 30,
                    "every stage of the healed cluster trains")
        stages = list(c0.stages)
        await stop([p for p in peers if str(p.transport.peer_id) != victim], run)
        return standby, victim, stages

    standby, victim, stages = run_virtual(main())
    assert standby in [p for p, _, _ in stages] and victim not in [p for p, _, _ in stages]
    assert len(stages) == 3 and all(b - a == 2 for _, a, b in stages)  # still two layers per node
