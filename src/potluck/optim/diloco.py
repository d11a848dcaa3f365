"""DiLoCo (`DiLoCo`, plain: no fragments, delay or codec): `local_steps` inner steps of the wrapped
optimizer, then an outer step with Nesterov momentum on the averaged change of the parameters. A
slower peer joins the round that a faster one entered, with fewer inner steps (`round_begun`); a
peer whose round came after the others' (a slower one, or one whose round failed) takes their
state instead. Members whose starting points differ (one stepped alone) notice it from the
digests in their round notes and average their outer state.

Memory: three model-sized buffers beyond the model and the wrapped optimizer (the outer starting
point, the averaged change, the outer momentum; the momentum is part of the state that newcomers
download and that groups average when they differ).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from potluck.averaging.averager import Averager
from potluck.core.errors import AveragingError
from potluck.core.runner import run_in_thread
from potluck.optim.context import RunContext
from potluck.optim.modes import DiLoCo, TrainingMode
from potluck.optim.progress import MAX_SPEED_RATIO, RoundNote
from potluck.optim.state import tensor_digest

__all__ = ["DiLoCoTraining", "round_begun"]

logger = logging.getLogger(__name__)

# A DiLoCo peer joins an outer round another peer has entered (`round_begun`) only after
# `local_steps` / this of its own inner steps (Streaming DiLoCo: of a fragment's interval). Honest
# peers' speeds are within MAX_SPEED_RATIO of each other, so they all join every round; a liar that
# claims to be in a round all the time makes the others' rounds at most this many times as frequent.
MIN_JOIN_STEP_FRACTION = MAX_SPEED_RATIO
# It joins before its own `local_steps` only if the rest of them would take longer than this
# fraction of the matchmaking window: the window opened when the other peer entered, which we
# hear of up to a progress interval (and a DHT read) late. Peers of about equal speed make all
# their steps.
JOIN_WINDOW_FRACTION = 0.5


class DiLoCoTraining(TrainingMode):
    """Plain DiLoCo's outer rounds (see the module docstring)."""

    inner_step_first = True

    def __init__(self, context: RunContext, options: DiLoCo):
        super().__init__(context)
        self.options = options
        self.steps = 0  # inner steps since the last outer round
        self.momentum = context.state.extra  # the outer momentum, part of the state
        self.outer: list[torch.Tensor] = []  # the outer parameters: where the inner steps started
        self.delta_averager: Averager | None = None  # the averaged change (see start)

    async def start(self) -> None:
        context = self.context
        params = context.state.params
        self.outer = await run_in_thread(lambda: [p.detach().clone() for p in params])
        context.state.serve(self.outer)  # (written under the state's lock: `_outer_step`, `restart`)
        zeros = await run_in_thread(lambda: [torch.zeros_like(p) for p in params])
        self.delta_averager = Averager(context.peer, zeros, context.run_id, name="delta", allow_state_sharing=False,
                                       **context.settings.averaging())
        context.share_last_group(self.delta_averager)

    def shutdown(self) -> None:
        if self.delta_averager is not None:
            self.delta_averager.shutdown()

    def quiet_step(self) -> bool:
        """Not the round's step (see `RunContext.quiet`): counted in the caller's thread."""
        steps, due = self.steps + 1, self.options.local_steps
        if steps >= due or not self.context.quiet(joinable=may_join(self.context, steps, due)):
            return False
        self.context.count_quiet_step()
        self.steps += 1
        return True

    async def step(self) -> None:
        await self.context.inner_step()
        self.steps += 1
        if self.steps >= self.options.local_steps or round_begun(self.context, self.steps, self.options.local_steps):
            await self._round()

    async def restart(self) -> None:
        """Start the next inner steps from the state just downloaded."""
        await self.context.compute(self.context.state.copy_params_to, self.outer)

    async def _round(self) -> None:
        """Outer step: average the parameter change of the last `local_steps` steps, then apply
        it to the shared starting point with Nesterov momentum."""
        context, tally = self.context, self.context.tally
        progress = context.progress()
        if progress.epoch > context.epoch:
            self.steps = tally.samples = 0
            await context.catch_up(progress.epoch, restart=self.restart)
            return
        if context.holds_round(progress.reports):
            return  # due again at our next step
        self.steps = 0
        await self.context.compute(self._take_change)
        result = None
        try:
            if context.anyone_else():
                # A stable group meets again without the DHT and closes once all are back; any
                # other round closes once everyone in a settled view is in (`RunContext.expected`,
                # asked again while the group gathers), else takes the whole window, which also
                # lets a peer we do not see yet come in.
                members = context.members(context.progress().reports)
                digest = await run_in_thread(tensor_digest, self.outer)
                task = asyncio.ensure_future(self.delta_averager.astep(
                    weight=float(tally.samples), gather=RoundNote(tally.samples, outer=digest).to_wire(),
                    group_key=f"outer{context.epoch}", target_group_size=context.expected,
                    members=members, no_shows=context.no_shows(), matchmaking_time=context.round_window()))
                tally.in_round = True  # slower peers see it and join now (round_begun)
                context.publish()
                try:
                    await context.wait_for_round(task, self.delta_averager, context.epoch)
                finally:
                    tally.in_round = False
                if task.cancelled():  # the others' round is over: take their state
                    tally.samples = 0
                    done = max(r.done for r in context.progress().reports)  # (as far as the swarm supports)
                    await context.catch_up(done, restart=self.restart)
                    return
                result = task.result()
                context.group_formed(result.peers, context.roster)  # they hear our progress at once
                context.grouped(context.epoch_seconds())  # (the patience of `holds_round`)
                context.record_round(context.epoch, {p: RoundNote.read(m) for p, m in result.gathered.items()},
                                     result.contributors)
        except AveragingError as e:
            context.failed_rounds += 1
            logger.warning("diloco averaging failed (%s); using the local change", e)
        await self.context.compute(self._outer_step)
        tally.samples = 0
        context.advance_epoch()
        gathered = result.gathered.values() if result is not None else ()
        digests = {RoundNote.read(m).outer for m in gathered}
        if len(digests) > 1:
            # The members started from different points (one stepped alone: it saw nobody yet,
            # or its round failed); the same change keeps them apart for good. Average them.
            logger.info("epoch %d: the group's outer parameters differ; averaging them", context.epoch)
            await context.average_state(f"outer-state{context.epoch}", len(result.peers), frozenset(result.peers))
            await self.restart()

    def _take_change(self) -> None:
        """The parameters' change since the last outer step, into the delta averager (in a worker thread)."""
        with self.delta_averager.get_tensors() as deltas, torch.no_grad():
            torch._foreach_copy_(deltas, self.outer)
            torch._foreach_sub_(deltas, self.context.state.params)

    def _outer_step(self) -> None:
        """Apply the averaged change to the outer parameters, and start from them (in a worker thread)."""
        momentum, lr = self.options.outer_momentum, self.options.outer_lr
        with self.delta_averager.get_tensors() as deltas, self.context.state.lock(), torch.no_grad():
            # SGD with Nesterov momentum (as torch.optim.SGD computes it), all in place: no temporaries
            torch._foreach_mul_(self.momentum, momentum)
            torch._foreach_add_(self.momentum, deltas)
            torch._foreach_add_(deltas, self.momentum, alpha=momentum)
            torch._foreach_add_(self.outer, deltas, alpha=-lr)
            torch._foreach_copy_(self.context.state.params, self.outer)


def round_begun(context: RunContext, steps: int, due: int) -> bool:
    """Another live peer has entered our epoch's outer round (it made its inner steps first),
    and we have made `steps` of the `due` ones (local_steps; Streaming DiLoCo: a fragment's
    interval), at least 1 / MIN_JOIN_STEP_FRACTION of them, but the rest would take us past
    JOIN_WINDOW_FRACTION of its matchmaking window: join it now, with fewer inner steps (weighted
    by our samples). Waiting for all of ours, a slower peer came after the window, stepped alone,
    and fell further behind every round: two peers of unequal speed never met again."""
    return may_join(context, steps, due) and context.another_in_round(context.progress().reports)


def may_join(context: RunContext, steps: int, due: int) -> bool:
    """`round_begun` without the others: whether our steps so far would join another's round
    (cheap: the caller's thread asks it of its quiet steps)."""
    speed, settings = context.samples_per_second, context.settings
    if steps * MIN_JOIN_STEP_FRACTION < due or speed <= 0:
        return False
    rest = (due - steps) * settings.batch_size_per_step / speed
    return rest >= JOIN_WINDOW_FRACTION * settings.matchmaking_time  # else we come in time with all our steps
