"""What potluck uses from Python 3.11, on 3.10 too.

On 3.11+ these are the standard library's own objects. On 3.10 they come from backports
(`taskgroup`, `exceptiongroup`, `tomli`), whose timeouts raise the built-in `TimeoutError` as
3.11's do: potluck's `except TimeoutError` clauses then catch them on both versions.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

if sys.version_info >= (3, 11):
    from asyncio import Runner, TaskGroup, timeout, timeout_at
    from builtins import BaseExceptionGroup, ExceptionGroup

    import tomllib

    def count_cancellations(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """`loop`, whose tasks count their cancellations (3.11's do already)."""
        return loop
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup
    from taskgroup import Runner, TaskGroup
    from taskgroup import timeout_at as _wrapping_timeout_at
    from taskgroup.tasks import task_factory as _counting_task

    def count_cancellations(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """`loop`, its tasks made of the backport's class, which counts cancellations as 3.11's
        tasks do (`cancelling`, `uncancel`), unless it has a task factory of its own."""
        if loop.get_task_factory() is None:
            loop.set_task_factory(_counting_task)
        return loop

    class _Deadline:
        """3.11's `asyncio.Timeout` as potluck uses it (entered once, its deadline fixed), for a
        task that counts its cancellations: at the deadline it cancels the task, and on exit turns
        that cancellation into TimeoutError unless another was requested meanwhile."""

        def __init__(self, when: float | None) -> None:
            self._when, self._task, self._handle, self._expired = when, None, None, False

        def when(self) -> float | None:
            return self._when

        def expired(self) -> bool:
            return self._expired

        async def __aenter__(self) -> _Deadline:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("a timeout must be used inside a task")
            self._task, self._cancelling = task, task.cancelling()
            if self._when is not None:
                loop = asyncio.get_running_loop()
                if self._when <= loop.time():
                    self._handle = loop.call_soon(self._expire)
                else:
                    self._handle = loop.call_at(self._when, self._expire)
            return self

        async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
            task, self._task = self._task, None
            if self._expired and task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

        def _expire(self) -> None:
            self._handle, self._expired = None, True
            self._task.cancel()

    def timeout_at(when: float | None) -> Any:
        """3.11's `asyncio.timeout_at`. In a task that counts its cancellations, `_Deadline`;
        elsewhere the backport's public one, which first wraps the task to count them: its exit
        stack and that wrapping left reference cycles on every use (garbage for the cyclic GC)."""
        task = asyncio.current_task()
        return _Deadline(when) if hasattr(task, "uncancel") else _wrapping_timeout_at(when)

    def timeout(delay: float | None) -> Any:
        """3.11's `asyncio.timeout` (see `timeout_at`)."""
        return timeout_at(None if delay is None else asyncio.get_running_loop().time() + delay)

__all__ = ["BaseExceptionGroup", "ExceptionGroup", "Runner", "TaskGroup", "count_cancellations", "timeout",
           "timeout_at", "tomllib"]
