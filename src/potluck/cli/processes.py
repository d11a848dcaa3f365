"""Child processes of the demos: each reports JSON lines on stdout, which the parent follows."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path


def missing_demo_packages(*modules: str) -> bool:
    """True (after telling the user how to install them) if any of the demo's extra packages is absent."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"the demo needs {', '.join(missing)}: pip install 'potluck[demo]' (or run ./scripts/demo.sh)",
              file=sys.stderr)
    return bool(missing)


@dataclass
class WorkerProcess:
    """One child: a hello line (with its address), progress rows, then a final row."""

    name: str
    role: str
    proc: subprocess.Popen
    needs_final: bool = True  # False for processes that serve until killed (no final row)
    status: str = "starting"
    hello: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    curve: list = field(default_factory=list)  # (time, loss) of every progress row with a loss
    evaluations: list = field(default_factory=list)  # (time, test accuracy, test loss) of each test row
    final: dict | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str | None:
        return self.hello.get("address")

    def read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "address" in message:
                self.hello = message
                self.status = "running"
                self.ready.set()
            elif "started" in message:  # the common start: when this process began training
                self.hello["started"] = message["started"]
            elif message.get("final"):
                self.final = message
            elif "test_accuracy" in message:
                self.evaluations.append((message["time"], message["test_accuracy"], message["test_loss"]))
            else:
                self.last = message
                if "loss" in message:
                    self.curve.append((message["time"], message["loss"]))
                if self.status in ("starting", "running"):
                    self.status = "training"
        if self.status != "killed":
            self.status = "done" if (self.final or not self.needs_final) else "exited"
        self.ready.set()


def spawn(name: str, role: str, argv: list[str], log_dir: Path, needs_final: bool = True) -> WorkerProcess:
    """Start `python -m potluck ARGV` with its stderr in LOG_DIR/NAME.log, and follow its stdout."""
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - owned by the child process
    proc = subprocess.Popen([sys.executable, "-m", "potluck", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    worker = WorkerProcess(name, role, proc, needs_final)
    threading.Thread(target=worker.read, daemon=True).start()
    return worker


def time_verdict(target: str, swarm: float | None, alone: float | None, duration: float,
                 resolution: float = 0.0) -> str:
    """A demo's comparison in one line, on when each side first reached `target` (seconds
    after the common start; None: not within `duration`), level if within `resolution` (the
    time between two measurements)."""
    if swarm is None and alone is None:
        return f"time to {target}: neither the swarm nor one process reached it in {duration:.0f} s"
    if swarm is None or alone is None:
        first = "swarm" if alone is None else "one process"
        other = "one process" if alone is None else "swarm"
        return (f"time to {target}: {first} {swarm if alone is None else alone:.1f} s, {other} not within "
                f"{duration:.0f} s: {first} ahead")
    if abs(swarm - alone) <= resolution:
        return (f"time to {target}: swarm {swarm:.1f} s vs one process {alone:.1f} s: level (within the "
                f"{resolution:g} s between measurements)")
    ahead = "swarm" if swarm <= alone else "one process"
    return (f"time to {target}: swarm {swarm:.1f} s vs one process {alone:.1f} s: {ahead} ahead "
            f"({max(swarm, alone) / max(min(swarm, alone), 1e-9):.2f}x sooner)")


def verdict(swarm: float, alone: float, loss: str = "test loss") -> str:
    """A demo's comparison in one line, on a loss (lower is better)."""
    ahead = "swarm" if swarm <= alone else "one process"
    margin = abs(alone - swarm) / max(alone, swarm, 1e-12)
    return (f"swarm {loss} {swarm:.4f} vs one process {alone:.4f} at equal wall time: "
            f"{ahead} ahead by {margin:.0%}")
