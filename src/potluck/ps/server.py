"""A parameter server (or one shard of one) over any potluck transport, TCP or emulated.

Workers push gradients and get fresh parameters back in the reply; what the server waits for
before it answers is the mode:
- `sync`: one step per round, with the average gradient of every live worker;
- `async`: every gradient is applied as it arrives; its staleness (server steps since the
  parameters it was computed on) is recorded;
- `ssp` (stale synchronous parallel): as async, but a worker more than `staleness_bound` pushes
  ahead of the slowest live worker is held until that one catches up;
- `backup`: one step per round with the first N - b gradients of the round; gradients computed on
  older parameters than the current step are dropped (the slowest b workers never hold a step up).

A worker that stays silent for `worker_timeout` (and is not waiting in a call) is dropped, so a
dead worker stops a round for at most that long. In the decentralized form a shard's server
copies its state to a standby on another peer after every step, before it answers the workers;
the standby takes over when workers turn to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.net.connection import CallContext
from potluck.net.identity import PeerID
from potluck.net.transport import Transport

logger = logging.getLogger(__name__)

MODES = ("sync", "async", "ssp", "backup")

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


class PSInputError(PotluckError, ValueError):
    """A worker sent a push the server cannot use (malformed, wrong count/shape/dtype, non-finite)."""


@dataclass
class ServerConfig:
    """How a parameter server steps; see the module docstring for the modes."""

    mode: str = "sync"
    num_workers: int = 1  # expected at start: the registration barrier waits for this many
    staleness_bound: int = 2  # ssp: how many pushes a worker may be ahead of the slowest
    backup_workers: int = 1  # backup: a step uses the first (live workers - backup_workers) gradients
    worker_timeout: float = WORKER_TIMEOUT
    registration_timeout: float = REGISTRATION_TIMEOUT

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.num_workers < 1 or self.staleness_bound < 0 or self.backup_workers < 0:
            raise ValueError("num_workers must be >= 1; staleness_bound and backup_workers >= 0")
        if self.worker_timeout <= 0 or self.registration_timeout < 0:
            raise ValueError("worker_timeout must be positive and registration_timeout non-negative")


@dataclass(frozen=True)
class ShardLayout:
    """Which server holds which parameters: `assignment[i]` is parameter i's shard, and
    `servers[k]` the peer ids that serve shard k, primary first, then its standbys."""

    assignment: tuple[int, ...]
    servers: tuple[tuple[str, ...], ...]

    def indices(self, shard: int) -> list[int]:
        return [i for i, s in enumerate(self.assignment) if s == shard]

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def to_dict(self) -> dict[str, Any]:
        return {"assignment": list(self.assignment), "servers": [list(s) for s in self.servers]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardLayout:
        return cls(tuple(int(i) for i in data["assignment"]), tuple(tuple(map(str, s)) for s in data["servers"]))


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


def method_name(run_id: str, shard: int, verb: str) -> str:
    """The RPC method of one shard's server: several shards (and standbys) can share a peer."""
    return f"ps.{run_id}.{shard}.{verb}"


@dataclass
class _WorkerState:
    last_seen: float
    clock: int = 0  # gradients pushed
    in_call: int = 0  # calls it is waiting in (a waiting worker is alive, whatever its silence)


