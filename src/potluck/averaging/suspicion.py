"""Consequences over time: members whose pieces keep deviating the same way are left out, then excluded.

Robust aggregation bounds what a minority does to one step, not to many: a liar that pushes a
little in the same direction every step adds up (benchmarks/byzantine.py). What tells it apart is
that its deviation persists. Honest pieces differ from each other by noise that is new at every
step (batches), so the running sum of the difference between two honest members' pieces grows
like the square root of the steps; between a patient liar and an honest member it grows like the
steps. A reducer tests that, pair by pair, over its shard:

    d_ij,t = x_i,t - x_j,t   (two senders' pieces at step t),   S_ij,t = sum of d_ij up to t
    Z_ij = sum_t <S_ij,t-2, d_ij,t> / sqrt(V_ij)

a martingale over an estimate of its standard deviation. S_ij,t-2 is independent of the noise of
steps t-1 and t, so <S_ij,t-2, d_ij,t - d_ij,t-1>^2 / 2 has the variance of the step's term,
whatever the noise's shape across coordinates, while a persistent push cancels in the
difference; V_ij sums these, made steady by two floors (`_variances`). Under honest noise
independent across steps Z_ij has about a standard normal tail; a consistent difference makes it
grow like the steps. Each pair is measured on its own two members' pieces, so other senders can
neither shield a liar nor frame an honest member. (The variance used to be sum_k S_k^2 d_k^2,
coordinate by coordinate, as if the noise were independent across coordinates: a real network's
gradient noise lies in few directions, so honest pairs scored far too wide. Honest members of 3-
to 5-peer runs of the digits CNN scored up to 26 in 30 steps, and were left out and framed in
small groups: tests/test_suspicion.py, tests/adversarial/test_patient_minority.py.)
A member's score is the lower median of its Z_ij over the other
senders: with fewer than half the senders lying, an honest member's median pairs it with an
honest one, whose difference liars cannot touch (the test uses no centre that liars could move).
Noise correlated across coordinates (low-rank gradient noise) or persistent (members' data that
differ) widens every honest pair's Z alike; the thresholds count in units of that width. Rules, per
averager and at each of this peer's reducers:

  * score >= SUSPECT_Z x sigma (sigma: the honest scores' width, at least 1, see
    WIDTH_PER_SIGMA; honest members whose noise is correlated or whose data differ
    persistently all score wide alike, and are not singled out): the member is left out of the
    next steps while it stays there (its reducer reports it as not delivered, so the step averages
    the others and it still receives the result);
  * at the cohort's second step, before the running statistic has a term, a first look
    (FIRST_LOOK_Z): each pair's <d_ij,1, d_ij,2> over its coordinate-by-coordinate deviation,
    taken only where the noise spreads over many directions (FIRST_LOOK_GATE) and at least
    FIRST_LOOK_MEMBERS send; a member standing out is left out through the cohort's step
    FIRST_LOOK_HOLD, then as the running statistic says;
  * score >= BAN_Z x sigma, or named blatantly not honest (far from the robust centre, or a
    huge weight: `allreduce.reduction.blatant_senders`) in FAR_STRIKES steps (a strike is
    forgiven after FAR_FORGIVE_STEPS of its steps without one): excluded for the run
    (`accountability.exclusions`: this peer's reducers never count its pieces again; it stays in
    groups, so a wrong verdict on an honest member never splits the honest peers).

The statistics survive a sender leaving; when one joins, or the shard moves, the pairs' evidence so
far stays (each term is a step's difference times sums of earlier steps, whatever those cover) and
only the members' running sums start again, where the old range does not cover the new one
(`_Cohort.inherit`: starting over let any join wipe every pair's record). They are the reducer's
own observations, never another peer's word. docs/security.md states the rates and the limits.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from potluck.averaging.accountability import BanList
from potluck.core.bounded import drop_oldest
from potluck.net.identity import PeerID

__all__ = ["BAN_Z", "FAR_FORGIVE_STEPS", "FAR_STRIKES", "FIRST_LOOK_GATE", "FIRST_LOOK_HOLD", "FIRST_LOOK_MEMBERS",
           "FIRST_LOOK_Z", "WIDTH_PER_SIGMA", "SUSPECT_Z", "SuspicionLedger"]

logger = logging.getLogger(__name__)

# Score at which a member is left out of steps. Under independent symmetric honest noise a pair's
# score exceeds z with probability about exp(-z^2 / 2) at each look: 1.5e-8 at 6, so a run of
# 1,000 steps in groups of 16 leaves an honest member out by chance with probability about 1e-3
# at most (a member needs the median of its pairs above, which is rarer still).
SUSPECT_Z = 6.0
# Score at which a member is excluded for the run: exp(-50) = 2e-22 per look.
BAN_Z = 10.0
# The first look: the pair statistic needs two steps of a pair's own history before its first term
# (S_ij,t-2), so a liar was counted in its first two steps, and a minority of 2 in 5 moved the
# honest peers 1.7 honest spreads in them (benchmarks/byzantine.py). At the cohort's second step,
# each pair's <d_ij,1, d_ij,2>, over its coordinate-by-coordinate deviation, is a first look; a
# member whose lower median over its pairs is this many widths of the honest first looks (their
# median over members of the lower median |.|, at least 1) is left out (5, not SUSPECT_Z: the
# attacks of benchmarks/byzantine.py score 4-9 widths there, and honest ones, behind the gate
# below, reached it once in 176,220 draws of benchmarks/suspicion.py --part first-look).
FIRST_LOOK_Z = 5.0
# ... but only where the noise spreads over many directions: with noise in few directions an honest
# pair's first look is one ratio of a few products, and the width of so few numbers does not make
# up for it (without the gate, honest members were left out in 0.1-0.4% of draws of noise in
# 1-128 directions). The gate (`_spread_over_directions`) measures how many directions the noise
# spreads over, from the members' differences at the two steps (about 1 for noise independent
# across coordinates, 5-25 in 8 directions; liars' pushes raise it a little); the first look is
# taken only at most this. Where noise lies in few directions (the digits CNN's gradients) the
# running statistic alone decides, from the third step, as before.
FIRST_LOOK_GATE = 2.0
# ... and only in cohorts of at least this many senders: honest members of 3 and 4 were still left
# out behind the gate (6 of 22,140 and 3 of 29,520 draws of noise in few directions), as their
# widths are medians of few numbers; with 1 of 4 the running statistic alone keeps the drift
# under one honest spread (benchmarks/byzantine.py).
FIRST_LOOK_MEMBERS = 5
# A member the first look left out stays out through the cohort's step this many, whatever the
# running statistic says meanwhile: its first terms (from the third step) are few, and a liar it
# has not caught yet would be counted again in the steps between.
FIRST_LOOK_HOLD = 4
FIRST_LOOK_REASON = "its pieces deviated the same way in its first two steps"
# The width of honest scores: thresholds count in units of sigma = max(1, w / WIDTH_PER_SIGMA),
# w the median over members of their lower median |Z_ij|. With i.i.d. noise w is 0.67 (the median
# of |N(0, 1)|) when all of a member's pairs are honest and up to about 1.1 when some are with
# liars (its median pair is then the larger of its honest ones): dividing by 1 keeps the
# thresholds where they are with i.i.d. noise, attacked or not. Data that differ persistently
# between members widen every honest member's scores alike, and sigma with it, to within 0.7-1.1
# of their own scale; a liar must stand out of them. (Noise correlated across coordinates no
# longer does, since the variance is measured on each pair's own steps: honest scores of the
# digits CNN stay under 3; with a median of only 3 members, the width alone never made up for
# it.) With
# fewer than half the senders lying, every honest member's median pair is honest, so liars cannot
# widen w.
WIDTH_PER_SIGMA = 1.0
# Steps in which a reducer named a member blatantly not honest (a piece OUTLIER_FACTOR x the median
# distance away, or a huge weight) before it is excluded: once could be a broken step (stale
# parameters after a restart), three are a habit. A named member is left out of that step.
FAR_STRIKES = 3
# Steps of a member at this reducer, none of them named far, after which one of its strikes is
# forgiven. An honest member is named only after a broken step, a few times over a run of days
# (a restart's stale parameters, a state not repaired yet, a start beside peers of other states:
# `benchmarks/soak.py` shows honest first gradients 200-460 x the median distance apart); strikes
# that never aged would exclude it in the end. A member named far in three of any hundred or so of
# its steps is still excluded, and one named less often is left out of each such step anyway.
FAR_FORGIVE_STEPS = 100
# Senders of a shard beyond which the statistics are not kept: each step costs n^2 / 2 passes
# over the shard (the pairs), and the memory two vectors of the shard's size per sender.
MAX_TRACKED_SENDERS = 32
# Fewer coordinates than this give the test too little to average over (a tiny shard): not kept.
MIN_TRACKED_ELEMENTS = 64
# Shards (coordinate ranges) whose statistics one averager keeps at once: its own shard and a
# replacement's, across a change of the load split.
MAX_COHORTS = 4
# Coordinates of a shard the record of deviations converts to float64 at once (its statistics are
# sums of products, exact enough only in float64): a converted copy of the whole shard's pieces
# would cost more memory than the pieces, and its allocation most of the record's time.
RECORD_COLUMNS = 2**14
# Members whose far namings are remembered, and members suspected at once (oldest forgotten first).
MAX_REMEMBERED = 1024


@dataclass
class _Cohort:
    """Statistics of the pairs of one shard's senders over the steps they all took part in."""

    peers: tuple[PeerID, ...]
    sums: torch.Tensor  # [n, size]: each sender's deviations summed over the steps so far
    last: torch.Tensor  # [n, size]: each sender's deviation at the last step
    # [n, n] float64 sums over the steps, of each pair's term <S_ij,t-2, d_ij,t> (cross), and of
    # the estimates of that term's variance: from the pair's own two steps (lagged), as if the
    # noise were independent across coordinates (coordinatewise), and the larger of the two at
    # each step (variance; see `_variances`)
    cross: torch.Tensor
    lagged: torch.Tensor
    coordinatewise: torch.Tensor
    variance: torch.Tensor
    steps: int = 0
    first: torch.Tensor | None = None  # [n, n]: the pairs' first look (FIRST_LOOK_Z), at the second step only

    @classmethod
    def empty(cls, peers: tuple[PeerID, ...], size: int) -> _Cohort:
        n = len(peers)
        return cls(peers, torch.zeros(n, size), torch.zeros(n, size),
                   *(torch.zeros(n, n, dtype=torch.float64) for _ in range(4)))

    def inherit(self, donor: _Cohort, shift: int) -> None:
        """Take what `donor` knows of the members in both (a fresh cohort: a member left, a
        newcomer joined, or the shard moved; `shift`: where this cohort's range starts in the
        donor's coordinates). A member leaving keeps everything of the others.
        Each term of a pair's statistic is one step's difference times sums of earlier steps, so
        whatever those sums cover, the terms and variances summed so far stay valid beside the
        new ones; the members' running sums carry over where the two ranges overlap (elsewhere,
        and for a newcomer, they start at zero). Starting all over instead let any join, a liar's
        own second identity's included, wipe every pair's record: a patient liar joined by
        another identity every 5 steps was never found."""
        common = [p for p in self.peers if p in donor.peers]
        if len(common) < 2:
            return
        mine = torch.tensor([self.peers.index(p) for p in common])
        theirs = torch.tensor([donor.peers.index(p) for p in common])
        for m, d in ((self.cross, donor.cross), (self.lagged, donor.lagged),
                     (self.coordinatewise, donor.coordinatewise), (self.variance, donor.variance)):
            m[mine[:, None], mine[None, :]] = d[theirs[:, None], theirs[None, :]]
        lo, hi = max(0, shift), min(donor.sums.shape[1], shift + self.sums.shape[1])
        if lo < hi:
            self.sums[mine, lo - shift:hi - shift] = donor.sums[theirs, lo:hi]
            self.last[mine, lo - shift:hi - shift] = donor.last[theirs, lo:hi]
        self.steps = donor.steps


