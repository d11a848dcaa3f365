"""The demos' monitor: a `potluck monitor` process that follows the demo's run into DIR/ledger.db.

It is a child like the peers (`potluck.cli.processes`), so a user sees what a run's organizer
sees: the dashboard while the swarm trains, then each peer's credit from the ledger.
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from potluck.cli.processes import WorkerProcess, spawn
from potluck.monitor.ledger import Ledger

# The monitor's interface: the dashboard of a local demo is for this machine only.
HOST = "127.0.0.1"
# Seconds a stopped monitor may take to exit: its poll in flight gives up after POLL_TIMEOUT
# (10 s, while the peers it reads are stopping too), then it closes its peer and its database.
STOP_TIMEOUT = 20.0


def free_port() -> int:
    """A port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class DemoMonitor:
    """The monitor process, its dashboard's URL (None where potluck.monitor.web is not installed) and its db."""

    worker: WorkerProcess
    url: str | None
    db: Path

    @classmethod
    def start(cls, run_id: str, initial_peer: str, out: Path, port: int | None) -> DemoMonitor:
        port = port or free_port()
        db = out / "ledger.db"
        worker = spawn("monitor", "monitor", ["monitor", "--run-id", run_id, "--initial-peers", initial_peer,
                                              "--db", str(db), "--host", HOST, "--port", str(port)],
                       out, needs_final=False)
        web = importlib.util.find_spec("potluck.monitor.web") is not None
        return cls(worker, f"http://{HOST}:{port}/" if web else None, db)

    def announce(self) -> str:
        if self.url is None:
            return (f"monitor: recording the run into {self.db} (the dashboard is not available in this "
                    f"installation); log in {self.db.parent}/monitor.log")
        return f"dashboard: {self.url}  (live swarm, loss and credit; ledger {self.db})"

    def stop(self) -> None:
        """Ask the monitor to stop (it finishes its poll and closes its database); returns at once."""
        if self.worker.proc.poll() is None:
            self.worker.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Stop the monitor and wait for it; killed if it does not exit in STOP_TIMEOUT."""
        self.stop()
        try:
            self.worker.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.worker.proc.kill()
            self.worker.proc.wait()

    def report(self, names: dict[str, str]) -> dict:
        """The report's `monitor` entry: URL, db, and each peer's credit (`names`: peer id -> demo name)."""
        contributors = []
        if self.db.is_file():
            with Ledger(self.db) as ledger:
                contributors = [{"peer": names.get(c.peer_id, c.peer_id), "peer_id": c.peer_id,
                                 "samples": c.samples, "share": round(c.share, 4)}
                                for c in ledger.contributors()]
        return {"url": self.url, "db": str(self.db), "exit_code": self.worker.proc.returncode,
                "contributors": contributors}


def credit_table(contributors: list[dict]) -> str:
    """The credit the ledger gives each peer, as printed at the end of a demo."""
    width = max([len("peer")] + [len(c["peer"]) for c in contributors])
    rows = [f"{'peer':<{width}}  {'samples credited':>16}  {'share':>6}"]
    rows += [f"{c['peer']:<{width}}  {c['samples']:>16}  {c['share']:>6.1%}" for c in contributors]
    return "\n".join(rows)
