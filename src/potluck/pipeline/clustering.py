"""Cluster formation: group nodes into clusters that each hold the whole model, balanced in speed.

Objective (stated once, used by the solver, the exhaustive check and `potluck pipeline plan`):
a cluster's throughput estimate, in samples/s, is

    T(c) = min( sum_{i in c} flops_i / work,  min_{i != j in c} bandwidth_ij / activation_bytes )

(its pooled compute if the model is split in proportion to speed, capped by the slowest link an
activation may have to cross). Every cluster must hold the model: sum_{i in c} memory_i >=
memory_needed. We **maximize the smallest T(c)** over the K clusters: the clusters average
their weights in lock-step rings, so the slowest cluster sets the pace, and a balanced
partition is what maximizes it. Among plans with the same objective, the one with the fewest
assigned nodes wins (a second MILP, with the first's optimum as a constraint): a node that would
not raise the minimum becomes a standby, ready to replace a failed node.

Algorithm: exact mixed-integer programs (scipy `milp`, HiGHS, solved to a 1e-9 gap), deterministic:
x[i,c] in {0,1} (node i in cluster c), t >= 0; maximize t subject to
sum_c x[i,c] <= 1; sum_i x[i,c] >= 1; sum_i memory_i x[i,c] >= memory_needed;
t <= sum_i (flops_i / work) x[i,c]; and for each pair with a slow link,
t <= bandwidth_ij / activation_bytes + M (2 - x[i,c] - x[j,c]). Symmetric clusters are
canonicalised afterwards (ordered by their first node), so the answer is a pure function of the input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from potluck.core.errors import PotluckError
from potluck.pipeline.profiling import NodeProfile

__all__ = ["ClusterPlan", "ClusteringError", "cluster_throughput", "form_clusters", "exhaustive_clusters",
           "plan_objective"]

# HiGHS gives up after this long; the MILP has K*n binaries and solves in milliseconds for the
# tens of nodes a pipeline run has. Hitting the limit means the input is far outside that.
MILP_TIME_LIMIT = 30.0
# Plans within this relative distance of the best min T(c) count as ties (solver round-off);
# among them the one with the fewest nodes in clusters wins.
TIE_TOLERANCE = 1e-9
# Solve to optimality: HiGHS's default relative gap (1e-4) would leave the tie-break undecided.
MIP_GAP = 1e-9


class ClusteringError(PotluckError):
    """No grouping satisfies the constraints (e.g. not enough memory for even one cluster)."""


@dataclass(frozen=True)
class ModelDemand:
    """What one copy of the model needs: compute per sample, bytes between stages, memory."""

    work: float              # FLOPs (or seconds on a 1-FLOP/s node) per sample, forward + backward
    activation_bytes: float  # bytes per sample crossing a stage boundary (the largest boundary)
    memory: float            # bytes for weights + grads + optimizer state + stashes + activations


@dataclass
class ClusterPlan:
    clusters: list[list[str]]  # peer ids per cluster
    standby: list[str]
    objective: float           # min_c T(c), samples/s
    throughputs: list[float]   # T(c) per cluster


def _link(a: NodeProfile, b: NodeProfile) -> float:
    """A link is as fast as the slower of the two directions measured."""
    return min(a.bandwidth_to(b.peer_id), b.bandwidth_to(a.peer_id))


def cluster_throughput(members: Sequence[NodeProfile], demand: ModelDemand) -> float:
    """T(c) of the module docstring; 0 for an empty cluster or one that cannot hold the model."""
    if not members or sum(m.memory for m in members) < demand.memory:
        return 0.0
    compute = sum(m.flops for m in members) / demand.work
    links = [_link(a, b) / demand.activation_bytes for a, b in itertools.combinations(members, 2)]
    return min([compute, *links])


def plan_objective(clusters: Sequence[Sequence[NodeProfile]], demand: ModelDemand) -> float:
    return min(cluster_throughput(c, demand) for c in clusters) if clusters else 0.0


def _canonical(nodes: Sequence[NodeProfile], groups: list[list[int]], demand: ModelDemand) -> ClusterPlan:
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    used = {i for g in groups for i in g}
    clusters = [[nodes[i].peer_id for i in g] for g in groups]
    throughputs = [cluster_throughput([nodes[i] for i in g], demand) for g in groups]
    return ClusterPlan(clusters, [n.peer_id for i, n in enumerate(nodes) if i not in used],
                       min(throughputs), throughputs)


def form_clusters(nodes: Sequence[NodeProfile], demand: ModelDemand, k: int | None = None) -> ClusterPlan:
    """Group `nodes` into `k` clusters (default: as many as memory allows) maximizing min T(c)."""
    nodes = sorted(nodes, key=lambda n: n.peer_id)
    if k is None:
        k = int(sum(n.memory for n in nodes) // demand.memory) if demand.memory > 0 else len(nodes)
        k = min(k, len(nodes))
        for candidate in range(k, 0, -1):
            try:
                return form_clusters(nodes, demand, candidate)
            except ClusteringError:
                continue
        raise ClusteringError(f"{len(nodes)} nodes with {sum(n.memory for n in nodes) / 2**20:.0f} MiB in all "
                              f"cannot hold one copy of the model ({demand.memory / 2**20:.0f} MiB)")
    if k < 1 or k > len(nodes):
        raise ClusteringError(f"cannot form {k} clusters from {len(nodes)} nodes")
    from scipy.optimize import Bounds, LinearConstraint, milp  # on first use: slow to import at start-up
    n = len(nodes)
    nv = n * k + 1  # x[i,c] at i*k + c, then t
    # Throughputs are scaled so the fastest node's is 1: HiGHS is exact on well-scaled numbers.
    scale = max(p.flops for p in nodes) / demand.work
    speed = np.array([p.flops / demand.work for p in nodes]) / scale
    big_m = float(speed.sum()) + 1.0
    mem_scale = max(demand.memory, 1.0)
    rows, lo, hi = [], [], []

    def add(coeffs: dict[int, float], low: float, high: float) -> None:
        row = np.zeros(nv)
        for idx, value in coeffs.items():
            row[idx] += value
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for i in range(n):
        add({i * k + c: 1.0 for c in range(k)}, 0, 1)
    for c in range(k):
        add({i * k + c: 1.0 for i in range(n)}, 1, np.inf)
        add({i * k + c: nodes[i].memory / mem_scale for i in range(n)}, demand.memory / mem_scale, np.inf)
        add({nv - 1: 1.0, **{i * k + c: -speed[i] for i in range(n)}}, -np.inf, 0)
        for i, j in itertools.combinations(range(n), 2):
            cap = _link(nodes[i], nodes[j]) / demand.activation_bytes / scale
            if cap < big_m:  # only links that could be the bottleneck need a constraint
                add({nv - 1: 1.0, i * k + c: big_m, j * k + c: big_m}, -np.inf, cap + 2 * big_m)
    integrality = np.ones(nv)
    integrality[-1] = 0
    upper = np.ones(nv)
    upper[-1] = big_m
    bounds = Bounds(np.zeros(nv), upper)
    options = {"time_limit": MILP_TIME_LIMIT, "mip_rel_gap": MIP_GAP}
    objective = np.zeros(nv)
    objective[-1] = -1.0  # first: the best min T(c)
    result = milp(objective, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
                  bounds=bounds, options=options)
    if result.x is None or result.status not in (0, 1):
        raise ClusteringError(f"no way to form {k} clusters that each hold the model: {result.message}")
    # then, keeping that optimum, as few nodes as possible in clusters: the rest become standbys
    best = float(result.x[-1])
    rows.append(np.eye(nv)[-1])
    lo.append(best * (1 - TIE_TOLERANCE))
    hi.append(np.inf)
    fewest = milp(np.r_[np.ones(nv - 1), 0.0], constraints=LinearConstraint(np.array(rows), lo, hi),
                  integrality=integrality, bounds=bounds, options=options)
    if fewest.x is not None and fewest.status in (0, 1):
        result = fewest
    x = np.round(result.x[:-1]).reshape(n, k)
    groups = [[i for i in range(n) if x[i, c] > 0.5] for c in range(k)]
    return _canonical(nodes, groups, demand)


def exhaustive_clusters(nodes: Sequence[NodeProfile], demand: ModelDemand, k: int) -> float:
    """The best objective over every assignment (node -> cluster or standby): the test oracle."""
    nodes = sorted(nodes, key=lambda n: n.peer_id)
    best = -math.inf
    for assignment in itertools.product(range(k + 1), repeat=len(nodes)):
        groups = [[nodes[i] for i, a in enumerate(assignment) if a == c] for c in range(k)]
        if any(not g or sum(m.memory for m in g) < demand.memory for g in groups):
            continue
        best = max(best, plan_objective(groups, demand))
    if best == -math.inf:
        raise ClusteringError("infeasible")
    return best
