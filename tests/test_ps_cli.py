"""`potluck ps server` and `potluck ps worker` as real processes on 127.0.0.1, started through the
CLI as a user would, on the user model of tests/user_model.py. Sync mode with fixed seeds makes a
run's final parameters exact: every run is compared with the same training done in this process."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from potluck.cli.ps import params_digest
from potluck.cli.spec import RunSpec
from potluck.net.identity import Identity
from potluck.ps.discovery import assemble_layout, layout_digest
from potluck.ps.messages import ServerAnnouncement, ShardRole
from potluck.ps.server import split_by_size
from tests import user_model
from tests.conftest import ROOT

# One intra-op thread in the children and in the reference: the same summation order, exact digests.
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
SEED, LR, STEPS = 3, 0.01, 30
SPEC = ["--model", "tests.user_model:make_layers", "--lr", str(LR), "--seed", str(SEED)]
# Seconds each batch of `paced_batches` takes: a run lasts over a second, so a kill lands mid-run.
PACE = 0.05
# Deadline for a process to print an expected line (start-up imports torch: seconds on a loaded machine).
LINE_DEADLINE = 60.0


def paced_batches(rank: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """tests.user_model:batches, slowed down (what `--data tests.test_ps_cli:paced_batches` names)."""
    for batch in user_model.batches(rank, seed):
        time.sleep(PACE)
        yield batch


def reference_digest(steps: int, workers: int) -> str:
    """The run the servers make, in this process: each step, the mean of every worker's gradient
    on its own batch, then one Adam step."""
    spec = RunSpec(model="tests.user_model:make_layers", data="tests.user_model:batches", lr=LR, seed=SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*spec.layers())
        params = list(model.parameters())
        optimizer = spec.make_optimizer(params)
        sources = [spec.source(rank) for rank in range(workers)]
        for step in range(steps):
            grads = []
            for source in sources:
                x, y = source(step)
                model.zero_grad(set_to_none=True)
                spec.loss_fn(model(x), y).backward()
                grads.append([p.grad.clone() for p in params])
            for i, p in enumerate(params):
                p.grad = torch.stack([g[i] for g in grads]).mean(0)
            optimizer.step()
        return params_digest(params)
    finally:
        torch.set_num_threads(threads)


class Child:
    """`python -m potluck ARGS` with its stdout followed by a thread and its stderr in a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "potluck", *args], stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=ENV, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line.rstrip())

    def wait_for(self, pattern: str, deadline: float = LINE_DEADLINE) -> re.Match:
        end = time.monotonic() + deadline
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"{self.name}: no line matching {pattern!r} within {deadline} s; it printed "
                             f"{self.seen[-10:]}; stderr: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.reader.join(5)
        self.proc.stdout.close()


@pytest.fixture
def children(tmp_path):
    started: list[Child] = []

    def start(name: str, *args: str) -> Child:
        child = Child(name, list(args), tmp_path)
        started.append(child)
        return child
    yield start
    for child in started:
        child.stop()


def common(run_id: str, bootstrap: str | None) -> list[str]:
    return ["--host", "127.0.0.1", "--run-id", run_id, "--shards", "2", "--workers", "2", *SPEC,
            *(["--initial-peers", bootstrap] if bootstrap else [])]


def finished(worker: Child) -> tuple[list[int], str]:
    done = worker.wait_for(r"done: server steps \[(.*)\]; final parameters sha256 (\w+)")
    return [int(s) for s in done.group(1).split(",")], done.group(2)


