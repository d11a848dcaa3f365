"""`potluck.Optimizer`: train one model together with whoever shows up.

Wraps any `torch.optim.Optimizer` and is one, so plain loops, Hugging Face `Trainer` and
Lightning can use it. Call `step()` after every local batch of `batch_size_per_step` samples.

Modes:
- "sync" (DeDLOC): gradients accumulate locally until the whole collaboration has processed
  `target_batch_size` samples (tracked through the DHT, and sent straight to the last group's
  members; peers enter the round when the batch is due at everyone's reported speed, and a
  stable group meets again without the DHT); then the peers average their gradients (weighted by
  samples), every peer applies the same optimizer step, and the epoch advances (`epoch_samples`:
  the samples behind it). A round that gathered fewer samples than the target does not end the
  epoch: its sum stays with one member and the peers accumulate on. Every
  `average_state_every` epochs the parameters and optimizer statistics are averaged too, which
  also repairs any drift; that round is skipped when every member of the gradient round held the
  same state (their digests travel with the gradients): it would change nothing.
- "moshpit": local SGD; every `local_steps` steps the parameters are averaged in Moshpit groups.
- "diloco": `local_steps` inner steps of the wrapped optimizer, then an outer step with Nesterov
  momentum on the averaged change of the parameters (a slower peer joins the round that a faster
  one entered, with fewer inner steps: `round_begun`). Streaming DiLoCo with `fragments`,
  `outer_delay` and `outer_compression` (`potluck.optim.streaming`): one fragment of the model at
  a time, its round overlapped with the next inner steps, its pseudo-gradient compressed.

A newcomer downloads the current state before its first step; a peer that falls behind catches
up the same way. It takes the state that most donors agree on among the live peers of its
progress view, at an epoch that view supports (docs/security.md: donors may lie).

Memory: potluck averages into and out of tensors that exist anyway (parameters, optimizer
statistics), and serves newcomers from a snapshot taken only when one asks. Model-sized buffers
it holds beyond the model and the wrapped optimizer (one peer, between rounds):
- "sync": 1 (the gradient accumulator, averaged in place and handed to the optimizer as `.grad`);
  2 with `delay_updates` (the next epoch accumulates while the last one averages).
- "moshpit": 0.
- "diloco": 3 (the outer starting point, the averaged change, the outer momentum; the momentum
  is part of the state that newcomers download and that groups average when they differ).
  Streaming (fragments, outer_delay or outer_compression): the same 3, each split among the
  fragments (outer parameters, momentum, pseudo-gradient buffers), plus 1 with a top-k
  `outer_compression` (the error feedback residuals); a round holds flat buffers of one
  fragment, not of the model.
A round with others uses buffers of the averaged size (a flat snapshot and the result, and a
shard to reduce), which the peer's buffer pool keeps for the next rounds up to
`MAX_POOLED_BYTES` in all; a donor holds at most one copy of its state while newcomers
download it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from potluck.averaging.averager import Averager, moshpit_grid
from potluck.averaging.role import Role
from potluck.averaging.state_transfer import Manifest
from potluck.core import compat, serialization
from potluck.core.errors import AveragingError, SerializationError
from potluck.core.peer_like import PeerLike
from potluck.core.runner import retrieve_exception, run_in_thread
from potluck.net.identity import PeerID
from potluck.optim.progress import (
    MAX_SPEED_RATIO,
    GlobalProgress,
    PeerProgress,
    ProgressTracker,
    RoundNote,
    RoundRecord,
    checked_metrics,
)
from potluck.optim.streaming import StreamingConfig, StreamingDiLoCo
from potluck.optim.streaming import tensor_digest as _digest

logger = logging.getLogger(__name__)

MODES = ("sync", "moshpit", "diloco")
# How often progress is published and read (seconds): often enough that peers enter an averaging
# round within a fraction of the matchmaking window of each other.
PROGRESS_INTERVAL = 0.1
# With neighbors (the last group's members, who hear from us directly at every change), progress
# goes through the DHT only every this many intervals: it is for newcomers and for noticing them.
DHT_EVERY_WITH_NEIGHBORS = 4
# Weight of the newest measurement in the samples-per-second estimate.
SPEED_SMOOTHING = 0.3
# Version tag of checkpoint files.
CHECKPOINT_FORMAT = "potluck-checkpoint-1"
# A peer further behind than this many epochs drops its accumulated gradients when it catches up.
MAX_STALE_EPOCHS = 1
# Tries of one epoch's gradient averaging while other live peers are still training on that
# epoch. A peer that applies its local gradients alone drifts from the swarm until the next state
# averaging, so it retries first (each try costs one matchmaking window); peers that left or went
# idle are not waited for (see PeerProgress.active).
MAX_ROUND_ATTEMPTS = 4
# A peer that has not called step() for this many of its own step intervals (and at least
# IDLE_FLOOR_SECONDS) reports itself idle: others stop waiting for it (e.g. it finished its work
# but stays online), and it catches up when it trains again. The floor is long: a busy machine
# can starve a training thread for a second, and a peer wrongly left out of the expected group
# size can split the swarm's round in two.
IDLE_STEP_INTERVALS = 4
IDLE_FLOOR_SECONDS = 5.0
# Epochs a downloaded state's scheduler may be moved on by replaying its steps one by one, when it
# is not a torch scheduler whose learning rate at any epoch has a closed form (those move in one
# call): about 3 us a step, so at most a tenth of a second.
MAX_REPLAYED_SCHEDULER_STEPS = 30_000
# A donor's state may be this many epochs ahead of the epoch our progress view supports. The view
# lags the donors by up to a report's life (LIVE_SECONDS), and a swarm with sub-second epochs (small
# models, the tests) moves several epochs meanwhile: honest donors at epoch view + 2 were refused,
# and the peer that needed them never caught up. The cap is against jumps of orders of magnitude
# (epoch 10^7 spins a scheduler; 10^9 moves every later epoch); a smaller one still needs most of
# the vouched donors to agree on the state.
MAX_STATE_EPOCH_LEAD = 8
# A peer that downloaded a state still older than the swarm's waits this long before asking again
# (the donors are applying the newest epoch this very moment), instead of downloading in a loop.
CATCH_UP_RETRY_SECONDS = PROGRESS_INTERVAL
# A DiLoCo peer joins an outer round another peer has entered (Optimizer.round_begun) only after
# `local_steps` / this of its own inner steps (Streaming DiLoCo: of a fragment's interval). Honest
# peers' speeds are within MAX_SPEED_RATIO of each other, so they all join every round; a liar that
# claims to be in a round all the time makes the others' rounds at most this many times as frequent.
MIN_JOIN_STEP_FRACTION = MAX_SPEED_RATIO
# It joins before its own `local_steps` only if the rest of them would take longer than this
# fraction of the matchmaking window: the window opened when the other peer entered, which we
# hear of up to a progress interval (and a DHT read) late. Peers of about equal speed make all
# their steps.
JOIN_WINDOW_FRACTION = 0.5


@dataclass(frozen=True)
class _Round:
    """A gradient-averaging round under way: its result, and which epoch it closes."""

    task: asyncio.Future  # the averager's astep
    epoch: int
    expected: int  # group size we asked for; reused for the state averaging after it
    samples: int  # our samples behind the averaged gradients (in the accumulator)
    members: frozenset[str] = frozenset()  # every live peer we knew of (see _members)
    duration: float = 0.0  # seconds the samples behind it accumulated (0: unknown)


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer; see the module docstring.

    Args:
        peer: a started `potluck.Peer`; the async API (`astart`, `astep`) takes any `PeerLike`.
        run_id: the name of the training run; peers with the same run_id train together.
        params: the model's parameters (as for any torch optimizer).
        optimizer: a torch optimizer over `params`, or a callable `params -> optimizer`.
        target_batch_size: samples in one global batch (one epoch) across all peers.
        batch_size_per_step: samples behind each call to `step()` on this peer.
        scheduler: a learning-rate scheduler over the wrapped optimizer, or a callable
            `optimizer -> scheduler`; stepped once per epoch.
        mode: "sync", "moshpit" or "diloco".
        role: a `potluck.Role` (or its value): NODE "node", CLIENT "client" (behind NAT) or AUX
            "aux" (helps average, trains nothing; the load split gives it a shard only where that
            shortens the round: with two senders each sends and receives one vector whoever
            reduces, so it gets none).
        average_state_every: in sync mode, average parameters and statistics every k epochs.
        local_steps: moshpit/diloco: local steps between averaging rounds.
        outer_lr, outer_momentum: diloco's outer Nesterov step.
        fragments: diloco: split the parameters (in order, about equal sizes) into this many
            fragments; fragment i's outer round comes every `local_steps` steps, offset by
            i * local_steps / fragments (a multiple of fragments). An epoch is then one
            fragment's round.
        outer_delay: diloco: inner steps a fragment's round runs in the background before it is
            applied (less than local_steps / fragments); the local parameters then take
            `mixing * local + (1 - mixing) * outer` (paper: mixing 0.5).
        outer_compression: diloco: codec for the pseudo-gradients on the wire, e.g. "blockwise4",
            "blockwise8", {"name": "topk", "ratio": 0.01} (top-k with error feedback per fragment).
        grid: moshpit grid sizes (see `Averager`). Default: one fitted to the swarm's size at
            each round (`potluck.averaging.moshpit_grid`: 2x2 for 4 peers, 10x10 for 100), each
            peer in the cell of its rank among the live peers.
        compression: codec for everything averaged (`potluck.compression.known_codecs()`).
        powersgd_rank: sync mode: average rank-r PowerSGD approximations of the gradients, with
            error feedback (see `Averager`), instead of the full gradients.
        aggregation: "mean", "centered_clip" or "trimmed_mean": how every averaging round of the
            run combines members' tensors (see `Averager`; robust ones bound what a minority of
            malicious members can do: docs/security.md). Not with powersgd_rank.
        load_state: download the swarm's state at start (newcomers).
        start: join the run now (see `astart`).

    `step()` hands each batch to `astep()`, which runs the collaborative logic on the peer's
    event loop; code that runs on that loop awaits `astep()` itself (tensor math runs in worker
    threads, so under `potluck.core.virtual_time` it costs no virtual time).
    """

    def __init__(self, peer: PeerLike, run_id: str, params: Iterable[Any], optimizer: Any,
                 target_batch_size: int, batch_size_per_step: int, scheduler: Any = None, *,
                 mode: str = "sync", role: Role | str = Role.NODE, average_state_every: int = 1,
                 local_steps: int = 10, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 grid: tuple[int, ...] | None = None, compression: Any = "none", matchmaking_time: float = 1.0,
                 averaging_timeout: float = 30.0, delay_updates: bool = False, load_state: bool = True,
                 load_state_timeout: float = 30.0, powersgd_rank: int | None = None, aggregation: str = "mean",
                 fragments: int = 1, outer_delay: int = 0, mixing: float = 0.5, outer_compression: Any = "none",
                 start: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        role = Role(role)
        if target_batch_size <= 0 or batch_size_per_step <= 0:
            raise ValueError("target_batch_size and batch_size_per_step must be positive")
        params = list(params)
        streaming = StreamingConfig(fragments, outer_delay, mixing, outer_compression)
        if mode != "diloco" and streaming != StreamingConfig():
            raise ValueError("fragments, outer_delay, mixing and outer_compression are diloco options")
        self.inner = optimizer(params) if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
            else optimizer
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a callable that builds one")
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups = self.inner.param_groups  # one set of groups and state, shared
        self.state = self.inner.state
        self.scheduler = scheduler(self.inner) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self.peer = peer
        self.run_id = run_id
        self.mode = mode
        self.role = role
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.average_state_every = average_state_every
        self.local_steps = local_steps
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout = averaging_timeout
        self.delay_updates = delay_updates
        self._pending: _Round | None = None  # a delayed update under way
        self._attempt = 0  # failed averaging tries of the current epoch
        self._failed_rounds = 0  # failed averaging tries since we started (published for monitors)
        self.catch_ups = 0  # times we fell behind the swarm and downloaded its state (benchmarks read it)
        self._metrics: tuple[float, dict[str, float]] | None = None  # report_metrics: (DHT time, values)
        self._next_catch_up = 0.0  # loop time before which we do not download again
        self._in_round = False  # step() is waiting for a round: our samples are frozen
        # The state's digest for the next gradient round, hashed in the background right after
        # the last step (the state does not change while the next batches accumulate): (state
        # generation it was started at, its task). `_state_generation` counts writes to the state.
        self._next_digest: tuple[int, asyncio.Future] | None = None
        self._state_generation = 0
        self._waited = False  # this step() waited for the network (rounds, downloads)
        self._stepping = False  # inside step(): never idle
        self._part = 0  # short rounds of this epoch so far (see PeerProgress.part)
        self._part_due: float | None = None  # loop time when the rest of a short round's batch is due
        self.local_epoch = 0
        self.samples = 0  # accumulated towards the current epoch (in the gradient accumulator)
        self._round_samples = 0  # ours in the epoch's averaging round that step() is waiting for
        self.epoch_samples = 0  # samples of the whole swarm behind the last epoch applied
        self.steps = 0  # local steps since the last averaging (moshpit, diloco)
        self.samples_per_second = 0.0
        self.samples_processed = 0  # local samples behind every step() so far (bytes_per_sample)
        stats = peer.transport.stats
        self._wire_at_start = (stats.bytes_sent, stats.bytes_received)
        self._last_step_time: float | None = None
        # loop time our current epoch (or part of it) began: the members' samples in its round
        # accumulated since about then (see ProgressTracker.averaged)
        self._epoch_began: float | None = None
        self._params = [p for g in self.inner.param_groups for p in g["params"] if p.requires_grad]
        if mode == "diloco":
            streaming.check(local_steps, len(self._params))
        self._init_optimizer_state()
        # DiLoCo's outer momentum is part of the state newcomers download and groups average:
        # members whose momentum differs would take different outer steps from one change.
        self._outer_momentum: list[torch.Tensor] = _zeros_like(self._params) if mode == "diloco" else []
        common = dict(compression=compression, role=role, matchmaking_time=matchmaking_time,
                      allreduce_timeout=averaging_timeout, copy=False, aggregation=aggregation)
        # The parameters and statistics themselves: averaged in place, served to newcomers.
        self.state_averager = Averager(peer, self._state_tensors(), f"{run_id}.state",
                                       grid=grid if mode == "moshpit" else None, **common)
        self._fitted_grid = mode == "moshpit" and grid is None
        self.state_averager.state_metadata = {"epoch": 0}
        client_mode = role == Role.CLIENT or peer.transport.client_mode
        self.tracker = ProgressTracker(peer.dht, peer.transport, run_id, peer.peer_id, target_batch_size, client_mode)
        self._reports: dict[str, PeerProgress] = {}  # others' latest reports, refreshed in the background
        self._progress_task: asyncio.Future | None = None
        self._background: set[asyncio.Future] = set()  # reports under way (see _publish)
        self._outer_params: list[torch.Tensor] | None = None  # diloco (see astart)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.grad_averager: Averager | None = None  # sync mode's accumulator (see astart)
        self.delta_averager: Averager | None = None  # diloco's averaged change (see astart)
        # Streaming DiLoCo's fragment rounds (see astart), or None (plain DiLoCo, other modes).
        self._streaming_config = streaming if mode == "diloco" and streaming.streaming else None
        self.streaming: StreamingDiLoCo | None = None
        self._grid = grid
        self._cleared = False  # the accumulator counts as zeros (saves a pass over it per epoch)
        self._spare: list[torch.Tensor] | None = None  # delay_updates: the next epoch's accumulator
        self._averaging_options, self._powersgd_rank = common, powersgd_rank  # for astart's averagers
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
            await self._try_load_state(self._load_state_timeout)
        options = self._averaging_options
        if self.mode == "sync":
            # The gradient accumulator, averaged in place: sum of batch gradients x samples /
            # target_batch_size (about a mean gradient in size, whatever the codec).
            zeros = await run_in_thread(_zeros_like, self._params)
            self.grad_averager = Averager(self.peer, zeros, f"{self.run_id}.grads", allow_state_sharing=False,
                                          powersgd_rank=self._powersgd_rank, **options)
        if self.mode == "diloco":
            self._outer_params = await run_in_thread(lambda: [p.detach().clone() for p in self._params])
        if self._streaming_config is not None:
            self.streaming = StreamingDiLoCo(self, self._streaming_config)
            await self.streaming.start(self._outer_params, options, self._grid)
        elif self.mode == "diloco":
            zeros = await run_in_thread(_zeros_like, self._params)
            self.delta_averager = Averager(self.peer, zeros, f"{self.run_id}.delta", allow_state_sharing=False,
                                           **options)
        await asyncio.wait_for(self.state_averager.announce_state(), 30)
        self._epoch_began = self._now()
        self._progress_task = asyncio.ensure_future(self._progress_loop())

    # -- torch.optim.Optimizer ---------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Account for one local batch; averages and updates when the swarm is ready.

        The gradients in `.grad` are consumed (cleared), so calling `zero_grad()` is optional.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.peer.run(self.astep())
        return loss

    async def astep(self) -> None:
        """`step()` on the peer's event loop (without a closure): the `.grad` of one local batch."""
        if self._stepping:
            raise RuntimeError("step() is already running: call it from one thread at a time")
        if not self._started:
            raise RuntimeError("the optimizer has not joined the run: await astart() first")
        self._measure_speed()
        self.samples_processed += self.batch_size_per_step
        self._waited, self._stepping = False, True
        try:
            if self.mode == "sync":
                await self._sync_step()
            else:
                await run_in_thread(self._inner_step)
                self.samples += self.batch_size_per_step
                self.steps += 1
                if self.streaming is not None:
                    await self.streaming.after_step()
                elif self.steps >= self.local_steps or (self.mode == "diloco"
                                                        and self.round_begun(self.steps, self.local_steps)):
                    await (self._moshpit_round() if self.mode == "moshpit" else self._diloco_round())
        finally:
            self._stepping = False
            if self._waited:  # time spent in rounds or downloads is not computing time
                self._last_step_time = self._now()

    def bytes_per_sample(self) -> tuple[float, float]:
        """(sent, received): bytes on this peer's wire since the optimizer was built, per sample
        it processed (0.0 before the first), from its transport's counters (`transport.stats`).
        The figure that compares modes' traffic; it counts all the peer's traffic (the DHT, state
        downloads, and any other optimizer on the same peer)."""
        stats, (sent, received) = self.peer.transport.stats, self._wire_at_start
        samples = max(self.samples_processed, 1)
        return (stats.bytes_sent - sent) / samples, (stats.bytes_received - received) / samples

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def report_metrics(self, loss: float | None = None, **values: float) -> None:
        """Publish training metrics (the loss, accuracies...) with our next progress records, for
        monitors (`potluck monitor`): at most MAX_METRICS names of MAX_METRIC_NAME_CHARS
        characters, finite numbers (ValueError otherwise). They replace the last ones reported."""
        if loss is not None:
            values = {"loss": float(loss), **values}
        self._metrics = (self.peer.dht.get_time(), checked_metrics(values))

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "epoch": self.local_epoch,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_inner(state["inner"])
        self.local_epoch = int(state.get("epoch", 0))
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.state_averager.state_metadata = {"epoch": self.local_epoch}

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save the collaboration's state as this peer holds it (parameters, optimizer statistics,
        epoch, scheduler). Our own safe format, never pickle. Any peer can do it at any time."""
        state = {"format": CHECKPOINT_FORMAT, "run_id": self.run_id, "epoch": self.local_epoch,
                 "params": [p.detach().clone() for p in self._params], "optimizer": self.inner.state_dict(),
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
        if len(state["params"]) != len(self._params):
            raise ValueError(f"{path} holds {len(state['params'])} parameters; this model has {len(self._params)}")
        if any(p.shape != saved.shape for p, saved in zip(self._params, state["params"], strict=True)):
            raise ValueError(f"{path}: parameter shapes do not fit this model")
        with self.state_averager.get_tensors(), torch.no_grad():
            for p, saved in zip(self._params, state["params"], strict=True):
                p.copy_(saved)
        self._load_inner(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = int(state["epoch"])
        self.state_averager.state_metadata = {"epoch": self.local_epoch}
        self.state_averager.round = self.local_epoch  # the version newcomers compare
        self.peer.run(self.state_averager.announce_state(), 30)
        self.peer.run(self._report(), 30)  # newcomers refuse a state whose epoch no progress record supports

    # -- sync mode (DeDLOC) -------------------------------------------------------------------------
    async def _sync_step(self) -> None:
        if not await run_in_thread(self._take_batch):
            logger.warning("dropping a batch with non-finite gradients (it is not shared with anyone)")
        if self._pending is not None:
            if not self._pending.task.done():
                return  # the last epoch's averaging is still running in the background
            await self._finish_update(self._pending)
        progress = self.progress()
        if progress.epoch == self.local_epoch + 1 and self.delay_updates:
            await self._update_epoch(progress)  # others started this epoch's round: join it now
        elif progress.epoch > self.local_epoch:
            if self._now() >= self._next_catch_up:
                await self._catch_up(progress.epoch)  # the round is over: we are a straggler
        elif progress.part > self._part and progress.epoch == self.local_epoch:
            self._part = progress.part  # a short round we were not in: our samples still count
        elif progress.eta_seconds == 0 or (self._part_due is not None and self._now() >= self._part_due):
            await self._update_epoch(progress)  # the global batch is due now (extrapolated at everyone's speed)

    def _take_batch(self) -> bool:
        """Add the batch's `.grad` to the accumulator (in a worker thread); False if it is not finite."""
        grads = [p.grad for p in self._params]
        finite = _finite(grads)
        if finite and self.role != Role.AUX:
            self._accumulate(grads)
        for p in self._params:
            p.grad = None
        return finite

    def _accumulate(self, grads: list[torch.Tensor | None]) -> None:
        """Add one batch's gradients to the accumulator (the spare one while a delayed update
        averages the other in the background)."""
        scale = self.batch_size_per_step / self.target_batch_size
        if self._pending is None:
            with self.grad_averager.get_tensors() as sums, torch.no_grad():
                if self._cleared:  # one pass instead of clearing, then adding
                    for total, g in zip(sums, grads, strict=True):
                        if g is None:
                            total.zero_()
                        else:
                            torch.mul(g, scale, out=total)
                    self._cleared = False
                else:
                    torch._foreach_add_([s for s, g in zip(sums, grads, strict=True) if g is not None],
                                        [g for g in grads if g is not None], alpha=scale)
        else:
            if self._spare is None:
                self._spare = [torch.zeros_like(p) for p in self._params]
            with torch.no_grad():
                torch._foreach_add_([s for s, g in zip(self._spare, grads, strict=True) if g is not None],
                                    [g for g in grads if g is not None], alpha=scale)
        self.samples += self.batch_size_per_step

    @property
    def accumulating_epoch(self) -> int:
        """The epoch our new samples count towards: one ahead while a delayed update is running."""
        return self.local_epoch + (self._pending is not None)

    def progress(self) -> GlobalProgress:
        """The collaboration's progress as this peer estimates it now."""
        local = PeerProgress(self.peer.peer_id, self.accumulating_epoch, self.samples, self.samples_per_second,
                             self.peer.dht.get_time(), self.tracker.client_mode, self.local_epoch, self._in_round,
                             False, self._part if self._pending is None else 0)
        return self.tracker.estimate(self.tracker.merged(self._reports), local)

    def _training_peers(self, reports: Iterable[PeerProgress], epoch: int, live: bool) -> list[PeerProgress]:
        """Other peers that may average `epoch`'s gradients: not idle, and on that epoch (or,
        in a view that may be a moment old, one before it). With `live`, only those that
        reported within LIVE_SECONDS (not departed), on that very epoch (a fresh view)."""
        now = self.peer.dht.get_time()
        oldest = epoch if live else epoch - 1
        return [r for r in reports if r.peer_id != self.peer.peer_id and oldest <= r.epoch and r.done <= epoch
                and not r.idle and (not live or r.live(now))]

    def _members(self, reports: Iterable[PeerProgress]) -> frozenset[str]:
        """Every peer that may take part in a round now: us and every live peer that is not
        idle, on any epoch. If they are exactly the last round's group, it meets again without
        the DHT; anyone else (a newcomer, a peer catching up) opens the round to everyone."""
        now = self.peer.dht.get_time()
        return frozenset([self.peer.peer_id, *(r.peer_id for r in reports if r.live(now) and not r.idle)])

    async def _update_epoch(self, progress: GlobalProgress) -> None:
        """Average the accumulated gradients with the swarm and apply one optimizer step.

        With `delay_updates`, the averaging runs in the background while the next batches are
        computed, and its step is applied at the first `step()` after it ends (one or more steps
        stale, as in DeDLOC); otherwise `step()` waits for it.
        """
        samples, epoch = self.samples, self.local_epoch
        self.samples, self._part_due = 0, None
        await run_in_thread(self._clear_now)
        # Close the group once everyone training has joined; overestimating only costs the rest
        # of the matchmaking window, underestimating would split the swarm in two.
        others = self._training_peers(progress.reports, epoch, live=False)
        expected = 1 + len(others)
        if not others:
            alone = asyncio.get_running_loop().create_future()  # nothing to average
            alone.set_exception(AveragingError("no other peer is training"))
            await self._finish_update(_Round(alone, epoch, expected, samples))
            return
        members = self._members(progress.reports)
        # Equal weights: each peer's accumulator already holds its samples' share of the sum. A
        # part after a short round has its own key: the short round's declarations are still live.
        # An aux peer holds no averaged state: its digest would say nothing. Digests all alike
        # after the round: no state round needed.
        state = await self._digest_now() if self.role != Role.AUX and self._averages_state_after(epoch) else None
        gather = RoundNote(samples, self.samples_per_second, state, aux=self.role == Role.AUX).to_wire()
        task = asyncio.ensure_future(self.grad_averager.astep(
            weight=1.0, gather=gather,
            group_key=f"epoch{epoch}.{self._part}", target_group_size=expected, members=members))
        duration = 0.0 if self._epoch_began is None else self._now() - self._epoch_began
        pending = _Round(task, epoch, expected, samples, members, duration)
        if self.delay_updates:
            self._pending = pending  # our new samples count towards the next epoch meanwhile
            return
        self._round_samples, self._in_round, self._waited = samples, True, True  # frozen: others stop extrapolating us
        report = asyncio.ensure_future(self._report())
        try:
            await self._wait_for_round(task, self.grad_averager, epoch)
            await report
        finally:
            self._round_samples, self._in_round = 0, False
        await self._finish_update(pending)

    async def _wait_for_round(self, task: asyncio.Future, averager: Averager, epoch: int) -> None:
        """Wait for `epoch`'s round; cancel it if we have no group yet and the round is over."""
        while not task.done():
            await asyncio.wait([task], timeout=PROGRESS_INTERVAL)
            if not task.done() and averager.forming and self._round_is_over(epoch):
                task.cancel()
                await asyncio.wait([task])

    def _round_is_over(self, epoch: int) -> bool:
        """Another peer has applied `epoch`'s update: its round ended (without us, if we are
        still looking for a group). Waiting out the matchmaking window for a group that will not
        come would also hold back the others, who count us into their next round."""
        return any(r.done > epoch for r in self.progress().reports if r.peer_id != self.peer.peer_id)

    async def _finish_update(self, pending: _Round) -> None:
        """Apply an averaging round's result: the wrapped optimizer's step, and the new epoch."""
        self._pending = None
        task, epoch = pending.task, pending.epoch
        error = AveragingError("the swarm's round ended without us") if task.cancelled() else task.exception()
        if error is None:
            result = task.result()
            self.tracker.set_neighbors(result.peers)
            notes = {p: RoundNote.read(m) for p, m in result.gathered.items()}
            total = sum(notes[p].samples for p in result.contributors if p in notes)
            self._record_round(epoch, notes, result.contributors,
                               result.contributors[0] if total < self.target_batch_size else None)
            if total < self.target_batch_size:
                # Short of the global batch (a peer computed slower than it reported): the sum
                # stays with one member, the first contributor, and the epoch goes on; every
                # member decides alike from the same group. The rest is due at the members'
                # speeds, which they just told each other: no need to wait for progress views.
                keeper = result.contributors[:1] == [self.peer.peer_id]
                speed = sum(notes[p].speed for p in result.contributors if p in notes)
                if speed > 0:
                    self._part_due = self._now() + (self.target_batch_size - total) / speed
                logger.info("epoch %d: the round had %d of %d samples; accumulating on", epoch, total,
                            self.target_batch_size)
                await run_in_thread(self._carry_over, len(result.contributors) if keeper else 0.0)
                self.samples += total if keeper else 0
                self._part += 1
                self._epoch_began = self._now()
                self._publish()
                return
            logger.info("epoch %d: averaged gradients of %d samples with %d peers", epoch, total, result.group_size)
            self.tracker.averaged({p: notes[p].samples for p in result.contributors if p in notes and not notes[p].aux},
                                  pending.duration, self.peer.dht.get_time())
            digests = [n.state for n in notes.values() if not n.aux]
            same = bool(digests) and digests[0] is not None and all(d == digests[0] for d in digests)
            await self._apply_gradients(len(result.contributors) / total, total, pending.expected,
                                        pending.members, same_state=same)
            return
        others = [r for r in self.progress().reports if r.peer_id != self.peer.peer_id]
        if others:  # alone we know the answer; otherwise ask the DHT what happened meanwhile
            others = [r for r in await self._fresh_reports() if r.peer_id != self.peer.peer_id]
        if any(r.done > epoch for r in others):
            logger.info("epoch %d: missed the swarm's round (%s); catching up", epoch, error)
            await run_in_thread(self._carry_over, 0.0)
            await self._catch_up(max(r.done for r in others))
            return
        self._attempt += 1
        self._failed_rounds += 1
        waiting = self._training_peers(others, epoch, live=True)  # not those gone or idle
        if waiting and self._attempt < MAX_ROUND_ATTEMPTS:
            logger.info("epoch %d: averaging failed (%s); %d peer(s) still training on this epoch: trying again",
                        epoch, error, len(waiting))
            await run_in_thread(self._carry_over, 1.0)
            self.samples += pending.samples
            return
        if waiting:
            logger.warning("epoch %d: averaging failed %d times (%s); applying local gradients",
                           epoch, self._attempt, error)
        await self._apply_gradients(1 / max(pending.samples, 1), pending.samples, pending.expected)

    async def _apply_gradients(self, per_sample: float, samples: int, expected: int,
                         members: frozenset[str] | None = None, same_state: bool = False) -> None:
        """The wrapped optimizer's step on the accumulator (x `per_sample` x target: the mean
        gradient), handed over as `.grad` without a copy; then the next epoch. The state is
        averaged after it if due, unless every member of the round held the same state before
        it (`same_state`): the same step on the same state leaves them all alike."""
        await run_in_thread(self._step_on_average, per_sample)
        self.epoch_samples = samples
        average_state = self._averages_state_after(self.local_epoch) and not same_state \
            and len(self.progress().reports) > 1  # alone, there is nobody to average with
        self._in_round = bool(average_state)  # already in the new epoch's first report
        self._advance_epoch()
        if average_state:
            await self._average_state(f"state{self.local_epoch}", expected, members)
            self._epoch_began = self._now()  # the new epoch's samples come after it
        self._prepare_digest()

    def _step_on_average(self, per_sample: float) -> None:
        """The wrapped optimizer's step on the averaged accumulator, then clear it (in a worker thread)."""
        self._clear_now()
        with self.grad_averager.get_tensors() as sums, torch.no_grad():
            if per_sample * self.target_batch_size != 1:
                torch._foreach_mul_(sums, per_sample * self.target_batch_size)
            for p, t in zip(self._params, sums, strict=True):
                p.grad = t
            try:
                self._inner_step(closes_epoch=True)
            finally:
                for p in self._params:
                    p.grad = None
        self._carry_over(0.0)

    def _averages_state_after(self, epoch: int) -> bool:
        return bool(self.average_state_every) and (epoch + 1) % self.average_state_every == 0

    def _state_digest(self) -> str:
        """A digest of the parameters and optimizer statistics, exact to the bit."""
        with self.state_averager.get_tensors() as tensors:
            return _digest(tensors)

    def _prepare_digest(self) -> None:
        """Start hashing the state now if the next gradient round carries its digest: it costs
        3x the model at about 0.8 GB/s (1.4 s for 100M parameters with Adam), which would
        otherwise delay our joining that round."""
        if self._next_digest is not None:
            _drop(self._next_digest[1])
        self._next_digest = None
        if self.role != Role.AUX and self._averages_state_after(self.local_epoch):
            task = asyncio.ensure_future(run_in_thread(self._state_digest))
            self._next_digest = (self._state_generation, task)

    async def _digest_now(self) -> str:
        """The state's digest: the one hashed after the last step if nothing wrote the state
        since (`_state_generation`), else hashed now."""
        prepared, self._next_digest = self._next_digest, None
        if prepared is not None and prepared[0] == self._state_generation:
            digest = await prepared[1]
            if prepared[0] == self._state_generation:  # nothing wrote the state while hashing
                return digest
        elif prepared is not None:
            _drop(prepared[1])
        return await run_in_thread(self._state_digest)

    def _carry_over(self, keep: float) -> None:
        """After a round: keep `keep` x the accumulator (0: clear it) and add the spare one (what
        was accumulated meanwhile)."""
        with self.grad_averager.get_tensors() as sums, torch.no_grad():
            if keep == 0 and self._spare is None:
                self._cleared = True
            elif keep == 0:
                torch._foreach_copy_(sums, self._spare)
            else:
                if keep != 1:
                    torch._foreach_mul_(sums, keep)
                if self._spare is not None:
                    torch._foreach_add_(sums, self._spare)
            if self._spare is not None:
                torch._foreach_zero_(self._spare)

    def _clear_now(self) -> None:
        """Really zero the accumulator if it only counts as cleared (before it is read)."""
        if self._cleared:
            with self.grad_averager.get_tensors() as sums:
                torch._foreach_zero_(sums)
            self._cleared = False

    async def _report(self, store: bool = True) -> None:
        """Publish our progress. While step() waits for the epoch's round, the samples in it still
        count, so that a peer whose view lags still sees the batch full and joins the round
        instead of missing it. Without `store`: to our neighbors only (see ProgressTracker)."""
        await self.tracker.report(self.accumulating_epoch, self.samples + self._round_samples,
                                  self.samples_per_second, self.local_epoch, self._in_round, self._idle(),
                                  self._part if self._pending is None else 0, store=store,
                                  failed=self._failed_rounds, metrics=self._metrics)

    def _record_round(self, epoch: int, notes: dict[str, RoundNote], contributors: list[str],
                      keeper: str | None = None) -> None:
        """Publish, for monitors, a round we completed: each contributor's samples as its note
        gave them to the group (a monitor credits a peer with what the others record for it),
        and our membership token (our name) if the run has an authority. Every member records it
        alike: under the same epoch (the lower median of the epochs in the notes, if they say
        theirs) and id (a digest of the notes: the same members may meet twice in an epoch)."""
        said = sorted(n.epoch for n in notes.values() if n.epoch is not None)
        epoch = said[(len(said) - 1) // 2] if said else epoch
        wire = json.dumps(sorted((p, notes[p].to_wire()) for p in contributors if p in notes)).encode()
        record = RoundRecord(epoch, self._part, tuple((p, notes[p].samples) for p in contributors
                                                      if p in notes and not notes[p].aux),
                             keeper, self.peer.dht.get_time(), hashlib.blake2b(wire, digest_size=8).hexdigest())
        token = getattr(self.peer, "membership", None)
        task = asyncio.ensure_future(self.tracker.record_round(record, None if token is None else token.to_wire()))
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)
        task.add_done_callback(retrieve_exception)

    def _publish(self) -> None:
        """Report a change of state (a new epoch, a round ended) without waiting: the report
        reads our state when it runs, so it is never older than the change. Neighbors hear it
        at once; the DHT then hears it from the progress loop."""
        task = asyncio.ensure_future(self._report(store=not self.tracker.has_neighbors))
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)
        task.add_done_callback(retrieve_exception)

    def _now(self) -> float:
        """The peer's loop time: virtual under `potluck.core.virtual_time`, so tests are exact."""
        return asyncio.get_running_loop().time()

    def _idle(self) -> bool:
        """We have stopped calling step() (a peer that never stepped is still starting)."""
        last, speed = self._last_step_time, self.samples_per_second
        if self._stepping or last is None or speed <= 0:
            return False
        idle_after = max(IDLE_FLOOR_SECONDS, IDLE_STEP_INTERVALS * self.batch_size_per_step / speed)
        return self._now() - last > idle_after

    async def _fresh_reports(self) -> list[PeerProgress]:
        """Everyone's progress read from the DHT now (the background view may be a moment old)."""
        try:
            reports = await asyncio.wait_for(self.tracker.fetch(), self.averaging_timeout)
        except TimeoutError:
            reports = None
        return list(self.tracker.merged(self._reports if reports is None else reports).values())

    def _advance_epoch(self) -> None:
        self.local_epoch += 1
        self._attempt = 0
        self._after_epoch()

    def _after_epoch(self) -> None:
        self._waited, self._part, self._part_due = True, 0, None
        self._epoch_began = self._now()
        if self.scheduler is not None:
            self.scheduler.step()
        self._label_state(self.local_epoch)
        self._publish()

    async def _average_state(self, key: str, expected: int, members: frozenset[str] | None = None) -> None:
        """Average parameters and statistics in place (untouched if the round fails)."""
        self._in_round = True
        try:
            await self.state_averager.astep(group_key=key, target_group_size=expected, members=members)
        except AveragingError as e:
            logger.warning("averaging parameters failed (%s); keeping local ones", e)
        finally:
            self._in_round = False
            self._state_generation += 1
        self._publish()  # computing again: others may extrapolate us

    async def _catch_up(self, epoch: int) -> None:
        """We fell behind the swarm: take its state; recent gradients count towards the next epoch."""
        behind = epoch - self.local_epoch
        self._attempt, self._waited, self._part, self._part_due = 0, True, 0, None
        self._epoch_began = self._now()
        logger.info("behind the swarm by %d epoch(s): downloading its state", behind)
        self.catch_ups += 1
        if not await self._try_load_state(self.averaging_timeout) or self.local_epoch < epoch - 1:
            self._move_to(epoch)  # nobody could share the newest state; keep ours and rejoin
        elif self.local_epoch < epoch:
            self._next_catch_up = self._now() + CATCH_UP_RETRY_SECONDS
        if behind > MAX_STALE_EPOCHS:
            if self.grad_averager is not None:  # sync mode's accumulated gradients are stale
                await run_in_thread(self._carry_over, 0.0)
            self.samples = 0

    # -- local-update modes ---------------------------------------------------------------------------
    async def _moshpit_round(self) -> None:
        self.steps = 0
        try:
            if self._anyone_else():
                expected = self._place_on_grid() if self._fitted_grid else None
                # in place; untouched on failure
                note = RoundNote(self.samples, epoch=self.local_epoch).to_wire()
                result = await self.state_averager.astep(weight=float(self.samples), target_group_size=expected,
                                                         gather=note)
                self._state_generation += 1
                self._record_round(self.local_epoch, {p: RoundNote.read(m) for p, m in result.gathered.items()},
                                   result.contributors)
        except AveragingError as e:
            self._failed_rounds += 1
            logger.warning("moshpit averaging failed (%s); continuing locally", e)
        self.samples = 0
        self._advance_epoch()

    async def _diloco_round(self) -> None:
        """Outer step: average the parameter change of the last `local_steps` steps, then apply
        it to the shared starting point with Nesterov momentum. A peer whose round came after the
        others' (a slower one, or one whose round failed) takes their state instead."""
        self.steps = 0
        swarm_epoch = self.progress().epoch
        if swarm_epoch > self.local_epoch:
            self.samples = 0
            await self._catch_up(swarm_epoch)
            return
        await run_in_thread(self._take_change)
        result = None
        try:
            if self._anyone_else():
                # A stable group meets again without the DHT and closes once all are back; any
                # other round takes the whole window, which also lets a slower peer come in.
                members = self._members(self.progress().reports)
                digest = await run_in_thread(_digest, self._outer_params)
                task = asyncio.ensure_future(self.delta_averager.astep(
                    weight=float(self.samples), gather=RoundNote(self.samples, outer=digest).to_wire(),
                    group_key=f"outer{self.local_epoch}", members=members))
                self._in_round = True  # slower peers see it and join now (round_begun)
                self._publish()
                try:
                    await self._wait_for_round(task, self.delta_averager, self.local_epoch)
                finally:
                    self._in_round = False
                if task.cancelled():  # the others' round is over: take their state
                    self.samples = 0
                    await self._catch_up(max(r.done for r in self.tracker.merged(self._reports).values()))
                    return
                result = task.result()
                self.tracker.set_neighbors(result.peers)  # they hear our progress at once
                self._record_round(self.local_epoch, {p: RoundNote.read(m) for p, m in result.gathered.items()},
                                   result.contributors)
        except AveragingError as e:
            self._failed_rounds += 1
            logger.warning("diloco averaging failed (%s); using the local change", e)
        await run_in_thread(self._outer_step)
        self.samples = 0
        self._advance_epoch()
        gathered = result.gathered.values() if result is not None else ()
        digests = {RoundNote.read(m).outer for m in gathered}
        if len(digests) > 1:
            # The members started from different points (one stepped alone: it saw nobody yet,
            # or its round failed); the same change keeps them apart for good. Average them.
            logger.info("epoch %d: the group's outer parameters differ; averaging them", self.local_epoch)
            await self._average_state(f"outer-state{self.local_epoch}", len(result.peers), frozenset(result.peers))
            await run_in_thread(torch._foreach_copy_, self._outer_params, [p.detach() for p in self._params])

    def round_begun(self, steps: int, due: int) -> bool:
        """DiLoCo: another live peer has entered our epoch's outer round (it made its inner steps
        first), and we have made `steps` of the `due` ones (local_steps; Streaming DiLoCo: a
        fragment's interval), at least 1 / MIN_JOIN_STEP_FRACTION of them, but
        the rest would take us past JOIN_WINDOW_FRACTION of its matchmaking window: join it now,
        with fewer inner steps (weighted by our samples). Waiting for all of ours, a slower peer
        came after the window, stepped alone, and fell further behind every round: two peers of
        unequal speed never met again."""
        if steps * MIN_JOIN_STEP_FRACTION < due or self.samples_per_second <= 0:
            return False
        rest = (due - steps) * self.batch_size_per_step / self.samples_per_second
        if rest < JOIN_WINDOW_FRACTION * self.matchmaking_time:
            return False  # we come in time with all our steps
        now, me = self.peer.dht.get_time(), self.peer.peer_id
        return any(r.peer_id != me and r.averaging and r.epoch == self.local_epoch and r.live(now)
                   for r in self.progress().reports)

    def _take_change(self) -> None:
        """The parameters' change since the last outer step, into the delta averager (in a worker thread)."""
        with self.delta_averager.get_tensors() as deltas, torch.no_grad():
            torch._foreach_copy_(deltas, self._outer_params)
            torch._foreach_sub_(deltas, self._params)

    def _outer_step(self) -> None:
        """Apply the averaged change to the outer parameters, and start from them (in a worker thread)."""
        with self.delta_averager.get_tensors() as deltas, self.state_averager.get_tensors(), torch.no_grad():
            # SGD with Nesterov momentum (as torch.optim.SGD computes it), all in place: no temporaries
            torch._foreach_mul_(self._outer_momentum, self.outer_momentum)
            torch._foreach_add_(self._outer_momentum, deltas)
            torch._foreach_add_(deltas, self._outer_momentum, alpha=self.outer_momentum)
            torch._foreach_add_(self._outer_params, deltas, alpha=-self.outer_lr)
            torch._foreach_copy_(self._params, self._outer_params)

    def _place_on_grid(self, averager: Averager | None = None, grid: tuple[int, ...] | None = None) -> int:
        """Moshpit without a given grid: every peer derives the same layout from what all of
        them see alike. The live peers (sorted ids) give the grid (`moshpit_grid`) and each one's
        cell (the digits of its rank); the epoch gives the round's dimension. Peers that agree
        meet as on the paper's torus: len(grid) rounds reach the exact mean. (Random cells and a
        per-peer round count left most peers alone in their groups, round after round.)
        Streaming DiLoCo places each fragment's `averager` on its given `grid` the same way.
        Returns the size of this round's group."""
        averager = self.state_averager if averager is None else averager
        now = self.peer.dht.get_time()
        me = self.peer.peer_id
        ids = sorted({me, *(r.peer_id for r in self.progress().reports if r.live(now) and not r.idle)})
        grid = moshpit_grid(len(ids)) if grid is None else tuple(grid)
        if grid != averager.grid:
            logger.info("moshpit: %d peers average on a %s grid (groups of about %d)", len(ids),
                        "x".join(map(str, grid)), grid[0])
        cells = [_cell(rank, grid) for rank in range(len(ids))]
        mine = cells[ids.index(me)]
        averager.set_grid(grid, mine, round=self.local_epoch)
        dim = self.local_epoch % len(grid)
        # The group closes as soon as every peer of its line is in, not at the window's end.
        return sum(all(c[k] == mine[k] for k in range(len(grid)) if k != dim) for c in cells)

    def _anyone_else(self) -> bool:
        """Some other peer trains (a lone peer does not wait a matchmaking window for nobody)."""
        return any(r.peer_id != self.peer.peer_id and not r.idle for r in self.progress().reports)

    # -- state ----------------------------------------------------------------------------------------
    def _inner_step(self, closes_epoch: bool = False) -> None:
        """The wrapped optimizer's step, under the state lock (newcomers never see half of it,
        nor the new parameters labelled with the old epoch)."""
        with self.state_averager.get_tensors():
            self._state_generation += 1
            self.inner.step()
            if closes_epoch:
                self._label_state(self.local_epoch + 1)
        self.zero_grad()  # consumed

    def _label_state(self, epoch: int) -> None:
        """What newcomers download is labelled with the epoch of the parameters."""
        self.state_averager.state_metadata = {"epoch": epoch}
        if self.mode == "sync":
            self.state_averager.round = epoch  # the version donors announce

    def _init_optimizer_state(self) -> None:
        """Create the wrapped optimizer's statistics now (zeros), so every peer averages and
        downloads the same set of tensors from the first epoch on. One parameter at a time and
        with a learning rate of 0: no copy of the model, and the parameters stay as they are."""
        if any(self.inner.state.get(p) for p in self._params):
            return
        rates = [group.get("lr") for group in self.inner.param_groups]
        try:
            for group in self.inner.param_groups:
                group["lr"] = 0.0
            for p in self._params:
                p.grad = torch.zeros_like(p)
                self.inner.step()
                p.grad = None
        finally:
            for group, rate in zip(self.inner.param_groups, rates, strict=True):
                group["lr"] = rate
        with torch.no_grad():
            for state in self.inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.zero_()

    def _optimizer_slots(self) -> list[tuple[dict, str]]:
        return [(state, name) for p in self._params for state in [self.inner.state.get(p, {})]
                for name in sorted(state) if isinstance(state[name], torch.Tensor)
                and state[name].is_floating_point()]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return [state[name] for state, name in self._optimizer_slots()]

    def _state_tensors(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params] + self._optimizer_tensors() + self._outer_momentum

    def _load_inner(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state into the tensors it has now: the state averager
        averages and serves those very tensors."""
        self._state_generation += 1
        kept = self._optimizer_tensors()
        with self.state_averager.get_tensors(), torch.no_grad():
            self.inner.load_state_dict(state_dict)
            slots = self._optimizer_slots()
            if [t.shape for t in kept] != [state[name].shape for state, name in slots]:
                raise ValueError("the optimizer state does not fit this model's")
            for old, (state, name) in zip(kept, slots, strict=True):
                old.copy_(state[name])
                state[name] = old

    async def _try_load_state(self, timeout: float) -> bool:
        try:
            self._state_generation += 1  # written even if the download fails part-way
            epoch = await self._download_state(timeout)  # into our tensors
        except AveragingError as e:
            logger.info("no state downloaded (%s); starting from local parameters", e)
            return False
        self._move_to(epoch)
        if self._outer_params is not None:
            await run_in_thread(torch._foreach_copy_, self._outer_params, [p.detach() for p in self._params])
        logger.info("downloaded the swarm's state at epoch %d", self.local_epoch)
        return True

    def _move_to(self, epoch: int) -> None:
        """Take the swarm's `epoch` as ours (never an older one), the scheduler with it in one call."""
        if epoch > self.local_epoch:
            if self.scheduler is not None:
                _advance_scheduler(self.scheduler, epoch - self.local_epoch)
            self.local_epoch = epoch
        self.state_averager.state_metadata = {"epoch": self.local_epoch}

    async def _download_state(self, timeout: float) -> int:
        """Download the state that most donors vouched for by our progress view agree on, into
        the state averager's tensors; returns its epoch. Donors count only if they are live peers
        in the view (identities we never heard from do not), and a state whose epoch or version
        is ahead of what the view supports (`MAX_STATE_EPOCH_LEAD`) is refused: one donor cannot
        set our parameters or our epoch."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with compat.timeout_at(deadline):
                reports = await self.tracker.fetch()
        except TimeoutError:
            raise AveragingError(f"could not read the swarm's progress within {timeout} s") from None
        if reports is not None:
            self._reports = reports
        progress, now = self.progress(), self.peer.dht.get_time()
        vouched = {PeerID.from_string(r.peer_id) for r in progress.reports
                   if r.peer_id != self.peer.peer_id and r.live(now)}
        limit = progress.epoch + MAX_STATE_EPOCH_LEAD
        left = deadline - loop.time()
        if left <= 0:
            raise AveragingError(f"no time left to download the state within {timeout} s")
        _, metadata = await self.state_averager.aload_state_from_peers(
            left, vouched=vouched, check=lambda manifest: _check_epoch(manifest, limit))
        return metadata["epoch"]

    # -- progress -----------------------------------------------------------------------------------
    def _measure_speed(self) -> None:
        now = self._now()
        if self._last_step_time is not None and now > self._last_step_time:
            speed = self.batch_size_per_step / (now - self._last_step_time)
            self.samples_per_second = speed if not self.samples_per_second else (
                (1 - SPEED_SMOOTHING) * self.samples_per_second + SPEED_SMOOTHING * speed)
        self._last_step_time = now

    async def _progress_loop(self) -> None:
        tick = 0
        while True:
            through_dht = not self.tracker.has_neighbors or tick % DHT_EVERY_WITH_NEIGHBORS == 0
            await self._report(store=through_dht)
            if through_dht:
                reports = await self.tracker.fetch()
                if reports is not None:
                    self._reports = reports
            tick += 1
            await asyncio.sleep(PROGRESS_INTERVAL)

    def shutdown(self) -> None:
        """Stop publishing progress and serving averaging; the peer itself stays up."""
        loop = None if self._progress_task is None else self._progress_task.get_loop()
        if loop is not None and not loop.is_closed():  # (a closed loop cancelled it already)
            loop.call_soon_threadsafe(self._progress_task.cancel)
        self.tracker.close()
        for averager in (self.grad_averager, self.state_averager, getattr(self, "delta_averager", None)):
            if averager is not None:
                averager.shutdown()
        if getattr(self, "streaming", None) is not None:
            self.streaming.shutdown()


def _check_epoch(manifest: Manifest, limit: int) -> None:
    """Refuse (ValueError) a donor's state unless it says which epoch it is, and neither that
    epoch nor its version is beyond `limit`."""
    metadata = manifest.metadata
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"its metadata names no epoch: {metadata!r:.100}")
    if max(epoch, manifest.version) > limit:
        raise ValueError(f"it claims epoch {epoch} (version {manifest.version}), beyond the {limit} "
                         f"that the swarm's progress supports")


def _advance_scheduler(scheduler: Any, epochs: int) -> None:
    """Move a learning-rate scheduler `epochs` epochs on, as many `step()` calls would: in one call
    for a torch scheduler with a closed form, else by replaying at most MAX_REPLAYED_SCHEDULER_STEPS
    steps (a scheduler further behind is left there, and logged)."""
    schedulers = torch.optim.lr_scheduler
    if isinstance(scheduler, schedulers.LRScheduler) and (
            hasattr(scheduler, "_get_closed_form_lr")
            or isinstance(scheduler, (schedulers.LambdaLR, schedulers.OneCycleLR, schedulers.CyclicLR))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # step(epoch) is deprecated, yet torch's only way to jump
            scheduler.step(scheduler.last_epoch + epochs)
        return
    for _ in range(min(epochs, MAX_REPLAYED_SCHEDULER_STEPS)):
        scheduler.step()
    if epochs > MAX_REPLAYED_SCHEDULER_STEPS:
        logger.warning("the learning-rate scheduler was moved on %d of the %d epochs downloaded (it has no closed "
                       "form); its rate is that of an earlier epoch", MAX_REPLAYED_SCHEDULER_STEPS, epochs)


def _drop(task: asyncio.Future) -> None:
    """Cancel a background task whose result is no longer wanted, and mark its outcome seen."""
    task.cancel()
    task.add_done_callback(retrieve_exception)


def _cell(rank: int, grid: tuple[int, ...]) -> list[int]:
    """The grid cell of the peer of `rank`: its digits in the grid's mixed radix."""
    digits = []
    for size in reversed(grid):
        rank, digit = divmod(rank, size)
        digits.append(digit)
    return digits[::-1]


def _zeros_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(t) for t in tensors]


def _finite(grads: list[torch.Tensor | None]) -> bool:
    """No NaN or infinity in the batch's gradients. One pass: a finite sum proves every value
    finite (a sum that overflows float also drops the batch; such gradients are no use)."""
    sums = [g.detach().sum(dtype=torch.float32) for g in grads if g is not None]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())
