"""DeDLOC's synchronous mode (`Sync`): gradients accumulate locally until the whole collaboration
has processed `target_batch_size` samples (tracked through the DHT, and sent straight to the last
group's members; peers enter the round when the batch is due at everyone's reported speed, and a
stable group meets again without the DHT); then the peers average their gradients (weighted by
samples), every peer applies the same optimizer step, and the epoch advances (`epoch_samples`:
the samples behind it).

A group whose members' notes hold fewer samples than the target does not average: each member
keeps its gradients and accumulates on (`_enough`). A round that averaged fewer (a member did
not deliver) does not end the epoch either: its sum stays with one member. Every
`average_state_every` epochs the parameters and optimizer statistics are averaged too, which also
repairs any drift; that round is skipped when every member of the gradient round held the same
state (their digests travel with the gradients): it would change nothing.

Memory: one model-sized buffer beyond the model and the wrapped optimizer (the gradient
accumulator, averaged in place and handed to the optimizer as `.grad`); two with `delay_updates`
(the next epoch accumulates while the last one averages).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from potluck.averaging.averager import Averager
from potluck.averaging.role import Role
from potluck.core.errors import AveragingError
from potluck.core.runner import retrieve_exception, run_in_thread
from potluck.optim.context import RunContext
from potluck.optim.modes import Sync, TrainingMode
from potluck.optim.progress import GlobalProgress, PeerProgress, RoundNote
from potluck.optim.state import tensor_digest
from potluck.optim.verified import Case, Validation

__all__ = ["SyncTraining"]

logger = logging.getLogger(__name__)

# Tries of one epoch's gradient averaging while other live peers are still training on that
# epoch. A peer that applies its local gradients alone drifts from the swarm until the next state
# averaging, so it retries first (each try costs one matchmaking window); peers that left or went
# idle are not waited for (see PeerProgress.active).
MAX_ROUND_ATTEMPTS = 4


@dataclass(frozen=True)
class _Round:
    """A gradient-averaging round under way: its result, and which epoch it closes."""

    task: asyncio.Future  # the averager's astep
    epoch: int
    expected: int  # group size we asked for; reused for the state averaging after it
    samples: int  # our samples behind the averaged gradients (in the accumulator)
    members: frozenset[str] = frozenset()  # every live peer we knew of (see RunContext.members)
    duration: float = 0.0  # seconds the samples behind it accumulated (0: unknown)
    scale: float = 1.0  # what the accumulator was multiplied by for the round (`_share_of`)
    part: int = 0  # short rounds of the epoch before it
    params: str | None = None  # verified training: the digest of the parameters behind our gradients
    counted: frozenset[str] = frozenset()  # the other peers counted into `expected`


class SyncTraining(TrainingMode):
    """The sync mode's rounds over a run's context (see the module docstring)."""

    def __init__(self, context: RunContext, options: Sync, validation: Validation | None = None):
        super().__init__(context)
        self.options = options
        # Verified training (potluck.optim.verified): our batches come from public seeds, by their
        # index among the batches behind the accumulator (`batches`: taken since it was cleared).
        self.validation = validation
        self.batches = 0
        self.grad_averager: Averager | None = None  # the accumulator (see start)
        self._pending: _Round | None = None  # a delayed update under way
        self.attempt = 0  # failed averaging tries of the current epoch
        self.part_due: float | None = None  # loop time when the rest of a short round's batch is due
        self.cleared = True  # the accumulator counts as zeros (saves a pass over it per epoch)
        self.spare: list[torch.Tensor] | None = None  # delay_updates: the next epoch's accumulator
        # The state's digest for the next gradient round, hashed in the background right after
        # the last step (the state does not change while the next batches accumulate): (state
        # generation it was started at, its task).
        self.next_digest: tuple[int, asyncio.Future] | None = None

    @property
    def pending(self) -> _Round | None:
        return self._pending

    @pending.setter
    def pending(self, value: _Round | None) -> None:
        self._pending = value
        self.context.tally.ahead = value is not None  # our new samples count towards the next epoch

    async def start(self) -> None:
        # The gradient accumulator, averaged in place: sum of batch gradients x samples /
        # target_batch_size (about a mean gradient in size, whatever the codec).
        context = self.context
        zeros = await run_in_thread(_zeros_like, context.state.params)
        self.grad_averager = Averager(context.peer, zeros, context.run_id, name="grads", allow_state_sharing=False,
                                      powersgd_rank=self.options.powersgd_rank, keep_sealed=self.validation is not None,
                                      **context.settings.averaging())
        context.share_last_group(self.grad_averager)
        if self.validation is not None:  # accusations may come before our own round has ended here
            self.validation.running = self.grad_averager.service.group_of
            self.validation.audience = lambda: [r.peer_id for r in self.context.progress().reports]

    def batch(self) -> Any:
        """The batch our next step must compute (verified training)."""
        if self.validation is None:
            raise RuntimeError("batch() is for verified training: build the Optimizer with verify=Verified(...)")
        if self.validation.broken is not None:
            raise RuntimeError(self.validation.broken)
        return self.validation.batch(self.context.epoch, str(self.context.peer.peer_id), self.batches)

    def shutdown(self) -> None:
        if self.pending is not None:  # a delayed round under way ends with the averager: nobody reads it
            self.pending.task.add_done_callback(retrieve_exception)
        if self.grad_averager is not None:
            self.grad_averager.shutdown()

    async def step(self) -> None:
        context, tally = self.context, self.context.tally
        if not await self.context.compute(self._take_batch):
            logger.warning("dropping a batch with non-finite gradients (it is not shared with anyone)")
        elif context.settings.role != Role.AUX:
            tally.samples += context.settings.batch_size_per_step  # (here: reports read it meanwhile)
        if self.pending is not None:
            pending = self.pending
            if not pending.task.done() and not await context.give_up_round(pending.task, self.grad_averager,
                                                                            pending.epoch):
                return  # the last epoch's averaging is still running in the background
            await self._finish_update(pending)
        progress = context.progress()
        if progress.epoch == context.epoch + 1 and self.options.delay_updates:
            await self._update_epoch(progress)  # others started this epoch's round: join it now
        elif progress.epoch > context.epoch:
            await self._catch_up(progress.applied)  # the round is over: we are a straggler
        elif progress.part > tally.part and progress.epoch == context.epoch:
            tally.part = progress.part  # a short round we were not in: our samples still count
        elif progress.eta_seconds == 0 or (self.part_due is not None and context.now() >= self.part_due):
            await self._update_epoch(progress)  # the global batch is due now (extrapolated at everyone's speed)

    # -- accumulating (in worker threads) -------------------------------------------------------------
    def _take_batch(self) -> bool:
        """Add the batch's `.grad` to the accumulator; False if it is not finite."""
        params = self.context.state.params
        grads = [p.grad for p in params]
        finite = _finite(grads)
        self.batches += 1  # (a dropped batch keeps its index: validators skip it too)
        if finite and self.context.settings.role != Role.AUX:
            self._accumulate(grads)
        for p in params:
            p.grad = None
        return finite

    def _accumulate(self, grads: list[torch.Tensor | None]) -> None:
        """Add one batch's gradients to the accumulator (the spare one while a delayed update
        averages the other in the background)."""
        settings = self.context.settings
        scale = settings.batch_size_per_step / settings.target_batch_size
        if self.pending is None:
            if self.cleared and scale == 1 and _adoptable(grads, self.grad_averager):
                self.grad_averager.adopt_tensors(grads)  # no copy: the batch's gradients are the sum
                self.cleared = False
                return
            with self.grad_averager.get_tensors() as sums, torch.no_grad():
                if self.cleared:  # one pass instead of clearing, then adding
                    for total, g in zip(sums, grads, strict=True):
                        if g is None:
                            total.zero_()
                        else:
                            torch.mul(g, scale, out=total)
                    self.cleared = False
                else:
                    torch._foreach_add_([s for s, g in zip(sums, grads, strict=True) if g is not None],
                                        [g for g in grads if g is not None], alpha=scale)
        else:
            if self.spare is None:
                self.spare = _zeros_like(self.context.state.params)
            with torch.no_grad():
                torch._foreach_add_([s for s, g in zip(self.spare, grads, strict=True) if g is not None],
                                    [g for g in grads if g is not None], alpha=scale)

    def _share_of(self, samples: int, aux: bool) -> tuple[float, float]:
        """How the accumulator goes into a round: (factor, weight). The mean adds up shares: each
        peer's accumulator holds its samples' share of the global batch's sum, weight 1. A robust
        aggregation counts each sender once, so pieces must be alike but for noise: each peer
        sends its mean gradient (the sum x target / its samples); a peer with nothing of its own
        (aux, or no samples) asks to be left out (weight 0) instead of sending zeros."""
        if not self._sends_means:
            return 1.0, 1.0
        if aux or samples <= 0:
            return 1.0, 0.0
        return self.context.settings.target_batch_size / samples, 1.0

    @property
    def _sends_means(self) -> bool:
        """Under a robust aggregation each peer sends its mean gradient and the result is one;
        under the mean, its samples' share of the sum (see `_share_of`)."""
        return self.context.settings.aggregation != "mean"

    def _rest_due(self, held: int, speed: float) -> None:
        """A round short of the global batch: the rest is due at the members' speeds, which they
        just told each other (no need to wait for progress views)."""
        if speed > 0:
            self.part_due = self.context.now() + (self.context.settings.target_batch_size - held) / speed

    def _scale_sums(self, factor: float) -> None:
        with self.grad_averager.get_tensors() as sums, torch.no_grad():
            torch._foreach_mul_(sums, factor)

    def _carry_over(self, keep: float) -> None:
        """After a round: keep `keep` x the accumulator (0: clear it) and add the spare one (what
        was accumulated meanwhile)."""
        if keep == 0:
            self.batches = 0
        with self.grad_averager.get_tensors() as sums, torch.no_grad():
            if keep == 0 and self.spare is None:
                self.cleared = True
            elif keep == 0:
                torch._foreach_copy_(sums, self.spare)
            else:
                if keep != 1:
                    torch._foreach_mul_(sums, keep)
                if self.spare is not None:
                    torch._foreach_add_(sums, self.spare)
            if self.spare is not None:
                torch._foreach_zero_(self.spare)

    def _clear_now(self) -> None:
        """Really zero the accumulator if it only counts as cleared (before it is read)."""
        if self.cleared:
            with self.grad_averager.get_tensors() as sums:
                torch._foreach_zero_(sums)
            self.cleared = False

    # -- rounds -----------------------------------------------------------------------------------------
    def _training_peers(self, reports: Iterable[PeerProgress], epoch: int, live: bool) -> list[PeerProgress]:
        """Other peers that may average `epoch`'s gradients: not idle, and on that epoch (or,
        in a view that may be a moment old, one before it). With `live`, only those that
        reported within LIVE_SECONDS (not departed), on that very epoch (a fresh view)."""
        now, me = self.context.peer.dht.get_time(), self.context.peer.peer_id
        oldest = epoch if live else epoch - 1
        return [r for r in reports if r.peer_id != me and oldest <= r.epoch and r.done <= epoch
                and not r.idle and (not live or r.live(now))]

    async def _update_epoch(self, progress: GlobalProgress) -> None:
        """Average the accumulated gradients with the swarm and apply one optimizer step.

        With `delay_updates`, the averaging runs in the background while the next batches are
        computed, and its step is applied at the first `step()` after it ends (one or more steps
        stale, as in DeDLOC); otherwise `step()` waits for it.
        """
        context, tally = self.context, self.context.tally
        samples, epoch = tally.samples, context.epoch
        # Close the group once everyone training has joined; overestimating only costs the rest
        # of the matchmaking window, underestimating would split the swarm in two.
        others = self._training_peers(progress.reports, epoch, live=False)
        if not others and context.holds(progress.reports, epoch):
            return  # our gradients wait for the peers behind us (`RunContext.holds`)
        tally.samples, self.part_due = 0, None
        await self.context.compute(self._clear_now)
        expected = 1 + len(others)
        if not others:
            alone = asyncio.get_running_loop().create_future()  # nothing to average
            alone.set_exception(AveragingError("no other peer is training"))
            await self._finish_update(_Round(alone, epoch, expected, samples))
            return
        members = context.members(progress.reports)
        # Equal weights: each peer's accumulator already holds its samples' share of the sum. A
        # part after a short round has its own key: the short round's declarations are still live.
        # An aux peer holds no averaged state: its digest would say nothing. Digests all alike
        # after the round: no state round needed. A member whose state departed from the swarm's
        # sends its digest in any round: the group then averages the state after it (`repair`).
        aux = context.settings.role == Role.AUX
        state = await self.digest_now() if not aux and (self._averages_state_after(epoch) or context.departed) \
            else None
        params = None if self.validation is None or aux else await run_in_thread(self._params_digest)
        if params is not None:
            self.validation.record(epoch, params)
        gather = RoundNote(samples, context.samples_per_second, state, aux=aux, params=params).to_wire()
        scale, weight = self._share_of(samples, aux)
        if scale != 1.0:
            await self.context.compute(self._scale_sums, scale)
        task = asyncio.ensure_future(self.grad_averager.astep(
            weight=weight, gather=gather, group_key=f"epoch{epoch}.{tally.part}", target_group_size=expected,
            members=members, no_shows=context.no_shows(), proceed=self._enough))
        duration = context.epoch_seconds()
        pending = _Round(task, epoch, expected, samples, members, duration, scale, tally.part, params,
                         frozenset(str(r.peer_id) for r in others))
        if self.options.delay_updates:
            self.pending = pending  # our new samples count towards the next epoch meanwhile
            return
        # frozen: others stop extrapolating us
        tally.round_samples, tally.in_round, context.waited = samples, True, True
        report = asyncio.ensure_future(context.report())
        try:
            await context.wait_for_round(task, self.grad_averager, epoch)
            await report
        finally:
            tally.round_samples, tally.in_round = 0, False
        await self._finish_update(pending)

    def _enough(self, gathered: dict[str, Any]) -> bool:
        """Whether a formed group holds the global batch (the members' notes, as every member
        got them). Short of it (a peer computed slower than it reported), nothing is averaged:
        each member keeps its gradients and the round comes again with more. Averaging a short
        round would cost a whole all-reduce for nothing, and its result, carried into the next
        round by one member, would tie that member's next piece to this round's noise: under a
        robust aggregation the record of deviations read that as a persistent deviation and
        left honest members out."""
        return sum(RoundNote.read(m).samples for m in gathered.values()) >= self.context.settings.target_batch_size

    async def _finish_update(self, pending: _Round) -> None:
        """Apply an averaging round's result: the wrapped optimizer's step, and the new epoch."""
        context, tally = self.context, self.context.tally
        self.pending = None
        task, epoch, target = pending.task, pending.epoch, context.settings.target_batch_size
        error = AveragingError("the swarm's round ended without us") if task.cancelled() else task.exception()
        if error is None and task.result().skipped:
            result = task.result()
            notes = [RoundNote.read(m) for m in result.gathered.values()]
            held = sum(n.samples for n in notes)
            self._rest_due(held, sum(n.speed for n in notes))
            logger.info("epoch %d: the group had %d of %d samples; accumulating on", epoch, held, target)
            await self.context.compute(self._carry_over, 1 / pending.scale)
            tally.samples += pending.samples
            tally.part += 1
            context.publish()
            return
        if error is None:
            result = task.result()
            context.group_formed(result.peers, pending.counted)
            notes = {p: RoundNote.read(m) for p, m in result.gathered.items()}
            total = sum(notes[p].samples for p in result.contributors if p in notes)
            context.record_round(epoch, notes, result.contributors,
                                 result.contributors[0] if total < target else None)
            if total < target:
                # Short of the global batch (a peer computed slower than it reported): the sum
                # stays with one member, the first contributor, and the epoch goes on; every
                # member decides alike from the same group.
                keeper = result.contributors[:1] == [context.peer.peer_id]
                self._rest_due(total, sum(notes[p].speed for p in result.contributors if p in notes))
                logger.info("epoch %d: the round had %d of %d samples; accumulating on", epoch, total, target)
                kept = total / target if self._sends_means else len(result.contributors)  # the sum's share
                await self.context.compute(self._carry_over, kept if keeper else 0.0)
                tally.samples += total if keeper else 0
                tally.part += 1
                context.epoch_began = context.now()
                context.publish()
                return
            logger.info("epoch %d: averaged gradients of %d samples with %d peers", epoch, total, result.group_size)
            averaged = {p: notes[p].samples for p in result.contributors if p in notes and not notes[p].aux}
            context.tracker.averaged(averaged, pending.duration, context.peer.dht.get_time())
            digests = [n.state for n in notes.values() if not n.aux]
            same = bool(digests) and digests[0] is not None and all(d == digests[0] for d in digests)
            repair = any(d is not None for d in digests)  # (in a round due for it, every member's is there)
            per_sample = 1 / target if self._sends_means else len(result.contributors) / total
            if self.validation is not None and pending.part == 0:
                await self._maybe_validate(result, notes, pending)
            context.grouped(pending.duration)
            await self._apply_gradients(per_sample, total, pending.expected, pending.members, same_state=same,
                                        repair=repair)
            return
        me = context.peer.peer_id
        others = [r for r in context.progress().reports if r.peer_id != me]
        if others:  # alone we know the answer; otherwise ask the DHT what happened meanwhile
            others = [r for r in await context.fresh_reports() if r.peer_id != me]
        if any(r.done > epoch for r in others):
            logger.info("epoch %d: missed the swarm's round (%s); catching up", epoch, error)
            await self.context.compute(self._carry_over, 0.0)
            await self._catch_up(max(r.done for r in others))
            return
        self.attempt += 1
        context.failed_rounds += 1
        waiting = self._training_peers(others, epoch, live=True)  # not those gone or idle
        if waiting and self.attempt < MAX_ROUND_ATTEMPTS:
            logger.info("epoch %d: averaging failed (%s); %d peer(s) still training on this epoch: trying again",
                        epoch, error, len(waiting))
            await self.context.compute(self._carry_over, 1 / pending.scale)
            tally.samples += pending.samples
            return
        if waiting:
            logger.warning("epoch %d: averaging failed %d times (%s); applying local gradients",
                           epoch, self.attempt, error)
            context.departed = True  # the others may have averaged without us
        await self._apply_gradients(1 / (max(pending.samples, 1) * pending.scale), pending.samples, pending.expected)

    async def _apply_gradients(self, per_sample: float, samples: int, expected: int,
                               members: frozenset[str] | None = None, same_state: bool = False,
                               repair: bool = False) -> None:
        """The wrapped optimizer's step on the accumulator (x `per_sample` x target: the mean
        gradient), handed over as `.grad` without a copy; then the next epoch. The state is
        averaged after it if due, or if a member of the round said its state departed (`repair`:
        it sent its digest when none was due), unless every member of the round held the same
        state before it (`same_state`): the same step on the same state leaves them all alike."""
        context = self.context
        await self.context.compute(self._step_on_average, per_sample)
        context.epoch_samples = samples
        average_state = (self._averages_state_after(context.epoch) or repair) and not same_state \
            and not self._alone()  # alone, there is nobody to average with
        context.tally.in_round = bool(average_state)  # already in the new epoch's first report
        self.attempt, self.part_due = 0, None
        context.advance_epoch()
        if average_state:
            await context.average_state(f"state{context.epoch}", expected, members)
            context.epoch_began = context.now()  # the new epoch's samples come after it
        self.prepare_digest()

    async def _maybe_validate(self, result: Any, notes: dict[str, RoundNote], pending: _Round) -> None:
        """Verified training: perhaps recompute one member's gradients of this round (in the
        background, at this round's parameters; see potluck.optim.verified). Only members that
        computed at the parameters we hold, in the epoch's first round (a later one may carry a
        short round's sum), with sealed blocks of their pieces; the first time, ourselves."""
        context, me = self.context, str(self.context.peer.peer_id)
        bsz = context.settings.batch_size_per_step
        self.validation.remember(result.group)
        candidates = {p: notes[p].samples for p in result.contributors
                      if p in notes and result.sealed.get(p) and not notes[p].aux
                      and notes[p].params == pending.params and notes[p].samples >= bsz}
        peer = self.validation.draw(candidates, pending.samples, me)
        if peer is None:
            return
        await context.compute(self.validation.snapshot, context.state.params)
        case = Case(result.group, pending.epoch, peer, result.gathered[peer], tuple(result.sealed[peer]))
        self.validation.start(case)

    def _params_digest(self) -> str:
        return tensor_digest(self.context.state.params)

    def _step_on_average(self, per_sample: float) -> None:
        """The wrapped optimizer's step on the averaged accumulator, then clear it (in a worker thread)."""
        context = self.context
        self._clear_now()
        with self.grad_averager.get_tensors() as sums, torch.no_grad():
            scale = per_sample * context.settings.target_batch_size
            if scale != 1:
                torch._foreach_mul_(sums, scale)
            for p, t in zip(context.state.params, sums, strict=True):
                p.grad = t if t.dtype == p.dtype else t.to(p.dtype)  # float32 sums of a 16-bit model
            try:
                context.state.inner_step(closes_epoch=context.epoch + 1)
            finally:
                for p in context.state.params:
                    p.grad = None
        self._carry_over(0.0)

    async def _catch_up(self, epoch: int) -> None:
        """We are a straggler: take the swarm's state (gradients older than the last epoch are
        dropped; in verified training, all: they are not of the new epoch's public batches)."""
        self.attempt, self.part_due = 0, None
        if self.validation is not None:
            await self.context.compute(self._carry_over, 0.0)
            self.context.tally.samples = 0
        await self.context.catch_up(epoch, drop=lambda: self.context.compute(self._carry_over, 0.0))

    def _alone(self) -> bool:
        """No other peer's progress report in view: no round to average the state or carry its digest."""
        return len(self.context.progress().reports) <= 1

    def _averages_state_after(self, epoch: int) -> bool:
        every = self.options.average_state_every
        return bool(every) and (epoch + 1) % every == 0

    # -- the state's digest -------------------------------------------------------------------------------
    def state_digest(self) -> str:
        """A digest of the parameters and optimizer statistics, exact to the bit."""
        return self.context.state.digest()

    def prepare_digest(self) -> None:
        """Start hashing the state now if the next gradient round carries its digest: it costs
        3x the model at about 0.8 GB/s (1.4 s for 100M parameters with Adam), which would
        otherwise delay our joining that round. Alone there is no round to join: the hash would only
        hold the state's lock, and so the next steps, for nothing (`digest_now` hashes on demand if a
        partner comes)."""
        if self.next_digest is not None:
            _drop(self.next_digest[1])
        self.next_digest = None
        if self.context.settings.role != Role.AUX and self._averages_state_after(self.context.epoch) \
                and not self._alone():
            task = asyncio.ensure_future(run_in_thread(self.state_digest))
            self.next_digest = (self.context.state.generation, task)

    async def digest_now(self) -> str:
        """The state's digest: the one hashed after the last step if nothing wrote the state
        since (its generation), else hashed now."""
        state = self.context.state
        prepared, self.next_digest = self.next_digest, None
        if prepared is not None and prepared[0] == state.generation:
            digest = await prepared[1]
            if prepared[0] == state.generation:  # nothing wrote the state while hashing
                return digest
        elif prepared is not None:
            _drop(prepared[1])
        return await run_in_thread(self.state_digest)