@pytest.mark.timeout(150)
def test_sharded_servers_lose_no_update_when_a_shard_server_is_killed(children):
    """2 shard servers, a standby of shard 0 and 2 workers, 5 processes; shard 0's server is
    SIGKILLed mid-run: the standby takes over with the optimizer state and the run ends exactly
    where the undisturbed run does."""
    shard1 = children("shard1", "ps", "server", "--shard", "1", *common("sharded", None))
    bootstrap = shard1.wait_for(r"--initial-peers (\S+)").group(1)
    shard0 = children("shard0", "ps", "server", "--shard", "0", "--await-standby", *common("sharded", bootstrap))
    standby = children("standby0", "ps", "server", "--shard", "0", "--standby-of", "auto",
                       *common("sharded", bootstrap))
    workers = [children(f"worker{r}", "ps", "worker", "--rank", str(r), "--steps", str(STEPS),
                        "--data", "tests.test_ps_cli:paced_batches", *common("sharded", bootstrap)) for r in (0, 1)]
    standby_id = standby.wait_for(r"peer id: (\S+)").group(1)
    assert workers[0].wait_for(r"shard 0: server \S+, standby (\S+)").group(1) == standby_id
    workers[0].wait_for(rf"step {STEPS // 4}/")
    shard0.proc.kill()
    results = [finished(w) for w in workers]
    taken = int(standby.wait_for(r"shard 0: took over from \S+ at step (\d+)").group(1))
    assert 0 < taken < STEPS
    expected = reference_digest(STEPS, 2)
    assert results == [([STEPS, STEPS], expected)] * 2


@pytest.mark.timeout(150)
def test_decentralized_workers_serve_the_shards_and_a_mismatched_model_is_refused(children):
    """Two workers that each serve one shard and stand by for the other train exactly as the
    reference; a worker whose model differs refuses the announced layout and says why."""
    first = children("worker0", "ps", "worker", "--serve-shard", "0", "--rank", "0", "--steps", str(STEPS),
                     "--data", "tests.user_model:batches", *common("dec", None))
    bootstrap = first.wait_for(r"--initial-peers (\S+)").group(1)
    second = children("worker1", "ps", "worker", "--serve-shard", "1", "--rank", "1", "--steps", str(STEPS),
                      "--data", "tests.user_model:batches", *common("dec", bootstrap))
    stranger = children("stranger", "ps", "worker", "--steps", "1", "--discovery-timeout", "5",
                        *common("dec", bootstrap), "--model", "tests.user_model:make_residual")
    assert finished(first) == finished(second) == ([STEPS, STEPS], reference_digest(STEPS, 2))
    assert stranger.proc.wait(LINE_DEADLINE) == 1
    error = stranger.log.read_text()
    assert "no complete shard layout after 5 s" in error and "announce a layout that does not match this model" in error
    for worker in (first, second):  # they stop serving once the other has stopped calling
        assert worker.proc.wait(LINE_DEADLINE) == 0


def test_a_layout_needs_every_shard_and_a_standby_both_sides_name():
    """`assemble_layout` on announcements as read from the DHT (the announcer is the signer)."""
    params = [p for layer in user_model.make_layers() for p in layer.parameters()]
    a, b, c, d = (Identity.generate().peer_id for _ in range(4))
    digest = layout_digest(params, 2)

    def ann(*roles: ShardRole, digest: str = digest) -> ServerAnnouncement:
        return ServerAnnouncement(digest, 2, roles)
    layout, missing = assemble_layout({a: ann(ShardRole(0, replica=c, await_standby=True))}, params)
    assert layout is None and "shard 1 has no server" in missing and "shard 0's server waits" in missing
    both = {a: ann(ShardRole(0, replica=c, await_standby=True)), b: ann(ShardRole(1, replica=d)),
            c: ann(ShardRole(0, standby_of=a)), d: ann(ShardRole(0, standby_of=a))}  # d: not the standby of 1
    layout, _ = assemble_layout(both, params)
    assert layout.servers == ((a, c), (b,))
    assert layout.assignment == tuple(split_by_size([p.numel() for p in params], 2))
    layout, missing = assemble_layout({a: ann(ShardRole(0), digest="0" * 64), b: ann(ShardRole(1))}, params)
    assert layout is None and "1 announce a layout that does not match this model" in missing
