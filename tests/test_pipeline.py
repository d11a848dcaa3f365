"""Ravnest pipeline, pure logic: schedule rules, clustering objective, partitioning, stashing, rings."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from potluck.pipeline.clustering import (
    ClusteringError,
    ModelDemand,
    exhaustive_clusters,
    form_clusters,
    plan_objective,
)
from potluck.pipeline.layout import Span
from potluck.pipeline.partition import (
    PartitionError,
    boundary_shapes,
    partition_layers,
    sequential_layers,
)
from potluck.pipeline.profiling import LayerCost, NodeProfile, profile_layers
from potluck.pipeline.ring import ring_segments
from potluck.pipeline.schedule import StageSchedule, simulate
from potluck.pipeline.stash import StashedWeights


# -- schedule ------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_schedule_prefers_backward_and_respects_the_staleness_bound():
    s = StageSchedule(staleness_bound=2, update_frequency=2, first=True)
    t1 = s.next_task()
    s.forward_done(t1.micro_batch)
    t2 = s.next_task()
    s.forward_done(t2.micro_batch)
    assert (t1.kind, t2.kind) == ("forward", "forward")
    assert s.next_task() is None  # two in flight: the bound stops injection
    s.add_backward(t1.micro_batch)
    assert s.next_task() == type(t1)("backward", t1.micro_batch)
    assert s.backward_done(t1.micro_batch) is False  # update_frequency 2: not yet
    t3 = s.next_task()
    assert t3.kind == "forward" and t3.micro_batch == 2
    s.forward_done(t3.micro_batch)
    s.add_backward(t2.micro_batch)
    s.add_backward(t3.micro_batch)
    assert s.next_task().kind == "backward"  # backward first, even with injection allowed
    assert s.backward_done(t2.micro_batch) is True
    assert s.max_in_flight == 2
    with pytest.raises(KeyError):
        s.add_backward(99)


@pytest.mark.timeout(10)
def test_schedule_expires_micro_batches_whose_gradient_never_comes():
    s = StageSchedule(staleness_bound=2, first=True)
    for now in (0.0, 1.0):
        s.forward_done(s.next_task().micro_batch, now)
    assert s.next_task() is None and s.next_expiry(5.0) == 5.0
    assert s.expire(5.5, 5.0) == [0]  # only the older one
    assert s.next_task().micro_batch == 2  # its slot is free again
    s.add_backward(1)
    assert s.expire(100.0, 5.0) == []  # a gradient that arrived is never expired


@pytest.mark.timeout(10)
def test_simulated_async_pipeline_has_no_bubble_and_beats_gpipe():
    fwd, bwd = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    a = simulate(fwd, bwd, link=0.2, micro_batches=200, mode="async", staleness_bound=6)
    g = simulate(fwd, bwd, link=0.2, micro_batches=200, mode="gpipe", gpipe_micro_batches=4)
    assert min(a.utilization) > 0.95
    assert max(g.utilization) < 0.7  # (P - 1) / (M + P - 1) of every global batch is bubble
    assert a.throughput > 1.3 * g.throughput


# -- clustering ----------------------------------------------------------------------------------------
def random_nodes(rng: random.Random, n: int) -> list[NodeProfile]:
    nodes = [NodeProfile(f"p{i}", flops=rng.choice([1.0, 2.0, 3.0, 5.0]), memory=rng.choice([2, 3, 4, 6]))
             for i in range(n)]
    for a in nodes:
        for b in nodes:
            if a is not b and b.peer_id not in a.bandwidth:
                bw = rng.choice([1.0, 4.0, 10.0, 100.0])
                a.bandwidth[b.peer_id] = b.bandwidth[a.peer_id] = bw
    return nodes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(12))
def test_clustering_objective_equals_exhaustive_optimum(seed):
    rng = random.Random(seed)
    n, k = rng.choice([(4, 2), (5, 2), (6, 2), (6, 3), (5, 1)])
    nodes = random_nodes(rng, n)
    demand = ModelDemand(work=1.0, activation_bytes=rng.choice([0.5, 1.0, 2.0]), memory=rng.choice([4, 6]))
    try:
        best = exhaustive_clusters(nodes, demand, k)
    except ClusteringError:
        with pytest.raises(ClusteringError):
            form_clusters(nodes, demand, k)
        return
    plan = form_clusters(nodes, demand, k)
    by_id = {n.peer_id: n for n in nodes}
    assert plan_objective([[by_id[p] for p in c] for c in plan.clusters], demand) == pytest.approx(best, rel=1e-6)
    assert plan.objective == pytest.approx(best, rel=1e-6)
    assert len(plan.clusters) == k
    placed = [p for c in plan.clusters for p in c] + plan.standby
    assert sorted(placed) == sorted(by_id)  # each node exactly once


@pytest.mark.timeout(30)
def test_clustering_is_deterministic_and_picks_the_number_of_clusters_memory_allows():
    nodes = [NodeProfile(f"n{i}", flops=1.0 + i % 3, memory=10) for i in range(9)]
    demand = ModelDemand(work=1.0, activation_bytes=1.0, memory=25)
    a, b = form_clusters(nodes, demand), form_clusters(list(reversed(nodes)), demand)
    assert a.clusters == b.clusters
    assert len(a.clusters) == 3 and all(len(c) == 3 for c in a.clusters)
    with pytest.raises(ClusteringError, match="cannot hold"):
        form_clusters(nodes[:2], demand)
    equal = [NodeProfile(f"e{i}", flops=1.0, memory=10) for i in range(7)]
    plan = form_clusters(equal, demand)  # a 7th node would not raise the slowest cluster: standby
    assert [len(c) for c in plan.clusters] == [3, 3] and len(plan.standby) == 1


# -- partitioning --------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_partition_balances_measured_time_against_node_speed():
    costs = [LayerCost(1.0, 10, 1) for _ in range(6)]
    fast, slow = NodeProfile("a", flops=2.0, memory=10**6), NodeProfile("b", flops=1.0, memory=10**6)
    p = partition_layers(costs, [fast, slow], reference_flops=1.0)
    sizes = {s.peer_id: s.end - s.start for s in p.stages}
    assert sizes == {"a": 4, "b": 2} and p.bottleneck == pytest.approx(2.0)


@pytest.mark.timeout(30)
def test_partition_respects_memory_and_puts_boundaries_on_fast_links():
    costs = [LayerCost(1.0, 100, 1000) for _ in range(6)]
    nodes = [NodeProfile(x, flops=1.0, memory=10**6) for x in "abc"]
    slow_link = 1e3  # a<->c is slow: the order must avoid it
    for x in nodes:
        for y in nodes:
            if x is not y:
                x.bandwidth[y.peer_id] = slow_link if {x.peer_id, y.peer_id} == {"a", "c"} else 1e9
    p = partition_layers(costs, nodes, reference_flops=1.0, in_flight=1, stashes=1)
    order = [s.peer_id for s in p.stages]
    assert {order[0], order[2]} == {"a", "c"} and order[1] == "b"
    small = [NodeProfile("a", 1.0, memory=500 * 2), NodeProfile("b", 1.0, memory=10**6)]
    p = partition_layers(costs, small, reference_flops=1.0, in_flight=0, stashes=1)
    assert {s.peer_id: s.end - s.start for s in p.stages}["a"] == 2  # only 2 layers fit on a
    with pytest.raises(PartitionError):
        partition_layers(costs, [NodeProfile("a", 1.0, memory=10)], reference_flops=1.0)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + self.b(torch.relu(self.a(h)))  # no cut may separate a from the skip
        return self.out(h)


@pytest.mark.timeout(30)
def test_fx_traced_model_splits_only_where_one_value_is_live():
    model = Residual()
    layers = sequential_layers(model)
    x = torch.randn(5, 8)
    y = x
    for layer in layers:
        y = layer(y)
    assert torch.allclose(y, model(x))
    assert 2 <= len(layers) <= 5
    shapes = boundary_shapes(layers, [8])
    assert shapes[0] == [8] and shapes[-1] == [3]
    costs = profile_layers(layers, x)
    assert len(costs) == len(layers) and all(c.seconds > 0 for c in costs)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert sequential_layers(seq) == list(seq)


# -- stashing and rings --------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_stashed_weights_keep_a_version_while_it_is_used():
    m = nn.Linear(2, 2)
    stash = StashedWeights(m)
    v0, w0 = stash.acquire()
    before = w0["weight"].clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    v1 = stash.advance()
    assert stash.versions_held == 2 and torch.equal(w0["weight"], before)
    stash.release(v0)
    assert stash.versions_held == 1 and v1 == 1
    assert torch.equal(stash.acquire()[1]["weight"], m.weight.detach())


@pytest.mark.timeout(10)
def test_ring_segments_cover_differently_split_clusters():
    layouts = {"c0": [Span("a", 0, 2), Span("b", 2, 6)], "c1": [Span("x", 0, 3), Span("y", 3, 6)]}
    segs = ring_segments(layouts)
    assert [(s.start, s.end, s.members) for s in segs] == [
        (0, 2, ("a", "x")), (2, 3, ("b", "x")), (3, 6, ("b", "y"))]
