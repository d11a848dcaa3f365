"""Robust aggregation of one chunk's pieces at its reducer: CenteredClip and a trimmed mean.

A plain (weighted) mean follows any one sender anywhere: a member that sends 1e30 moves the
average by 1e30 / n. These aggregators bound what a minority of senders can do:

  * `trimmed_mean`: per coordinate, drop the `trimmed_count(n)` largest and as many smallest
    values and average the rest (each sender counts once). With at most that many malicious
    senders every result lies between the smallest and the largest honest value.
  * `centered_clip` (Karimireddy, He, Jaggi 2021; the aggregator of BTARD, Gorbunov et al.):
    from the coordinate-wise median v, repeat v <- v + mean_i clip(x_i - v, tau), where clip
    scales a difference down to norm tau. A sender moves v by at most tau / n per iteration,
    whatever it sends. tau follows the honest spread: CLIP_RADIUS times the median distance of
    the pieces from the current v, so honest pieces lie within it at the fixed point (the
    condition under which the result is within tau f / (n - f) of the honest mean). Each block
    of VERIFY_BLOCK elements is clipped alone, so that a block can be checked alone.

Both count senders, not their claims: each sender with a positive weight counts once (weights
are the senders' own word; even bounded, a malicious sender claiming the most it may would hold
2/5 of the weight with 2 of 8 senders instead of 1/4, near CenteredClip's breakdown).

Every peer that reduces the same pieces gets the same bits: the computation is elementwise
(correctly rounded IEEE operations), in a fixed sender order, with separate multiplies and adds
(no fused multiply-add, whose rounding differs between CPUs), sums of squares are taken by a fixed
pairwise tree of elementwise adds (torch's own reductions split work by thread count and SIMD
width), the median and the sort pick existing values, and the iteration count depends only on
those bits. When every piece equals x, both return x.

Bounding a liar does not name it: `far_pieces` does, for a piece blatantly far from the rest
(OUTLIER_FACTOR times the median distance from the robust centre, over a reducer's shard; see
allreduce.reducer.ShardReducer._name).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from potluck.averaging.accountability import VERIFY_BLOCK

AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")
# CenteredClip's radius tau: this many times the median distance of the pieces from the current
# estimate v, recomputed at every iteration. While fewer than half the senders lie, that median is
# an honest sender's distance, and in high dimensions honest pieces of one step all lie at about
# the same distance from their mean (within a few percent, concentration of the norm). A radius of
# 1.25 medians holds them unclipped at the fixed point, which is then the honest pieces' mean plus
# the clipped liars' pull: at most tau f / n. A radius below 1 clips honest pieces too, and in
# high dimensions their clipped pulls point apart while the liars' point one way, so a far liar
# pulls a full tau every iteration (measured: 0.5 medians, measured from the coordinate-wise
# median, gave 2 of 5 liars 0.75 honest spreads per round; benchmarks/byzantine.py, docs/security.md).
CLIP_RADIUS = 1.25
# Rows up to which order statistics come from a sorting network of elementwise minimums and
# maximums (`lower_median`, `trimmed_mean`): 63 comparators for 16; beyond, torch's median is as
# fast. Against torch's sort along the rows, 45x faster for 4 rows of 787,500 values and 18x for 8.
NETWORK_ROWS = 16
# CenteredClip's iterations at most: with the honest pieces unclipped, each iteration shrinks the
# distance to the fixed point by a factor of at most f / n (the clipped liars' share), so from the
# median start 10 leave it within 1e-3 of the radius even with f / n = 1/2 (the BTARD paper's
# experiments converge within about 10).
CLIP_ITERATIONS = 10
# CenteredClip stops early once an iteration moves v by at most this fraction of tau.
CLIP_TOLERANCE = 1e-3
# CenteredClip iterates over this many values at a time (senders x elements, whole blocks): each
# iteration passes over the pieces, their differences and their squares several times, and a
# group's (2 MiB a tensor) stays in the CPU's caches between passes. 2-3x faster than one group
# of all blocks for 4 x 787,500 values (benchmarks/aggregation.py); fewer groups cost more calls.
CLIP_GROUP_ELEMENTS = 1 << 19
# Trimmed mean: the fraction of senders dropped at each end of every coordinate (rounded up,
# see `trimmed_count`): a quarter tolerates 1 malicious of 4 and 2 of 8.
TRIM_FRACTION = 0.25
# A piece is named as blatantly not honest (`far_pieces`) when its distance from the robust centre
# is above this many times the median distance of the pieces. Honest pieces of one model at one
# step differ by batch noise and local steps: their distances from the centre stay within a small
# factor of each other (the farthest of 4 to 16 i.i.d. pieces is at most 1.07 x the median; data
# that differs between peers spreads them more). A piece 100 times as far is not a gradient or a
# state of the same model; a liar that stays nearer is bounded, not named.
OUTLIER_FACTOR = 100.0
# Pieces named only among at least this many: with three, one liar that copies an honest piece
# holds the median distance near zero and makes the third, honest piece look far.
MIN_PIECES_TO_NAME = 4


def trimmed_count(n: int) -> int:
    """Values dropped at each end of a coordinate among `n`: at least TRIM_FRACTION of them
    (rounded up), leaving at least one value (three senders: the median; two: none dropped)."""
    return min(math.ceil(n * TRIM_FRACTION - 1e-9), (n - 1) // 2)


def aggregate(kind: str, pieces: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor,
              measure: bool = False) -> dict[int, float]:
    """Write into `out` the robust aggregate `kind` of `pieces` (flat float32 tensors of `out`'s
    size), each counted once. Zero-weight pieces take no part, unless every weight is zero
    (then all do), as in the weighted mean. With `measure`: the distance of each piece that took
    part (by its index) from the robust centre (CenteredClip's start, the coordinate-wise median,
    whose distances it computes anyway; the trimmed mean's result, one more pass)."""
    indices = [i for i, w in enumerate(weights) if w > 0] or list(range(len(pieces)))
    kept = [pieces[i] for i in indices]
    if not kept:
        out.zero_()
        return {}
    if kind == "centered_clip":
        distances = centered_clip(kept, out)
    elif kind == "trimmed_mean":
        distances = trimmed_mean(kept, out, measure)
    else:
        raise ValueError(f"unknown robust aggregation {kind!r}; choose from {AGGREGATIONS[1:]}")
    return dict(zip(indices, distances, strict=True)) if measure else {}


def far_pieces(distances: Mapping[Any, float]) -> tuple[float, list[Any]]:
    """The lower median of `distances` and the keys of those above OUTLIER_FACTOR times it. None
    among fewer than MIN_PIECES_TO_NAME, nor when the median is 0 (most pieces sit on the centre:
    no honest spread to compare with, and a piece one honest step away would look infinitely far)."""
    if len(distances) < MIN_PIECES_TO_NAME:
        return 0.0, []
    median = sorted(distances.values())[(len(distances) - 1) // 2]
    if not median > 0:
        return median, []
    return median, [k for k, d in distances.items() if d > OUTLIER_FACTOR * median]


def trimmed_mean(pieces: Sequence[torch.Tensor], out: torch.Tensor, measure: bool = False) -> list[float]:
    """Coordinate-wise trimmed mean of `pieces` into `out` (see the module docstring); with
    `measure`, the distance of each piece from it (else [])."""
    k = trimmed_count(len(pieces))
    rows = _sorted_rows(list(pieces)) if k else list(pieces)
    _running_mean(rows[k:len(pieces) - k], out)
    if not measure:
        return []
    return [math.sqrt(s) for s in _row_sums_of_squares(torch.stack(list(pieces)).sub_(out))]


def centered_clip(pieces: Sequence[torch.Tensor], out: torch.Tensor) -> list[float]:
    """CenteredClip of `pieces` into `out` (see the module docstring), block by block: each
    VERIFY_BLOCK elements from the start of `out` (the last block may be shorter) are clipped
    alone. A member that checks a reducer's work then recomputes one block from one block of
    every sender, as under the elementwise aggregations, instead of a whole chunk from every
    sender (which cost about three times the all-reduce's bytes on slow links). 4096 dimensions
    still concentrate honest distances, as CLIP_RADIUS relies on, and a liar's pull is bounded
    in every block. Blocks are clipped CLIP_GROUP_ELEMENTS at a time (the same bits: each block's
    result depends on that block alone).
    Returns the distance of each piece from the coordinate-wise median it starts from."""
    n, width = len(pieces), out.shape[0]
    full = width // VERIFY_BLOCK * VERIFY_BLOCK
    squares = [0.0] * n
    if full:
        blocks = [p[:full].reshape(-1, VERIFY_BLOCK) for p in pieces]
        count = full // VERIFY_BLOCK
        starts = torch.empty(n, count, dtype=torch.float64)
        group = max(1, CLIP_GROUP_ELEMENTS // (n * VERIFY_BLOCK))
        for lo in range(0, count, group):
            hi = min(count, lo + group)
            v, sums = _clip_blocks(torch.stack([b[lo:hi] for b in blocks]))  # the group's copy
            out[lo * VERIFY_BLOCK:hi * VERIFY_BLOCK].copy_(v.reshape(-1))
            starts[:, lo:hi] = sums
        squares = starts.sum(dim=1).tolist()
    if width > full:
        v, sums = _clip_blocks(torch.stack([p[full:] for p in pieces]).unsqueeze(1))
        out[full:].copy_(v.reshape(-1))
        squares = [a + b for a, b in zip(squares, sums.sum(dim=1).tolist(), strict=True)]
    return [math.sqrt(s) for s in squares]


def _clip_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CenteredClip of each block of `x` (senders x blocks x elements) alone: the blocks' results
    (blocks x elements), and the squared distances (float64, senders x blocks) of each piece from
    the start. Blocks advance together but each by its own radius and coefficients, and stops on
    its own: a block's bits do not depend on the other blocks beside it.
    Few, whole-tensor ops per iteration (their count, not their size, is the cost of the small
    shards of a fast link, and each one hands the GIL to other threads): one product of all the
    differences by their coefficients, the senders' terms added in a fixed order (identical bits
    on every CPU), and one sum of squares for both the next differences and the step's length."""
    n = x.shape[0]
    v = lower_median(x)  # an existing value of each coordinate
    rows = x.new_empty(n + 1, *x.shape[1:])  # the differences x - v, then the last step
    diff, step = rows[:n], rows[n]
    sums = _SquareSums(n + 1, x.shape[1], x.shape[2], x.device)  # each row's sum alone: the same bits as one by one
    torch.sub(x, v, out=diff)
    step.zero_()
    squares = start = sums(rows)[:n]  # senders x blocks
    terms = torch.empty_like(x)
    active = np.ones(v.shape[0], dtype=bool)
    for _ in range(CLIP_ITERATIONS):
        # The radius and coefficients, senders x blocks of float64, in numpy (in host memory):
        # its elementwise operations are IEEE-exact like torch's, at a fraction of the cost per call.
        norms = np.sqrt(squares.cpu().numpy())
        tau = CLIP_RADIUS * np.sort(norms, axis=0)[(n - 1) // 2]  # per block
        with np.errstate(divide="ignore", invalid="ignore"):
            # coefficient of each piece in its block: 1/n, scaled down to pull by at most tau
            coefficients = np.where(norms <= tau, 1.0, tau / norms) / n
            # a difference beyond float32 (norm inf) counts 0 (inf x 0 would be NaN)
            coefficients = np.where(np.isfinite(norms) & (norms > 0), coefficients, 0.0)
            active &= np.isfinite(tau) & (coefficients * norms > 0).any(axis=0)  # else v stays as it is
        if not active.any():
            break
        c32 = torch.from_numpy(coefficients.astype(np.float32)).to(x.device).unsqueeze(2)
        torch.mul(diff, c32, out=terms)
        zero = c32 == 0
        if zero.any():
            terms.masked_fill_(zero, 0.0)
        step.zero_()
        for i in range(n):  # fixed sender order, separate adds: identical bits on every CPU
            step.add_(terms[i])
        if active.all():
            v.add_(step)
        else:
            v = torch.where(torch.from_numpy(active).to(x.device).unsqueeze(1), v + step, v)
        torch.sub(x, v, out=diff)
        both = sums(rows)
        squares = both[:n]
        moved = np.sqrt(both[n].cpu().numpy())
        active &= ~(moved <= CLIP_TOLERANCE * tau)
    return v, start


def lower_median(x: torch.Tensor) -> torch.Tensor:
    """The lower median along the first dimension (the value of rank (n - 1) // 2): by a sorting
    network up to NETWORK_ROWS rows (4-6x faster than torch's median for 4-8 rows), torch's median
    beyond. An order statistic: the same value either way."""
    n = x.shape[0]
    if n > NETWORK_ROWS:
        return x.median(dim=0).values
    return _sorted_rows(list(x.unbind(0)))[(n - 1) // 2].clone()


def _sorted_rows(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """`rows` sorted coordinate by coordinate, smallest first: by a sorting network of elementwise
    minimums and maximums up to NETWORK_ROWS rows, else torch's stable sort. The same values either
    way, a zero's sign aside (the network moves existing values; the pieces are finite:
    `reduction` refuses others)."""
    if len(rows) > NETWORK_ROWS:
        return list(torch.stack(rows).sort(dim=0, stable=True).values.unbind(0))
    for a, b in _sorting_network(len(rows)):
        rows[a], rows[b] = torch.minimum(rows[a], rows[b]), torch.maximum(rows[a], rows[b])
    return rows


def _sorting_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort of n rows as comparators (a, b), a < b: after each, row a
    holds the smaller value. Built for the next power of two; comparators that reach beyond n are
    left out (those rows would hold +inf and never move)."""
    size = 1 << max(0, (n - 1).bit_length())
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return [(a, b) for a, b in pairs if b < n]


def _running_mean(rows: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The mean of `rows` in their order, as `_weighted_chunk` computes it with equal weights:
    identical rows give exactly that row back."""
    out.copy_(rows[0])
    if len(rows) > 1:
        term = torch.empty_like(out)
        for seen, row in enumerate(rows[1:], start=1):
            torch.sub(row, out, out=term)
            term.div_(seen + 1)
            out.add_(term)


def _row_sums_of_squares(t: torch.Tensor) -> list[float]:
    """Sum of squares of each row of a 2-D float32 tensor (see `_SquareSums`)."""
    return _SquareSums(t.shape[0], 1, t.shape[1], t.device)(t.unsqueeze(1))[:, 0].tolist()


class _SquareSums:
    """Sums of squares along the last dimension of 3-D float32 tensors of one shape, as float64,
    by a fixed pairwise tree of elementwise adds: the same bits whatever the thread count, SIMD
    width or the other rows (torch's own reductions depend on all three). In float32, a third of
    the cost of float64 (these sums were half of CenteredClip's time), unless a sum of the call
    overflows it (one square of 1.8e19 does): then the whole call again in float64, where squares
    of any float32 fit; a choice made from the bits alone, so every peer makes the same one. Norms
    need no more than float32's 7 digits: CenteredClip stops at a thousandth of its radius."""

    def __init__(self, rows: int, blocks: int, width: int, device: torch.device | str = "cpu"):
        self.shape, self.device = (rows, blocks, width), device
        self.trees: dict[torch.dtype, _Tree] = {}  # the scratch of each precision, made when first used

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        root = self._tree(torch.float32)(t)
        if not bool(torch.isfinite(root).all()):
            root = self._tree(torch.float64)(t)
        return root.to(torch.float64, copy=True)

    def _tree(self, dtype: torch.dtype) -> _Tree:
        tree = self.trees.get(dtype)
        if tree is None:
            tree = self.trees[dtype] = _Tree(*self.shape, dtype, self.device)
        return tree


class _Tree:
    """The scratch of `_SquareSums` in one precision, and the views of the tree's levels, made
    once for the iterations of CenteredClip to reuse: slicing them again costs more than the adds
    on small blocks."""

    def __init__(self, rows: int, blocks: int, width: int, dtype: torch.dtype, device: torch.device | str):
        size = 1 << max(0, (width - 1).bit_length())
        self.squares = torch.empty(rows, blocks, size, dtype=dtype, device=device)
        self.leaves = self.squares[:, :, :width]
        self.padding = self.squares[:, :, width:] if width < size else None  # the tree's padding leaves
        self.levels = []
        while size > 1:
            size //= 2
            self.levels.append((self.squares[:, :, :size], self.squares[:, :, size:2 * size]))
        self.root = self.squares[:, :, 0]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.squares.dtype == t.dtype:
            torch.mul(t, t, out=self.leaves)  # (one pass: the squares straight into the leaves)
        else:
            self.leaves.copy_(t)
            self.leaves.mul_(self.leaves)
        if self.padding is not None:
            self.padding.zero_()
        for into, other in self.levels:
            into.add_(other)
        return self.root
