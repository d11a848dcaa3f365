"""Stage workers: one node's part of an asynchronous pipeline, over the transport.

A `StageWorker` holds a contiguous run of layers. It follows `StageSchedule` (backward first, a
staleness bound, no flush), computes on `StashedWeights` snapshots (exact weight stashing),
streams activations forward and gradients backward as unary calls (optionally compressed with a
`potluck.compression` codec, `PipelineConfig.compression`), applies an update after every
`update_frequency` backwards, and, every `average_every` updates, averages its layers with the
nodes holding them in other clusters (`ring.RingAllReduce`) in the background, without pausing the pipeline.

Methods served (`RunNames(run_id).pipeline`): `forward` (`Activation`), `backward` (`Gradient`),
`control` (`Ping`, `Configure`, `GetLayers`, `GetStats`; see `messages`). Malformed or mis-shaped input is
refused with a clear error and the worker goes on serving.

Layers may live on any device and in any float dtype (`make_layers` puts them there): what crosses
the wire (activations, gradients, labels, weights, ring vectors) is copied to host memory in the
compute thread, and what arrives goes to the device and dtype of the stage's first parameter.

Who may call what (the caller is the peer id the transport's handshake proved): `Configure` and
`GetStats` only the controllers the worker was created with (one peer, or every node that may be
elected its cluster's controller: `potluck pipeline run`), and a `Configure` only for an epoch no older
than the stage's (a superseded controller cannot roll it back); `fwd` only the previous stage and
`bwd` only the next stage of the route the message's epoch belongs to; `GetLayers` (weights) the
controller and nodes named in the run's layouts (`LayoutDirectory.lists`); `Ping` anyone. Ring data
is taken from nodes named in the layouts only (`RingAllReduce(allowed=...)`). Anyone else's call is
refused with an error that says so, and the stage goes on serving its neighbours.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from potluck.compression import get_codec
from potluck.core import compat
from potluck.core.errors import CompressionError, NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.runner import run_in_thread
from potluck.core.staging import gather_into, module_place, to_host
from potluck.net.identity import PeerID
from potluck.net.transport import Transport
from potluck.pipeline.layout import LayoutDirectory
from potluck.pipeline.messages import (
    MAX_LAYER_INDEX,
    Ack,
    Activation,
    Configure,
    FailureReport,
    GetLayers,
    GetStats,
    Gradient,
    LayerStates,
    Ping,
    Route,
    StageReport,
    parse_control,
)
from potluck.pipeline.ring import RingAllReduce, RingError, RoundSkipped, ring_segments
from potluck.pipeline.schedule import StageSchedule
from potluck.pipeline.stash import StashedWeights

__all__ = ["PipelineConfig", "PipelineError", "StageWorker", "MakeLayers", "Source", "call"]

logger = logging.getLogger(__name__)

# Ring rounds share each node's uplink with the pipeline's activations, which queue behind whatever
# ring data is already sent: small parts, few in flight (~ one bandwidth-delay product of a
# 50 MB/s, 10 ms link) keep an activation's wait short. Measured (benchmarks/pipeline.py --quick,
# a ring round every 4 updates): 1 MiB x 8 parts cut a 2-cluster pipeline's throughput by 27%,
# 256 KiB x 2 by 2% (7% in the full run, which averages more often relative to its length).
BACKGROUND_PART_BYTES = 2**18
BACKGROUND_PARTS_IN_FLIGHT = 2
# A failure report to the controller: it only checks the peer and starts recovery in the background.
REPORT_TIMEOUT = 5.0
# A message may be from a newer epoch than this stage's (its sender was re-configured first); one
# from further ahead than this is refused (every recovery adds one or two epochs).
MAX_EPOCHS_AHEAD = 16
# The largest micro-batch a stage accepts: bounds what one message can make it allocate.
MAX_MICRO_BATCH = 4096

MakeLayers = Callable[[Sequence[int]], list[nn.Module]]
Source = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineError(PotluckError):
    """Bad pipeline input or state: a refused message, a stage that cannot be configured."""


@dataclass
class PipelineConfig:
    """Tunables shared by every stage of a run (flat, named values)."""

    run_id: str
    staleness_bound: int = 4        # micro-batches in flight per cluster
    update_frequency: int = 1       # backwards per optimizer update
    compression: Any = "none"       # activations and gradients on the wire ("fp16", "uniform8", ...)
    message_timeout: float = 30.0   # deadline of one activation/gradient message
    average_every: int = 0          # ring all-reduce every this many updates (0: never)
    ring_timeout: float = 60.0      # deadline of one ring round
    outer_lr: float = 1.0           # step toward the ring mean (1.0 = take the mean)
    flush_every: int = 0            # >0: synchronous GPipe-style baseline, flush every this many micro-batches
    emulate_compute: bool = False   # also wait the stage's profiled compute time (benchmarks on virtual time)
    micro_batch_timeout: float = 120.0  # a micro-batch whose gradient has not come back by then is dropped
    model: str | None = None        # the model's fingerprint (optim.schema): nodes of another are not the run's


@dataclass
class StageStats:
    busy_seconds: float = 0.0
    forwards: int = 0
    backwards: int = 0
    updates: int = 0
    max_version_lag: int = 0
    losses: list[float] = field(default_factory=list)
    rounds: int = 0          # ring rounds started (ids are shared with the ring's other members)
    rounds_applied: int = 0
    ring_failures: int = 0
    expired: int = 0          # micro-batches given up (their gradient never came)


async def call(transport: Transport, peer: PeerID | str, method: str, message: Any, timeout: float) -> Any:
    """Send a typed `message` to a peer id in text or not; the raw reply, for the caller's
    `from_wire` (a controller may configure its own stage: that goes through the loopback)."""
    peer = PeerID.from_string(peer) if isinstance(peer, str) else peer
    return await transport.call(peer, method, message.to_wire(), timeout=timeout)


@dataclass(slots=True)
class InFlight:
    """A micro-batch between its arrival and its backward: input, labels, then its forward's
    output and weight version, then the gradient of that output."""

    x: torch.Tensor | None
    labels: torch.Tensor | None
    out: torch.Tensor | None = None
    version: int = -1
    grad: torch.Tensor | None = None

    @property
    def forwarded(self) -> bool:
        return self.out is not None


class StageWorker:
    """One node's stage; configured (and re-configured after failures) by a `ClusterController`."""

    def __init__(self, peer: PeerLike, config: PipelineConfig, make_layers: MakeLayers,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 controller: PeerID | str | Collection[PeerID | str], num_layers: int,
                 source: Source | None = None, loss_fn: LossFn | None = None,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None):
        """`controller`: the peer id of the `ClusterController` that will configure this stage, or
        the ids of every node that may become it (the only peers whose `Configure` is taken, so no
        stranger can be the first to configure it);
        `num_layers`: the model's size (a route past it is refused when parsed)."""
        self.peer = peer
        self.transport = transport = peer.transport
        self.config = config
        ids = [controller] if isinstance(controller, (str, PeerID)) else list(controller)
        self.controllers = frozenset(PeerID.from_string(c) if isinstance(c, str) else c for c in ids)
        if not 0 < num_layers <= MAX_LAYER_INDEX:
            raise ValueError(f"num_layers must be in [1, {MAX_LAYER_INDEX}], got {num_layers}")
        self.num_layers = num_layers
        self.make_layers = make_layers
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler  # e.g. a LambdaLR, stepped after every update
        self.lr_scheduler: Any = None
        self.source = source
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.directory = LayoutDirectory(peer, config.run_id)  # every cluster's layout, for the rings
        # Who may configure this stage into a cluster (cluster, caller's id); None: any controller.
        # A pipeline node sets it from its plan (`PipelineNode._may_configure`).
        self.may_configure: Callable[[str, str], bool] | None = None
        self.codec = get_codec(config.compression)
        self.stats = StageStats()
        self.layers: dict[int, nn.Module] = {}
        self._retired: dict[int, nn.Module] = {}
        self._epoch_changed = asyncio.Event()
        self.route: Route | None = None
        self.schedule: StageSchedule | None = None
        self.stash: StashedWeights | None = None
        self.module: nn.Module | None = None
        self.place: tuple[torch.device, torch.dtype] = (torch.device("cpu"), torch.float32)  # the module's
        self.opt: torch.optim.Optimizer | None = None
        self._saved: dict[int, InFlight] = {}
        self._wake = asyncio.Event()
        self.progressed = asyncio.Event()  # set after every task, (re)configuration and ring round
        self._compute_lock = asyncio.Lock()
        self._outbox: dict[str, asyncio.Queue] = {"next": asyncio.Queue(), "prev": asyncio.Queue()}
        self._tasks: list[asyncio.Task] = []
        self._pending_sends: set[asyncio.Task] = set()
        self._averaging: asyncio.Task | None = None
        self._updates_at_last_round = 0
        self._micro_batch_base = 0
        self._last_batch = 0
        self.on_version: Callable[[int, int, dict[str, torch.Tensor]], None] | None = None  # test hook
        self.trace: list[tuple[str, int, int]] | None = None  # (kind, micro-batch, version) if enabled
        # The run is ending (`PipelineNode.end`): a neighbor that stops answering has finished, not
        # failed; it is neither reported nor warned of.
        self.ending = False
        names = RunNames(config.run_id).pipeline
        self.fwd_method, self.bwd_method, self.ctl_method = names.forward, names.backward, names.control
        transport.add_handler(self.fwd_method, self._on_forward)
        transport.add_handler(self.bwd_method, self._on_backward)
        transport.add_handler(self.ctl_method, self._on_control)
        self.ring = RingAllReduce(peer, config.run_id, self.ctl_method, part_bytes=BACKGROUND_PART_BYTES,
                                  parts_in_flight=BACKGROUND_PARTS_IN_FLIGHT, allowed=self.directory.lists)

    @property
    def peer_id(self) -> str:
        return str(self.transport.peer_id)

    def start(self) -> None:
        """Start the compute loop and the two senders (call on the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.ensure_future(self._compute_loop()),
                       asyncio.ensure_future(self._sender("next")), asyncio.ensure_future(self._sender("prev"))]

    async def close(self) -> None:
        for method in (self.fwd_method, self.bwd_method, self.ctl_method):
            self.transport.remove_handler(method)
        self.ring.close()
        tasks = [*self._tasks, *([self._averaging] if self._averaging else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- configuration ------------------------------------------------------------------------------
    async def configure(self, route: Route) -> None:
        """Take the stage `route` describes: layers [start, end), neighbours, shapes, epoch.

        Layers already held keep their trained weights; missing ones are fetched from
        `route.sources` ({layer: peer ids}, the holders in other clusters) or built fresh.
        In-flight micro-batches of the previous epoch are dropped.
        """
        needed = list(range(route.start, route.end))
        async with self._compute_lock:
            self.route = None  # refuse traffic while reconfiguring
            if self.schedule is not None:
                self._micro_batch_base = max(self._micro_batch_base, self.schedule.next_micro_batch)
            self._saved.clear()
            for task in list(self._pending_sends):  # e.g. sends hanging on a node that went silent
                task.cancel()
            for queue in self._outbox.values():
                while not queue.empty():
                    queue.get_nowait()
            missing = [i for i in needed if i not in self.layers]
            fetched = await self._fetch_layers(missing, route.sources) if route.sources else {}
            fresh = [i for i in missing if i not in fetched]
            built = dict(zip(fresh, self.make_layers(fresh), strict=True)) if fresh else {}
            built.update(fetched)
            # layers given away stay readable (get_layers) until the next epoch: the stage that
            # takes them over may be configured after this one
            self._retired = {i: layer for i, layer in self.layers.items() if i not in needed}
            self.layers = {i: self.layers[i] if i in self.layers else built[i] for i in needed}
            self.module = nn.Sequential(*(self.layers[i] for i in needed))
            self.place = module_place(self.module)
            self.opt = self.optimizer_factory(list(self.module.parameters()))
            if self.scheduler_factory is not None:
                self.lr_scheduler = self.scheduler_factory(self.opt)
                for _ in range(self.stats.updates):  # a re-configured stage keeps its place in the schedule
                    self.lr_scheduler.step()
            for p in self.module.parameters():
                p.grad = torch.zeros_like(p)
            self.stash = StashedWeights(self.module)
            self.schedule = StageSchedule(self.config.staleness_bound, self.config.update_frequency,
                                          first=route.first, flush_every=self.config.flush_every)
            self.schedule.next_micro_batch = self._micro_batch_base
            self.route = route
            if self.on_version:
                self.on_version(route.epoch, 0, self.stash.weights(0))
        logger.info("%s: stage %d of cluster %s, layers %d-%d, epoch %d", self.peer_id[:8], route.stage,
                    route.cluster, route.start, route.end, route.epoch)
        self._wake.set()
        self._epoch_changed.set()
        self.progressed.set()

    async def _fetch_layers(self, layers: list[int], sources: Mapping[int, tuple[str, ...]]) -> dict[int, nn.Module]:
        """Layers built here and loaded with the weights of their holder in another cluster."""
        got: dict[int, nn.Module] = {}
        for i in layers:
            for peer in sources.get(i, ()):
                try:
                    reply = await call(self.transport, peer, self.ctl_method, GetLayers((i,)),
                                       self.config.message_timeout)
                    layer = self.make_layers([i])[0]
                    # strict: names, shapes and dtypes must match (RuntimeError otherwise)
                    layer.load_state_dict(LayerStates.from_wire(reply, wanted=(i,)).states[i])
                    got[i] = layer
                    break
                except (NetworkError, RuntimeError) as e:  # MalformedMessage is a NetworkError
                    logger.warning("could not fetch layer %d from %s: %s", i, peer[:8], e)
        return got

    # -- handlers -----------------------------------------------------------------------------------
    @staticmethod
    def _require(ctx: Any, allowed: PeerID | str | frozenset[PeerID] | None, what: str, whom: str) -> None:
        """Refuse `what` unless its caller is `allowed` (a set: one of them; None: nobody), saying
        who may send it."""
        caller = ctx.peer_id
        if allowed is None:
            allowed = frozenset()
        elif not isinstance(allowed, frozenset):
            allowed = frozenset([PeerID.from_string(allowed) if isinstance(allowed, str) else allowed])
        if caller in allowed:
            return
        names = ", ".join(f"{str(a)[:12]}..." for a in sorted(allowed, key=str))
        expected = f"{whom} ({names})" if allowed else f"{whom}, and it has none"
        raise PipelineError(f"{what} refused: this stage takes it only from {expected}, not from {caller}")

    async def _check_epoch(self, epoch: int, ctx: Any) -> Route | None:
        """The route a message of `epoch` belongs to, or None if that epoch is over (dropped). A
        message from a newer epoch waits, within its call's deadline, until this stage is configured
        for it: the controller configures the stages concurrently, so a neighbour may start first.
        Only a node named in the run's layouts is waited for (the controller publishes a layout
        before configuring it): a stranger cannot hold calls open here."""
        if self.route is not None and epoch > self.route.epoch + MAX_EPOCHS_AHEAD:
            raise PipelineError(f"epoch {epoch} is far ahead of this stage's {self.route.epoch}")
        if (self.route is None or self.route.epoch < epoch) and not await self.directory.lists(ctx.peer_id):
            raise PipelineError(f"epoch {epoch} refused: this stage waits for a newer epoch only for nodes named "
                                f"in the run's layouts, not for {ctx.peer_id}")
        try:
            async with compat.timeout(self.config.message_timeout):
                while self.route is None or self.route.epoch < epoch:
                    self._epoch_changed.clear()
                    await self._epoch_changed.wait()
        except TimeoutError:
            raise PipelineError(f"this stage was not configured for epoch {epoch} in time") from None
        return self.route if self.route.epoch == epoch else None

    def _decode(self, payload: Mapping[str, Any], shape: Sequence[int], what: str) -> torch.Tensor:
        try:
            tensor = self.codec.decode(payload, most=MAX_MICRO_BATCH * math.prod(shape))
        except CompressionError as e:
            raise PipelineError(f"{what}: {e} (expected shape: batch <= {MAX_MICRO_BATCH}, "
                                f"{', '.join(map(str, shape))})") from None
        if not tensor.is_floating_point():
            raise PipelineError(f"{what} must be floating point, got {tensor.dtype}")
        if tensor.dim() < 1 or tuple(tensor.shape[1:]) != tuple(shape) or not 0 < tensor.shape[0] <= MAX_MICRO_BATCH:
            raise PipelineError(f"{what} has shape {tuple(tensor.shape)}, expected (batch <= {MAX_MICRO_BATCH}, "
                                f"{', '.join(map(str, shape))})")
        return tensor.float()

    async def _on_forward(self, request: Any, ctx: Any) -> Any:
        message = Activation.from_wire(request)
        route = await self._check_epoch(message.epoch, ctx)
        if route is None:
            return Ack(False).to_wire()
        if route.first:
            raise PipelineError("the first stage takes no activations")
        self._require(ctx, route.prev_peer, "activation", "its previous stage")
        x = self._decode(message.payload, route.in_shape, "activation")
        y = message.labels
        if y.shape[:1] != x.shape[:1]:
            raise PipelineError(f"{y.shape[0] if y.dim() else 0} labels for {x.shape[0]} samples")
        mb = message.micro_batch
        if mb in self._saved or mb in self.schedule.forward_ready:
            raise PipelineError(f"micro-batch {mb} was already received")
        if len(self.schedule.forward_ready) >= self.config.staleness_bound:
            raise PipelineError("too many micro-batches queued: the sender ignores the staleness bound")
        self._saved[mb] = InFlight(x, y)
        self.schedule.add_forward(mb)
        self._wake.set()
        return Ack().to_wire()

    async def _on_backward(self, request: Any, ctx: Any) -> Any:
        message = Gradient.from_wire(request)
        route = await self._check_epoch(message.epoch, ctx)
        if route is None:
            return Ack(False).to_wire()
        self._require(ctx, route.next_peer, "gradient", "its next stage")
        mb = message.micro_batch
        saved = self._saved.get(mb)
        if saved is None or not saved.forwarded or saved.grad is not None or mb in self.schedule.backward_ready:
            raise PipelineError(f"gradient for micro-batch {mb}, which is not waiting for one here")
        out = saved.out
        g = self._decode(message.payload, tuple(out.shape[1:]), "gradient")
        if g.shape != out.shape:
            raise PipelineError(f"gradient has shape {tuple(g.shape)}, the activation had {tuple(out.shape)}")
        saved.grad = g
        self.schedule.add_backward(mb)
        self._wake.set()
        return Ack().to_wire()

    async def _on_control(self, request: Any, ctx: Any) -> Any:
        match parse_control(request, self.num_layers):
            case Ping():
                return Ack().to_wire()
            case GetStats():
                self._require(ctx, self.controllers, "stats", "its controller")
                return self.report().to_wire()
            case Configure(route=route):
                self._require(ctx, self.controllers, "configure", "its controller")
                if self.may_configure is not None and not self.may_configure(route.cluster, str(ctx.peer_id)):
                    raise PipelineError(f"configure refused: {ctx.peer_id} may not control cluster {route.cluster!r} "
                                        "with this stage in it")
                if self.route is not None and route.epoch < self.route.epoch:
                    raise PipelineError(f"configure refused: epoch {route.epoch} is older than this stage's "
                                        f"{self.route.epoch} (from a superseded controller)")
                await self.configure(route)
                return Ack().to_wire()
            case GetLayers(layers=wanted):
                if ctx.peer_id not in self.controllers and not await self.directory.lists(ctx.peer_id):
                    raise PipelineError(f"get_layers refused: this stage sends weights only to its controller and "
                                        f"nodes named in the run's layouts, not to {ctx.peer_id}")
                held = {**self._retired, **self.layers}
                missing = [i for i in wanted if i not in held]
                if missing:
                    raise PipelineError(f"this node does not hold layers {missing[:8]}")
                async with self._compute_lock:
                    states = {i: held[i].state_dict() for i in wanted}
                    copies = iter(to_host([v for i in wanted for v in states[i].values()], copy=True))
                    return LayerStates({i: {k: next(copies) for k in states[i]} for i in wanted}).to_wire()

    @property
    def idle(self) -> bool:
        """Nothing computing, queued or in flight here (e.g. after pausing injection)."""
        sch = self.schedule
        return not self._compute_lock.locked() and (sch is None or not (sch.in_flight or sch.forward_ready
                                                                        or sch.backward_ready))

    def report(self) -> StageReport:
        s = self.stats
        return StageReport(busy_seconds=s.busy_seconds, forwards=s.forwards, backwards=s.backwards,
                           updates=s.updates, max_in_flight=self.schedule.max_in_flight if self.schedule else 0,
                           max_version_lag=s.max_version_lag, rounds=s.rounds, rounds_applied=s.rounds_applied,
                           loss=sum(s.losses[-20:]) / len(s.losses[-20:]) if s.losses else None,
                           stage=self.route.stage if self.route else None)

    # -- compute ------------------------------------------------------------------------------------
    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            task = self.schedule.next_task() if self.route is not None and self.schedule else None
            if task is None:
                self._wake.clear()
                expiry = self.schedule.next_expiry(self.config.micro_batch_timeout) if self.schedule else None
                try:
                    async with compat.timeout_at(expiry):
                        await self._wake.wait()
                except TimeoutError:
                    self._expire_stale(loop.time())
                continue
            route = self.route
            async with self._compute_lock:
                if self.route is not route:
                    continue  # re-configured meanwhile: the task belongs to the old epoch
                started = loop.time()
                try:
                    if task.kind == "forward":
                        message = await run_in_thread(self._forward, task.micro_batch, route)
                    else:
                        message = await run_in_thread(self._backward, task.micro_batch, route)
                except Exception:  # a bug or a model error must not kill the stage; the batch is lost
                    logger.exception("%s: %s of micro-batch %d failed", self.peer_id[:8], task.kind, task.micro_batch)
                    self._saved.pop(task.micro_batch, None)
                    continue
                if self.config.emulate_compute:
                    await asyncio.sleep(self._emulated_seconds(task.kind, route))
                self.stats.busy_seconds += loop.time() - started
            if message is not None:
                direction, outgoing = message
                self._outbox[direction].put_nowait((route, outgoing))
            self.progressed.set()
            self._maybe_average()

    def _expire_stale(self, now: float) -> None:
        for mb in self.schedule.expire(now, self.config.micro_batch_timeout):
            entry = self._saved.pop(mb, None)
            if entry is not None and entry.forwarded:
                self.stash.release(entry.version)
            self.stats.expired += 1
            logger.log(logging.DEBUG if self.ending else logging.WARNING,
                       "%s: micro-batch %d expired: no gradient within %.0f s", self.peer_id[:8], mb,
                       self.config.micro_batch_timeout)

    def _emulated_seconds(self, kind: str, route: Route) -> float:
        """The profiled time of this task on this node: forward 1/3, backward 2/3 of forward+backward."""
        total = route.compute_seconds * self._last_batch
        if route.last:
            return total  # forward, loss and backward in one task
        return total / 3 if kind == "forward" else 2 * total / 3

    def _forward(self, mb: int, route: Route) -> tuple[str, Activation | Gradient] | None:
        device, dtype = self.place
        if route.first:
            x, y = self.source(mb)
            x = x.to(device, dtype)
        else:
            saved = self._saved[mb]
            x, y = saved.x.to(device, dtype).requires_grad_(), saved.labels
        self._last_batch = x.shape[0]
        version, params = self.stash.acquire()
        out = functional_call(self.module, params, (x,))
        self.schedule.forward_done(mb, self._loop.time())
        self.stats.forwards += 1
        if self.trace is not None:
            self.trace.append(("forward", mb, version))
        self._saved[mb] = InFlight(x, y, out, version)
        if route.last:
            loss = self.loss_fn(out, y.to(out.device))
            self.stats.losses.append(loss.item())
            return self._backward(mb, route, loss)
        return "next", Activation(route.epoch, mb, self._encode(out), *to_host([y]))

    def _backward(self, mb: int, route: Route, loss: torch.Tensor | None = None) -> tuple[str, Gradient] | None:
        saved = self._saved.pop(mb)
        x, out, version = saved.x, saved.out, saved.version
        params = self.stash.weights(version)
        names = list(params)
        inputs = [params[n] for n in names] + ([] if route.first else [x])
        if loss is not None:
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        else:
            grads = torch.autograd.grad(out, inputs, saved.grad.to(out.device, out.dtype), allow_unused=True)
        scale = 1.0 / self.config.update_frequency
        master = dict(self.module.named_parameters())
        for name, g in zip(names, grads, strict=False):
            if g is not None:
                master[name].grad.add_(g, alpha=scale)
        self.stash.release(version)
        self.stats.backwards += 1
        self.stats.max_version_lag = max(self.stats.max_version_lag, self.stash.version - version)
        if self.trace is not None:
            self.trace.append(("backward", mb, version))
        if self.schedule.backward_done(mb):
            self.opt.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            for p in self.module.parameters():
                p.grad.zero_()
            new = self.stash.advance()
            self.stats.updates += 1
            if self.on_version:
                self.on_version(route.epoch, new, self.stash.weights(new))
        if route.first:
            return None
        return "prev", Gradient(route.epoch, mb, self._encode(grads[-1]))

    def _encode(self, t: torch.Tensor) -> dict[str, Any]:
        """`t` encoded by the codec where it lives (a GPU quantizes faster), its payload in host memory."""
        payload = self.codec.encode(t.detach())
        keys = [k for k, v in payload.items() if isinstance(v, torch.Tensor)]
        return {**payload, **dict(zip(keys, to_host([payload[k] for k in keys]), strict=True))}

    async def _sender(self, direction: str) -> None:
        """Send queued messages without waiting for each reply before the next (a reply costs a round
        trip; waiting would cap a stage at one message per round trip). At most `staleness_bound`
        are unanswered at once; the link keeps them in order."""
        queue = self._outbox[direction]
        window = asyncio.Semaphore(self.config.staleness_bound)
        pending = self._pending_sends
        try:
            while True:
                route, message = await queue.get()
                if route is not self.route:
                    continue
                await window.acquire()
                task = asyncio.ensure_future(self._send(direction, route, message))
                pending.add(task)
                task.add_done_callback(lambda t: (pending.discard(t), window.release()))
        finally:
            for task in pending:
                task.cancel()

    async def _send(self, direction: str, route: Route, message: Activation | Gradient) -> None:
        target = route.next_peer if direction == "next" else route.prev_peer
        method = self.fwd_method if direction == "next" else self.bwd_method
        try:
            await call(self.transport, target, method, message, self.config.message_timeout)
        except (NetworkError, TimeoutError) as e:
            if route is self.route and self.ending:
                logger.debug("%s: %s stage %s has finished: %s", self.peer_id[:8], direction, target[:8], e)
            elif route is self.route:
                logger.warning("%s: %s stage %s failed: %s", self.peer_id[:8], direction, target[:8], e)
                await self._report_failure(route, target)

    async def _report_failure(self, route: Route, peer: str) -> None:
        if route.controller is None or route.report_method is None:
            return
        try:
            await call(self.transport, route.controller, route.report_method, FailureReport(peer, route.epoch),
                       REPORT_TIMEOUT)
        except (PotluckError, TimeoutError) as e:
            logger.warning("could not report a failure to the controller: %s", e)

    # -- averaging across clusters --------------------------------------------------------------------
    def _maybe_average(self) -> None:
        every = self.config.average_every
        if not every or self.stats.updates - self._updates_at_last_round < every:
            return
        if self._averaging is not None and not self._averaging.done():
            return  # the previous round still runs; compute goes on
        self._updates_at_last_round = self.stats.updates
        self._averaging = asyncio.ensure_future(self.average_round())

    async def average_round(self) -> bool:
        """One round of the multi-ring all-reduce over every ring this node is in; True if applied."""
        round_id = self.stats.rounds
        self.stats.rounds += 1
        try:
            layouts = await self.directory.fetch()
            route = self.route
            if route is None:
                return False
            mine = [s for s in ring_segments(layouts) if self.peer_id in s.members
                    and route.start <= s.start and s.end <= route.end]
            async with self._compute_lock:
                snapshots = {s: [p.detach().clone() for i in range(s.start, s.end)
                                 for p in self.layers[i].parameters()] for s in mine}
            vectors = {s: gather_into(snaps, torch.empty(sum(t.numel() for t in snaps)))
                       for s, snaps in snapshots.items()}  # float32, in host memory
            results = await asyncio.gather(*(self.ring.allreduce(round_id, s, vectors[s], self.config.ring_timeout)
                                             for s in mine), return_exceptions=True)
            skipped = [r.round for r in results if isinstance(r, RoundSkipped)]
            if skipped:  # a neighbour is ahead: join it at its round next time
                self.stats.rounds = max(self.stats.rounds, *skipped)
            async with self._compute_lock:
                if self.route is not route:
                    return False
                applied = False
                for s, result in zip(mine, results, strict=True):
                    if isinstance(result, BaseException):
                        self.stats.ring_failures += 1
                        logger.log(logging.INFO if isinstance(result, RoundSkipped) else logging.WARNING,
                                   "ring %d-%d round %d failed: %s", s.start, s.end, round_id, result)
                        continue
                    mean, members = result
                    applied = applied or len(members) > 1
                    offset = 0
                    params = [p for i in range(s.start, s.end) for p in self.layers[i].parameters()]
                    with torch.no_grad():
                        for p, snap in zip(params, snapshots[s], strict=True):
                            target = mean[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
                            if self.config.outer_lr == 1.0:  # the mean, plus any update made meanwhile
                                p.copy_(target + (p - snap))
                            else:
                                p.add_(target - snap, alpha=self.config.outer_lr)
                            offset += p.numel()
                if applied:
                    self.stats.rounds_applied += 1
                    version = self.stash.advance()
                    if self.on_version:
                        self.on_version(route.epoch, version, self.stash.weights(version))
            return applied
        except (RingError, NetworkError, TimeoutError, PotluckError) as e:
            self.stats.ring_failures += 1
            logger.log(logging.DEBUG if self.ending else logging.WARNING, "averaging round %d failed: %s", round_id, e)
            return False
        finally:
            self.ring.finish_round(round_id)
            self.progressed.set()
