"""`ExpertServer`: hosts experts for remote callers, batches their requests and trains the experts.

Requests for the same expert from many clients wait in a per-expert queue; one runtime thread takes
the oldest queue's requests, up to `max_batch_size` rows, and runs them as one batch (torch releases
the GIL, so the event loop keeps receiving meanwhile; whatever arrives during a batch forms the
next one). A forward call from one client keeps its autograd graph ("stash") keyed by the caller's
call id, so the backward call only runs autograd instead of recomputing the forward pass; if the
graph was evicted (memory bound, age) or the weights changed since, the client resends the inputs
and the server recomputes. After each backward batch the expert's optimizer steps.

Callers share the server fairly (issue 14: eight forward calls of a stranger evicted an honest
caller's stashed graph). The stash is shared between the subnets (`net.origins`) and the callers
that hold graphs in it: when it is full, the subnet holding the most graphs loses the oldest
graph of its caller holding the most, so a caller flooding it evicts its own graphs, made-up ids
of one host evict each other's (issue 29: eight of them kept every new caller's graph out), and
every subnet keeps at least its share (`stash_calls` / subnets with graphs stashed). Each caller
(by the transport's authenticated peer id) has a token bucket of calls, `caller_rate` per second
with bursts of `caller_burst`: past it a call is refused at once with `CallerRateLimited` ("slow
down") while other callers are served. The buckets are an LRU of at most `MAX_RATE_CALLERS`
callers, so many identities cannot grow the table. Requests are also
bounded by the expert's declared shapes and `max_batch_size` rows, and must be finite (`messages`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from potluck.core.bounded import drop_oldest
from potluck.core.errors import MalformedMessage
from potluck.core.peer_like import PeerLike
from potluck.core.serialization import dumps, loads
from potluck.core.tensors import all_finite
from potluck.moe.errors import BadExpertRequest, ExpertError, StashMissing
from potluck.moe.experts import TensorSchema, make_expert
from potluck.moe.grid import ANNOUNCE_HORIZON, ExpertLocation, announce_experts
from potluck.moe.messages import (
    MAX_UID_CHARS,
    BackwardReply,
    BackwardRequest,
    ExpertCheckpoint,
    ExpertInfo,
    ForwardReply,
    ForwardRequest,
    InfoRequest,
)
from potluck.net.connection import CallContext

__all__ = ["CallerRateLimited", "ExpertServer", "ExpertStats", "HostedExpert", "METHOD_BACKWARD", "METHOD_FORWARD",
           "METHOD_INFO"]

logger = logging.getLogger(__name__)

METHOD_FORWARD = "moe.forward"
METHOD_BACKWARD = "moe.backward"
METHOD_INFO = "moe.info"

# Rows one call may send and one batch may hold. A call over it is refused with a clear error: with
# the expert's declared per-sample shapes it bounds the tensor elements a single request may carry,
# and so the memory it can make the server allocate (frames are also capped, 64 MiB).
DEFAULT_MAX_BATCH_SIZE = 4096
# How long an announcement stays valid; refreshed every third of it, so one lost refresh is harmless
# and a dead server disappears from searches within this many seconds.
DEFAULT_ANNOUNCE_TTL = 30.0
# Bound on one round of announcements (a DHT store of every expert's keys).
ANNOUNCE_TIMEOUT = 10.0
# Forward graphs kept for backward calls: each holds a batch's activations (for an ffn expert of
# width 1024 and 2048 rows, ~100 MB), so the count is small; a call older than the age limit has
# most likely been abandoned by its client.
DEFAULT_STASH_CALLS = 8
STASH_SECONDS = 60.0
# Calls (forward, backward, info) one caller may make per second, and in a burst, before it is told
# to slow down. An honest client calls each expert it routes a step to once forward and once
# backward: 500 calls/s is e.g. 16 experts of this server at 15 steps/s, and a burst of 1,000 a
# whole step of a client that routes through 500 experts here. They bound how much of the server's
# compute one caller takes from the others, not the server's total (the transport's per-connection
# limits and max_batch_size do that).
CALLER_CALLS_PER_SECOND = 500.0
CALLER_BURST = 1000
# Callers whose buckets are remembered (least recently calling forgotten first). A forgotten
# caller starts again with a full bucket, which it could have refilled by waiting anyway; 4,096
# is several times the connections a peer accepts (768), so active callers are not forgotten,
# while peer ids cost nothing to make and would otherwise grow the table without bound.
MAX_RATE_CALLERS = 4096
# Seconds between checkpoints of every expert (plus one at shutdown).
DEFAULT_CHECKPOINT_INTERVAL = 60.0
# Batch sizes remembered per expert for the statistics.
RECENT_BATCHES = 1000

_UID = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class ExpertStats:
    """What one hosted expert has done (read them to see batching and stash use)."""

    forward_calls: int = 0
    forward_batches: int = 0
    backward_calls: int = 0
    backward_batches: int = 0
    rows: int = 0
    stash_hits: int = 0
    recomputes: int = 0
    updates: int = 0
    rejected: int = 0
    skipped_updates: int = 0  # backward batches whose parameter gradients were not finite: not applied
    recent_batch_calls: deque = field(default_factory=lambda: deque(maxlen=RECENT_BATCHES))

    @property
    def max_calls_per_batch(self) -> int:
        return max(self.recent_batch_calls, default=0)

    def as_dict(self) -> dict[str, int]:
        return {"forward_calls": self.forward_calls, "forward_batches": self.forward_batches,
                "backward_calls": self.backward_calls, "backward_batches": self.backward_batches,
                "rows": self.rows, "stash_hits": self.stash_hits, "recomputes": self.recomputes,
                "updates": self.updates, "rejected": self.rejected, "skipped_updates": self.skipped_updates,
                "max_calls_per_batch": self.max_calls_per_batch}


@dataclass
class _Task:
    kind: str  # "forward" | "backward"
    caller: str
    call_id: int
    inputs: tuple[torch.Tensor, ...] | None
    grads: tuple[torch.Tensor, ...] | None
    rows: int
    future: asyncio.Future
    needs_grad: tuple[bool, ...] = ()  # per input: does the caller want its gradient
    seq: int = 0  # arrival order, for fairness between queues
    subnet: str | None = None  # where the caller's connection comes from (its stash share)


class CallerRateLimited(ExpertError):
    """A caller made more calls than its share of this expert server: slow down and retry later."""


@dataclass
class _Stashed:
    version: int
    created: float
    leaves: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


class _Stash:
    """Forward graphs kept for backward calls, keyed (caller, call id), shared fairly between the
    subnets (`net.origins`) and the callers that hold them.

    At most `capacity` graphs and none older than STASH_SECONDS. When a new graph makes it full,
    the subnet holding the most graphs (the newcomer's own on a tie), and within it the caller
    holding the most (the newcomer itself on a tie), loses its oldest: a flood evicts the flooder's
    own graphs, and one host's made-up ids share one subnet's place, so every subnet keeps at least
    capacity / (subnets holding graphs), and every caller of a subnet its share of that. A caller
    is counted under the subnet of its first stashed graph while it holds any (no subnet: one of
    its own). Only graphs are counted, so the tables of counts are as bounded as the stash.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int], _Stashed] = OrderedDict()  # oldest first
        self._held: dict[str, int] = {}  # graphs per caller (callers with none are not in it)
        self._subnet: dict[str, str] = {}  # each caller's subnet, while it holds graphs
        self._held_by_subnet: dict[str, int] = {}  # graphs per subnet (subnets with none are not in it)

    def __len__(self) -> int:
        return len(self._entries)

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    def held_by_subnet(self, subnet: str) -> int:
        return self._held_by_subnet.get(subnet, 0)

    def put(self, key: tuple[str, int], entry: _Stashed, subnet: str | None = None) -> bool:
        """Keep `entry` (the caller `key[0]`'s, from `subnet`); False if it was evicted at once
        (every subnet and caller holds its share already, and so does this one: it gives a graph up)."""
        self.pop(key)  # a reused call id replaces its graph
        caller = key[0]
        mine = self._subnet.setdefault(caller, f"caller:{caller}" if subnet is None else subnet)
        self._entries[key] = entry
        self._held[caller] = self._held.get(caller, 0) + 1
        self._held_by_subnet[mine] = self._held_by_subnet.get(mine, 0) + 1
        now = time.monotonic()
        while self._entries and now - next(iter(self._entries.values())).created > STASH_SECONDS:
            self.pop(next(iter(self._entries)))  # abandoned by its client, most likely
        while len(self._entries) > self.capacity:
            most = max(self._held_by_subnet.values())
            loser = mine if self._held_by_subnet[mine] == most else next(
                self._subnet[k[0]] for k in self._entries if self._held_by_subnet[self._subnet[k[0]]] == most)
            within = [c for c in self._held if self._subnet[c] == loser]
            most = max(self._held[c] for c in within)
            victim = caller if self._subnet[caller] == loser and self._held[caller] == most else next(
                k[0] for k in self._entries if self._subnet[k[0]] == loser and self._held[k[0]] == most)
            self.pop(next(k for k in self._entries if k[0] == victim))  # its oldest graph
        return key in self._entries

    def pop(self, key: tuple[str, int]) -> _Stashed | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            caller = key[0]
            subnet = self._subnet[caller]
            for counts, name in ((self._held, caller), (self._held_by_subnet, subnet)):
                left = counts[name] - 1
                if left:
                    counts[name] = left
                else:
                    del counts[name]
            if caller not in self._held:
                del self._subnet[caller]
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._held.clear()
        self._subnet.clear()
        self._held_by_subnet.clear()


