"""`potluck ps server` and `potluck ps worker` as real processes on 127.0.0.1, started through the
CLI as a user would, on the user model of tests/user_model.py. Sync consistency with fixed seeds
makes a run's final parameters exact: every run is compared with the same training done in this process."""

from __future__ import annotations

import argparse
import asyncio
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

from potluck.cli import ps as ps_command
from potluck.cli.ps import params_digest
from potluck.cli.spec import RunSpec
from potluck.core.names import PS_RUNS, RunNames
from potluck.core.virtual_time import run_virtual
from potluck.dht.errors import RecordRejected
from potluck.dht.records import own_subkey
from potluck.net.emulated import EmulatedNetwork
from potluck.net.identity import Identity
from potluck.ps.discovery import (
    ANNOUNCE_INTERVAL,
    LAYOUT_MISMATCH_GRACE,
    POLL_INTERVAL,
    RUNS_QUERY_TIMEOUT,
    LayoutNotFound,
    RunNotFound,
    ShardHost,
    assemble_layout,
    discover_layout,
    find_primary,
    foreign_layout,
    layout_digest,
)
from potluck.ps.messages import MAX_SERVED_RUNS, ServerAnnouncement, ShardRole
from potluck.ps.runs import ask_served_runs, served_runs
from potluck.ps.server import ParameterServer, split_by_size
from potluck.ps.simulation import EmulatedPeer
from tests import forkserver, user_model
from tests.conftest import ROOT

# One intra-op thread in the children and in the reference: the same summation order, exact digests.
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
SEED, LR, STEPS = 3, 0.01, 30
SPEC = ["--model", "tests.user_model:make_layers", "--lr", str(LR), "--seed", str(SEED)]
# Seconds each batch of `paced_batches` takes: a run lasts over a second, so a kill lands mid-run.
PACE = 0.05
# Deadline for a process to print an expected line (start-up imports torch: seconds on a loaded machine).
LINE_DEADLINE = 60.0
# `dying_batches`: this worker SIGKILLs itself as it reaches this batch (before its push of it).
DYING_RANK, DIES_AT = 3, 7


