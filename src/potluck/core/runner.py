"""The per-process event loop: one asyncio loop in a background thread, and a synchronous facade.

All networking of all peers in a process runs on this loop, so user code stays synchronous and a
trainer stays one process. Peers take a reference with `acquire_runner()` and drop it with
`release_runner()`; the loop thread stops when the last reference goes, leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from potluck.core import compat
from potluck.core.errors import DeadlineExceeded

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Intra-op threads torch uses for tensor work done on the event loop thread (see LoopRunner._run).
LOOP_TORCH_THREADS = 1

# How long shutdown waits for tasks to react to cancellation before closing the loop anyway.
SHUTDOWN_GRACE_SECONDS = 5.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster I/O), the standard loop otherwise; POTLUCK_UVLOOP=0 opts out."""
    if os.environ.get("POTLUCK_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return compat.count_cancellations(uvloop.new_event_loop())
    return compat.count_cancellations(asyncio.new_event_loop())


class LoopRunner:
    """Owns an event loop running in a daemon thread; submits coroutines to it from any thread."""

    def __init__(self, loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop,
                 name: str = "potluck-loop"):
        self.loop = loop_factory()
        self._started = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        # Tensor work on the loop is chunk-sized (about 1 MiB): torch's intra-op threads spin-wait
        # for more CPU than they save (an all-reduce took twice the CPU with 2 of them on 2 cores).
        # The setting is per thread: the user's threads keep theirs.
        torch.set_num_threads(LOOP_TORCH_THREADS)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns a thread-safe future."""
        if self._closed:
            coro.close()
            raise RuntimeError("the potluck event loop was shut down; create a new Peer")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None,
            caller: CallerThread | None = None) -> T:
        """Run `coro` on the loop and wait for its result; on timeout cancel it and raise.
        `caller`: lend this thread, while it waits, to the blocking work `coro` hands to it.

        Calling this from the loop thread itself would deadlock, so it is refused: code running on
        the loop must await the async twin instead.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("a blocking potluck call was made from inside the event loop; "
                               "await the async method (e.g. `await dht.aget(...)`) instead")
        future = self.submit(coro)
        try:
            if caller is not None:
                caller.serve(future, timeout)
            return future.result(timeout if caller is None else 0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"the operation did not finish within {timeout} s") from None
        except BaseException:
            future.cancel()
            raise
        finally:
            # The future holds the error being raised, whose traceback holds this frame: without
            # this, the two form a cycle that keeps everything the error's frames reference.
            future = None

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Cancel every task still on the loop, stop it, join the thread and close the loop."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(_cancel_everything(timeout), self.loop)
            try:
                fut.result(timeout + 1)
            except Exception:  # noqa: BLE001 - shutting down regardless
                logger.warning("tasks did not finish cleanly during shutdown", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout + 1)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_everything(timeout: float) -> None:
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


_lock = threading.Lock()
_runner: LoopRunner | None = None
_refs = 0


def acquire_runner(loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> LoopRunner:
    """The process-wide runner, started on first use; pair every call with `release_runner()`.

    `loop_factory` chooses the loop when this call starts it (e.g. `virtual_time_loop` for a
    scenario on the emulated network); if a runner is already up, it is refused."""
    global _runner, _refs
    with _lock:
        if _runner is None or not _runner.is_running:
            _runner = LoopRunner() if loop_factory is None else LoopRunner(loop_factory)
        elif loop_factory is not None:
            raise RuntimeError("potluck's event loop is already running (peers are still up); "
                               "shut them down before choosing another loop")
        _refs += 1
        return _runner


def release_runner() -> None:
    """Drop one reference; the last one stops the loop thread."""
    global _runner, _refs
    with _lock:
        _refs = max(0, _refs - 1)
        runner = _runner if _refs == 0 else None
        if runner is not None:
            _runner = None
    if runner is not None:
        runner.shutdown()


def retrieve_exception(future: asyncio.Future) -> None:
    """Mark a future's outcome as seen (a done-callback for tasks nobody awaits any more), so
    asyncio does not log "exception was never retrieved"."""
    if not future.cancelled():
        future.exception()


async def run_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work (tensor math, file I/O) in the default thread pool, off the loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class CallerThread:
    """The thread blocked in a synchronous call (`LoopRunner.run(..., caller=)`), lent to the
    blocking work of that call: `await caller.run(fn)` runs `fn` there instead of in the pool.

    Why: a training thread waiting in `Optimizer.step()` has nothing else to do, and tensor math
    of model size runs slower in a pool thread. glibc's malloc gives each thread its own arena,
    and a pool thread's arena maps and unmaps every large temporary, so each step pays page
    faults the main thread's heap does not: the wrapped Adam step of a 100M-parameter model took
    1.1-1.3x as long in a pool thread as in the main thread, in one process, alternating.
    Work handed over once the call has returned runs in the pool, as before.
    """

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open = True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the lent thread while it waits, else in the pool (from the loop)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            lent = self._open
            if lent:
                self._work.put((fn, args, done, loop))
        if not lent:
            return await run_in_thread(fn, *args)
        return await done

    def serve(self, call: concurrent.futures.Future, timeout: float | None = None) -> None:
        """Run handed work in this thread until `call` is done (or `timeout` passes)."""
        call.add_done_callback(lambda _: self._work.put(None))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    item = self._work.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    return
                if item is None:
                    return
                _do(*item)
        finally:
            with self._lock:
                self._open = False
            while True:  # handed over as the call ended (by its background tasks): to the pool
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _call_soon(item[3], _to_pool, *item)


def _do(fn: Callable[..., Any], args: tuple, done: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
        _call_soon(loop, _settle, done, None, e)
    except BaseException:  # Ctrl-C in the lent thread, amid the work: the call is cancelled with it
        _call_soon(loop, done.cancel)
        raise
    else:
        _call_soon(loop, _settle, done, result, None)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop was closed: nobody awaits the work any more
        pass


def _to_pool(fn: Callable[..., Any], args: tuple, done: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    if done.done():
        return
    ran = loop.run_in_executor(None, fn, *args)
    ran.add_done_callback(lambda f: done.cancel() if f.cancelled() else _settle(done, None, f.exception())
                          if f.exception() is not None else _settle(done, f.result(), None))


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not done.done():
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)