class _CallerBuckets:
    """A token bucket of calls per caller (`rate` per second, at most `burst`), in an LRU of at
    most `max_callers` callers; time is the event loop's (virtual under the emulator)."""

    def __init__(self, rate: float, burst: int, max_callers: int = MAX_RATE_CALLERS):
        self.rate, self.burst, self.max_callers = rate, burst, max_callers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, caller: str, now: float) -> float:
        """Spend one of `caller`'s tokens; 0.0 if it had one, else the seconds until it has."""
        tokens, at = self._buckets.pop(caller, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[caller] = (tokens, now)  # most recent last
        drop_oldest(self._buckets, self.max_callers)
        return wait


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _leaf(x: torch.Tensor, needs_grad: bool = True) -> torch.Tensor:
    return x.detach().requires_grad_(needs_grad and x.is_floating_point())


def _split(tensors: Sequence[torch.Tensor], rows: list[int]) -> list[list[torch.Tensor]]:
    """Per-call pieces of batched tensors, as contiguous tensors ready to send."""
    pieces = [t.split(rows) for t in tensors]
    return [[p[i].contiguous() for p in pieces] for i in range(len(rows))]


class HostedExpert:
    """One expert on a server: its module, optimizer, schema, stash and statistics.

    Its batch methods run on the server's single runtime thread only, so weights never change
    under a running batch.
    """

    def __init__(self, uid: str, module: nn.Module, input_schema: Sequence[TensorSchema],
                 optimizer: torch.optim.Optimizer | None, stash_calls: int = DEFAULT_STASH_CALLS):
        self.uid = uid
        self.module = module
        self.input_schema = tuple(input_schema)
        self.optimizer = optimizer
        self.stash_calls = stash_calls
        self.version = 0  # bumped by every optimizer step: a stashed graph of an older version is stale
        self.stats = ExpertStats()
        self._stash = _Stash(stash_calls)
        self.device = next(module.parameters(), torch.empty(0)).device  # batches run where the weights are
        training = module.training
        module.eval()  # the probe must not move e.g. BatchNorm statistics
        with torch.no_grad():
            sample = [torch.zeros((2, *s.shape), dtype=s.dtype, device=self.device) for s in self.input_schema]
            self.output_schema = tuple(TensorSchema(tuple(o.shape[1:]), o.dtype) for o in _as_tuple(module(*sample)))
        module.train(training)

    # -- batches (on the runtime thread) -------------------------------------------------------------
    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad] if self.optimizer is not None else []

    def forward_batch(self, tasks: list[_Task]) -> list[ForwardReply]:
        self.stats.forward_batches += 1
        self.stats.forward_calls += len(tasks)
        self.stats.recent_batch_calls.append(len(tasks))
        rows = [t.rows for t in tasks]
        self.stats.rows += sum(rows)
        if len(tasks) == 1 and self.stash_calls > 0:
            task = tasks[0]
            leaves = [_leaf(x.to(self.device), need) for x, need in zip(task.inputs, task.needs_grad, strict=True)]
            with torch.enable_grad():
                outputs = _as_tuple(self.module(*leaves))
            stashed = _Stashed(self.version, time.monotonic(), leaves, outputs)
            kept = self._stash.put((task.caller, task.call_id), stashed, task.subnet)
            return [ForwardReply(tuple(o.detach() for o in outputs), kept=kept)]
        inputs = [torch.cat(parts).to(self.device) for parts in zip(*(t.inputs for t in tasks), strict=True)]
        with torch.no_grad():
            outputs = _as_tuple(self.module(*inputs))
        return [ForwardReply(tuple(pieces), kept=False) for pieces in _split(outputs, rows)]

    def _grads(self, outputs: Sequence[torch.Tensor], leaves: list[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
               params: list[nn.Parameter]) -> tuple[list[torch.Tensor | None], Sequence[torch.Tensor | None]]:
        wanted = [x for x in leaves if x.requires_grad] + params
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
        if not wanted or not pairs:
            got: Sequence[torch.Tensor | None] = [None] * len(wanted)
        else:
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        it = iter(got)
        input_grads: list[torch.Tensor | None] = []
        for x in leaves:
            g = next(it) if x.requires_grad else None
            input_grads.append(torch.zeros_like(x) if g is None and x.requires_grad else g)
        return input_grads, list(it)

    def backward_batch(self, tasks: list[_Task]) -> list[Any]:
        self.stats.backward_batches += 1
        self.stats.backward_calls += len(tasks)
        params = self._trainable()
        results: list[Any] = [None] * len(tasks)
        sums: list[torch.Tensor | None] = [None] * len(params)

        def accumulate(grads: Sequence[torch.Tensor | None]) -> None:
            for i, g in enumerate(grads):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i] + g

        recompute = []
        for i, task in enumerate(tasks):
            entry = self._stash.pop((task.caller, task.call_id))
            if entry is not None and entry.version == self.version:
                if entry.outputs[0].shape[0] != task.rows:
                    results[i] = BadExpertRequest(f"backward request to expert {self.uid!r}",
                                                  f"'grads' has {task.rows} rows; call {task.call_id} had "
                                                  f"{entry.outputs[0].shape[0]}", self.uid)
                    continue
                grads = [g.to(self.device) for g in task.grads]
                input_grads, param_grads = self._grads(entry.outputs, entry.leaves, grads, params)
                results[i] = BackwardReply(tuple(input_grads))
                accumulate(param_grads)
                self.stats.stash_hits += 1
            elif task.inputs is not None:
                recompute.append(i)
            else:
                results[i] = StashMissing(f"expert {self.uid!r} no longer holds call {task.call_id}; resend inputs")
        if recompute:
            chosen = [tasks[i] for i in recompute]
            needed = [any(flags) for flags in zip(*(t.needs_grad for t in chosen), strict=True)]
            leaves = [_leaf(torch.cat(parts).to(self.device), need)
                      for parts, need in zip(zip(*(t.inputs for t in chosen), strict=True), needed, strict=True)]
            grad_outputs = [torch.cat(parts).to(self.device) for parts in zip(*(t.grads for t in chosen), strict=True)]
            with torch.enable_grad():
                outputs = _as_tuple(self.module(*leaves))
            input_grads, param_grads = self._grads(outputs, leaves, grad_outputs, params)
            accumulate(param_grads)
            rows = [t.rows for t in chosen]
            pieces = [g.split(rows) if g is not None else [None] * len(rows) for g in input_grads]
            for n, i in enumerate(recompute):
                results[i] = BackwardReply(tuple(p[n].contiguous() if need and p[n] is not None else None
                                                 for p, need in zip(pieces, tasks[i].needs_grad, strict=True)))
            self.stats.recomputes += len(recompute)
        if params and any(s is not None for s in sums):
            if not all(all_finite(g) for g in sums if g is not None):
                # Requests with non-finite values are refused at parse time, but finite inputs can
                # still overflow: never let such a step into the weights.
                logger.warning("expert %s: non-finite parameter gradients in a backward batch; update skipped",
                               self.uid)
                self.stats.skipped_updates += 1
                return results
            for p, g in zip(params, sums, strict=True):
                p.grad = g
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            self.stats.updates += 1
            self._stash.clear()  # graphs of the old weights cannot be differentiated any more: free them now
        return results

    # -- checkpoints (on the runtime thread) ---------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write the expert's weights and optimizer state atomically (safe format, no pickle)."""
        state = ExpertCheckpoint(self.uid, self.version, self.stats.updates, self.module.state_dict(),
                                 self.optimizer.state_dict() if self.optimizer is not None else None)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(dumps(state.to_wire()))
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        try:
            state = ExpertCheckpoint.from_wire(loads(path.read_bytes()))
        except MalformedMessage as e:
            raise ExpertError(f"{path} is not a checkpoint of expert {self.uid!r}: {e}") from None
        if state.uid != self.uid:
            raise ExpertError(f"{path} is not a checkpoint of expert {self.uid!r} (it holds {state.uid!r})")
        self.module.load_state_dict(state.model)
        if self.optimizer is not None and state.optimizer is not None:
            self.optimizer.load_state_dict(state.optimizer)
        self.version = state.version
        self.stats.updates = state.updates


