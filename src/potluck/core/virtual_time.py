"""A virtual clock for asyncio: timers fire in order, but waiting for them takes no real time.

With the emulated network this runs hours of protocol time among hundreds of peers in seconds,
and makes every timing in a scenario exactly repeatable. The loop is an ordinary selector loop
whose `time()` is a counter: when nothing is ready and the loop would sleep until its next
timer, the counter jumps to that timer instead. Real I/O is still polled on every iteration,
and with nothing scheduled at all the loop blocks for real, so `call_soon_threadsafe` (e.g.
`LoopRunner.submit` from the user's thread) wakes it as usual.

Time stands still while `run_in_executor` work is running: tensor math runs in threads, and if
the clock skipped ahead meanwhile, every deadline would expire before the math finished. Frozen,
computation costs no virtual time, so virtual timings measure the network alone and do not
depend on how fast the host is.

Use it with the emulated network only: a real socket's data takes real time to arrive, and the
clock would jump past deadlines that are waiting for it. Drive scenarios from a coroutine on
the loop (`run_virtual`); a loop with periodic timers and nothing else to do keeps jumping ahead
while it waits for another thread.

Why not `looptime` (PyPI): it does patch a loop we create (`looptime.new_event_loop()`), but while
executor jobs run it advances the clock in step with real time, so results depend on host speed
and that behaviour is not configurable; it also registers a pytest plugin in every environment
that installs it. The loop below is small enough to own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from potluck.core import compat

__all__ = ["VirtualTimeLoop", "run_virtual", "virtual_time_loop"]

T = TypeVar("T")

# Real seconds the loop waits for I/O per iteration while executor jobs run. A finished job
# wakes the loop at once (call_soon_threadsafe); this only bounds the cost of a lost wake-up.
EXECUTOR_POLL_SECONDS = 0.05


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real I/O, then jumps the owning loop's clock instead of sleeping until a timer."""

    def __init__(self, loop: VirtualTimeLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if self._loop._deliver_executor_results():  # (see run_in_executor)
            return []  # their callbacks run at this instant, before the clock moves
        if self._loop._executor_jobs:
            return super().select(EXECUTOR_POLL_SECONDS)
        if timeout is None:
            return super().select(None)  # nothing scheduled: only another thread can wake us
        self._loop._now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock jumps to the next timer instead of sleeping."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)
        # (the job's own future, the one its caller awaits), in the order they were submitted
        self._executor_jobs: list[tuple[asyncio.Future[Any], asyncio.Future[Any]]] = []
        super().__init__(selector=_VirtualSelector(self))
        compat.count_cancellations(self)

    def time(self) -> float:
        return self._now

    def run_in_executor(self, executor: concurrent.futures.Executor | None,
                        func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """As usual, but the clock stands still until the job is done (see the module doc).

        Results are handed back only once every job in flight is done, in the order the jobs
        were submitted, and once nothing else is due at this instant: threads finish in whatever
        order and moment the host schedules them, and handing results back then would make a
        scenario's events (and so its outcome) vary from run to run. For the same reason a job
        must not change what the loop reads before its result is back. A job's thread must not
        wait for the loop (it never does: jobs are tensor math and file I/O)."""
        job = super().run_in_executor(executor, func, *args)
        result = self.create_future()
        self._executor_jobs.append((job, result))
        return result

    def _deliver_executor_results(self) -> bool:
        if not self._executor_jobs or not all(job.done() for job, _ in self._executor_jobs):
            return False
        jobs, self._executor_jobs = self._executor_jobs, []
        for job, result in jobs:
            if result.cancelled():
                if not job.cancelled():
                    job.exception()  # seen: nobody waits for it any more
            elif job.cancelled():
                result.cancel()
            elif job.exception() is not None:
                result.set_exception(job.exception())
            else:
                result.set_result(job.result())
        return True


def virtual_time_loop() -> asyncio.AbstractEventLoop:
    """A new virtual-time loop; pass as `LoopRunner(loop_factory=virtual_time_loop)`."""
    return VirtualTimeLoop()


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh virtual-time loop (like `asyncio.run`)."""
    with compat.Runner(loop_factory=virtual_time_loop) as runner:
        return runner.run(coro)
