"""`potluck.Optimizer`: train one model together with whoever shows up.

Wraps any `torch.optim.Optimizer` and is one, so plain loops, Hugging Face `Trainer` and
Lightning can use it. Call `step()` after every local batch of `batch_size_per_step` samples.

This class keeps the torch API only (`step`, `zero_grad`, `state_dict`, checkpoints, metrics);
how the peers train together is the training mode's (`potluck.optim.modes`: sync, moshpit,
diloco), over the run's shared context (`potluck.optim.context`: the model's state, progress,
epochs, catching up).

A newcomer downloads the current state before its first step; a peer that falls behind catches
up the same way. It takes the state that most donors agree on among the live peers of its
progress view, at an epoch that view supports (docs/security.md: donors may lie).

Memory: potluck averages into and out of tensors that exist anyway (parameters, optimizer
statistics), and serves newcomers from a snapshot taken only when one asks. Model-sized buffers
it holds beyond the model and the wrapped optimizer (one peer, between rounds): sync 1 (2 with
`delay_updates`), moshpit 0, diloco 3 (each mode's module says which). A round with others uses
buffers of the averaged size (a flat snapshot and the result, and a shard to reduce), which the
peer's buffer pool keeps for the next rounds up to `MAX_POOLED_BYTES` in all; a donor holds at
most one copy of its state while newcomers download it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from potluck.averaging.averager import Averager, stateless_codec
from potluck.averaging.role import Role
from potluck.core import serialization
from potluck.core.errors import SerializationError
from potluck.core.peer_like import PeerLike
from potluck.core.runner import CallerThread
from potluck.optim.context import EpochEvent, RunContext, RunSettings
from potluck.optim.diloco import DiLoCoTraining
from potluck.optim.modes import DiLoCo, ModeOptions, Moshpit, Sync, TrainingMode, mode_options, run_schema
from potluck.optim.moshpit import MoshpitTraining
from potluck.optim.progress import GlobalProgress, ProgressTracker, checked_metrics
from potluck.optim.state import ModelState
from potluck.optim.streaming import StreamingDiLoCo
from potluck.optim.sync import SyncTraining
from potluck.optim.verified import Validation, Verified

__all__ = ["CHECKPOINT_FORMAT", "Optimizer", "default_aggregation"]

# Version tag of checkpoint files.
CHECKPOINT_FORMAT = "potluck-checkpoint-1"


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer; see the module docstring.

    Args:
        peer: a started `potluck.Peer`; the async API (`astart`, `astep`) takes any `PeerLike`.
        run_id: the name of the training run; peers with the same run_id train together.
        params: the model's parameters (as for any torch optimizer); `model.named_parameters()`
            makes their names part of the run schema and of its errors.
        optimizer: a torch optimizer over `params`, or a callable `params -> optimizer`.
        target_batch_size: samples in one global batch (one epoch) across all peers.
        batch_size_per_step: samples behind each call to `step()` on this peer.
        scheduler: a learning-rate scheduler over the wrapped optimizer, or a callable
            `optimizer -> scheduler`; stepped once per epoch.
        mode: "sync", "moshpit" or "diloco" with that mode's options as keywords (`local_steps=64`,
            ...), or the options themselves: `potluck.optim.Sync(...)`, `Moshpit(...)`, `DiLoCo(...)`,
            whose docstrings list them.
        role: a `potluck.Role` (or its value): NODE "node", CLIENT "client" (behind NAT) or AUX
            "aux" (helps average, trains nothing; the load split gives it a shard only where that
            shortens the round: with two senders each sends and receives one vector whoever
            reduces, so it gets none).
        compression: codec of each round (`potluck.compression.known_codecs()`): of the gradients
            (sync), the pseudo-gradients (diloco), the state (moshpit, whose rounds average it). The
            state that sync and diloco average every few epochs goes losslessly: a lossy codec on
            the wrapped optimizer's statistics (Adam's second moments) breaks training.
        aggregation: "mean", "centered_clip" or "trimmed_mean": how every averaging round of the
            run combines members' tensors (see `Averager`; robust ones bound what a minority of
            malicious members can do: docs/security.md). Not with Sync's powersgd_rank. By
            default (None, `default_aggregation`): "centered_clip" in an open run (anyone may
            join) of the sync and diloco modes; "mean" where an authority admits the peers, with
            powersgd_rank, and in the moshpit mode.
        matchmaking_time, averaging_timeout: seconds a round's group gathers; its all-reduce's deadline.
            A DiLoCo round gathers at least two of the slowest training peer's steps (a peer joins
            only between steps), at most 8x matchmaking_time (`RunContext.round_window`).
        bandwidth: this peer's link in bytes/s, one number for up and down or (up, down): the
            rounds' load split takes it instead of measuring, and over TCP (Linux) they pace their
            sends to the upload, which keeps a long link's queue short (see `Averager`). Give the
            real rate (a speed test's): a smaller one slows the rounds down to it.
        load_state: download the swarm's state at start (newcomers), within `load_state_timeout`.
        start: join the run now (see `astart`).
        verify: `potluck.optim.Verified(model, loss, dataset)` for verified training (sync mode,
            no compression, no delay_updates or PowerSGD): each step computes `loss(model,
            self.batch())`, a batch drawn from a public seed, and peers recompute a random
            share of each other's gradients and ban those that lie (`potluck.optim.verified`).

    Peers train together only if their run schema matches (`potluck.optim.schema`, `self.schema`):
    the trained parameters' names, dtypes and shapes, the mode and its options (all but
    `Sync.delay_updates`), `target_batch_size`, `compression`, `aggregation`, and the wrapped
    optimizer's class and hyperparameters (all but the learning rate and implementation switches).
    A peer whose schema differs from a run's is not counted by its peers; once it sees the run's
    peers complete rounds without it, its `step()` raises `ModelMismatch` naming the first
    difference.

    `step()` hands each batch to `astep()`, which runs the collaborative logic on the peer's
    event loop; code that runs on that loop awaits `astep()` itself (tensor math runs in worker
    threads, so under `potluck.core.virtual_time` it costs no virtual time).
    """

    def __init__(self, peer: PeerLike, run_id: str, params: Iterable[Any], optimizer: Any,
                 target_batch_size: int, batch_size_per_step: int, scheduler: Any = None, *,
                 mode: str | ModeOptions = "sync", role: Role | str = Role.NODE, compression: Any = "none",
                 aggregation: str | None = None, matchmaking_time: float = 1.0, averaging_timeout: float = 30.0,
                 bandwidth: float | tuple[float, float] | None = None,
                 load_state: bool = True, load_state_timeout: float = 30.0, start: bool = True,
                 verify: Verified | None = None, **options: Any):
        options = mode_options(mode, options)
        aggregation = default_aggregation(peer, options) if aggregation is None else aggregation
        stateless_codec(compression)  # refused now, not when the first round's averager is built
        if target_batch_size <= 0 or batch_size_per_step <= 0:
            raise ValueError("target_batch_size and batch_size_per_step must be positive")
        if verify is not None:
            _check_verifiable(options, compression)
        params = list(params)
        self.inner = optimizer(params) if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
            else optimizer
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a callable that builds one")
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups = self.inner.param_groups  # one set of groups and state, shared
        self.state = self.inner.state
        self.scheduler = scheduler(self.inner) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self.peer, self.run_id, self.mode = peer, run_id, options.name
        # Verified peers must draw the same batches from the same data to check each other.
        verified = None if verify is None else {"dataset": verify.dataset_digest(), "batch_size": batch_size_per_step}
        self.schema = run_schema(self.inner, options, target_batch_size, compression, aggregation, verified)
        settings = RunSettings(target_batch_size, batch_size_per_step, Role(role), compression, aggregation,
                               matchmaking_time, averaging_timeout, self.schema.fingerprint, bandwidth)
        trained = [p for g in self.inner.param_groups for p in g["params"] if p.requires_grad]
        options.check(sum(p.shape[0] if p.dim() else 1 for p in trained))
        # Moshpit averages the state every round; the other modes only now and then (a record of
        # deviations would collect too few steps there, at two state sizes of memory)
        state_averaging = {**settings.averaging(), "compression": options.state_codec(compression),
                           "deviations": isinstance(options, Moshpit)}
        model = ModelState(peer, run_id, self.inner, options.extra_state(trained), state_averaging,
                           options.state_grid(), options.versions_follow_epochs, self.schema)
        self.context = RunContext(peer, run_id, model, self.scheduler, settings, self.schema)
        self.validation = None if verify is None else \
            Validation(verify, run_id, batch_size_per_step, target_batch_size, model.params, aggregation != "mean")
        self.training = _training(self.context, options, self.validation)
        if self.validation is not None:
            self.context.tracker.caught = self.validation.banned_at  # monitors credit them nothing
        stats = peer.transport.stats
        self._wire_at_start = (stats.bytes_sent, stats.bytes_received)
        self._load_state, self._load_state_timeout = load_state, load_state_timeout
        self._started = False
        if start:
            self.peer.run(self.astart())

    async def astart(self) -> None:
        """Join the run: download the swarm's state (a newcomer), offer ours, publish progress.
        The constructor does this unless given `start=False` (code on the peer's event loop,
        which cannot block on it, awaits this instead)."""
        if self._started:
            return
        self._started = True
        if self._load_state:  # before the model-sized buffers below: a newcomer's peak is its state
            await self.context.try_load_state(self._load_state_timeout)
        await self.training.start()
        if self.validation is not None:
            self.validation.attach(self.peer.transport)
        await asyncio.wait_for(self.state_averager.announce_state(), 30)
        self.context.start_progress()

    # -- torch.optim.Optimizer ---------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Account for one local batch; averages and updates when the swarm is ready.

        The gradients in `.grad` are consumed (cleared), so calling `zero_grad()` is optional; in
        sync mode their memory may become the accumulator's, so keep a copy, not a reference.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        context = self.context
        if self.training.inner_step_first and self._started and not context.stepping:
            context.state.inner_step()  # here, under the state's lock: no hop to a worker thread
            if self.training.quiet_step():
                return loss  # counted here too: nothing for the event loop to do
            context.inner_taken = True
        caller = CallerThread()  # the rest of the step's tensor math runs here too (RunContext.compute)
        context.caller = caller
        try:
            self.peer.run(self.astep(), caller=caller)
        finally:
            if context.caller is caller:
                context.caller = None
            context.last_hop = time.monotonic()
        return loss

    async def astep(self) -> None:
        """`step()` on the peer's event loop (without a closure): the `.grad` of one local batch."""
        context = self.context
        if context.stepping:
            raise RuntimeError("step() is already running: call it from one thread at a time")
        if not self._started:
            raise RuntimeError("the optimizer has not joined the run: await astart() first")
        context.check_model()  # raises ModelMismatch once we found our model is not the run's
        context.measure_speed()
        context.waited, context.stepping = False, True
        try:
            await self.training.step()
        finally:
            context.stepping, context.inner_taken = False, False
            if context.waited:  # time spent in rounds or downloads is not computing time
                context.last_step_time = context.now()

    def batch(self) -> Any:
        """Verified training: the batch the next `step()` must compute the gradients of (drawn
        from the dataset by a public seed, which other peers use to check it)."""
        if not isinstance(self.training, SyncTraining):
            raise RuntimeError("batch() is for verified training: build the Optimizer with verify=Verified(...)")
        return self.training.batch()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "epoch": self.local_epoch,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.context.state.load_inner(state["inner"])
        self.context.epoch = int(state.get("epoch", 0))
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.state_averager.state_metadata = self.context.state.metadata(self.local_epoch)

    # -- the run, as this peer sees it -------------------------------------------------------------------
    @property
    def local_epoch(self) -> int:
        """Epochs (global batches, or outer rounds) this peer's model has been through."""
        return self.context.epoch

    @property
    def accumulating_epoch(self) -> int:
        """The epoch our new samples count towards: one ahead while a delayed update is running."""
        return self.context.accumulating_epoch

    @property
    def epoch_samples(self) -> int:
        """Samples of the whole swarm behind the last epoch applied."""
        return self.context.epoch_samples

    @property
    def samples_per_second(self) -> float:
        return self.context.samples_per_second

    @property
    def catch_ups(self) -> int:
        """Times this peer fell behind the swarm and downloaded its state."""
        return self.context.catch_ups

    @property
    def state_averager(self) -> Averager:
        """The averager of the parameters and optimizer statistics (and the state's donor)."""
        return self.context.state.averager

    @property
    def tracker(self) -> ProgressTracker:
        return self.context.tracker

    def progress(self) -> GlobalProgress:
        """The collaboration's progress as this peer estimates it now."""
        return self.context.progress()

    def register_epoch_hook(self, hook: Callable[[EpochEvent], None]) -> RemovableHandle:
        """Call `hook(EpochEvent)` on the peer's event loop whenever this peer's epoch changes (an
        update, or catching up with the swarm); `.remove()` the returned handle to stop."""
        return self.context.register_epoch_hook(hook)

    def report_metrics(self, loss: float | None = None, **values: float) -> None:
        """Publish training metrics (the loss, accuracies...) with our next progress records, for
        monitors (`potluck monitor`): at most MAX_METRICS names of MAX_METRIC_NAME_CHARS
        characters, finite numbers (ValueError otherwise). They replace the last ones reported."""
        if loss is not None:
            values = {"loss": float(loss), **values}
        self.context.metrics = (self.peer.dht.get_time(), checked_metrics(values))

    def bytes_per_sample(self) -> tuple[float, float]:
        """(sent, received): bytes on this peer's wire since the optimizer was built, per sample
        it processed (0.0 before the first), from its transport's counters (`transport.stats`).
        The figure that compares modes' traffic; it counts all the peer's traffic (the DHT, state
        downloads, and any other optimizer on the same peer)."""
        stats, (sent, received) = self.peer.transport.stats, self._wire_at_start
        samples = max(self.context.samples_processed, 1)
        return (stats.bytes_sent - sent) / samples, (stats.bytes_received - received) / samples

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save the collaboration's state as this peer holds it (parameters, optimizer statistics,
        epoch, scheduler). Our own safe format, never pickle. Any peer can do it at any time."""
        state = {"format": CHECKPOINT_FORMAT, "run_id": self.run_id, "epoch": self.local_epoch,
                 "params": [p.detach().clone() for p in self.context.state.params],
                 "optimizer": self.inner.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(serialization.dumps(state))
        os.replace(tmp, path)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Resume from `save_checkpoint`'s file; other peers then download this state from us."""
        try:
            state = serialization.loads(Path(path).read_bytes())
        except SerializationError:
            state = None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a potluck checkpoint")
        try:
            self.context.state.load_params(state["params"])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        self.context.state.load_inner(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.context.epoch = int(state["epoch"])
        self.state_averager.state_metadata = self.context.state.metadata(self.local_epoch)
        self.state_averager.round = self.local_epoch  # the version newcomers compare
        self.peer.run(self.state_averager.announce_state(), 30)
        self.peer.run(self.context.report(), 30)  # newcomers refuse a state whose epoch no progress record supports

    def shutdown(self) -> None:
        """Stop publishing progress and serving averaging; the peer itself stays up."""
        self.context.stop()
        self.training.shutdown()
        if self.validation is not None:
            self.validation.detach()


def default_aggregation(peer: PeerLike, options: ModeOptions) -> str:
    """The aggregation of a run that names none: CenteredClip in an open run of the sync and
    diloco modes (identities are free there, and under the mean one member sets everyone's
    parameters to anything: see docs/security.md); the mean where an authority admits the peers
    (it can revoke a liar), under PowerSGD (its factors are not a robust aggregation's pieces),
    and in the moshpit mode (its pieces are parameters, which honest peers of different speeds
    hold apart for many rounds: a record of deviations would read that as lying)."""
    governed = getattr(getattr(peer, "transport", None), "membership", None) is not None
    if governed or isinstance(options, Moshpit) or getattr(options, "powersgd_rank", None) is not None:
        return "mean"
    return "centered_clip"


def _check_verifiable(options: ModeOptions, compression: Any) -> None:
    """ValueError unless verified training can check this run's gradients exactly: the sync mode
    (one gradient per round, computed at parameters every member holds), sent losslessly."""
    if not isinstance(options, Sync):
        raise ValueError("verified training needs mode='sync' (other modes average parameters or changes, "
                         "which nobody can recompute from a seed)")
    if options.delay_updates or options.powersgd_rank is not None:
        raise ValueError("verified training needs Sync without delay_updates and powersgd_rank (gradients "
                         "sent as computed, at the parameters of their epoch)")
    if getattr(stateless_codec(compression), "name", None) != "none":
        raise ValueError("verified training needs compression='none': a lossy code hides small lies")


def _training(context: RunContext, options: ModeOptions, validation: Validation | None = None) -> TrainingMode:
    """The training mode that `options` describe, over `context`."""
    if isinstance(options, Sync):
        return SyncTraining(context, options, validation)
    if isinstance(options, Moshpit):
        return MoshpitTraining(context, options)
    if isinstance(options, DiLoCo):
        return StreamingDiLoCo(context, options) if options.streaming else DiLoCoTraining(context, options)
    raise TypeError(f"no training mode for {options!r}")