class ExpertServer:
    """Serves `experts` ({uid: module}) on `peer` and announces them in its DHT.

    Args:
        peer: a started `potluck.Peer` that accepts connections (not in client mode).
        experts: uid -> module; uids look like `ffn.3.14` (a name and grid coordinates).
        optimizer: `params -> torch.optim.Optimizer`, one per expert; None serves frozen experts.
        input_schema: the inputs every expert takes (`TensorSchema`s, batch dim excluded), or a
            dict uid -> schema; required, since requests are checked against it.
        max_batch_size: rows per call and per batch.
        announce_ttl: seconds an announcement stays valid (refreshed every third of it).
        checkpoint_dir: where per-expert checkpoints live; existing ones are loaded at start.
        checkpoint_interval: seconds between checkpoints.
        stash_calls: forward graphs kept for backward calls (0: always recompute), shared fairly
            between callers.
        device: where the experts run (e.g. "cuda"); default: where their weights already are.
        caller_rate, caller_burst: calls per second, and in a burst, each caller may make
            (None: `CALLER_CALLS_PER_SECOND`, `CALLER_BURST`); more get `CallerRateLimited`.
    """

    def __init__(self, peer: PeerLike, experts: Mapping[str, nn.Module], optimizer: OptimizerFactory | None = None, *,
                 input_schema: Sequence[TensorSchema] | Mapping[str, Sequence[TensorSchema]] | None = None,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, announce_ttl: float = DEFAULT_ANNOUNCE_TTL,
                 checkpoint_dir: str | os.PathLike | None = None,
                 checkpoint_interval: float = DEFAULT_CHECKPOINT_INTERVAL,
                 stash_calls: int = DEFAULT_STASH_CALLS, device: str | torch.device | None = None,
                 caller_rate: float | None = None, caller_burst: int | None = None):
        if not peer.transport.addresses:
            raise ValueError("an expert server must be reachable: its peer has no address (client mode, or "
                             "behind NAT with no relay reserved)")
        if input_schema is None:
            raise ValueError("input_schema is required: the inputs each expert takes, e.g. "
                             "(TensorSchema((1024,)),); make_expert() returns it for built-in types")
        if not experts:
            raise ValueError("no experts to serve")
        if max_batch_size < 1 or announce_ttl <= 0 or checkpoint_interval <= 0 or stash_calls < 0:
            raise ValueError("max_batch_size must be >= 1, announce_ttl and checkpoint_interval > 0, stash_calls >= 0")
        if announce_ttl > ANNOUNCE_HORIZON:
            raise ValueError(f"announce_ttl is at most {ANNOUNCE_HORIZON:.0f} s (readers skip announcements further "
                             f"ahead); announcements are refreshed every third of it, so a short one costs little")
        caller_rate = CALLER_CALLS_PER_SECOND if caller_rate is None else caller_rate
        caller_burst = CALLER_BURST if caller_burst is None else caller_burst
        if not caller_rate > 0 or caller_burst < 1:
            raise ValueError("caller_rate must be positive and caller_burst at least 1")
        self._rates = _CallerBuckets(caller_rate, caller_burst)
        self.peer = peer
        self.max_batch_size = max_batch_size
        self.announce_ttl = announce_ttl
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_interval = checkpoint_interval
        self.experts: dict[str, HostedExpert] = {}
        for uid, module in experts.items():
            if not _UID.match(uid) or len(uid) > MAX_UID_CHARS:
                raise ValueError(f"malformed expert uid {uid!r}: use at most {MAX_UID_CHARS} letters, digits, "
                                 "'_', '-' and dots")
            schema = input_schema[uid] if isinstance(input_schema, Mapping) else input_schema
            if device is not None:
                module.to(device)
            opt = optimizer([p for p in module.parameters() if p.requires_grad]) if optimizer else None
            self.experts[uid] = HostedExpert(uid, module, schema, opt, stash_calls)
        # uid -> the updates its checkpoint held, for each expert resumed from `checkpoint_dir` (what
        # a restarted server tells its user it loaded; the others start from their initial weights).
        self.resumed: dict[str, int] = {}
        if self.checkpoint_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            for uid, hosted in self.experts.items():
                if (path := self._checkpoint_path(uid)).exists():
                    hosted.load(path)
                    self.resumed[uid] = hosted.stats.updates
                    logger.info("expert %s resumed from %s (%d updates)", uid, path, hosted.stats.updates)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="potluck-experts")
        self._queues: dict[tuple[str, str], deque[_Task]] = {}
        self._work: asyncio.Event | None = None
        self._running_batch: list[_Task] = []
        self._tasks: list[asyncio.Task] = []
        self._arrivals = 0
        self._alive = True
        peer.run(self._astart(), timeout=ANNOUNCE_TIMEOUT + 30)

    @classmethod
    def from_type(cls, peer: PeerLike, uids: Sequence[str], expert_type: str, hidden: int,
                  optimizer: OptimizerFactory | None = None, seed: int | None = 0, **kwargs: Any) -> ExpertServer:
        """A server for built-in (or registered) experts of one type; `seed` makes weights repeatable."""
        experts, schema = {}, None
        with torch.random.fork_rng():  # seeding here must not change the caller's random stream
            for i, uid in enumerate(uids):
                if seed is not None:
                    torch.manual_seed(seed + i)
                experts[uid], schema = make_expert(expert_type, hidden)
        return cls(peer, experts, optimizer, input_schema=schema, **kwargs)

    @property
    def stats(self) -> dict[str, ExpertStats]:
        return {uid: hosted.stats for uid, hosted in self.experts.items()}

    def locations(self) -> list[ExpertLocation]:
        return [ExpertLocation(uid, self.peer.transport.peer_id) for uid in self.experts]

    # -- lifecycle ----------------------------------------------------------------------------------
    async def _astart(self) -> None:
        transport = self.peer.transport
        if METHOD_FORWARD in transport.handlers.unary:
            raise ExpertError("this peer already runs an expert server; host all experts in one")
        self._work = asyncio.Event()
        transport.add_handler(METHOD_FORWARD, self._serve_forward)
        transport.add_handler(METHOD_BACKWARD, self._serve_backward)
        transport.add_handler(METHOD_INFO, self._serve_info)
        await self._announce()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run_batches(), name="moe-runtime"),
                       loop.create_task(self._announce_forever(), name="moe-announce")]
        if self.checkpoint_dir is not None:
            self._tasks.append(loop.create_task(self._checkpoint_forever(), name="moe-checkpoints"))

    def shutdown(self) -> None:
        """Stop serving, save a last checkpoint and stop the runtime thread; safe to call twice."""
        if not self._alive:
            return
        self._alive = False
        try:
            self.peer.run(self._ashutdown(), timeout=60)
        except RuntimeError:  # the peer (and its event loop) was shut down first: still save the experts
            if self.checkpoint_dir is None:
                raise
            for uid, hosted in self.experts.items():
                self._executor.submit(hosted.save, self._checkpoint_path(uid)).result()
        finally:
            self._executor.shutdown(wait=True)

    async def _ashutdown(self) -> None:
        transport = self.peer.transport
        for method in (METHOD_FORWARD, METHOD_BACKWARD, METHOD_INFO):
            transport.remove_handler(method)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in [*self._running_batch, *(t for queue in self._queues.values() for t in queue)]:
            if not task.future.done():
                task.future.set_exception(ExpertError("the expert server is shutting down"))
        for queue in self._queues.values():
            queue.clear()
        if self.checkpoint_dir is not None:
            await self.save_checkpoints()

    def __enter__(self) -> ExpertServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- announcements and checkpoints --------------------------------------------------------------
    async def _announce(self) -> None:
        expiration = self.peer.dht.get_time() + self.announce_ttl
        await announce_experts(self.peer.dht, self.locations(), expiration, timeout=ANNOUNCE_TIMEOUT)

    async def _announce_forever(self) -> None:
        while True:
            await asyncio.sleep(self.announce_ttl / 3)
            try:
                await self._announce()
            except Exception:  # noqa: BLE001 - a missed refresh is retried next period
                logger.warning("could not refresh the expert announcements", exc_info=True)

    def _checkpoint_path(self, uid: str) -> Path:
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / f"{uid}.ckpt"

    async def save_checkpoints(self) -> None:
        """Checkpoint every expert now (on the runtime thread, between batches)."""
        loop = asyncio.get_running_loop()
        for uid, hosted in self.experts.items():
            await loop.run_in_executor(self._executor, hosted.save, self._checkpoint_path(uid))

    async def _checkpoint_forever(self) -> None:
        while True:
            await asyncio.sleep(self.checkpoint_interval)
            try:
                await self.save_checkpoints()
            except Exception:  # noqa: BLE001 - keep serving; the next period tries again
                logger.warning("could not save expert checkpoints", exc_info=True)

    # -- handlers (each parses its request first: the rest sees typed messages only) ----------------
    def _refused(self, error: BadExpertRequest) -> None:
        if error.uid is not None and (hosted := self.experts.get(error.uid)) is not None:
            hosted.stats.rejected += 1

    def _check_rate(self, ctx: CallContext) -> str:
        """The caller, if it has a call left in its bucket (before anything is parsed); else
        CallerRateLimited says to slow down, and the call costs nothing more."""
        caller = str(ctx.peer_id)
        wait = self._rates.take(caller, asyncio.get_running_loop().time())
        if wait > 0:
            raise CallerRateLimited(
                f"slow down: peer {caller} is over its share of this expert server ({self._rates.rate:g} calls/s, "
                f"bursts of {self._rates.burst}); retry in {wait:.2g} s")
        return caller

    async def _serve_info(self, msg: object, ctx: CallContext) -> dict:
        self._check_rate(ctx)
        hosted = self.experts[InfoRequest.from_wire(msg, experts=self.experts).uid]
        return ExpertInfo(hosted.input_schema, hosted.output_schema, self.max_batch_size,
                          hosted.stats.updates).to_wire()

    async def _serve_forward(self, msg: object, ctx: CallContext) -> dict:
        caller = self._check_rate(ctx)
        try:
            request = ForwardRequest.from_wire(msg, experts=self.experts, max_rows=self.max_batch_size)
        except BadExpertRequest as e:
            self._refused(e)
            raise
        task = _Task("forward", caller, request.call_id, request.inputs, None, request.rows,
                     asyncio.get_running_loop().create_future(), request.needs_grad, subnet=ctx.remote.origin.subnet)
        reply: ForwardReply = await self._enqueue(self.experts[request.uid], task)
        return reply.to_wire()

    async def _serve_backward(self, msg: object, ctx: CallContext) -> dict:
        caller = self._check_rate(ctx)
        try:
            request = BackwardRequest.from_wire(msg, experts=self.experts, max_rows=self.max_batch_size)
        except BadExpertRequest as e:
            self._refused(e)
            raise
        task = _Task("backward", caller, request.call_id, request.inputs, request.grads, request.rows,
                     asyncio.get_running_loop().create_future(), request.needs_grad)
        reply: BackwardReply = await self._enqueue(self.experts[request.uid], task)
        return reply.to_wire()

    async def _enqueue(self, hosted: HostedExpert, task: _Task) -> Any:
        self._arrivals += 1
        task.seq = self._arrivals
        self._queues.setdefault((hosted.uid, task.kind), deque()).append(task)
        self._work.set()
        return await task.future

    # -- the runtime --------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[HostedExpert, str, list[_Task]] | None:
        """The queue whose first live request waited longest, and its requests up to max_batch_size rows."""
        oldest: tuple[str, str] | None = None
        for key, queue in self._queues.items():
            while queue and queue[0].future.done():  # the caller gave up
                queue.popleft()
            if queue and (oldest is None or queue[0].seq < self._queues[oldest][0].seq):
                oldest = key
        if oldest is None:
            return None
        queue, batch, rows = self._queues[oldest], [], 0
        while queue and (not batch or rows + queue[0].rows <= self.max_batch_size):
            task = queue.popleft()
            if not task.future.done():
                batch.append(task)
                rows += task.rows
        return (self.experts[oldest[0]], oldest[1], batch) if batch else None

    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            picked = self._next_batch()
            if picked is None:
                self._work.clear()
                await self._work.wait()
                continue
            hosted, kind, batch = picked
            job = hosted.forward_batch if kind == "forward" else hosted.backward_batch
            self._running_batch = batch
            try:
                results = await loop.run_in_executor(self._executor, job, batch)
            except Exception as e:  # noqa: BLE001 - the expert failed on this batch; tell its callers
                logger.warning("expert %s failed a %s batch", hosted.uid, kind, exc_info=True)
                results = [ExpertError(f"expert {hosted.uid!r} failed: {type(e).__name__}: {e}")] * len(batch)
            for task, result in zip(batch, results, strict=True):
                if task.future.done():
                    continue
                if isinstance(result, BaseException):
                    task.future.set_exception(result)
                else:
                    task.future.set_result(result)
