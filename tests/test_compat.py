"""CI runs Python 3.11 only; this keeps 3.11-only APIs out of the library so it still runs on 3.10.

Each name below exists on 3.11 but not on 3.10 (or, for `future.result(timeout=...)`, raises a
`TimeoutError` there that `except TimeoutError` does not catch). `potluck.core.compat` is the one
place that may name them.
"""

from __future__ import annotations

import re
from pathlib import Path

import potluck
from potluck.core import compat

SOURCE = Path(potluck.__file__).parent
FORBIDDEN = {
    r"asyncio\.(timeout|timeout_at|TaskGroup|Runner)\b": "use potluck.core.compat's",
    r"datetime\.UTC\b": "use datetime.timezone.utc",
    r"^\s*import tomllib|^\s*from tomllib": "use compat.tomllib",
    r"(?<![.\w])(Base)?ExceptionGroup\b": "use compat.ExceptionGroup / compat.BaseExceptionGroup",
    r"\.result\(\s*(timeout\s*=\s*)?[\w.]+\s*\)": "a concurrent future's result(timeout) raises a "
                                                   "non-builtin TimeoutError on 3.10; catch it by name or use wait()",
}
ALLOWED = {("core/runner.py", r"\.result\(\s*(timeout\s*=\s*)?[\w.]+\s*\)"),  # catches the right class by name
           ("dht/node.py", r"\.result\(\s*(timeout\s*=\s*)?[\w.]+\s*\)")}  # a lookup's own result(target), no future


def test_the_library_names_no_api_that_python_3_10_lacks():
    problems = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel == "core/compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, advice in FORBIDDEN.items():
                if re.search(pattern, line) and (rel, pattern) not in ALLOWED:
                    problems.append(f"{rel}:{number}: {line.strip()}  ({advice})")
    assert not problems, "\n".join(problems)


def test_compat_gives_the_standard_library_objects_on_this_python():
    import asyncio
    import sys
    if sys.version_info >= (3, 11):
        assert compat.timeout is asyncio.timeout and compat.TaskGroup is asyncio.TaskGroup
        assert compat.ExceptionGroup is ExceptionGroup  # noqa: F821 - a builtin from 3.11 on
    assert compat.tomllib.loads("a = 1") == {"a": 1}


def test_compat_timeouts_behave_as_3_11s_in_potlucks_loops(arun):
    """What potluck relies on of `compat.timeout` (on 3.10 its own `_Deadline`): an expired deadline
    raises TimeoutError and the task goes on; a cancellation from outside stays a cancellation, even
    when it comes as the deadline passes; of nested deadlines only the one that expired converts."""
    import asyncio

    async def scenario():
        async with compat.timeout(0.01) as deadline:
            assert deadline.when() is not None and not deadline.expired()
        try:
            async with compat.timeout(0.01) as deadline:
                await asyncio.sleep(1)
        except TimeoutError:
            assert deadline.expired()
        else:
            raise AssertionError("the deadline did not expire")
        async with compat.timeout(None) as unbounded:
            await asyncio.sleep(0.01)
        assert unbounded.when() is None and not unbounded.expired()

        try:  # the outer deadline expires while the inner one is pending: only the outer converts
            async with compat.timeout(0.01) as outer:
                try:
                    async with compat.timeout(5):
                        await asyncio.sleep(1)
                except TimeoutError:
                    raise AssertionError("the inner deadline converted the outer one's cancellation") from None
        except TimeoutError:
            assert outer.expired()
        async with compat.timeout(5):  # and the inner one expiring leaves the outer one alone
            try:
                async with compat.timeout(0.01):
                    await asyncio.sleep(1)
            except TimeoutError:
                pass
            await asyncio.sleep(0.02)

        async def cancelled_as_it_expires():
            loop = asyncio.get_running_loop()
            me = asyncio.current_task()
            async with compat.timeout_at(loop.time() + 0.05):
                loop.call_at(loop.time() + 0.05, me.cancel)  # same moment: both requests pending
                await asyncio.sleep(1)
        task = asyncio.ensure_future(cancelled_as_it_expires())
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert task.cancelled(), "a cancellation from outside became a TimeoutError"
        return True

    assert arun(scenario(), timeout=30)
