"""Moshpit SGD (`Moshpit`): local steps, and every `local_steps` steps the parameters (and
optimizer statistics) averaged in place in Moshpit groups. No model-sized buffer beyond the model
and the wrapped optimizer.

Without a given grid every peer derives the same layout from what all of them see alike
(`place_on_grid`); Streaming DiLoCo places its fragment rounds the same way.
"""

from __future__ import annotations

import logging

from potluck.averaging.averager import Averager, moshpit_grid
from potluck.core.errors import AveragingError
from potluck.optim.context import RunContext
from potluck.optim.modes import Moshpit, TrainingMode
from potluck.optim.progress import RoundNote

__all__ = ["MoshpitTraining", "place_on_grid"]

logger = logging.getLogger(__name__)


class MoshpitTraining(TrainingMode):
    """Moshpit rounds of the state averager every `local_steps` local steps."""

    inner_step_first = True

    def __init__(self, context: RunContext, options: Moshpit):
        super().__init__(context)
        self.options = options
        self.steps = 0  # local steps since the last round
        self.fitted_grid = options.grid is None
        # Its peers meet whatever their epochs and never take the swarm's: a lead over ours ends
        # nothing here, and every live peer counts in the grid (`place_on_grid`), backed or not.
        context.tracker.backed_leads = False

    async def start(self) -> None:
        pass  # the state averager is all it needs

    async def step(self) -> None:
        await self.context.inner_step()
        self.steps += 1
        if self.steps >= self.options.local_steps:
            await self._round()

    async def _round(self) -> None:
        context, tally = self.context, self.context.tally
        averager = context.state.averager
        self.steps = 0
        try:
            if context.anyone_else():
                expected = place_on_grid(context, averager) if self.fitted_grid else None
                # in place; untouched on failure
                note = RoundNote(tally.samples, epoch=context.epoch).to_wire()
                result = await averager.astep(weight=float(tally.samples), target_group_size=expected, gather=note)
                context.state.generation += 1
                context.record_round(context.epoch, {p: RoundNote.read(m) for p, m in result.gathered.items()},
                                     result.contributors)
        except AveragingError as e:
            context.failed_rounds += 1
            logger.warning("moshpit averaging failed (%s); continuing locally", e)
        tally.samples = 0
        context.advance_epoch()


def place_on_grid(context: RunContext, averager: Averager, grid: tuple[int, ...] | None = None) -> int:
    """Moshpit without a given grid: every peer derives the same layout from what all of
    them see alike. The live peers (sorted ids) give the grid (`moshpit_grid`) and each one's
    cell (the digits of its rank); the epoch gives the round's dimension. Peers that agree
    meet as on the paper's torus: len(grid) rounds reach the exact mean. (Random cells and a
    per-peer round count left most peers alone in their groups, round after round.)
    Streaming DiLoCo places each fragment's `averager` on its given `grid` the same way.
    Returns the size of this round's group."""
    now = context.peer.dht.get_time()
    me = context.peer.peer_id
    ids = sorted({me, *(r.peer_id for r in context.progress().reports if r.live(now) and not r.idle)})
    grid = moshpit_grid(len(ids)) if grid is None else tuple(grid)
    if grid != averager.grid:
        logger.info("moshpit: %d peers average on a %s grid (groups of about %d)", len(ids),
                    "x".join(map(str, grid)), grid[0])
    cells = [_cell(rank, grid) for rank in range(len(ids))]
    mine = cells[ids.index(me)]
    averager.set_grid(grid, mine, round=context.epoch)
    dim = context.epoch % len(grid)
    # The group closes as soon as every peer of its line is in, not at the window's end.
    return sum(all(c[k] == mine[k] for k in range(len(grid)) if k != dim) for c in cells)


def _cell(rank: int, grid: tuple[int, ...]) -> list[int]:
    """The grid cell of the peer of `rank`: its digits in the grid's mixed radix."""
    digits = []
    for size in reversed(grid):
        rank, digit = divmod(rank, size)
        digits.append(digit)
    return digits[::-1]
