"""Streaming DiLoCo (arXiv 2501.18512): DiLoCo's outer loop one fragment of the model at a time,
overlapped with the inner steps, with compressed pseudo-gradients.

The model's parameters are split, in parameter order, into `fragments` runs of about equal size
(cut between rows inside a tensor where a run's share ends: `split_fragments`).
Every `local_steps / fragments` inner steps one fragment's outer round starts (fragment
`epoch % fragments`): so each fragment is synchronized every `local_steps` steps, staggered by
`local_steps / fragments`, and the peak traffic is one fragment's, not the model's. A round:
1. its pseudo-gradient, the fragment's outer parameters minus its local ones, is written into the
   fragment's delta buffers; with a top-k codec only the largest values are kept there, and what
   was left out is added to that fragment's next pseudo-gradient (error feedback);
2. the fragment's averager averages it with the group in the background, the wire codec
   (`outer_compression`) compressing it, while the inner steps go on for `outer_delay` more steps
   (fewer once another peer has applied the round: it is faster, and waits for us);
3. the averaged pseudo-gradient moves the fragment's outer parameters (Nesterov, as DiLoCo), and
   the local parameters take `mixing * local + (1 - mixing) * outer` (the paper's rule: with
   `outer_delay` > 0 the local ones have moved on since the round began; with 0 they are the
   outer ones, as in DiLoCo).
The outer parameters and momentum of a fragment are what stay identical across a round's group:
each member applies the same averaged pseudo-gradient to them. Members whose outer points differ
(one stepped alone after a failed round, a newcomer) notice it from the digests in their round
notes, and average the fragment's outer parameters and momentum with the group.

Memory, model-sized buffers beyond the model and the wrapped optimizer: the outer parameters, the
outer momentum, the delta buffers (each split among the fragments: 1 model each), plus the error
feedback residuals with a top-k `outer_compression` (1 model). A round in flight also holds the
averager's flat buffers of one fragment.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from potluck.averaging.averager import Averager, StepResult
from potluck.compression import TopK, get_codec
from potluck.core.errors import AveragingError
from potluck.core.runner import retrieve_exception, run_in_thread
from potluck.optim.context import RunContext
from potluck.optim.diloco import may_join, round_begun
from potluck.optim.modes import DiLoCo, TrainingMode
from potluck.optim.moshpit import place_on_grid
from potluck.optim.progress import RoundNote
from potluck.optim.state import tensor_digest

__all__ = ["ErrorFeedback", "StreamingDiLoCo", "cut", "split_fragments"]

logger = logging.getLogger(__name__)

# A peer this many fragment rounds behind the swarm moves on to its round without downloading
# its state: the fragment of a missed round is repaired in its next round (see `_rejoin`).
MAX_ROUNDS_REJOINED = 1


Piece = tuple[int, int, int]  # (parameter index, first row, end row): rows along dim 0; a scalar has one


def split_fragments(shapes: Sequence[Sequence[int]], fragments: int) -> list[list[Piece]]:
    """The parameters (in order) cut into `fragments` consecutive runs of about equal numbers of
    values, each non-empty: a run ends at the row where its share does, inside a tensor if need
    be. Cut only between tensors, a model that is mostly one embedding table put nearly all of it
    in one fragment, whose rounds then moved the whole model's bytes (every other round, while
    the others moved almost nothing). ValueError if there are fewer rows than fragments."""
    rows = [s[0] if len(s) else 1 for s in shapes]
    sizes = [math.prod(s) if len(s) else 1 for s in shapes]
    starts = list(itertools.accumulate(rows, initial=0))  # each tensor's first row, counting all rows
    if not 1 <= fragments <= starts[-1]:
        raise ValueError(f"cannot cut {starts[-1]} rows into {fragments} fragments")
    total, cuts, before = sum(sizes), [0], 0  # cuts: rows (counting all) where each fragment begins
    for i, (n, size) in enumerate(zip(rows, sizes, strict=True)):
        while len(cuts) < fragments and before + size > len(cuts) * total / fragments:
            within = round((len(cuts) * total / fragments - before) / (size / n)) if n else 0
            cuts.append(starts[i] + within)
        before += size
    cuts += [starts[-1]] * (fragments - len(cuts))
    for k in range(1, fragments):  # every fragment at least one row, in order
        cuts[k] = min(max(cuts[k], cuts[k - 1] + 1), starts[-1] - (fragments - k))
    cuts.append(starts[-1])
    return [[(i, max(a, first) - first, min(b, end) - first)  # (a tensor without rows holds nothing to average)
             for i, (first, end) in enumerate(itertools.pairwise(starts)) if max(a, first) < min(b, end)]
            for a, b in itertools.pairwise(cuts)]


def cut(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A fragment's piece of `tensor`: the tensor itself if whole, else a view of its rows."""
    _, first, end = piece
    if tensor.dim() == 0 or (first == 0 and end == tensor.shape[0]):
        return tensor
    return tensor.detach()[first:end]


