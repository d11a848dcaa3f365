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
    from taskgroup.timeouts import _Timeout

    def count_cancellations(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """`loop`, its tasks made of the backport's class, which counts cancellations as 3.11's
        tasks do (`cancelling`, `uncancel`), unless it has a task factory of its own."""
        if loop.get_task_factory() is None:
            loop.set_task_factory(_counting_task)
        return loop

    def timeout_at(when: float | None) -> Any:
        """3.11's `asyncio.timeout_at`. In a task that counts its cancellations, the backport's plain
        timeout; elsewhere its public one, which first wraps the task to count them: its exit stack
        and that wrapping left reference cycles on every use (garbage for the cyclic GC)."""
        task = asyncio.current_task()
        return _Timeout(when) if hasattr(task, "uncancel") else _wrapping_timeout_at(when)

    def timeout(delay: float | None) -> Any:
        """3.11's `asyncio.timeout` (see `timeout_at`)."""
        return timeout_at(None if delay is None else asyncio.get_running_loop().time() + delay)

__all__ = ["BaseExceptionGroup", "ExceptionGroup", "Runner", "TaskGroup", "count_cancellations", "timeout",
           "timeout_at", "tomllib"]