@dataclass
class SuspicionLedger:
    """One averager's record of its members' deviations at this peer's reducers (see the module).
    `excluded`: this peer's statistical verdicts (shared by its averagers); `caught`: the members
    it caught lying (`accountability.ban_list`), left out too should one still be in a group.
    `track`: keep the pairs' statistics (False: far namings and the lists only, no memory)."""

    excluded: BanList
    caught: BanList = field(default_factory=BanList)
    track: bool = True
    suspects: dict[PeerID, str] = field(default_factory=dict)  # left out of the next steps, and why
    _cohorts: OrderedDict = field(default_factory=OrderedDict)  # (start, end) -> _Cohort
    _far: OrderedDict = field(default_factory=OrderedDict)  # peer -> [strikes, its clean steps since the last]

    def left_out(self, peers: Sequence[PeerID]) -> dict[PeerID, str]:
        """Which of a step's `peers` a reducer leaves out, and why: caught, excluded or suspected."""
        out = {}
        for p in peers:
            if p in self.caught:
                out[p] = f"caught lying: {self.caught.evidence(p)}"
            elif p in self.excluded:
                out[p] = f"excluded: {self.excluded.evidence(p)}"
            elif p in self.suspects:
                out[p] = self.suspects[p]
        return out

    def scores(self, start: int, end: int) -> dict[PeerID, float]:
        """Each tracked sender's score over the shard [start, end) (empty if not tracked)."""
        cohort = self._cohorts.get((start, end))
        return {} if cohort is None else dict(zip(cohort.peers, _scores(cohort), strict=True))

    def record(self, start: int, peers: Sequence[PeerID], pieces: Sequence[torch.Tensor],
               named_far: Sequence[PeerID] = ()) -> None:
        """One step of a shard starting at `start`: each sender's piece (flat, the shard's size);
        `named_far`: senders named blatantly not honest in it (`blatant_senders`: a piece far from the
        robust centre, or a huge claimed weight). Updates the scores, then who is suspected
        and who is excluded: a reducer records a step's pieces as soon as they are all in, so a
        member found out leaves the very step that gave it away (`left_out`)."""
        for p in named_far:
            strikes = self._far.pop(p, [0, 0])[0] + 1
            self._far[p] = [strikes, 0]
            drop_oldest(self._far, MAX_REMEMBERED)
            why = f"named blatantly not honest (far from the robust centre, or a huge weight) in {strikes} step(s)"
            if strikes >= FAR_STRIKES:
                self._exclude(p, why)
            else:
                self._suspect(p, why)
        named = set(named_far)
        for p in peers:  # a single far naming leaves a member out of one step only
            if p in named:
                continue
            if self.suspects.get(p, "").startswith("named blatantly"):
                del self.suspects[p]
            record = self._far.get(p)
            if record is not None:
                record[1] += 1
                if record[1] >= FAR_FORGIVE_STEPS:
                    record[0], record[1] = record[0] - 1, 0
                    if record[0] == 0:
                        del self._far[p]
        size = pieces[0].numel() if pieces else 0
        if not self.track or not 2 < len(peers) <= MAX_TRACKED_SENDERS or size < MIN_TRACKED_ELEMENTS:
            return
        cohort = self._cohort(start, start + size, tuple(peers))
        # Only differences between pieces matter; taking out the step's mean keeps the running
        # sums small (parameters summed over 1,000 steps would drown their differences in float32).
        deviations = torch.stack([p.reshape(-1) for p in pieces])
        deviations.sub_(deviations.mean(dim=0))
        _update(cohort, deviations)
        self._judge(cohort)

    def _cohort(self, start: int, end: int, peers: tuple[PeerID, ...]) -> _Cohort:
        key = (start, end)
        old = self._cohorts.pop(key, None)
        if old is not None and peers == old.peers:
            cohort = old
        else:  # other senders, or a new range: this range's record, else the last one used, gives what it knows
            cohort = _Cohort.empty(peers, end - start)
            donor_key, donor = (key, old) if old is not None else next(reversed(self._cohorts.items()), (key, None))
            if donor is not None:
                cohort.inherit(donor, start - donor_key[0])
        self._cohorts[key] = cohort
        drop_oldest(self._cohorts, MAX_COHORTS)
        return cohort

    def _judge(self, cohort: _Cohort) -> None:
        if cohort.first is not None:
            self._first_look(cohort)
            return
        scores, spreads = _scores(cohort), _scores(cohort, absolute=True)
        sigma = max(1.0, sorted(spreads)[(len(spreads) - 1) // 2] / WIDTH_PER_SIGMA)
        for p, z in zip(cohort.peers, scores, strict=True):
            why = (f"its pieces keep deviating the same way: score {z:.1f} over {cohort.steps} steps, "
                   f"{z / sigma:.1f} x the honest width {sigma:.1f}")
            if z >= BAN_Z * sigma:
                self._exclude(p, why)
            elif z >= SUSPECT_Z * sigma:
                if p not in self.suspects:
                    logger.warning("leaving %s out of averaging while %s", p, why)
                self._suspect(p, why)
            elif p in self.suspects and self.suspects[p].startswith("its pieces") \
                    and not (self.suspects[p].startswith(FIRST_LOOK_REASON) and cohort.steps <= FIRST_LOOK_HOLD):
                del self.suspects[p]

    def _first_look(self, cohort: _Cohort) -> None:
        """The cohort's second step: leave out the members whose first look stands out
        (FIRST_LOOK_Z), through its step FIRST_LOOK_HOLD; the judgements after that clear them
        unless the running statistic holds them too."""
        assert cohort.first is not None
        scores, spreads = _lower_medians(cohort.first), _lower_medians(cohort.first.abs())
        sigma = max(1.0, sorted(spreads)[(len(spreads) - 1) // 2] / WIDTH_PER_SIGMA)
        for p, z in zip(cohort.peers, scores, strict=True):
            if z >= FIRST_LOOK_Z * sigma:
                why = f"{FIRST_LOOK_REASON}: first look {z:.1f}, {z / sigma:.1f} x the honest width {sigma:.1f}"
                logger.warning("leaving %s out of this step: %s", p, why)
                self._suspect(p, why)

    def _suspect(self, peer: PeerID, why: str) -> None:
        """Leave `peer` out of the next steps while it stays suspect. A suspect that never sends
        again is never cleared by a later step: the oldest go beyond MAX_REMEMBERED (made-up ids
        named once each would otherwise pile up)."""
        self.suspects.pop(peer, None)
        self.suspects[peer] = why
        drop_oldest(self.suspects, MAX_REMEMBERED)

    def _exclude(self, peer: PeerID, why: str) -> None:
        self.suspects.pop(peer, None)
        self.excluded.ban(peer, why)


def _update(cohort: _Cohort, deviations: torch.Tensor) -> None:
    """Add step t's deviations ([n, size]) to the pairs' statistics: each pair's term
    <S_ij,t-2, d_ij,t>, and that term's variance under honest noise, measured on the pair's own
    pieces as <S_ij,t-2, d_ij,t - d_ij,t-1>^2 / 2 (a persistent push cancels in the difference
    of two steps' deviations; the noise does not). One pass over the shard, RECORD_COLUMNS
    coordinates at a time in float64: every pair's sums come from n x n products of the members'
    own vectors (`_Products`), not from each pair's difference vectors."""
    sums, last = cohort.sums, cohort.last
    cohort.first = _first_look(last, deviations) if cohort.steps == 1 and len(cohort.peers) >= FIRST_LOOK_MEMBERS \
        else None
    sums -= last  # S_t-2: the sums before the last step, independent of d_t-1 and of d_t
    products = _Products(sums.shape[0], min(RECORD_COLUMNS, sums.shape[1]))
    for lo in range(0, sums.shape[1], RECORD_COLUMNS):
        products.add(sums[:, lo:lo + RECORD_COLUMNS], deviations[:, lo:lo + RECORD_COLUMNS],
                     last[:, lo:lo + RECORD_COLUMNS])
    now = _pairs(products.now)
    cohort.cross += now
    lagged = (now - _pairs(products.before)).square_().mul_(0.5)
    coordinatewise = products.coordinatewise()
    cohort.lagged += lagged
    cohort.coordinatewise += coordinatewise
    cohort.variance += torch.maximum(lagged, coordinatewise)
    sums += last
    sums += deviations
    last.copy_(deviations)
    cohort.steps += 1


def _first_look(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """[n, n]: each pair's <d_ij,1, d_ij,2> over its coordinate-by-coordinate standard deviation,
    from the members' deviations at the first two steps (FIRST_LOOK_Z); None where the noise lies
    in too few directions for it (FIRST_LOOK_GATE)."""
    if _spread_over_directions(first, second) > FIRST_LOOK_GATE:
        return None
    products = _Products(first.shape[0], min(RECORD_COLUMNS, first.shape[1]))
    for lo in range(0, first.shape[1], RECORD_COLUMNS):
        chunk = slice(lo, lo + RECORD_COLUMNS)
        products.add(first[:, chunk], second[:, chunk], first[:, chunk])
    spread = products.coordinatewise().sqrt_()
    return (_pairs(products.now) / spread).nan_to_num_(0.0, posinf=0.0, neginf=0.0)


def _spread_over_directions(first: torch.Tensor, second: torch.Tensor) -> float:
    """FIRST_LOOK_GATE's statistic, from the members' pieces at two steps (rows; any common
    offset cancels): for each member i, |cos| between its difference from j at the first step and
    its difference from k at the second (j != k: independent under honest noise, and free of any
    push of a liar unless both are liars), its upper median over (j, k); the median over members,
    times sqrt(size). About 1.2 for noise independent across coordinates, larger the fewer
    directions the noise (or a persistent difference between members' data) lies in."""
    n, size = first.shape
    a, b = first.double(), second.double()
    cross, aa, bb = a @ b.T, a @ a.T, b @ b.T
    da, db = aa.diagonal(), bb.diagonal()
    norms_a = (da[:, None] + da[None, :] - 2 * aa).clamp_(min=0).sqrt_()  # |x_i,1 - x_j,1|
    norms_b = (db[:, None] + db[None, :] - 2 * bb).clamp_(min=0).sqrt_()
    # [i, j, k]: <x_i,1 - x_j,1, x_i,2 - x_k,2>, over the two norms
    dots = cross.diagonal()[:, None, None] - cross[:, None, :] - cross.T[:, :, None] + cross[None, :, :]
    cos = dots.abs_() / (norms_a[:, :, None] * norms_b[:, None, :]).clamp_(min=1e-300)
    index = torch.arange(n)
    distinct = (index[:, None, None] != index[None, :, None]) & (index[:, None, None] != index[None, None, :]) \
        & (index[None, :, None] != index[None, None, :])
    values = (n - 1) * (n - 2)
    if values == 0:
        return math.inf
    ranked = cos.masked_fill_(~distinct, math.inf).reshape(n, -1).sort(dim=1).values  # the (j, k) of each i first
    members = sorted(ranked[:, values // 2].tolist())  # each member's upper median
    return members[(n - 1) // 2] * math.sqrt(size)


class _Products:
    """n x n float64 sums over coordinates, from which every pair's statistics follow. With a =
    S_t-2, b = d_t, c = d_t-1 (rows: members): now = a b^T, before = a c^T; and for the pairs'
    sum_k (a_i - a_j)_k^2 (b_i - b_j)_k^2, expanded, a^2 (b^2)^T, (a^2 b) b^T, (a b^2) a^T and
    (a b)(a b)^T (products elementwise within a row)."""

    def __init__(self, n: int, columns: int):
        zeros = [torch.zeros(n, n, dtype=torch.float64) for _ in range(6)]
        self.now, self.before, self.squares, self.left, self.right, self.mixed = zeros
        self._scratch = torch.empty(5, n, columns, dtype=torch.float64)

    def add(self, a32: torch.Tensor, b32: torch.Tensor, c32: torch.Tensor) -> None:
        width = a32.shape[1]
        a, b, c, x, y = (t[:, :width] for t in self._scratch)
        a.copy_(a32)
        b.copy_(b32)
        c.copy_(c32)
        self.now += a @ b.T
        self.before += a @ c.T
        torch.mul(a, a, out=x)  # a^2
        torch.mul(b, b, out=c)  # b^2 (c is spent)
        self.squares += x @ c.T
        x.mul_(b)  # a^2 b
        self.left += x @ b.T
        torch.mul(a, c, out=y)  # a b^2
        self.right += y @ a.T
        torch.mul(a, b, out=x)  # a b
        self.mixed += x @ x.T

    def coordinatewise(self) -> torch.Tensor:
        """[n, n]: sum_k (a_i - a_j)_k^2 (b_i - b_j)_k^2 for every pair: the variance of
        <a_i - a_j, b_i - b_j> if b's noise were independent across coordinates."""
        diag = self.squares.diagonal()
        out = diag[:, None] + diag[None, :] + self.squares + self.squares.T
        out -= 2 * (self.left + self.left.T + self.right + self.right.T)
        out += 4 * self.mixed
        return out.clamp_(min=0.0).fill_diagonal_(0.0)


def _pairs(gram: torch.Tensor) -> torch.Tensor:
    """[n, n]: <a_i - a_j, b_i - b_j> for every pair, from the n x n products <a_i, b_j>."""
    diag = gram.diagonal()
    return diag[:, None] + diag[None, :] - gram - gram.T


def _variances(cohort: _Cohort) -> torch.Tensor:
    """[n, n]: each pair's variance estimate, the larger of two. (1) Step by step, the larger
    of its own lagged estimate and the coordinate-by-coordinate one: a lagged estimate is one
    sample per step, and two close steps can make it tiny (the statistic of a few steps is then
    as heavy-tailed as a ratio of normals); the coordinate-by-coordinate one never is, but misses
    noise correlated across coordinates. (2) The coordinate-by-coordinate sum times the noise's
    shape, kappa: how much the lagged estimates exceed the coordinate-by-coordinate ones, in the
    whole cohort (the median over members of their lower median over pairs, at least 1: one
    number from every pair's every step, so far steadier than one pair's own, and liars, whose
    push cancels in the lagged estimate, cannot move a median of the honest majority's pairs)."""
    n = len(cohort.peers)
    ratio = (cohort.lagged / cohort.coordinatewise).nan_to_num(1.0, posinf=1.0)
    members = [sorted(float(ratio[i, j]) for j in range(n) if j != i)[(n - 2) // 2] for i in range(n)]
    kappa = max(1.0, sorted(members)[(n - 1) // 2])
    return torch.maximum(cohort.variance, kappa * cohort.coordinatewise)


def _lower_medians(pairs: torch.Tensor) -> list[float]:
    """[n, n] -> each member's lower median over the others of its row."""
    n = pairs.shape[0]
    ranked = pairs.double().clone().fill_diagonal_(math.inf).sort(dim=1).values  # itself last
    return ranked[:, (n - 2) // 2].tolist()


def _scores(cohort: _Cohort, absolute: bool = False) -> list[float]:
    """Each sender's lower median over the others of the pair statistic Z_ij (of |Z_ij|: how
    far honest pairs stray either way, the scale of the relative condition)."""
    variance = _variances(cohort)
    z = torch.where(variance > 0, cohort.cross / variance.clamp(min=1e-300).sqrt(), torch.zeros_like(variance))
    return _lower_medians(z.abs() if absolute else z)
