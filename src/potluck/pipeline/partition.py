"""Partitioning: split a model's layers into contiguous stages, one per node of a cluster.

Inputs are *measured*: each layer's forward+backward seconds per sample on a reference node
(`profiling.profile_layers`), scaled by each node's measured FLOP/s; bytes per layer; link
bandwidths. A stage's period is max(its compute time, the time to send its boundary activation
to the next node): sends overlap with compute, so the slower of the two sets the pace. For a
fixed node order a dynamic program finds the contiguous split that minimizes the largest period
(the pipeline's bottleneck) within every node's memory. Node orders are searched exhaustively for
small clusters (the boundary terms then pick the fastest links), greedily for big ones.

`sequential_layers` turns an `nn.Sequential`, or any model `torch.fx` can trace, into the list of
layers the partitioner cuts between.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from potluck.core.errors import PotluckError
from potluck.pipeline.profiling import LayerCost, NodeProfile

__all__ = ["PartitionError", "Stage", "Partition", "partition_layers", "sequential_layers", "stage_memory"]

# Exhaustive node-order search up to this cluster size (7! = 5040 orders, each a small DP).
MAX_EXHAUSTIVE_ORDER = 7
# Memory per parameter byte: the weight, its gradient, and two Adam moments.
STATE_FACTOR = 4


class PartitionError(PotluckError):
    """The layers cannot be split over these nodes (too few layers, or not enough memory)."""


@dataclass(frozen=True)
class Stage:
    peer_id: str
    start: int  # first layer index
    end: int    # one past the last layer index


@dataclass
class Partition:
    stages: list[Stage]
    bottleneck: float            # seconds per sample of the slowest stage or link
    periods: list[float]         # per stage: max(compute, outgoing transfer), seconds per sample


def stage_memory(costs: Sequence[LayerCost], start: int, end: int, in_flight: int, stashes: int) -> float:
    """Bytes a stage needs: state of its weights, stashed versions, and in-flight activations."""
    params = sum(c.param_bytes for c in costs[start:end])
    activations = sum(c.activation_bytes for c in costs[start:end])
    return params * STATE_FACTOR + params * stashes + activations * in_flight


def _split(order: Sequence[NodeProfile], costs: Sequence[LayerCost], reference_flops: float,
           in_flight: int, stashes: int) -> tuple[float, list[int], list[float]] | None:
    """Best contiguous split for one node order: (bottleneck, stage end indices, periods) or None."""
    n, layers = len(order), len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c.seconds)
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(n + 1)]
    cut = [[-1] * (layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        node = order[s - 1]
        for j in range(s, layers - (n - s) + 1):
            out_time = 0.0
            if s < n:
                out_time = costs[j - 1].activation_bytes / max(node.bandwidth_to(order[s].peer_id), 1e-9)
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or stage_memory(costs, i, j, in_flight, stashes) > node.memory:
                    continue
                period = max((prefix[j] - prefix[i]) * reference_flops / node.flops, out_time)
                value = max(best[s - 1][i], period)
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[n][layers] == inf:
        return None
    ends, j = [], layers
    for s in range(n, 0, -1):
        ends.append(j)
        j = cut[s][j]
    ends.reverse()
    starts = [0, *ends[:-1]]
    periods = []
    for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
        out = costs[b - 1].activation_bytes / order[s].bandwidth_to(order[s + 1].peer_id) if s + 1 < n else 0.0
        periods.append(max((prefix[b] - prefix[a]) * reference_flops / order[s].flops, out))
    return best[n][layers], ends, periods


def _greedy_order(nodes: Sequence[NodeProfile]) -> list[NodeProfile]:
    """Start from the fastest node, then always continue over the fastest link."""
    left = sorted(nodes, key=lambda p: (-p.flops, p.peer_id))
    order = [left.pop(0)]
    while left:
        nxt = max(left, key=lambda p: (order[-1].bandwidth_to(p.peer_id), p.peer_id))
        left.remove(nxt)
        order.append(nxt)
    return order


def partition_layers(costs: Sequence[LayerCost], nodes: Sequence[NodeProfile], reference_flops: float,
                     in_flight: int = 4, stashes: int = 2) -> Partition:
    """Split the layers over all `nodes` (one stage each), minimizing the bottleneck period.

    `reference_flops` is the FLOP/s of the node that measured `costs`; `in_flight` micro-batches of
    activations and `stashes` stashed weight versions are budgeted in each node's memory.
    """
    if len(nodes) > len(costs):
        raise PartitionError(f"{len(nodes)} nodes but only {len(costs)} layers: each stage needs a layer")
    nodes = sorted(nodes, key=lambda p: p.peer_id)
    orders = itertools.permutations(nodes) if len(nodes) <= MAX_EXHAUSTIVE_ORDER else [_greedy_order(nodes)]
    best = None
    for order in orders:
        found = _split(order, costs, reference_flops, in_flight, stashes)
        if found is not None and (best is None or found[0] < best[0][0]):
            best = (found, order)
    if best is None:
        raise PartitionError("no split fits every node's memory; add nodes or reduce the model")
    (bottleneck, ends, periods), order = best
    starts = [0, *ends[:-1]]
    stages = [Stage(p.peer_id, a, b) for p, a, b in zip(order, starts, ends, strict=True)]
    return Partition(stages, bottleneck, periods)


class _Segment(nn.Module):
    """A run of traced graph nodes with one input and one output."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def sequential_layers(model: nn.Module) -> list[nn.Module]:
    """The layers to cut between: the children of an `nn.Sequential`, or, for any other model,
    the pieces of its `torch.fx` graph between points where exactly one value is live (so a
    residual block stays whole)."""
    if isinstance(model, nn.Sequential):
        return list(model)
    from torch.fx import symbolic_trace
    from torch.fx.passes.split_module import split_module

    traced = symbolic_trace(model)
    nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise PartitionError(f"a pipelined model takes one input tensor, this one takes {len(placeholders)}")
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {}
    for node in [*placeholders, *nodes]:
        users = [position.get(u, len(nodes)) for u in node.users]
        last_use[node] = max(users, default=-1)
    blocks, block = {}, 0
    for i, node in enumerate(nodes):
        blocks[node] = block
        live = [n for n in [*placeholders, *nodes[:i + 1]] if last_use[n] > i]
        if len(live) == 1 and live[0] is node:
            block += 1
    split = split_module(traced, model, lambda n: blocks[n])
    children = [getattr(split, name) for name in sorted((n for n, _ in split.named_children()),
                                                          key=lambda s: int(s.rsplit("_", 1)[1]))]
    return [_Segment(c) for c in children]


def boundary_shapes(layers: Sequence[nn.Module], sample_shape: Sequence[int]) -> list[list[int]]:
    """Per-sample shapes at every boundary: [input of layer 0, ..., output of the last layer].

    Runs a one-sample batch through `layers` copied to the meta device, so no memory is used.
    """
    import copy
    x = torch.empty(1, *sample_shape, device="meta")
    shapes = [list(sample_shape)]
    for layer in layers:
        x = copy.deepcopy(layer).to("meta")(x)
        shapes.append(list(x.shape[1:]))
    return shapes
