"""How much of the vector each peer reduces: DeDLOC's linear program over measured bandwidths.

Every non-aux member sends its whole vector except its own share and receives the averaged rest;
every reducer receives its share from every other sender and sends the result to every other
receiver. With fractions x_i (sum 1, zero for client members) the time of member i is bounded
by its upload and its download; we minimize the slowest member's time:

    minimize t  subject to  up_i(x) <= t * upload_i,  down_i(x) <= t * download_i
"""

from __future__ import annotations

import functools

import numpy as np

# Bandwidths below this (bytes/s) are treated as this, so a peer that measured nothing yet still
# gets a sane share instead of breaking the program.
MIN_BANDWIDTH = 1e5
# Relative slack when capping a member's time at the level found, so later rounds stay feasible.
CAP_TOLERANCE = 1e-6
# Shares below this are rounding noise from the tolerances above: dropped.
MIN_SHARE = 1e-4
# A small price on every member's time, so the solver reports each t_i tight, not just below T.
TIGHT = 1e-4
# No member reduces more than this many even shares (1 / reducing members): what a member
# reduces is what it could corrupt until verification catches it, and what the group waits
# for from it. Twice an even share still lets fast members carry most of a skewed group's load.
MAX_SHARE_FACTOR = 2.0
# Declared bandwidths are believed up to this multiple of the group's median: bandwidths are
# self-reported, so a member claiming a huge one would otherwise be given (nearly) the whole
# vector to reduce. Real spreads beyond 8x (a datacenter node among home peers) lose a little
# balance; a liar can take at most what a member 8x faster than the median would get.
BANDWIDTH_SPREAD = 8.0
# A group's split is accepted if its slowest member is at most this much slower than in the
# split a member computes itself: solvers (versions, platforms) may pick different optima, and
# part sizes are rounded to whole elements.
SPLIT_SLACK = 0.05
# Programs solved lately, kept with their answers: a stable group meets every round with the same
# roles and declared bandwidths, and the leader and every member each solve the group's program
# (9 ms of the event loop each, for 4 members of which one is a client: on a fast link, a good
# part of the round). A handful covers the groups one peer takes part in; each entry is a few
# numbers per member.
SOLVED_PROGRAMS = 32


def optimal_fractions(roles: list[str], upload: list[float], download: list[float] | None = None) -> list[float]:
    """Fraction of the vector each member reduces (0 for clients), minimizing the slowest member."""
    return list(_optimal_fractions(tuple(roles), tuple(map(float, upload)),
                                   None if download is None else tuple(map(float, download))))


@functools.lru_cache(maxsize=SOLVED_PROGRAMS)
def _optimal_fractions(roles: tuple[str, ...], upload: tuple[float, ...],
                       download: tuple[float, ...] | None) -> tuple[float, ...]:
    n = len(roles)
    if len(set(upload)) == 1 and (download is None or len(set(download)) == 1) and all(r == "node" for r in roles):
        return (1.0 / n,) * n  # equal nodes: the program's answer is the even split
    from scipy.optimize import linprog  # imported on first use: it costs half a second at start-up

    download = upload if download is None else download
    up = np.maximum(np.asarray(upload, dtype=float), MIN_BANDWIDTH)
    down = np.maximum(np.asarray(download, dtype=float), MIN_BANDWIDTH)
    scale = max(up.max(), down.max())  # times of order 1: solver tolerances are absolute
    up, down = up / scale, down / scale
    can_reduce = np.array([r != "client" for r in roles])
    if not can_reduce.any():
        raise ValueError("a group needs at least one member that is not a client")
    sends = np.array([r != "aux" for r in roles], dtype=float)  # aux members neither send nor receive
    senders, receivers = sends.sum(), sends.sum()
    # Variables: x_0..x_{n-1}, per-member times t_0..t_{n-1}, and the slowest time T.
    # Volumes are in units of the whole vector:
    #   up_i   = sends_i * (1 - x_i) + x_i * (receivers - sends_i)
    #   down_i = x_i * (senders - sends_i) + sends_i * (1 - x_i)
    # Minimizing T alone has many optima when one slow member dominates, so we go on
    # lexicographically: cap the members that set T, and minimize the slowest of the others,
    # until every member is capped. The work then spreads evenly over the fastest members.
    rows, rhs = [], []
    for i in range(n):
        for coefficient, bandwidth in (((receivers - sends[i]) - sends[i], up[i]),
                                       ((senders - sends[i]) - sends[i], down[i])):
            row = np.zeros(2 * n + 1)  # (coefficient * x_i + sends_i) / bandwidth <= t_i
            row[i] = coefficient / bandwidth
            row[n + i] = -1.0
            rows.append(row)
            rhs.append(-sends[i] / bandwidth)
    a_eq = [np.concatenate([np.ones(n), np.zeros(n + 1)])]
    cost = np.concatenate([np.zeros(n), np.full(n, TIGHT), [1.0]])  # keeps each t_i at its true time
    caps: dict[int, float] = {}
    x = None
    for _ in range(n):
        a_ub, b_ub = list(rows), list(rhs)
        for i in range(n):
            if i not in caps:  # t_i <= T
                row = np.zeros(2 * n + 1)
                row[n + i], row[2 * n] = 1.0, -1.0
                a_ub.append(row)
                b_ub.append(0.0)
        bounds = ([(0.0, max_share(roles) if can_reduce[i] else 0.0) for i in range(n)]
                  + [(0.0, caps.get(i)) for i in range(n)] + [(0.0, None)])
        result = linprog(cost, A_ub=np.array(a_ub), b_ub=np.array(b_ub), A_eq=np.array(a_eq), b_eq=[1.0],
                         bounds=bounds, method="highs")
        if not result.success:
            break
        x, slowest = result.x[:n], result.x[2 * n]
        newly = [i for i in range(n) if i not in caps and result.x[n + i] >= slowest * (1 - CAP_TOLERANCE)]
        for i in newly:
            caps[i] = slowest * (1 + CAP_TOLERANCE)
        if len(caps) == n or not newly:
            break
    if x is None:  # cannot happen for valid input; fall back to an even split
        share = 1.0 / can_reduce.sum()
        return tuple(share if c else 0.0 for c in can_reduce)
    x = np.where(x < MIN_SHARE, 0.0, x)
    return tuple(float(v) for v in x / x.sum())


