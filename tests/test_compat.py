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
