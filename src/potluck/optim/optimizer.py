"""`potluck.Optimizer`: train one model together with whoever shows up.

Wraps any `torch.optim.Optimizer` and is one, so plain loops, Hugging Face `Trainer` and
Lightning can use it. Call `step()` after every local batch of `batch_size_per_step` samples.

Modes:
- "sync" (DeDLOC): gradients accumulate locally until the whole collaboration has processed
  `target_batch_size` samples (tracked through the DHT); then the peers average their gradients
  (weighted by samples), every peer applies the same optimizer step, and the epoch advances. Every
  `average_state_every` epochs the parameters and optimizer statistics are averaged too, which
  also repairs any drift.
- "moshpit": local SGD; every `local_steps` steps the parameters are averaged in Moshpit groups.
- "diloco": `local_steps` inner steps of the wrapped optimizer, then an outer step with Nesterov
  momentum on the averaged change of the parameters.

A newcomer downloads the current state before its first step; a peer that falls behind catches
up the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from potluck.averaging.averager import Averager
from potluck.core import serialization
from potluck.core.errors import AveragingError, SerializationError
from potluck.core.tensors import all_finite
from potluck.optim.progress import GlobalProgress, PeerProgress, ProgressTracker

logger = logging.getLogger(__name__)

MODES = ("sync", "moshpit", "diloco")
# How often progress is published and read (seconds): often enough that peers enter an averaging
# round within a fraction of the matchmaking window of each other.
PROGRESS_INTERVAL = 0.2
# Weight of the newest measurement in the samples-per-second estimate.
SPEED_SMOOTHING = 0.3
# Version tag of checkpoint files.
CHECKPOINT_FORMAT = "potluck-checkpoint-1"
# A peer further behind than this many epochs drops its accumulated gradients when it catches up.
MAX_STALE_EPOCHS = 1
# Tries of one epoch's gradient averaging while other peers are still on that epoch. A peer that
# applies its local gradients alone drifts from the swarm until the next state averaging, so it
# retries first (each try costs one matchmaking window).
MAX_ROUND_ATTEMPTS = 4
# A peer that downloaded a state still older than the swarm's waits this long before asking again
# (the donors are applying the newest epoch this very moment), instead of downloading in a loop.
CATCH_UP_RETRY_SECONDS = PROGRESS_INTERVAL


@dataclass(frozen=True)
class _Round:
    """A gradient-averaging round under way: its result, and which epoch it closes."""

    future: concurrent.futures.Future
    epoch: int
    expected: int  # group size we asked for; reused for the state averaging after it
    samples: int  # our samples behind the averaged gradients


class Optimizer(torch.optim.Optimizer):
    """A collaborative optimizer; see the module docstring.

    Args:
        peer: a started `potluck.Peer`.
        run_id: the name of the training run; peers with the same run_id train together.
        params: the model's parameters (as for any torch optimizer).
        optimizer: a torch optimizer over `params`, or a callable `params -> optimizer`.
        target_batch_size: samples in one global batch (one epoch) across all peers.
        batch_size_per_step: samples behind each call to `step()` on this peer.
        scheduler: a learning-rate scheduler over the wrapped optimizer, or a callable
            `optimizer -> scheduler`; stepped once per epoch.
        mode: "sync", "moshpit" or "diloco".
        averaging_mode: "node", "client" (behind NAT) or "aux" (helps average, trains nothing).
        average_state_every: in sync mode, average parameters and statistics every k epochs.
        local_steps: moshpit/diloco: local steps between averaging rounds.
        outer_lr, outer_momentum: diloco's outer Nesterov step.
        grid: moshpit grid sizes (see `Averager`).
        compression: codec for everything averaged (`potluck.compression.known_codecs()`).
        powersgd_rank: sync mode: average rank-r PowerSGD approximations of the gradients, with
            error feedback (see `Averager`), instead of the full gradients.
        load_state: download the swarm's state at start (newcomers).
    """

    def __init__(self, peer: Any, run_id: str, params: Iterable[Any], optimizer: Any,
                 target_batch_size: int, batch_size_per_step: int, scheduler: Any = None, *,
                 mode: str = "sync", averaging_mode: str = "node", average_state_every: int = 1,
                 local_steps: int = 10, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 grid: tuple[int, ...] | None = None, compression: Any = "none", matchmaking_time: float = 1.0,
                 averaging_timeout: float = 30.0, delay_updates: bool = False, load_state: bool = True,
                 load_state_timeout: float = 30.0, powersgd_rank: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if target_batch_size <= 0 or batch_size_per_step <= 0:
            raise ValueError("target_batch_size and batch_size_per_step must be positive")
        params = list(params)
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
        self.averaging_mode = averaging_mode
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.average_state_every = average_state_every
        self.local_steps = local_steps
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout = averaging_timeout
        self.delay_updates = delay_updates
        self._pending: _Round | None = None  # a delayed update under way
        self._attempt = 0  # failed averaging tries of the current epoch
        self._next_catch_up = 0.0  # time.monotonic() before which we do not download again
        self.local_epoch = 0
        self.samples = 0  # accumulated towards the current epoch
        self._round_samples = 0  # ours in the epoch's averaging round that step() is waiting for
        self.steps = 0  # local steps since the last averaging (moshpit, diloco)
        self.samples_per_second = 0.0
        self._last_step_time: float | None = None
        self._params = [p for g in self.inner.param_groups for p in g["params"] if p.requires_grad]
        self._grad_sums = [torch.zeros_like(p) for p in self._params]
        self._init_optimizer_state()
        common = dict(compression=compression, mode=averaging_mode, matchmaking_time=matchmaking_time,
                      allreduce_timeout=averaging_timeout)
        self.grad_averager = Averager(peer, self._grad_sums, f"{run_id}.grads", allow_state_sharing=False,
                                      powersgd_rank=powersgd_rank, **common)
        self.state_averager = Averager(peer, self._state_tensors(), f"{run_id}.state",
                                       grid=grid if mode == "moshpit" else None, **common)
        self.state_averager.state_metadata = {"epoch": 0}
        if mode == "diloco":
            self._outer_params = [p.detach().clone().requires_grad_(True) for p in self._params]
            self.outer = torch.optim.SGD(self._outer_params, lr=outer_lr, momentum=outer_momentum, nesterov=True)
            self.delta_averager = Averager(peer, [torch.zeros_like(p) for p in self._params], f"{run_id}.delta",
                                           allow_state_sharing=False, **common)
        client_mode = averaging_mode == "client" or peer.transport.client_mode
        self.tracker = ProgressTracker(peer.dht, run_id, peer.peer_id, target_batch_size, client_mode)
        self._reports: dict[str, PeerProgress] = {}  # others' latest reports, refreshed in the background
        self._progress_task: concurrent.futures.Future | None = None
        if load_state:
            self._try_load_state(load_state_timeout)
        self.peer.run(self.state_averager.announce_state(), 30)
        self._progress_task = peer.submit(self._progress_loop())

    # -- torch.optim.Optimizer ---------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Account for one local batch; averages and updates when the swarm is ready.

        The gradients in `.grad` are consumed (cleared), so calling `zero_grad()` is optional.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._measure_speed()
        if self.mode == "sync":
            self._sync_step()
        else:
            self.inner.step()
            self.zero_grad()  # consumed, as in sync mode
            self.samples += self.batch_size_per_step
            self.steps += 1
            if self.steps >= self.local_steps:
                self._moshpit_round() if self.mode == "moshpit" else self._diloco_round()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "epoch": self.local_epoch,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
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
        with torch.no_grad():
            for p, saved in zip(self._params, state["params"], strict=True):
                if p.shape != saved.shape:
                    raise ValueError(f"{path}: a parameter of shape {tuple(saved.shape)} does not fit {tuple(p.shape)}")
                p.copy_(saved)
        self.inner.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = int(state["epoch"])
        self.state_averager.state_metadata = {"epoch": self.local_epoch}
        self.state_averager.round = self.local_epoch  # the version newcomers compare
        self._sync_state_tensors(to_averager=True)
        self.peer.run(self.state_averager.announce_state(), 30)

    # -- sync mode (DeDLOC) -------------------------------------------------------------------------
    def _sync_step(self) -> None:
        grads = [p.grad for p in self._params]
        if any(g is not None and not all_finite(g) for g in grads):
            logger.warning("dropping a batch with non-finite gradients (it is not shared with anyone)")
        elif self.averaging_mode != "aux":
            with torch.no_grad():
                for total, g in zip(self._grad_sums, grads, strict=True):
                    if g is not None:
                        total.add_(g, alpha=self.batch_size_per_step)
            self.samples += self.batch_size_per_step
        for p in self._params:
            p.grad = None
        if self._pending is not None:
            if not self._pending.future.done():
                return  # the last epoch's averaging is still running in the background
            self._finish_update(self._pending)
        progress = self.progress()
        if progress.epoch == self.local_epoch + 1 and self.delay_updates:
            self._update_epoch(progress)  # others started this epoch's round: join it now
        elif progress.epoch > self.local_epoch:
            if time.monotonic() >= self._next_catch_up:
                self._catch_up(progress.epoch)  # the round is over: we are a straggler
        elif progress.samples >= self.target_batch_size:
            self._update_epoch(progress)

    @property
    def accumulating_epoch(self) -> int:
        """The epoch our new samples count towards: one ahead while a delayed update is running."""
        return self.local_epoch + (self._pending is not None)

    def progress(self) -> GlobalProgress:
        """The collaboration's progress as this peer estimates it now."""
        local = PeerProgress(self.peer.peer_id, self.accumulating_epoch, self.samples, self.samples_per_second,
                             self.peer.dht.get_time(), self.tracker.client_mode, self.local_epoch)
        return self.tracker.estimate(self._reports, local)

    def _update_epoch(self, progress: GlobalProgress) -> None:
        """Average the accumulated gradients with the swarm and apply one optimizer step.

        With `delay_updates`, the averaging runs in the background while the next batches are
        computed, and its step is applied at the first `step()` after it ends (one or more steps
        stale, as in DeDLOC); otherwise `step()` waits for it.
        """
        samples = self.samples
        with self.grad_averager.get_tensors() as tensors:
            for t, total in zip(tensors, self._grad_sums, strict=True):
                t.copy_(total / max(samples, 1))
        for total in self._grad_sums:
            total.zero_()
        self.samples = 0
        epoch = self.local_epoch
        # Close the group once everyone who is alive has joined; overestimating only costs the
        # rest of the matchmaking window, underestimating would split the swarm in two.
        expected = max(2, sum(1 for r in progress.reports if r.epoch >= epoch - 1))
        if not any(r.peer_id != self.peer.peer_id for r in progress.reports):
            future: concurrent.futures.Future = concurrent.futures.Future()  # alone: nothing to average
            future.set_exception(AveragingError("no other peer is training"))
            self._finish_update(_Round(future, epoch, expected, samples))
            return
        future = self.peer.submit(self.grad_averager.astep(
            weight=float(samples), group_key=f"epoch{epoch}", target_group_size=expected))
        pending = _Round(future, epoch, expected, samples)
        if self.delay_updates:
            self._pending = pending  # our new samples count towards the next epoch meanwhile
            return
        self._round_samples = samples  # peers slow to see the batch full must still see it
        try:
            concurrent.futures.wait([future])
        finally:
            self._round_samples = 0
        self._finish_update(pending)

    def _finish_update(self, pending: _Round) -> None:
        """Apply an averaging round's result: the wrapped optimizer's step, and the new epoch."""
        self._pending = None
        future, epoch = pending.future, pending.epoch
        error = future.exception()
        if error is None:
            logger.info("epoch %d: averaged gradients with %d peers", epoch, future.result().group_size)
        else:
            others = [r for r in self.progress().reports if r.peer_id != self.peer.peer_id]
            if others:  # alone we know the answer; otherwise ask the DHT what happened meanwhile
                others = [r for r in self._fresh_reports() if r.peer_id != self.peer.peer_id]
            if any(r.done > epoch for r in others):
                logger.info("epoch %d: missed the swarm's round (%s); catching up", epoch, error)
                self._catch_up(max(r.done for r in others))
                return
            self._attempt += 1
            if others and self._attempt < MAX_ROUND_ATTEMPTS:
                logger.info("epoch %d: averaging failed (%s); others are still on this epoch: trying again",
                            epoch, error)
                self._restore_gradients(pending)
                return
            if others:
                logger.warning("epoch %d: averaging failed %d times (%s); applying local gradients",
                               epoch, self._attempt, error)
        with self.grad_averager.get_tensors() as tensors:
            for p, t in zip(self._params, tensors, strict=True):
                p.grad = t.clone()
        self.inner.step()
        self.zero_grad()
        self._advance_epoch()
        if self.average_state_every and self.local_epoch % self.average_state_every == 0 \
                and len(self.progress().reports) > 1:  # alone, there is nobody to average with
            self._average_state(f"state{self.local_epoch}", pending.expected)

    async def _report(self) -> None:
        """Publish our progress. While step() waits for the epoch's round, the samples in it still
        count, so that a peer whose view lags still sees the batch full and joins the round
        instead of missing it."""
        await self.tracker.report(self.accumulating_epoch, self.samples + self._round_samples,
                                  self.samples_per_second, self.local_epoch)

    def _restore_gradients(self, pending: _Round) -> None:
        """Put a failed round's gradients back, so they count towards the retry."""
        with self.grad_averager.get_tensors() as tensors, torch.no_grad():
            for total, t in zip(self._grad_sums, tensors, strict=True):
                total.add_(t, alpha=pending.samples)
        self.samples += pending.samples

    def _fresh_reports(self) -> list[PeerProgress]:
        """Everyone's progress read from the DHT now (the background view may be a moment old)."""
        reports = self.peer.run(self.tracker.fetch(), self.averaging_timeout)
        return list((self._reports if reports is None else reports).values())

    def _advance_epoch(self) -> None:
        self.local_epoch += 1
        self._attempt = 0
        self._after_epoch()

    def _after_epoch(self) -> None:
        if self.scheduler is not None:
            self.scheduler.step()
        # What newcomers download: this epoch's parameters and statistics, labelled with it.
        self._sync_state_tensors(to_averager=True)
        self.state_averager.state_metadata = {"epoch": self.local_epoch}
        if self.mode == "sync":
            self.state_averager.round = self.local_epoch  # the version donors announce
        self.peer.run(self._report(), 10)

    def _average_state(self, key: str, expected: int) -> None:
        self._sync_state_tensors(to_averager=True)
        try:
            self.state_averager.step(group_key=key, target_group_size=expected)
        except AveragingError as e:
            logger.warning("averaging parameters failed (%s); keeping local ones", e)
            return
        self._sync_state_tensors(to_averager=False)

    def _catch_up(self, epoch: int) -> None:
        """We fell behind the swarm: take its state; recent gradients count towards the next epoch."""
        behind = epoch - self.local_epoch
        self._attempt = 0
        logger.info("behind the swarm by %d epoch(s): downloading its state", behind)
        if not self._try_load_state(self.averaging_timeout) or self.local_epoch < epoch - 1:
            self.local_epoch = epoch  # nobody could share the newest state; keep ours and rejoin
            self.state_averager.state_metadata = {"epoch": self.local_epoch}
        elif self.local_epoch < epoch:
            self._next_catch_up = time.monotonic() + CATCH_UP_RETRY_SECONDS
        if behind > MAX_STALE_EPOCHS:
            for total in self._grad_sums:
                total.zero_()
            self.samples = 0

    # -- local-update modes ---------------------------------------------------------------------------
    def _moshpit_round(self) -> None:
        self.steps = 0
        self._sync_state_tensors(to_averager=True)
        try:
            self.state_averager.step(weight=float(self.samples))
            self._sync_state_tensors(to_averager=False)
        except AveragingError as e:
            logger.warning("moshpit averaging failed (%s); continuing locally", e)
        self.samples = 0
        self._advance_epoch()

    def _diloco_round(self) -> None:
        """Outer step: average the parameter change of the last `local_steps` steps, then apply
        it to the shared starting point with Nesterov momentum."""
        self.steps = 0
        with self.delta_averager.get_tensors() as deltas, torch.no_grad():
            for d, start, p in zip(deltas, self._outer_params, self._params, strict=True):
                d.copy_(start - p)
        try:
            self.delta_averager.step(weight=float(self.samples), group_key=f"outer{self.local_epoch}")
        except AveragingError as e:
            logger.warning("diloco averaging failed (%s); using the local change", e)
        with self.delta_averager.get_tensors() as deltas:
            for start, d in zip(self._outer_params, deltas, strict=True):
                start.grad = d.clone()
        self.outer.step()
        self.outer.zero_grad()
        with torch.no_grad():
            for p, start in zip(self._params, self._outer_params, strict=True):
                p.copy_(start)
        self.samples = 0
        self._advance_epoch()

    # -- state ----------------------------------------------------------------------------------------
    def _init_optimizer_state(self) -> None:
        """Create the wrapped optimizer's statistics now (zeros), so every peer averages and
        downloads the same set of tensors from the first epoch on."""
        if any(self.inner.state.get(p) for p in self._params):
            return
        backup = [p.detach().clone() for p in self._params]
        for p in self._params:
            p.grad = torch.zeros_like(p)
        self.inner.step()
        with torch.no_grad():
            for p, b in zip(self._params, backup, strict=True):
                p.copy_(b)
                p.grad = None
            for state in self.inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.zero_()

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return [state[name] for p in self._params for state in [self.inner.state.get(p, {})]
                for name in sorted(state) if isinstance(state[name], torch.Tensor)
                and state[name].is_floating_point()]

    def _state_tensors(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params] + self._optimizer_tensors()

    def _sync_state_tensors(self, to_averager: bool) -> None:
        ours = self._state_tensors()
        with self.state_averager.get_tensors() as theirs, torch.no_grad():
            for mine, avg in zip(ours, theirs, strict=True):
                (avg.copy_(mine) if to_averager else mine.copy_(avg.view_as(mine)))

    def _try_load_state(self, timeout: float) -> bool:
        try:
            version, metadata = self.state_averager.load_state_from_peers(timeout)
        except AveragingError as e:
            logger.info("no state downloaded (%s); starting from local parameters", e)
            return False
        self._sync_state_tensors(to_averager=False)
        epoch = int(metadata.get("epoch", 0)) if isinstance(metadata, dict) else 0
        while self.local_epoch < epoch:
            self.local_epoch += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self.state_averager.state_metadata = {"epoch": self.local_epoch}
        if self.mode == "diloco":
            with torch.no_grad():
                for start, p in zip(self._outer_params, self._params, strict=True):
                    start.copy_(p)
        logger.info("downloaded the swarm's state at epoch %d", self.local_epoch)
        return True

    # -- progress -----------------------------------------------------------------------------------
    def _measure_speed(self) -> None:
        now = time.perf_counter()
        if self._last_step_time is not None and now > self._last_step_time:
            speed = self.batch_size_per_step / (now - self._last_step_time)
            self.samples_per_second = speed if not self.samples_per_second else (
                (1 - SPEED_SMOOTHING) * self.samples_per_second + SPEED_SMOOTHING * speed)
        self._last_step_time = now

    async def _progress_loop(self) -> None:
        while True:
            await self._report()
            reports = await self.tracker.fetch()
            if reports is not None:
                self._reports = reports
            await asyncio.sleep(PROGRESS_INTERVAL)

    def shutdown(self) -> None:
        """Stop publishing progress and serving averaging; the peer itself stays up."""
        if self._progress_task is not None:
            self._progress_task.cancel()
        for averager in (self.grad_averager, self.state_averager, getattr(self, "delta_averager", None)):
            if averager is not None:
                averager.shutdown()
