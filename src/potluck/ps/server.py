"""A parameter server (or one shard of one) on any potluck peer, over TCP or the emulated network.

Workers push gradients and get fresh parameters back in the reply; what the server waits for
before it answers is its consistency model (`ServerConfig.consistency`):
- `sync`: one step per round, with the average gradient of every live worker;
- `async`: every gradient is applied as it arrives; its staleness (server steps since the
  parameters it was computed on) is recorded;
- `ssp` (stale synchronous parallel): as async, but a worker more than `staleness_bound` pushes
  ahead of the slowest live worker is held until that one catches up;
- `backup`: one step per round with the first N - b gradients of the round; gradients computed on
  older parameters than the current step are dropped (the slowest b workers never hold a step up).

A worker that stays silent for `worker_timeout` (and is not waiting in a call) is dropped, so a
dead worker stops a round for at most that long. A shard's server with a standby on another peer
(the decentralized form, or `attach_replica`) copies its state to it after every step, before it
answers the workers: parameters, optimizer state (Adam's moments and step counts) and each
worker's last applied push. The standby takes over when workers turn to it and goes on exactly as
the primary would have: a push the primary applied and the worker sends again to the standby is
answered, not applied twice.

Only the run's workers may call (issue 14: a stranger pushed 3e38 into an async server). The
caller is the transport's authenticated peer id. With `workers=` the server knows the run's
workers by peer id and refuses everyone else; without it, `register` hands out `num_workers`
seats, first come, and a peer that holds no seat can neither push nor pull (a worker dropped for
silence keeps its seat and may come back). A standby serves only the workers its primary copied
to it. A refused caller gets a `PSInputError` that says why, and the server goes on serving.
Pushes are also checked by size: non-finite values are refused at parse time, and a push whose
norm is above `MAX_PUSH_NORM`, above the run's `max_push_norm`, or `push_norm_factor` times the
median norm of recent accepted pushes is refused before it reaches the optimizer. That bounds one
push's size, not its direction: a registered worker may push a sign-flipped or scaled gradient
within the caps. Against that, sync and backup rounds can combine their gradients with a robust
`aggregation` (`potluck.averaging.robust`, as averaging does); async and ssp apply each push alone,
so there is no set of gradients to aggregate, and they refuse one.

Every call is parsed into its typed message (`potluck.ps.messages`) before a handler sees it; a
malformed one is refused with `MalformedMessage` naming the field, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import InitVar, dataclass
from typing import Any, TypeVar

import torch

from potluck.averaging.allreduce import CHUNK_ELEMENTS
from potluck.averaging.robust import AGGREGATIONS, aggregate
from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.staging import to_host
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.ps.messages import (
    MAX_WORKERS,
    ParamsReply,
    PullRequest,
    PushRequest,
    RegisterRequest,
    ReplicaAck,
    ReplicaUpdate,
)
from potluck.ps.runs import served_runs

logger = logging.getLogger(__name__)

# What a server waits for before it answers a push (see the module docstring).
CONSISTENCY_MODELS = ("sync", "async", "ssp", "backup")

# A worker that has not called for this long, and is not waiting in a call, is dropped: sync
# rounds stop waiting for it and SSP stops holding the others back for it. It must exceed the
# slowest live worker's time per step (compute plus transfer), or slow workers are dropped too.
WORKER_TIMEOUT = 10.0
# How long `register` waits for the expected number of workers before training starts with
# those present (a barrier, so the first sync round is not a round of one).
REGISTRATION_TIMEOUT = 30.0
# How long a server waits for its standby to take a copy of the state after a step; a standby
# that does not answer in time is given up (training goes on without a replica).
REPLICATE_TIMEOUT = 10.0
# Staleness and clock-gap records kept for inspection: bounded memory on long runs.
MAX_RECORDS = 100_000
# A push whose L2 norm is above this is refused, whatever the run's options: its square overflows
# float32 (~3.4e38), so the optimizer's own arithmetic on it (Adam's squared gradients, momentum
# sums, a round's mean) would turn its float32 state into infinities. No honest gradient comes
# near it; a stranger's 3e38 (issue 14) does.
MAX_PUSH_NORM = math.sqrt(torch.finfo(torch.float32).max)  # ~1.8e19
# Default relative bound: a push more than this many times the median norm of the last
# PUSH_NORM_WINDOW accepted pushes is refused. Honest gradient norms drift over a run and spike
# by a few times (10x is a large spike); two orders of magnitude above the recent median is not a
# gradient of the same model on the same parameters but a corrupted or hostile one, and one such
# push applied with a normal learning rate undoes many steps. It bounds a single outlier, not a
# member that inflates its pushes slowly (robust aggregation is for that).
PUSH_NORM_FACTOR = 100.0
# Accepted push norms the median is taken over: about a few steps of a large run (the norm of
# one worker's gradient moves slowly), and a fixed, small amount of memory.
PUSH_NORM_WINDOW = 64
# Accepted (non-zero) pushes before the relative bound applies: the median of fewer is no scale.
PUSH_NORM_WARMUP = 8


class PSInputError(PotluckError, ValueError):
    """A peer made a call the server refuses whatever its contents (e.g. a replica update from a
    peer other than the shard's primary); malformed messages raise `MalformedMessage` instead."""


@dataclass
class ServerConfig:
    """How a parameter server steps: its consistency model (see the module docstring) and limits.
    `mode` is the old name of `consistency`, accepted (with a DeprecationWarning) for one release."""

    consistency: str = "sync"
    num_workers: int = 1  # expected at start: the registration barrier waits for this many
    staleness_bound: int = 2  # ssp: how many pushes a worker may be ahead of the slowest
    backup_workers: int = 1  # backup: a step uses the first (live workers - backup_workers) gradients
    worker_timeout: float = WORKER_TIMEOUT
    registration_timeout: float = REGISTRATION_TIMEOUT
    # Pushes with an L2 norm above this are refused (None: only MAX_PUSH_NORM); e.g. the norm the
    # workers clip their gradients to, when the run clips.
    max_push_norm: float | None = None
    # Pushes above this many times the median norm of recent accepted pushes are refused (None: off).
    push_norm_factor: float | None = PUSH_NORM_FACTOR
    # How a sync or backup round combines its gradients: "mean", or "centered_clip" or
    # "trimmed_mean" (bounded pull of a minority of lying workers; see `potluck.averaging.robust`).
    aggregation: str = "mean"
    mode: InitVar[str | None] = None

    def __post_init__(self, mode: str | None) -> None:
        if mode is not None:
            warnings.warn("ServerConfig(mode=...) is deprecated: it is called consistency now "
                          "(ServerConfig(consistency=...)); mode= goes in the next release",
                          DeprecationWarning, stacklevel=3)
            self.consistency = mode
        if self.consistency not in CONSISTENCY_MODELS:
            raise ValueError(f"consistency must be one of {CONSISTENCY_MODELS}, not {self.consistency!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if self.aggregation != "mean" and self.consistency not in ("sync", "backup"):
            raise ValueError(f"aggregation={self.aggregation!r} needs consistency 'sync' or 'backup': "
                             f"{self.consistency!r} applies every push alone, so there are no gradients to aggregate")
        if self.num_workers < 1 or self.staleness_bound < 0 or self.backup_workers < 0:
            raise ValueError("num_workers must be >= 1; staleness_bound and backup_workers >= 0")
        if self.worker_timeout <= 0 or self.registration_timeout < 0:
            raise ValueError("worker_timeout must be positive and registration_timeout non-negative")
        if self.num_workers > MAX_WORKERS:
            raise ValueError(f"num_workers must be at most {MAX_WORKERS} (a replica update lists every worker)")
        if (self.max_push_norm is not None and not self.max_push_norm > 0) or (
                self.push_norm_factor is not None and not self.push_norm_factor >= 1):
            raise ValueError("max_push_norm must be positive and push_norm_factor at least 1 (or None: off)")


def split_by_size(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Assign tensors to shards so the shards hold about the same number of elements (largest
    tensor first onto the lightest shard); returns each tensor's shard. Deterministic."""
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    load = [0] * num_shards
    assignment = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        assignment[i] = shard
        load[shard] += sizes[i]
    return assignment


@dataclass
class _WorkerState:
    last_seen: float
    clock: int = 0  # gradients pushed
    in_call: int = 0  # calls it is waiting in (a waiting worker is alive, whatever its silence)


Message = TypeVar("Message")


class ParameterServer:
    """Serves one shard of a model's parameters on `peer` (see the module docstring).

    Args:
        peer: a started peer (a `potluck.Peer`, or an emulated one); the server answers on its transport.
        run_id: the training run; several runs can share a peer.
        params: this shard's initial parameters, on any device (copied to host memory: the server
            owns its copy, and its optimizer steps there).
        optimizer: a callable `params -> torch.optim.Optimizer` (any optimizer).
        config: the consistency model and its limits.
        shard: this shard's index (it is part of the method names).
        replica: the peer that keeps a standby copy of this shard (decentralized form).
        standby_of: the shard's primary: start as its standby, take copies of the state from it
            (and from nobody else), and serve once a worker turns here.
        offload: run optimizer steps in a worker thread (keeps the loop responsive); False runs
            them on the loop, which makes emulated runs under the virtual clock repeat exactly.
        workers: the run's workers, by peer id: only they may call (no registration seats). None:
            `register` hands out `config.num_workers` seats, first come (see the module docstring).
    """

    def __init__(self, peer: PeerLike, run_id: str, params: Sequence[torch.Tensor],
                 optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 config: ServerConfig | None = None, *, shard: int = 0, replica: PeerID | None = None,
                 standby_of: PeerID | None = None, offload: bool = True,
                 workers: Collection[PeerID] | None = None):
        if workers is not None and len(set(workers)) > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} workers (a replica update lists every worker)")
        self.peer = peer
        self.transport = peer.transport
        self.offload = offload
        self.run_id = run_id
        self.names = RunNames(run_id)
        self.shard = shard
        self.config = config or ServerConfig()
        # the shard's own copy, in host memory whatever device `params` are on: pushes arrive there
        self.params = [t.requires_grad_(True) for t in to_host(params, copy=True)]
        self.optimizer = optimizer(self.params)
        self.replica = replica
        self.primary = standby_of
        self.standby = standby_of is not None
        self.step = 0
        self.workers: dict[PeerID, _WorkerState] = {}
        self.staleness: deque[int] = deque(maxlen=MAX_RECORDS)  # per applied gradient, in server steps
        self.clock_gaps: deque[int] = deque(maxlen=MAX_RECORDS)  # per push: its clock minus the slowest's
        self.step_times: deque[float] = deque(maxlen=MAX_RECORDS)  # loop time of every step
        self.dropped_gradients = 0
        self.dropped_workers: deque[PeerID] = deque(maxlen=MAX_RECORDS)  # in the order they were dropped
        self.refused_pushes = 0  # pushes over a norm bound (strangers are refused before they count)
        # Who may call: the fixed list, or the seats taken by `register` (at most num_workers).
        self.allowed: frozenset[PeerID] | None = frozenset(workers) if workers is not None else None
        self.members: set[PeerID] = set()
        self._push_norms: deque[float] = deque(maxlen=PUSH_NORM_WINDOW)
        self._round: dict[PeerID, tuple[torch.Tensor, ...]] = {}
        self._replica_workers: tuple[PeerID, ...] = ()
        # Each worker's last accepted push, by its `seq`: one at or below this is a push already
        # applied, sent again (to the standby, after its primary died before answering).
        self._last_push: dict[PeerID, int] = {}
        self._copied_workers: frozenset[PeerID] = frozenset()  # the workers of the standby's last copy
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._registered = asyncio.Event()
        self._serve("register", RegisterRequest.from_wire, self._on_register, caller=self._check_registering)
        self._serve("pull", PullRequest.from_wire, self._on_pull, caller=self._check_worker)
        self._serve("push", lambda msg: PushRequest.from_wire(msg, like=self.params, latest_step=self.step),
                    self._on_push, caller=self._check_worker)
        self._serve("replicate", lambda msg: ReplicaUpdate.from_wire(msg, like=self.params), self._on_replicate,
                    caller=self._check_primary)
        served_runs(self.transport).add(self, run_id)  # a worker of a wrong --run-id asks (ps.runs)

    def shutdown(self) -> None:
        """Stop serving (pending calls end with the connection or their deadline)."""
        for verb in ("register", "push", "pull", "replicate"):
            self.transport.remove_handler(self.names.ps_shard(self.shard, verb))
        served_runs(self.transport).remove(self)

    def _serve(self, verb: str, parse: Callable[[Any], Message],
               serve: Callable[[Message, PeerID], Awaitable[ParamsReply | ReplicaAck]],
               caller: Callable[[PeerID], None] | None = None) -> None:
        """Answer `verb` calls: check who calls (before spending time on the request), parse the
        request into its message, serve it, send the reply's wire form."""
        async def handler(request: Any, ctx: CallContext) -> Any:
            if caller is not None:
                caller(ctx.peer_id)
            reply = await serve(parse(request), ctx.peer_id)
            return reply.to_wire()
        self.transport.add_handler(self.names.ps_shard(self.shard, verb), handler)

    # -- handlers ---------------------------------------------------------------------------------
    async def _on_pull(self, request: PullRequest, worker: PeerID) -> ParamsReply:
        self._activate()
        async with self._lock:
            return self._reply()

    async def _on_register(self, request: RegisterRequest, worker: PeerID) -> ParamsReply:
        self._activate()
        self._enter(worker)
        try:
            if len(self.workers) >= self.config.num_workers:
                self._registered.set()
            try:
                async with compat.timeout(self.config.registration_timeout):
                    await self._registered.wait()
            except TimeoutError:
                self._registered.set()  # start with whoever is here
                logger.info("ps %s/%d: starting with %d of %d workers", self.run_id, self.shard,
                            len(self.workers), self.config.num_workers)
            async with self._lock:
                if self.replica is not None and worker not in self._copied_workers:
                    await self._replicate()  # before the first step: the standby serves only workers it knows
                return self._reply()
        finally:
            self._leave(worker)

    async def _on_push(self, request: PushRequest, worker: PeerID) -> ParamsReply:
        self._check_norm(request.grads, worker)
        self._activate()
        base_step, grads = request.step, request.grads
        self._drop_expired()  # consistency models that never wait (async, backup) still drop the dead
        self._enter(worker)
        try:
            seq = request.seq
            if seq is not None and seq <= self._last_push.get(worker, -1):
                async with self._lock:  # applied before (by the primary this standby took over from)
                    return self._reply()
            consistency = self.config.consistency
            if consistency in ("sync", "backup"):
                return await self._push_round(worker, base_step, grads, seq)
            state = self.workers[worker]
            if consistency == "ssp":
                self.clock_gaps.append(state.clock - self._min_clock())
            state.clock += 1
            async with self._lock:
                if seq is not None:
                    self._last_push[worker] = seq
                await self._apply([grads], [self.step - base_step])
                reply = self._reply()
            if consistency == "ssp":
                bound = self.config.staleness_bound
                await self._wait_until(lambda: worker not in self.workers
                                       or self.workers[worker].clock - self._min_clock() <= bound)
                async with self._lock:
                    reply = self._reply()
            return reply
        finally:
            self._leave(worker)

    # -- who may call --------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"run {self.run_id!r}, shard {self.shard}"

    def _check_registering(self, caller: PeerID) -> None:
        """`register`: a listed worker, a seat holder, or a free seat (first come)."""
        if self._known(caller):
            return
        if self.allowed is None and not self.standby and len(self.members) < self.config.num_workers:
            self.members.add(caller)  # takes a seat; it keeps it (a dropped worker may come back)
            return
        self._refuse(caller)

    def _check_worker(self, caller: PeerID) -> None:
        """`push`, `pull`: only the run's registered workers (a stranger's call changes nothing)."""
        if not self._known(caller):
            self._refuse(caller)

    def _known(self, caller: PeerID) -> bool:
        if caller in self.members:
            return True
        if (self.allowed is not None and caller in self.allowed) or (self.standby and caller in self._replica_workers):
            self.members.add(caller)
            return True
        return False

    def _refuse(self, caller: PeerID) -> None:
        if self.allowed is not None:
            why = f"this server serves a fixed list of {len(self.allowed)} workers"
        elif self.standby:
            why = "a standby serves only the workers its primary registered"
        elif len(self.members) >= self.config.num_workers:
            why = f"all {self.config.num_workers} worker seats are taken"
        else:
            why = "call register first"
        raise PSInputError(f"peer {caller} is not a registered worker of {self._where()}: {why}")

    def _check_norm(self, grads: Sequence[torch.Tensor], worker: PeerID) -> None:
        """Refuse a push whose norm is above the bounds (see the module docstring); the norm is
        summed in float64, so a huge push is measured rather than overflowing."""
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 if g.is_floating_point()
                             else float(torch.linalg.vector_norm(g)) ** 2 for g in grads))
        bound, why = MAX_PUSH_NORM, "its square overflows float32, so the optimizer's state would turn infinite"
        if self.config.max_push_norm is not None and self.config.max_push_norm < bound:
            bound, why = self.config.max_push_norm, "the run's max_push_norm"
        factor = self.config.push_norm_factor
        if factor is not None and len(self._push_norms) >= PUSH_NORM_WARMUP:
            median = statistics.median(self._push_norms)
            if factor * median < bound:
                bound = factor * median
                why = (f"{factor:g} times the median norm ({median:.3g}) of the last {len(self._push_norms)} "
                       "accepted pushes")
        if not norm <= bound:  # also refuses a NaN norm
            self.refused_pushes += 1
            logger.info("ps %s/%d: push from %s refused: norm %.3g above %.3g", self.run_id, self.shard, worker,
                        norm, bound)
            raise PSInputError(f"push refused by {self._where()}: its gradient norm {norm:.3g} is above "
                               f"{bound:.3g} ({why})")
        if norm > 0:  # zero pushes (nothing to send) say nothing about the scale
            self._push_norms.append(norm)

    def _check_primary(self, caller: PeerID) -> None:
        if caller != self.primary:
            raise PSInputError(f"only shard {self.shard}'s primary may update its standby")

    async def _on_replicate(self, update: ReplicaUpdate, sender: PeerID) -> ReplicaAck:
        if not self.standby:
            return ReplicaAck(False)  # promoted already: the old primary's late copy is not wanted
        async with self._lock:
            with torch.no_grad():
                for p, new in zip(self.params, update.params, strict=True):
                    p.copy_(new)
            for p, slots in zip(self.params, update.optimizer, strict=False):  # () keeps the standby's own
                self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in slots.items()}
            self.step = update.step
            self._replica_workers = update.workers
            self._last_push = dict(update.last_push)
        return ReplicaAck(True)

    async def attach_replica(self, replica: PeerID) -> bool:
        """Copy this shard's state to `replica` now and after every step from here on (a standby
        that announced itself after this server started). False if it did not take the copy."""
        async with self._lock:
            self.replica = replica
            await self._replicate()
            return self.replica is not None

    # -- rounds (sync, backup) --------------------------------------------------------------------
    async def _push_round(self, worker: PeerID, base_step: int, grads: tuple[torch.Tensor, ...],
                          seq: int | None) -> ParamsReply:
        async with self._lock:  # not while a step is being applied: the push belongs to the next round
            if self.config.consistency == "backup" and base_step < self.step:
                self.dropped_gradients += 1  # computed on parameters a finished round has replaced
                return self._reply(dropped=True)
            target = self.step + 1
            self._round[worker] = grads
            if seq is not None:
                self._last_push[worker] = seq
            self.workers[worker].clock += 1
        self._notify()
        await self._wait_until(lambda: self.step >= target)
        async with self._lock:
            return self._reply()

    def _round_ready(self) -> bool:
        if not self._round or self.config.consistency not in ("sync", "backup"):
            return False
        if self.config.consistency == "sync":
            return all(w in self._round for w in self.workers)
        return len(self._round) >= max(1, len(self.workers) - self.config.backup_workers)

    async def _finish_round(self) -> None:
        async with self._lock:
            if not self._round_ready():
                return
            # In peer-id order, not arrival order: float sums depend on the order, and this way a
            # round's result (and a standby's, after a takeover) is the same whoever pushed first.
            grads = [self._round[w] for w in sorted(self._round, key=str)]
            self._round = {}
            await self._apply(grads, [0] * len(grads))

    # -- applying gradients -----------------------------------------------------------------------
    async def _apply(self, grads: list[tuple[torch.Tensor, ...]], staleness: list[int]) -> None:
        """One optimizer step with the `aggregation` of `grads` (their mean by default); the caller holds the lock."""
        if self.offload:
            await asyncio.get_running_loop().run_in_executor(None, self._step_now, grads)
        else:
            self._step_now(grads)
        self.step += 1
        self.staleness.extend(staleness)
        self.step_times.append(asyncio.get_running_loop().time())
        if self.replica is not None:
            await self._replicate()
        self._notify()

    def _step_now(self, grads: list[tuple[torch.Tensor, ...]]) -> None:
        """Average and step (in a worker thread when offloaded: tensor math stays off the loop)."""
        if self.config.aggregation != "mean" and len(grads) > 1:
            self._aggregate_robustly(grads)
        else:
            for i, p in enumerate(self.params):
                p.grad = torch.stack([g[i] for g in grads]).mean(0) if len(grads) > 1 else grads[0][i].clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _aggregate_robustly(self, grads: list[tuple[torch.Tensor, ...]]) -> None:
        """Set each parameter's gradient to the round's robust aggregate: each worker's push is
        flattened into one vector and aggregated a chunk of CHUNK_ELEMENTS at a time, as an
        all-reduce reducer does (so CenteredClip clips each chunk by its norm, and its float64
        temporaries stay a chunk's size whatever the model's)."""
        flat = [torch.cat([t.reshape(-1).float() for t in push]) for push in grads]
        out = torch.empty_like(flat[0])
        for start in range(0, out.numel(), CHUNK_ELEMENTS):
            end = start + CHUNK_ELEMENTS
            aggregate(self.config.aggregation, [f[start:end] for f in flat], [1.0] * len(flat), out[start:end])
        offset = 0
        for p in self.params:
            p.grad = out[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    async def _replicate(self) -> None:
        # The registered workers (not only the live ones): a worker the primary dropped for silence
        # may come back to the standby.
        optimizer = tuple({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                           for k, v in self.optimizer.state.get(p, {}).items()} for p in self.params)
        update = ReplicaUpdate(self.step, tuple(p.detach().clone() for p in self.params),
                               tuple(self.members | set(self.workers)), optimizer, dict(self._last_push))
        self._copied_workers = frozenset(update.workers)
        try:
            reply = await self.transport.call(self.replica, self.names.ps_shard(self.shard, "replicate"),
                                              update.to_wire(), timeout=REPLICATE_TIMEOUT)
            accepted = ReplicaAck.from_wire(reply).accepted
        except NetworkError as e:  # MalformedMessage is a ProtocolError, so one too
            logger.warning("ps %s/%d: standby %s unavailable (%s); going on without a replica",
                           self.run_id, self.shard, self.replica, e)
            self.replica = None
            return
        if not accepted:
            logger.warning("ps %s/%d: standby %s has taken over the shard (workers thought this server dead); "
                           "no longer replicating to it", self.run_id, self.shard, self.replica)
            self.replica = None

    def _activate(self) -> None:
        """A standby that a worker turns to becomes the shard's server, with the primary's workers."""
        if not self.standby:
            return
        self.standby = False
        now = asyncio.get_running_loop().time()
        for w in self._replica_workers:
            self.workers.setdefault(w, _WorkerState(now))
            self.members.add(w)
        self._registered.set()
        logger.warning("ps %s/%d: standby takes over at step %d with %d workers", self.run_id, self.shard,
                       self.step, len(self.workers))

    # -- membership and waiting ---------------------------------------------------------------------
    def _enter(self, worker: PeerID) -> None:
        now = asyncio.get_running_loop().time()
        state = self.workers.get(worker)
        if state is None:
            state = self.workers[worker] = _WorkerState(now, clock=self._min_clock() if self.workers else 0)
            self._notify()
        state.last_seen = now
        state.in_call += 1

    def _leave(self, worker: PeerID) -> None:
        state = self.workers.get(worker)
        if state is not None:
            state.in_call -= 1
            state.last_seen = asyncio.get_running_loop().time()

    def _min_clock(self) -> int:
        return min((s.clock for s in self.workers.values()), default=0)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _drop_expired(self) -> None:
        now = asyncio.get_running_loop().time()
        for worker, state in list(self.workers.items()):
            if state.in_call == 0 and state.last_seen + self.config.worker_timeout <= now:
                del self.workers[worker]
                self._round.pop(worker, None)
                self.dropped_workers.append(worker)
                logger.warning("ps %s/%d: worker %s silent for %.1f s; dropped", self.run_id, self.shard,
                               worker, now - state.last_seen)
                self._notify()

    def _next_expiry(self) -> float | None:
        """Loop time at which the next idle worker is dropped (the same sum `_drop_expired` checks)."""
        idle = [s.last_seen + self.config.worker_timeout for s in self.workers.values() if s.in_call == 0]
        return min(idle) if idle else None

    async def _wait_until(self, done: Callable[[], bool]) -> None:
        """Wait for `done()`, finishing rounds that become ready and dropping silent workers;
        the handler's deadline (the caller's) bounds the whole wait."""
        while not done():
            if self._round_ready():
                await self._finish_round()
                continue
            changed = self._changed
            try:
                async with compat.timeout_at(self._next_expiry()):
                    await changed.wait()
            except TimeoutError:
                self._drop_expired()

    # -- replies ------------------------------------------------------------------------------------
    def _reply(self, dropped: bool = False) -> ParamsReply:
        return ParamsReply(self.step, tuple(p.detach().clone() for p in self.params), dropped)