class ParameterServer:
    """Serves one shard of a model's parameters on `transport` (see the module docstring).

    Args:
        transport: a started transport (a Peer's `.transport`, or an emulated one).
        run_id: the training run; several runs can share a peer.
        params: this shard's initial parameters (copied; the server owns its copy).
        optimizer: a callable `params -> torch.optim.Optimizer` (any optimizer).
        config: the mode and its limits.
        shard: this shard's index (it is part of the method names).
        replica: the peer that keeps a standby copy of this shard (decentralized form).
        standby: the peer id of the shard's primary: start as its standby, take copies of the state
            from it (and from nobody else), and serve once a worker turns here.
        offload: run optimizer steps in a worker thread (keeps the loop responsive); False runs
            them on the loop, which makes emulated runs under the virtual clock repeat exactly.
    """

    def __init__(self, transport: Transport, run_id: str, params: Sequence[torch.Tensor],
                 optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 config: ServerConfig | None = None, *, shard: int = 0, replica: str | PeerID | None = None,
                 standby: str | None = None, offload: bool = True):
        self.transport = transport
        self.offload = offload
        self.run_id = run_id
        self.shard = shard
        self.config = config or ServerConfig()
        self.params = [p.detach().clone().requires_grad_(True) for p in params]
        self.optimizer = optimizer(self.params)
        self.replica = PeerID.from_string(replica) if isinstance(replica, str) else replica
        self.primary = standby
        self.standby = standby is not None
        self.step = 0
        self.workers: dict[str, _WorkerState] = {}
        self.staleness: deque[int] = deque(maxlen=MAX_RECORDS)  # per applied gradient, in server steps
        self.clock_gaps: deque[int] = deque(maxlen=MAX_RECORDS)  # per push: its clock minus the slowest's
        self.step_times: deque[float] = deque(maxlen=MAX_RECORDS)  # loop time of every step
        self.dropped_gradients = 0
        self.dropped_workers: list[str] = []
        self._round: dict[str, list[torch.Tensor]] = {}
        self._replica_workers: list[str] = []
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._registered = asyncio.Event()
        for verb in ("register", "push", "pull", "replicate"):
            transport.add_handler(method_name(run_id, shard, verb), self._serve(verb))

    def shutdown(self) -> None:
        """Stop serving (pending calls end with the connection or their deadline)."""
        for verb in ("register", "push", "pull", "replicate"):
            self.transport.remove_handler(method_name(self.run_id, self.shard, verb))

    def _serve(self, verb: str) -> Callable[[Any, CallContext], Any]:
        async def handler(request: Any, ctx: CallContext) -> Any:
            return await self.handle(verb, request, str(ctx.peer_id))
        return handler

    async def handle(self, verb: str, request: Any, worker: str) -> Any:
        """Serve one call from `worker` (a peer id), whether another peer or this one."""
        if verb == "replicate":
            if worker != self.primary:
                raise PSInputError(f"only shard {self.shard}'s primary may update its standby")
            return await self._on_replicate(request)
        self._activate()
        if verb == "register":
            return await self._on_register(worker)
        if verb == "pull":
            async with self._lock:
                return self._reply()
        if verb == "push":
            return await self._on_push(request, worker)
        raise PSInputError(f"unknown parameter-server call {verb!r}")

    # -- handlers ---------------------------------------------------------------------------------
    async def _on_register(self, worker: str) -> dict[str, Any]:
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
                return self._reply()
        finally:
            self._leave(worker)

    async def _on_push(self, request: Any, worker: str) -> dict[str, Any]:
        base_step, grads = self._check_push(request)
        self._drop_expired()  # modes that never wait (async, backup) still drop the dead
        self._enter(worker)
        try:
            mode = self.config.mode
            if mode in ("sync", "backup"):
                return await self._push_round(worker, base_step, grads)
            state = self.workers[worker]
            if mode == "ssp":
                self.clock_gaps.append(state.clock - self._min_clock())
            state.clock += 1
            async with self._lock:
                await self._apply([grads], [self.step - base_step])
                reply = self._reply()
            if mode == "ssp":
                bound = self.config.staleness_bound
                await self._wait_until(lambda: worker not in self.workers
                                       or self.workers[worker].clock - self._min_clock() <= bound)
                async with self._lock:
                    reply = self._reply()
            return reply
        finally:
            self._leave(worker)

    async def _on_replicate(self, request: Any) -> bool:
        if not self.standby:
            return False  # promoted already: the old primary's late copy is not wanted
        if not isinstance(request, dict) or not isinstance(request.get("step"), int):
            raise PSInputError("a replica update must be {'step': int, 'params': [tensors], 'workers': [ids]}")
        params = self._check_tensors(request.get("params"), "parameter")
        workers = request.get("workers")
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise PSInputError("a replica update must list the workers as strings")
        async with self._lock:
            with torch.no_grad():
                for p, new in zip(self.params, params, strict=True):
                    p.copy_(new)
            self.step = request["step"]
            self._replica_workers = workers
        return True

    # -- rounds (sync, backup) --------------------------------------------------------------------
    async def _push_round(self, worker: str, base_step: int, grads: list[torch.Tensor]) -> dict[str, Any]:
        async with self._lock:  # not while a step is being applied: the push belongs to the next round
            if self.config.mode == "backup" and base_step < self.step:
                self.dropped_gradients += 1  # computed on parameters a finished round has replaced
                return {**self._reply(), "dropped": True}
            target = self.step + 1
            self._round[worker] = grads
            self.workers[worker].clock += 1
        self._notify()
        await self._wait_until(lambda: self.step >= target)
        async with self._lock:
            return self._reply()

    def _round_ready(self) -> bool:
        if not self._round or self.config.mode not in ("sync", "backup"):
            return False
        if self.config.mode == "sync":
            return all(w in self._round for w in self.workers)
        return len(self._round) >= max(1, len(self.workers) - self.config.backup_workers)

    async def _finish_round(self) -> None:
        async with self._lock:
            if not self._round_ready():
                return
            grads = list(self._round.values())
            self._round = {}
            await self._apply(grads, [0] * len(grads))

    # -- applying gradients -----------------------------------------------------------------------
    async def _apply(self, grads: list[list[torch.Tensor]], staleness: list[int]) -> None:
        """One optimizer step with the mean of `grads`; the caller holds the lock."""
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

    def _step_now(self, grads: list[list[torch.Tensor]]) -> None:
        """Average and step (in a worker thread when offloaded: tensor math stays off the loop)."""
        for i, p in enumerate(self.params):
            p.grad = torch.stack([g[i] for g in grads]).mean(0) if len(grads) > 1 else grads[0][i].clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    async def _replicate(self) -> None:
        request = {"step": self.step, "params": [p.detach().clone() for p in self.params],
                   "workers": list(self.workers)}
        try:
            await self.transport.call(self.replica, method_name(self.run_id, self.shard, "replicate"), request,
                                      timeout=REPLICATE_TIMEOUT)
        except NetworkError as e:
            logger.warning("ps %s/%d: standby %s unavailable (%s); going on without a replica",
                           self.run_id, self.shard, self.replica, e)
            self.replica = None

    def _activate(self) -> None:
        """A standby that a worker turns to becomes the shard's server, with the primary's workers."""
        if not self.standby:
            return
        self.standby = False
        now = asyncio.get_running_loop().time()
        for w in self._replica_workers:
            self.workers.setdefault(w, _WorkerState(now))
        self._registered.set()
        logger.warning("ps %s/%d: standby takes over at step %d with %d workers", self.run_id, self.shard,
                       self.step, len(self.workers))

    # -- membership and waiting ---------------------------------------------------------------------
    def _enter(self, worker: str) -> None:
        now = asyncio.get_running_loop().time()
        state = self.workers.get(worker)
        if state is None:
            state = self.workers[worker] = _WorkerState(now, clock=self._min_clock() if self.workers else 0)
            self._notify()
        state.last_seen = now
        state.in_call += 1

    def _leave(self, worker: str) -> None:
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

    # -- checks and replies ---------------------------------------------------------------------------
    def _check_push(self, request: Any) -> tuple[int, list[torch.Tensor]]:
        if not isinstance(request, dict):
            raise PSInputError("a push must be a dict {'step': int, 'grads': [tensors]}, "
                               f"not {type(request).__name__}")
        step = request.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= self.step:
            raise PSInputError(f"a push's step must be an int between 0 and the server's step {self.step}, "
                               f"got {step!r}")
        return step, self._check_tensors(request.get("grads"), "gradient")

    def _check_tensors(self, tensors: Any, what: str) -> list[torch.Tensor]:
        if not isinstance(tensors, list) or len(tensors) != len(self.params):
            count = len(tensors) if isinstance(tensors, list) else type(tensors).__name__
            raise PSInputError(f"expected a list of {len(self.params)} {what} tensors for shard {self.shard}, "
                               f"got {count}")
        for i, (t, p) in enumerate(zip(tensors, self.params, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise PSInputError(f"{what} {i} is a {type(t).__name__}, not a tensor")
            if t.shape != p.shape or t.dtype != p.dtype:
                raise PSInputError(f"{what} {i} is {t.dtype} {tuple(t.shape)}; expected {p.dtype} {tuple(p.shape)}")
            if not torch.isfinite(t).all():
                raise PSInputError(f"{what} {i} has non-finite values")
        return tensors

    def _reply(self) -> dict[str, Any]:
        return {"step": self.step, "params": [p.detach().clone() for p in self.params]}