def _drop(task: asyncio.Future) -> None:
    """Cancel a background task whose result is no longer wanted, and mark its outcome seen."""
    task.cancel()
    task.add_done_callback(retrieve_exception)


def _zeros_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Accumulators for gradients of `tensors`: float32 for float16/bfloat16 ones, whose own
    precision (8 bits of mantissa for bfloat16) would drop small batches' gradients from a sum
    of many. Views of one buffer per dtype and device: glibc maps a buffer that large on its own
    and unmaps it when freed, so when a batch's gradients take the accumulator's place
    (`_adoptable`) its memory goes back to the system (separate tensors made in another thread
    went back to that thread's heap, where nothing used them again: +1 model of RSS)."""
    dtypes = [torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype for t in tensors]
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t, dtype in zip(tensors, dtypes, strict=True):
        sizes[dtype, t.device] = sizes.get((dtype, t.device), 0) + t.numel()
    buffers = {(dtype, device): torch.zeros(n, dtype=dtype, device=device) for (dtype, device), n in sizes.items()}
    offsets = dict.fromkeys(buffers, 0)
    views = []
    for t, dtype in zip(tensors, dtypes, strict=True):
        key, n = (dtype, t.device), t.numel()
        views.append(buffers[key][offsets[key]:offsets[key] + n].view(t.shape))
        offsets[key] += n
    return views


def _adoptable(grads: list[torch.Tensor | None], averager: Averager) -> bool:
    """Whether a batch's gradients can become the cleared accumulator instead of being copied
    into it (one pass over the model saved per epoch): each its own whole, dense storage, that
    nothing else holds (not a view into a buffer that is used again, such as a bucket of a
    machine's ranks), and alike to the accumulator in shape, dtype and device."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # private in torch: without it, copy
    if use_count is None:
        return False
    with averager.get_tensors() as sums:
        alike = all(g is not None and (g.shape, g.dtype, g.device) == (s.shape, s.dtype, s.device)
                    for g, s in zip(grads, sums, strict=True))
    if not alike:
        return False
    for g in grads:
        storage = g.untyped_storage()
        if g._base is not None or g.storage_offset() != 0 or not g.is_contiguous() \
                or storage.nbytes() != g.numel() * g.element_size() or use_count(storage._cdata) != 2:
            return False  # (2: the gradient's tensor and `storage` here)
    return len({g.data_ptr() for g in grads}) == len(grads)


def _finite(grads: list[torch.Tensor | None]) -> bool:
    """No NaN or infinity in the batch's gradients. One pass: a finite sum proves every value
    finite (a sum that overflows float also drops the batch; such gradients are no use)."""
    sums = [g.detach().sum(dtype=torch.float32) for g in grads if g is not None]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())