def paced_batches(rank: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """tests.user_model:batches, slowed down (what `--data tests.test_ps_cli:paced_batches` names)."""
    for batch in user_model.batches(rank, seed):
        time.sleep(PACE)
        yield batch


def dying_batches(rank: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """tests.user_model:batches, but worker DYING_RANK is SIGKILLed as it reaches batch DIES_AT: a
    crash at a known step, so the test knows which rounds it took part in."""
    epoch = seed - SEED  # RunSpec.source asks for epoch e with seed + e
    for i, batch in enumerate(user_model.batches(rank, seed)):
        if rank == DYING_RANK and epoch * user_model.EPOCH_BATCHES + i == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch


def wide_layers() -> list[nn.Module]:
    """tests.user_model:make_layers with twice the hidden units: a worker started with the wrong --model."""
    hidden = 2 * user_model.HIDDEN
    return [nn.Sequential(nn.Linear(user_model.FEATURES, hidden), nn.ReLU()),
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()), nn.Linear(hidden, user_model.CLASSES)]


def reference_digest(steps: int, order: list[int], rounds: dict[int, int] | None = None) -> str:
    """The run the servers make, in this process: each step, the mean of the live workers'
    gradients on their own batches, summed in `order` (ranks by peer id, as the servers sum
    them), then one Adam step. `rounds`: rank -> the steps it took part in, if it died."""
    rounds = rounds or {}
    spec = RunSpec(model="tests.user_model:make_layers", data="tests.user_model:batches", lr=LR, seed=SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*spec.layers())
        params = list(model.parameters())
        optimizer = spec.make_optimizer(params)
        sources = {rank: spec.source(rank) for rank in order}
        for step in range(steps):
            grads = []
            for rank in order:
                if step >= rounds.get(rank, steps):
                    continue
                x, y = sources[rank](step)
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
            self.proc = forkserver.Popen([sys.executable, "-m", "potluck", *args], stdout=subprocess.PIPE,
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


def common(run_id: str, bootstrap: str | None, n: int = 2) -> list[str]:
    return ["--host", "127.0.0.1", "--run-id", run_id, "--shards", str(n), "--workers", str(n), *SPEC,
            *(["--initial-peers", bootstrap] if bootstrap else [])]


def by_peer_id(ids: list[str]) -> list[int]:
    """Ranks in the order the servers sum their gradients."""
    return sorted(range(len(ids)), key=lambda r: ids[r])


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
    ids = [w.wait_for(r"peer id: (\S+)").group(1) for w in workers]
    standby_id = standby.wait_for(r"peer id: (\S+)").group(1)
    assert workers[0].wait_for(r"shard 0: server \S+, standby (\S+)").group(1) == standby_id
    workers[0].wait_for(rf"step {STEPS // 4}/")
    shard0.proc.kill()
    results = [finished(w) for w in workers]
    taken = int(standby.wait_for(r"shard 0: took over from \S+ at step (\d+)").group(1))
    assert 0 < taken < STEPS
    assert results == [([STEPS, STEPS], reference_digest(STEPS, by_peer_id(ids)))] * 2


@pytest.mark.timeout(150)
def test_decentralized_workers_lose_no_update_when_one_is_killed(children):
    """Four workers, each the server of one of 4 shards and the standby of the one before; worker 3
    is SIGKILLed before its 8th push. Worker 0 takes shard 3 over, the rounds go on with the other
    three, and every survivor ends with the parameters of that same training done in this process."""
    def start(rank: int, bootstrap: str | None) -> Child:
        return children(f"worker{rank}", "ps", "worker", "--serve-shard", str(rank), "--rank", str(rank), "--steps",
                        str(STEPS), "--data", "tests.test_ps_cli:dying_batches", "--worker-timeout", "3",
                        *common("dec", bootstrap, n=4))
    workers = [start(0, None)]
    ids = [workers[0].wait_for(r"peer id: (\S+)").group(1)]
    bootstrap = workers[0].wait_for(r"--initial-peers (\S+)").group(1)
    workers += [start(rank, bootstrap) for rank in (1, 2, 3)]
    ids += [w.wait_for(r"peer id: (\S+)").group(1) for w in workers[1:]]
    expected = reference_digest(STEPS, by_peer_id(ids), {DYING_RANK: DIES_AT})
    taken = int(workers[0].wait_for(r"shard 3: took over from \S+ at step (\d+)").group(1))
    assert taken in (DIES_AT, DIES_AT + 1)  # printed after the step it noticed it in
    assert [finished(w) for w in workers[:3]] == [([STEPS] * 4, expected)] * 3
    assert workers[DYING_RANK].proc.wait(LINE_DEADLINE) == -signal.SIGKILL


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


@pytest.mark.timeout(60)
def test_servers_announce_in_their_own_names_and_a_late_standby_is_adopted():
    """On the emulated network (virtual clock): workers find the layout the servers announce; a
    standby that starts later is adopted by its primary at the next renewal; an announcement in
    another server's name, under an unsigned subkey or as a plain record cannot be stored."""
    async def scenario():
        network = EmulatedNetwork(latency=0.001)
        peers = [await EmulatedPeer.start(network, None, None)]
        for _ in range(4):
            peers.append(await EmulatedPeer.start(network, None, peers[0]))
        a, b, c, worker, mallory = peers
        params = [p for layer in user_model.make_layers() for p in layer.parameters()]
        digest = layout_digest(params, 2)
        assignment = split_by_size([p.numel() for p in params], 2)

        def serve(peer: EmulatedPeer, shard: int, standby_of=None) -> ShardHost:
            mine = [p for p, s in zip(params, assignment, strict=True) if s == shard]
            server = ParameterServer(peer, "late", mine, lambda ps: torch.optim.Adam(ps), shard=shard,
                                     standby_of=standby_of, offload=False)
            host = ShardHost(peer, "late", [server], digest, 2)
            tasks.append(asyncio.create_task(host.keep_announced()))
            return host
        tasks: list[asyncio.Task] = []
        try:
            hosts = [serve(a, 0), serve(b, 1)]
            forged = ServerAnnouncement(digest, 2, (ShardRole(0),))
            for subkey in ("x", own_subkey(b.transport.peer_id), None):  # unsigned, in b's name, plain
                with pytest.raises(RecordRejected):
                    await mallory.dht.astore(RunNames("late").ps_servers, forged.to_wire(), mallory.dht.get_time() + 30,
                                             subkey=subkey)
            before = await discover_layout(worker, "late", params, timeout=10)
            primary = await find_primary(c, "late", 0, digest, 2, timeout=10)
            serve(c, 0, standby_of=primary)
            await asyncio.sleep(ANNOUNCE_INTERVAL + 2 * POLL_INTERVAL)
            after = await discover_layout(worker, "late", params, timeout=10)
            return before, after, primary, hosts[0].servers[0].replica, [p.transport.peer_id for p in peers]
        finally:
            for task in tasks:
                task.cancel()
            for peer in peers:
                await peer.close()
    before, after, primary, replica, (a, b, c, _, _) = run_virtual(scenario())
    assert before.servers == ((a,), (b,)) and primary == a
    assert replica == c and after.servers == ((a, c), (b,))


@pytest.mark.timeout(30)
def test_the_old_mode_option_still_sets_the_consistency_hidden_from_help_and_says_it_is_going(capsys):
    parser = argparse.ArgumentParser(prog="potluck")
    ps_command.register(parser.add_subparsers())
    base = ["ps", "server", "--shard", "0"]
    assert ps_command._config(parser.parse_args(base)).consistency == "sync"
    assert capsys.readouterr().err == ""
    old = parser.parse_args([*base, "--mode", "ssp"])
    assert ps_command._config(old).consistency == "ssp"
    assert "--mode is deprecated, use --consistency" in capsys.readouterr().err
    assert parser.parse_args([*base, "--consistency", "backup"]).consistency == "backup"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--help"])
    shown = capsys.readouterr().out
    assert "--consistency" in shown and not re.search(r"--mode\b", shown)


# A worker of another model must be told this soon after it joined the swarm (it prints its peer id).
MISMATCH_DEADLINE = 10.0


def told_at_once(worker) -> tuple[int, list[str]]:
    """A worker's exit code and error lines, once it has exited within MISMATCH_DEADLINE of joining."""
    worker.wait_for(r"peer id: ")
    try:
        code = worker.proc.wait(MISMATCH_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker was not told within {MISMATCH_DEADLINE} s: {worker.seen[-5:]}; "
                             f"{worker.log.read_text()[-2000:]}") from None
    return code, [line for line in worker.log.read_text().splitlines() if line.startswith("potluck ps: error:")]


@pytest.mark.timeout(120)
def test_a_worker_of_another_model_stops_at_once_naming_the_tensor(children):
    """A server of the user's model, then a worker started with a wider --model. Before, the
    worker refused the servers' layout and waited out its 120 s discovery timeout ("no complete
    shard layout"); now it exits with one line naming the first tensor that differs, within
    MISMATCH_DEADLINE of joining."""
    server = children("server", "ps", "server", "--shard", "0", *common("wrong", None, n=1))
    bootstrap = server.wait_for(r"--initial-peers (\S+)").group(1)
    server.wait_for(r"serving shard 0")
    worker = children("worker", "ps", "worker", "--steps", "3", *common("wrong", bootstrap, n=1),
                      "--model", "tests.test_ps_cli:wide_layers")
    code, errors = told_at_once(worker)
    hidden = 2 * user_model.HIDDEN
    assert code == 1 and len(errors) == 1, worker.log.read_text()[-2000:]
    assert (f"parameter 0 '0.0.weight': yours is float32 [{hidden}, {user_model.FEATURES}], the servers' is "
            f"float32 [{user_model.HIDDEN}, {user_model.FEATURES}]") in errors[0]


@pytest.mark.timeout(120)
def test_a_worker_of_another_run_id_stops_at_once_naming_the_servers_run(children):
    """A server of run 'mine', then a worker of run 'other' joined through it. Before, the worker
    found no announcement of its run and waited out its 120 s discovery timeout; now it asks the
    peer it joined through which runs it serves and exits with one line naming 'mine', within
    MISMATCH_DEADLINE of joining."""
    server = children("server", "ps", "server", "--shard", "0", *common("mine", None, n=1))
    bootstrap = server.wait_for(r"--initial-peers (\S+)").group(1)
    server.wait_for(r"serving shard 0")
    worker = children("worker", "ps", "worker", "--steps", "3", *common("other", bootstrap, n=1))
    code, errors = told_at_once(worker)
    assert code == 1 and len(errors) == 1, worker.log.read_text()[-2000:]
    assert "Traceback" not in worker.log.read_text()
    assert errors[0].startswith("potluck ps: error: run 'other': ") and \
        "serves parameter-server run 'mine' only; give this worker the same --run-id" in errors[0], errors[0]


def test_only_a_complete_layout_of_another_model_with_none_of_ours_is_foreign():
    """`foreign_layout`: what makes a worker stop. A layout of another model counts only when it
    is complete (every shard has a primary) and no other peer announces one of the worker's model;
    the worker's own announcement (it serves a shard itself) does not count as one."""
    params = [p for layer in user_model.make_layers() for p in layer.parameters()]
    other = [p for layer in wide_layers() for p in layer.parameters()]
    me, a, b = (Identity.generate().peer_id for _ in range(3))
    ours, theirs = layout_digest(params, 2), layout_digest(other, 2)
    half = {a: ServerAnnouncement(theirs, 2, (ShardRole(0),))}
    whole = {**half, b: ServerAnnouncement(theirs, 2, (ShardRole(1),))}
    assert foreign_layout(half, params, me) is None  # incomplete: its servers may still be starting
    assert foreign_layout(whole, params, me) == whole[a]
    assert foreign_layout({**whole, me: ServerAnnouncement(ours, 2, (ShardRole(0),))}, params, me) == whole[a]
    assert foreign_layout({a: whole[a], b: ServerAnnouncement(ours, 2, (ShardRole(1),))}, params, me) is None


@pytest.mark.timeout(30)
def test_a_worker_asks_only_its_join_peers_which_runs_they_serve_and_ignores_bad_answers():
    """On the emulated network (virtual clock). A peer serving shards of 'mine' lists its runs, the
    asker's first; a worker of 'other' that asks it stops with RunNotFound soon after the grace.
    Asking only a plain peer (no such method) and a hostile one (an oversized list) it waits out
    its timeout as before, and so it does when an asked peer serves its run without announcing."""
    async def scenario():
        network = EmulatedNetwork(latency=0.001)
        peers = [await EmulatedPeer.start(network, None, None)]
        for _ in range(4):
            peers.append(await EmulatedPeer.start(network, None, peers[0]))
        a, b, plain, mallory, worker = peers
        ids = [p.transport.peer_id for p in peers]
        params = [p for layer in user_model.make_layers() for p in layer.parameters()]

        async def oversized(request, ctx):
            return {"runs": ["evil"] * (MAX_SERVED_RUNS + 1)}  # accepted, it would stop the worker
        mallory.transport.add_handler(PS_RUNS, oversized)
        optimizer = lambda ps: torch.optim.SGD(ps, 0.1)  # noqa: E731
        mine = ParameterServer(a, "mine", params, optimizer, offload=False)
        extra = ParameterServer(a, "aaa", params, optimizer, offload=False)
        ParameterServer(b, "other", params, optimizer, offload=False)  # serves 'other', announces nothing
        host = ShardHost(a, "mine", [mine], layout_digest(params, 1), 1)
        task = asyncio.create_task(host.keep_announced())
        loop = asyncio.get_running_loop()
        try:
            answers = [await ask_served_runs(worker.transport, ids[:4], "mine", RUNS_QUERY_TIMEOUT)]
            extra.shutdown()
            extra.shutdown()  # twice: nothing more happens
            answers.append(await ask_served_runs(worker.transport, ids[:4], "aaa", RUNS_QUERY_TIMEOUT))
            found = await discover_layout(worker, "mine", params, timeout=10, ask=ids[:4])
            start = loop.time()
            with pytest.raises(RunNotFound) as caught:
                await discover_layout(worker, "other", params, timeout=30, ask=[ids[2], ids[3], ids[0]])
            took = loop.time() - start
            for ask in ([ids[2], ids[3]], [ids[0], ids[1]]):
                with pytest.raises(LayoutNotFound) as waited:
                    await discover_layout(worker, "other", params, timeout=8, ask=ask)
                assert not isinstance(waited.value, RunNotFound), waited.value
            mine.shutdown()
            left = served_runs(a.transport).servers
            return answers, found, caught.value, took, left, ids
        finally:
            task.cancel()
            for peer in peers:
                await peer.close()
    answers, found, error, took, left, ids = run_virtual(scenario())
    assert answers[0] == {ids[0]: ("mine", "aaa"), ids[1]: ("other",)}  # the plain and hostile peers: left out
    assert answers[1] == {ids[0]: ("mine",), ids[1]: ("other",)}
    assert found.servers == ((ids[0],),) and not left
    assert took < LAYOUT_MISMATCH_GRACE + RUNS_QUERY_TIMEOUT + 2 * POLL_INTERVAL, took
    assert str(error) == (f"run 'other': no shard server announces this run, and the peer {ids[0]} this worker "
                          "joined through serves parameter-server run 'mine' only; give this worker the same "
                          "--run-id as the servers")