class ErrorFeedback:
    """Top-k with error feedback for one fragment's pseudo-gradients: one `TopK` per tensor (its
    residual is what was left out so far). After `thin(deltas)`, deltas + residuals equals the
    pseudo-gradients plus the residuals before (nothing is lost, only delayed)."""

    def __init__(self, spec: Any, count: int):
        self.codecs = [get_codec(spec) for _ in range(count)]

    def thin(self, deltas: list[torch.Tensor]) -> None:
        """Keep the largest values (with what was held back before) in `deltas`, in place."""
        for codec, delta in zip(self.codecs, deltas, strict=True):
            payload = codec.encode(delta)
            flat = delta.view(-1)
            flat.zero_()
            flat[payload["indices"].long()] = payload["values"].to(delta.dtype)

    @property
    def residuals(self) -> list[torch.Tensor | None]:
        return [codec.residual for codec in self.codecs]

    def reset(self) -> None:
        """Forget the residuals, after a round that went on without us: its pseudo-gradient is
        still in the local parameters' change, where the next one finds it again, so the part
        held back from it must not be added twice. (What earlier rounds held back goes with it:
        a rare, bounded loss.)"""
        for codec in self.codecs:
            codec.reset()


@dataclass
class Fragment:
    """One fragment of the model: its parameters (whole tensors and views of rows), its slices of
    the outer parameters and momentum (views of the mode's own lists: one set of tensors), and
    its two averagers."""

    index: int
    params: list[torch.Tensor]
    outer: list[torch.Tensor]
    momentum: list[torch.Tensor]
    averager: Averager  # over the delta buffers: the pseudo-gradients
    outer_averager: Averager  # over outer + momentum: repairs members that differ
    feedback: ErrorFeedback | None


@dataclass
class Flight:
    """A fragment's round under way in the background."""

    fragment: Fragment
    epoch: int
    task: asyncio.Future | None  # None: nobody else trains (the local change is applied)
    steps_left: int  # inner steps until it is applied
    samples: int  # behind its change (since the last round began): the others record them