def max_share(roles: list[str]) -> float:
    """The largest fraction of the vector one member may reduce (see MAX_SHARE_FACTOR)."""
    return min(1.0, MAX_SHARE_FACTOR / sum(r != "client" for r in roles))


def part_sizes(total: int, fractions: list[float], min_part: int = 1) -> list[int]:
    """Integer part sizes from fractions: they sum to `total`, and tiny shares are dropped."""
    if total == 0:
        return [0] * len(fractions)
    raw = [f * total for f in fractions]
    sizes = [int(r) if r >= min_part else 0 for r in raw]
    if not any(sizes):
        sizes[max(range(len(raw)), key=raw.__getitem__)] = total
        return sizes
    # Hand the rounding remainder to the largest parts, deterministically.
    remainder = total - sum(sizes)
    order = sorted((i for i, s in enumerate(sizes) if s), key=lambda i: (-(raw[i] - sizes[i]), i))
    k = 0
    while remainder > 0:
        sizes[order[k % len(order)]] += 1
        remainder -= 1
        k += 1
    return sizes


def clamp_bandwidths(values: list[float]) -> list[float]:
    """Self-reported bandwidths as the load split believes them: at least MIN_BANDWIDTH, at most
    BANDWIDTH_SPREAD times the group's median."""
    ceiling = BANDWIDTH_SPREAD * max(MIN_BANDWIDTH, float(np.median(values)))
    return [min(max(v, MIN_BANDWIDTH), ceiling) for v in values]


def balanced_parts(total: int, roles: list[str], upload: list[float], download: list[float]) -> list[int]:
    """The split a leader decides from its members' declared bandwidths (clamped)."""
    return part_sizes(total, optimal_fractions(roles, clamp_bandwidths(upload), clamp_bandwidths(download)))


def slowest_time(roles: list[str], upload: list[float], download: list[float], fractions: list[float]) -> float:
    """The time of the slowest member under a split (the program's objective), in vector units
    per byte/s, from clamped bandwidths."""
    up, down = clamp_bandwidths(upload), clamp_bandwidths(download)
    sends = [r != "aux" for r in roles]
    senders = receivers = sum(sends)
    times = [max((s * (1 - x) + x * (receivers - s)) / u, (x * (senders - s) + s * (1 - x)) / d)
             for s, x, u, d in zip(sends, fractions, up, down, strict=True)]
    return max(times)


def fair_split(parts: list[int], roles: list[str], upload: list[float], download: list[float]) -> bool:
    """Whether `parts` is a split the rule allows: no member above its maximal share, and the
    slowest member no slower (up to SPLIT_SLACK) than in the split computed here."""
    total = sum(parts)
    if total == 0:
        return True
    if max(parts) > max_share(roles) * total * (1 + SPLIT_SLACK) + 1:
        return False
    mine = balanced_parts(total, roles, upload, download)
    best = slowest_time(roles, upload, download, [p / total for p in mine])
    return slowest_time(roles, upload, download, [p / total for p in parts]) <= best * (1 + SPLIT_SLACK)
