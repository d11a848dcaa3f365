"""What the real-world checks (scripts/netns/nat_check.py, scripts/browser/dashboard_check.py) share:
their child processes with logs, the step runner that fills the JSON summary, and the summary's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
LOG_TAIL_LINES = 15  # of a process's log, in a failure's message: its last error without the whole run


class CheckFailed(Exception):
    pass


class Processes:
    """Our child processes; stderr of each goes to a log file shown on failure."""

    def __init__(self, log_dir: Path, stop_grace: float):
        self.log_dir = log_dir
        self.stop_grace = stop_grace  # SIGTERM to SIGKILL
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.own_session: set[str] = set()

    async def spawn(self, name: str, *argv: str, stdin: int = asyncio.subprocess.DEVNULL,
                    own_session: bool = False) -> asyncio.subprocess.Process:
        """Start `argv` with the repository's sources; in its `own_session` it is killed with its children."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=stdin, stdout=asyncio.subprocess.PIPE,
                                                        stderr=log, env=env, cwd=ROOT,
                                                        start_new_session=own_session)
        self.procs[name] = proc
        if own_session:
            self.own_session.add(name)
        return proc

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def read_until(self, name: str, match: Callable[[str], bool], timeout: float) -> str:
        """The first stdout line of `name` that `match`es, within `timeout`."""
        proc = self.procs[name]
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = (await proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        raise CheckFailed(f"{name} exited ({await proc.wait()}) before it was ready:\n"
                                          f"{self.log_tail(name)}")
                    if match(line.strip()):
                        return line.strip()
        except TimeoutError:
            raise CheckFailed(f"{name} was not ready within {timeout:.0f} s:\n{self.log_tail(name)}") from None

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for name, proc in self.procs.items():
            try:
                await asyncio.wait_for(proc.wait(), self.stop_grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    if name in self.own_session:
                        os.killpg(proc.pid, signal.SIGKILL)  # with its children (chromium's renderers)
                    else:
                        proc.kill()
                await proc.wait()


async def run_step(summary: dict, name: str, step: Callable[[], Awaitable[Any]]) -> Any:
    """Run one step into summary["steps"][name]; its value, or None if it failed (raised, or said "ok": False)."""
    start = time.monotonic()
    try:
        value = await step()
    except CheckFailed as e:
        summary["steps"][name] = {"ok": False, "error": str(e), "seconds": round(time.monotonic() - start, 2)}
        return None
    report = value if isinstance(value, dict) else {} if value is None else {"value": value}
    ok = report.pop("ok", True)
    summary["steps"][name] = {"ok": ok, **report, "seconds": round(time.monotonic() - start, 2)}
    return value if ok else None


def stop_on_signals(prog: str) -> None:
    """SIGTERM, SIGHUP and SIGINT end the check through its `finally`s (processes stopped, namespaces removed)."""
    def raise_on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(f"{prog}: stopped by signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, raise_on_signal)


@contextlib.contextmanager
def log_folder(keep: str | None, prefix: str) -> Iterator[Path]:
    """`keep` (made if missing, left after), or a temporary folder removed at the end."""
    log_dir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield log_dir
    finally:
        if not keep:
            shutil.rmtree(log_dir, ignore_errors=True)


def finish(prog: str, summary: dict, start: float, complete: bool) -> int:
    """Print the JSON summary; the exit status (1 unless every step ran, `complete`, and passed)."""
    steps = summary["steps"]
    summary["ok"] = "error" not in summary and complete and all(s["ok"] for s in steps.values())
    summary["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(summary, indent=2))
    if not summary["ok"]:
        failed = [name for name, s in steps.items() if not s["ok"]]
        print(f"{prog}: FAILED ({', '.join(failed) or summary.get('error')})", file=sys.stderr)
        return 1
    print(f"{prog}: all steps passed", file=sys.stderr)
    return 0