class StreamingDiLoCo(TrainingMode):
    """Streaming DiLoCo's fragment schedule (see the module docstring); progress, catching up and
    epochs are the run's (an epoch is one fragment round: local_steps / fragments inner steps)."""

    inner_step_first = True

    def __init__(self, context: RunContext, options: DiLoCo):
        super().__init__(context)
        self.options = options
        self.interval = options.local_steps // options.fragments
        self.steps = 0  # inner steps since the last round started
        self.momentum = context.state.extra  # the outer momentum, part of the state
        self.outer: list[torch.Tensor] = []  # the outer parameters (see start)
        self.fragments: list[Fragment] = []
        self.flight: Flight | None = None
        # Moshpit groups for the rounds, placed at each round (see `_launch`); a repair meets
        # exactly the round's group.
        self.grid: tuple[int, ...] | None = None if options.grid is None else tuple(options.grid)

    async def start(self) -> None:
        """Build each fragment's buffers and averagers over the outer parameters and momentum:
        one set of tensors, so downloads reach them."""
        context, options = self.context, self.options
        params, momentum = context.state.params, self.momentum
        self.outer = outer = await run_in_thread(lambda: [p.detach().clone() for p in params])
        # Newcomers take the outer point, written under the state's lock (`_outer_step`, `restart`),
        # except by a repair's averager: a snapshot taken during one may hold half of its result,
        # and that fragment is then repaired in the newcomer's next round of it, as before.
        context.state.serve(outer)
        averaging = context.settings.averaging()
        wire = {**averaging, "compression": options.wire_codec().spec, "grid": self.grid}
        spec = get_codec(options.outer_compression)
        for i, pieces in enumerate(split_fragments([p.shape for p in params], options.fragments)):
            mine, outers, moments = ([cut(tensors[piece[0]], piece) for piece in pieces]
                                     for tensors in (params, outer, momentum))
            deltas = await run_in_thread(lambda mine=mine: [torch.zeros_like(p) for p in mine])
            self.fragments.append(Fragment(
                i, mine, outers, moments,
                Averager(context.peer, deltas, context.run_id, name=f"delta{i}", allow_state_sharing=False, **wire),
                Averager(context.peer, outers + moments, context.run_id,
                         name=f"outer{i}", allow_state_sharing=False, deviations=False, **averaging),
                ErrorFeedback(options.outer_compression, len(pieces)) if isinstance(spec, TopK) else None))
        # The fragments' rounds meet the same peers: one memory of the last group for all, so a
        # later fragment's first round asks the last leader directly, as a repeated round does
        # (no DHT declaration, no matchmaking window: once per run, not once per fragment).
        # A repair (`_repair`, right after its round) meets that round's group too: declared in
        # the DHT, over slow links every member of it gathered alone, and the outer points stayed
        # apart for good. (It blocks the steps, so no round's matchmaking runs beside it.)
        last = self.fragments[0].averager.matchmaker.last
        last.computed = self.context.computes_towards_us  # a late last leader is waited for, a stalled one not
        for fragment in self.fragments:
            fragment.averager.matchmaker.last = fragment.outer_averager.matchmaker.last = last

    def quiet_step(self) -> bool:
        """Neither a round's start nor a landing (see `RunContext.quiet`): counted in the
        caller's thread."""
        flight, steps = self.flight, self.steps + 1
        if steps >= self.interval or (flight is not None and (flight.steps_left <= 1
                                                              or flight.epoch < self.context.others_applied)) \
                or not self.context.quiet(joinable=flight is None and may_join(self.context, steps, self.interval)):
            return False
        self.context.count_quiet_step()
        self.steps += 1
        if flight is not None:
            flight.steps_left -= 1
        return True

    async def step(self) -> None:
        """One inner step: apply the round in flight when its delay is over, or once another peer
        has applied it (that one is faster: it waits for us, `RunContext.holds_round`), and start
        the next fragment's round when it is due."""
        context = self.context
        await context.inner_step()
        self.steps += 1
        if self.flight is not None:
            self.flight.steps_left -= 1
            # A peer 2.5x as fast as another, with a delay of nearly a round's interval, waited
            # at every round for the slower one to sit out its delay: the slower one's pace.
            if self.flight.steps_left <= 0 or self.flight.epoch < context.applied_by_others(context.progress().reports):
                await self._land()
        if self.steps >= self.interval or (self.flight is None and round_begun(context, self.steps, self.interval)):
            await self._launch()

    async def restart(self) -> None:
        """Start the next inner steps from the state just downloaded."""
        await self.context.compute(self.context.state.copy_params_to, self.outer)

    async def _launch(self) -> None:
        context, tally = self.context, self.context.tally
        progress = context.progress()
        if progress.epoch > context.epoch:  # the others are ahead: rejoin them
            self.steps = 0
            await self._rejoin(progress.epoch)
            return
        if context.holds_round(progress.reports):
            return  # due again at our next step
        self.steps = 0
        fragment = self.fragments[context.epoch % len(self.fragments)]
        await self.context.compute(self._take_change, fragment)
        task = None
        if context.anyone_else():
            # With a grid, the peers' cells come from their ranks, as in moshpit mode (random cells
            # left most peers alone); without, a stable group meets again without the DHT, and any
            # other round closes once everyone in a settled view is in (`RunContext.expected`, asked
            # again while the group gathers).
            members = context.members(context.progress().reports) if self.grid is None else None
            expected = context.expected if members is not None \
                else place_on_grid(context, fragment.averager, self.grid)
            digest = await run_in_thread(tensor_digest, fragment.outer + fragment.momentum)
            settings = context.settings
            task = asyncio.ensure_future(fragment.averager.astep(
                weight=float(settings.batch_size_per_step * self.options.local_steps),
                gather=RoundNote(tally.samples, outer=digest).to_wire(),
                group_key=f"outer{context.epoch}", target_group_size=expected, members=members,
                no_shows=context.no_shows() if members is not None else (),
                matchmaking_time=context.round_window()))
            tally.in_round = True  # slower peers see it and join now (round_begun)
            context.publish()
        self.flight = Flight(fragment, context.epoch, task, self.options.outer_delay, tally.samples)
        if self.options.outer_delay == 0:
            await self._land()

    async def _land(self) -> None:
        """Apply the round in flight (waiting for it if it is not over yet)."""
        context, flight = self.context, self.flight
        self.flight = None
        fragment, result = flight.fragment, None
        if flight.task is not None:
            if not flight.task.done():
                context.waited = True
            try:
                await context.wait_for_round(flight.task, fragment.averager, flight.epoch)
            finally:
                context.tally.in_round = False
            if flight.task.cancelled():  # the others' round is over without us: rejoin them
                if fragment.feedback is not None:
                    fragment.feedback.reset()
                await self._rejoin(max(r.done for r in context.progress().reports))  # (as far as supported)
                return
            try:
                result = flight.task.result()
                # they hear our progress at once (a grid's cells are not everyone: no no-shows there)
                context.group_formed(result.peers, context.roster if self.grid is None else ())
                context.grouped(context.epoch_seconds())  # (the patience of `holds_round`)
                context.record_round(flight.epoch, {p: RoundNote.read(m) for p, m in result.gathered.items()},
                                     result.contributors)
            except AveragingError as e:
                context.failed_rounds += 1
                logger.warning("fragment %d: averaging failed (%s); using the local change", fragment.index, e)
        await self.context.compute(self._outer_step, fragment)
        # those since it began go to the next round
        context.tally.samples = max(0, context.tally.samples - flight.samples)
        context.advance_epoch()
        if result is not None and len({RoundNote.read(m).outer for m in result.gathered.values()}) > 1:
            await self._repair(fragment, result)

    async def _rejoin(self, epoch: int) -> None:
        """The swarm is at `epoch`, ahead of us. One round behind (a slower peer, whose group
        formed without it): move on to it; the fragment of the round we missed has a stale outer
        point, which its next round's digests reveal and average away. Further behind: download
        the swarm's state (as DiLoCo does). Downloading for one round would never end when rounds
        are shorter than a download: the swarm is a round further on by the time it finishes."""
        context = self.context
        context.tally.samples = 0
        if epoch - context.epoch > MAX_ROUNDS_REJOINED:
            await context.catch_up(epoch, restart=self.restart)
            return
        logger.info("fragment round %d went on without us; rejoining the swarm at round %d", context.epoch, epoch)
        context.rejoin(epoch)

    def _take_change(self, fragment: Fragment) -> None:
        """The fragment's pseudo-gradient into its delta buffers, thinned if top-k (worker thread)."""
        with fragment.averager.get_tensors() as deltas, torch.no_grad():
            torch._foreach_copy_(deltas, fragment.outer)
            torch._foreach_sub_(deltas, fragment.params)
            if fragment.feedback is not None:
                fragment.feedback.thin(deltas)

    def _outer_step(self, fragment: Fragment) -> None:
        """The averaged pseudo-gradient moves the outer parameters (Nesterov, as DiLoCo's outer
        step); the local ones take them, mixed with themselves if they moved on meanwhile."""
        options, state = self.options, self.context.state
        with fragment.averager.get_tensors() as deltas, state.lock(), torch.no_grad():
            state.generation += 1
            torch._foreach_mul_(fragment.momentum, options.outer_momentum)
            torch._foreach_add_(fragment.momentum, deltas)
            torch._foreach_add_(deltas, fragment.momentum, alpha=options.outer_momentum)
            torch._foreach_add_(fragment.outer, deltas, alpha=-options.outer_lr)
            if options.outer_delay == 0:
                torch._foreach_copy_(fragment.params, fragment.outer)
            else:  # mixing * local + (1 - mixing) * outer
                torch._foreach_lerp_(fragment.params, fragment.outer, 1.0 - options.mixing)

    async def _repair(self, fragment: Fragment, result: StepResult) -> None:
        """The group's outer points differed: average them (and the momentum) with the group;
        the local parameters move with their outer point."""
        logger.info("fragment %d: the group's outer parameters differ; averaging them", fragment.index)
        before = await self.context.compute(lambda: [t.clone() for t in fragment.outer])
        try:
            await fragment.outer_averager.astep(group_key=f"outer-state{self.context.epoch}",
                                                target_group_size=len(result.peers), members=frozenset(result.peers))
        except AveragingError as e:
            logger.warning("fragment %d: averaging the outer parameters failed (%s)", fragment.index, e)
            return
        await self.context.compute(self._follow, fragment, before)

    def _follow(self, fragment: Fragment, before: list[torch.Tensor]) -> None:
        state = self.context.state
        with state.lock(), torch.no_grad():
            state.generation += 1
            if self.options.outer_delay == 0:
                torch._foreach_copy_(fragment.params, fragment.outer)
            else:
                torch._foreach_sub_(before, fragment.outer)
                torch._foreach_sub_(fragment.params, before)

    def shutdown(self) -> None:
        """Stop the round in flight (from any thread) and the fragments' averagers."""
        task = None if self.flight is None else self.flight.task
        if task is not None and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(_drop, task)
        for fragment in self.fragments:
            fragment.averager.shutdown()
            fragment.outer_averager.shutdown()


def _drop(task: asyncio.Future) -> None:
    task.cancel()
    task.add_done_callback(retrieve_exception)
