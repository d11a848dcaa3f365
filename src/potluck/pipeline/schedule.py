"""Pure scheduling logic of the zero-bubble asynchronous pipeline (no sockets, no tensors).

`StageSchedule` decides what one stage does next. Rules:
1. Backward first: a gradient that has arrived is processed before any forward, so stashed
   weights and activations are freed as early as possible.
2. Otherwise a forward, if fewer than `staleness_bound` micro-batches are in flight at this stage
   (forwarded here, backward not yet done). At the first stage this bounds how many micro-batches
   the whole cluster has in flight, and so how stale the weights a micro-batch sees can be.
3. No flush: the first stage injects a new micro-batch whenever rule 2 allows.
4. An update is due after every `update_frequency` backwards.
With `flush_every=M` the same rules give the synchronous GPipe-style baseline instead: the first
stage injects M micro-batches, then waits until all M backwards are done (the flush) before the
next global batch (use `update_frequency=M`, so every global batch sees one weight version).

`simulate` runs the same rules over a cluster with fixed per-stage compute times and link
delays (a discrete-event simulation), for the analysis in docs/pipeline.md and for tests; the
`gpipe` mode is the synchronous baseline (inject `micro_batches`, wait for all their backwards,
update, repeat).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["StageSchedule", "Task", "SimulationResult", "simulate"]


@dataclass(frozen=True)
class Task:
    kind: str  # "forward" or "backward"
    micro_batch: int


class StageSchedule:
    """What a stage should do next; the stage reports what it did."""

    def __init__(self, staleness_bound: int, update_frequency: int = 1, first: bool = False, flush_every: int = 0):
        if staleness_bound < 1 or update_frequency < 1 or flush_every < 0:
            raise ValueError("staleness_bound and update_frequency must be >= 1, flush_every >= 0")
        self.flush_every = flush_every
        self.staleness_bound = staleness_bound
        self.update_frequency = update_frequency
        self.first = first
        self.forward_ready: deque[int] = deque()
        self.backward_ready: deque[int] = deque()
        self.in_flight: set[int] = set()
        self.forwarded_at: dict[int, float] = {}
        self.backwards = 0
        self.max_in_flight = 0
        self.next_micro_batch = 0  # at the first stage: the id of the next one to inject
        self.injection_paused = False

    def add_forward(self, micro_batch: int) -> None:
        """An activation arrived (stages after the first)."""
        self.forward_ready.append(micro_batch)

    def add_backward(self, micro_batch: int) -> None:
        """A gradient arrived for a micro-batch this stage forwarded."""
        if micro_batch not in self.in_flight:
            raise KeyError(f"gradient for micro-batch {micro_batch}, which is not in flight here")
        self.backward_ready.append(micro_batch)

    def can_forward(self) -> bool:
        return len(self.in_flight) < self.staleness_bound

    def next_task(self) -> Task | None:
        if self.backward_ready:
            return Task("backward", self.backward_ready.popleft())
        if not self.can_forward():
            return None
        if self.forward_ready:
            return Task("forward", self.forward_ready.popleft())
        if self.first and not self.injection_paused and not self._flushing():
            mb = self.next_micro_batch
            self.next_micro_batch += 1
            return Task("forward", mb)
        return None

    def _flushing(self) -> bool:
        """GPipe mode: the current global batch is all injected; wait until it drains."""
        return bool(self.flush_every) and (self.next_micro_batch % self.flush_every == 0) and bool(self.in_flight) \
            and self.next_micro_batch > 0

    def forward_done(self, micro_batch: int, now: float = 0.0) -> None:
        self.in_flight.add(micro_batch)
        self.forwarded_at[micro_batch] = now
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def expire(self, now: float, max_age: float) -> list[int]:
        """Give up on micro-batches forwarded more than `max_age` ago whose gradient has not come
        (a message lost, a stage downstream failed to compute it): frees their in-flight slots."""
        old = [mb for mb, t in self.forwarded_at.items() if t + max_age <= now and mb not in self.backward_ready]
        for mb in old:
            self.in_flight.discard(mb)
            del self.forwarded_at[mb]
        return old

    def next_expiry(self, max_age: float) -> float | None:
        """When the oldest micro-batch in flight would expire (None if nothing is in flight)."""
        return min(self.forwarded_at.values()) + max_age if self.forwarded_at else None

    def backward_done(self, micro_batch: int) -> bool:
        """Record a finished backward; True when an optimizer update is due now."""
        self.in_flight.discard(micro_batch)
        self.forwarded_at.pop(micro_batch, None)
        self.backwards += 1
        return self.backwards % self.update_frequency == 0

    def drop_in_flight(self) -> None:
        """Forget every micro-batch (after a re-partition: their activations are gone)."""
        self.forward_ready.clear()
        self.backward_ready.clear()
        self.in_flight.clear()
        self.forwarded_at.clear()


@dataclass
class SimulationResult:
    makespan: float
    micro_batches: int
    busy: list[float] = field(default_factory=list)  # per stage

    @property
    def throughput(self) -> float:
        return self.micro_batches / self.makespan

    @property
    def utilization(self) -> list[float]:
        return [b / self.makespan for b in self.busy]


def simulate(forward: Sequence[float], backward: Sequence[float], link: float, micro_batches: int,
             mode: str = "async", staleness_bound: int = 4, gpipe_micro_batches: int = 4) -> SimulationResult:
    """Event simulation of one cluster: per-stage forward/backward seconds, `link` seconds per hop.

    The last stage does forward, loss and backward as one task (forward[-1] + backward[-1]).
    """
    n = len(forward)
    gpipe = mode == "gpipe"
    schedules = [StageSchedule(gpipe_micro_batches if gpipe else staleness_bound, first=(s == 0),
                               flush_every=gpipe_micro_batches if gpipe else 0) for s in range(n)]
    free_at = [0.0] * n
    busy = [0.0] * n
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, stage, micro-batch)
    seq = 0
    done = 0
    now = 0.0

    def push(t: float, kind: str, stage: int, mb: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, stage, mb))
        seq += 1

    def start_work(stage: int) -> None:
        sch = schedules[stage]
        if free_at[stage] > now:
            return
        if stage == 0:
            sch.injection_paused = sch.next_micro_batch >= micro_batches
        task = sch.next_task()
        if task is None:
            return
        if task.kind == "forward":
            cost = forward[stage] + (backward[stage] if stage == n - 1 else 0.0)
        else:
            cost = backward[stage]
        free_at[stage] = now + cost
        busy[stage] += cost
        push(now + cost, task.kind, stage, task.micro_batch)

    for s in range(n):
        start_work(s)
    while events:
        now, _, kind, stage, mb = heapq.heappop(events)
        sch = schedules[stage]
        if kind == "forward":
            sch.forward_done(mb)
            if stage == n - 1:
                sch.backward_done(mb)
                if stage > 0:
                    push(now + link, "grad_arrives", stage - 1, mb)
                else:
                    done += 1
            else:
                push(now + link, "act_arrives", stage + 1, mb)
        elif kind == "backward":
            sch.backward_done(mb)
            if stage > 0:
                push(now + link, "grad_arrives", stage - 1, mb)
            else:
                done += 1
        elif kind == "act_arrives":
            sch.add_forward(mb)
        elif kind == "grad_arrives":
            sch.add_backward(mb)
        for s in range(n):
            start_work(s)
    return SimulationResult(now, done, busy)
