"""What potluck uses from Python 3.11, on 3.10 too.

On 3.11+ these are the standard library's own objects. On 3.10 they come from backports
(`taskgroup`, `exceptiongroup`, `tomli`), whose timeouts raise the built-in `TimeoutError` as
3.11's do: potluck's `except TimeoutError` clauses then catch them on both versions.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import Runner, TaskGroup, timeout, timeout_at
    from builtins import BaseExceptionGroup, ExceptionGroup

    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup
    from taskgroup import Runner, TaskGroup, timeout, timeout_at

__all__ = ["BaseExceptionGroup", "ExceptionGroup", "Runner", "TaskGroup", "timeout", "timeout_at", "tomllib"]
