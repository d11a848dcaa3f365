"""Training benchmark: wall time to reach a target test accuracy on scikit-learn's digits.

Three systems, run one after another (never concurrently: the standard machine has 2 cores), each
training the small CNN of `potluck demo` (`potluck.cli.demo.make_model`, same initial weights) on the
same train/test split (`load_data`), with Adam(lr=6e-3), target_batch_size=1024 (the global batch,
one epoch), batch_size_per_step=32, average_state_every=5, matchmaking_time=0.5 and
averaging_timeout=20 s:

  potluck   a swarm of N peer processes (default 4), `potluck.Optimizer` in sync (DeDLOC) mode;
  alone     one potluck peer process, the same `potluck.Optimizer` and settings, no other peers;
  hivemind  N peer processes with `hivemind.Optimizer` (hivemind 1.1.12 and its Go daemon, from the
            python of .venv-hivemind: scripts/hivemind-venv.sh), the same model, data and settings;
  hivemind_tuned  the same, except matchmaking_time=3 s (--tuned-matchmaking-time), within what
            hivemind's docstring recommends for small local runs (3-5 s): with 0.5 s its averaging
            rounds tend to fail and wait out averaging_timeout, so this is its better-case figure.

Every process uses one torch thread. The parent starts the processes, waits until each has joined
and built its optimizer, then sends every process the same start time; from then each process
trains (forward, backward, opt.step()) and evaluates its model on the test set at each new epoch
and at least every 0.5 s, and reports the wall time since the common start at which its test
accuracy first reached the target. A system's time to accuracy is the time of its first peer to
get there (`all_peers_seconds`: the last one). A system stops when all its peers got there or
after --cap seconds of training ("not reached": value null).

Prints one JSON object per line, e.g.
  {"metric": "time_to_accuracy", "system": "potluck", "value": 21.3, "unit": "s", "target": 0.95, ...}
  {"metric": "time_to_accuracy_ratio", "unit": "hivemind/potluck", "value": 1.9, ...}
A system that does not reach the target within the cap has value null; its ratio then has value
null and `at_least` = cap / potluck's time.

Usage: python benchmarks/training.py [--quick] [--peers 4] [--target 0.95] [--cap 90]
           [--systems potluck,alone,hivemind,hivemind_tuned] [--tuned-matchmaking-time 3]
           [--matchmaking-time 0.5] [--averaging-timeout 20] [--hivemind-python PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import select
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from peer_processes import Worker, parse_or_run_worker

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"
STARTUP_TIMEOUT = 90.0   # one peer process: imports, peer/DHT start (hivemind: DHT process + Go daemon)
STOP_TIMEOUT = 20.0      # from "stop" to the final report of a process
WORKER_IDLE_TIMEOUT = 600.0  # a worker that hears nothing from the parent for this long exits
LR = 6e-3
TARGET_BATCH = 1024
LOCAL_BATCH = 32
AVERAGE_STATE_EVERY = 5
EVAL_EVERY = 0.5


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# == worker side ====================================================================================
_SAYING = threading.Lock()  # workers' threads say things too: one whole line at a time


def say(**event: Any) -> None:
    with _SAYING:
        print("@@" + json.dumps(event), flush=True)


def read_line(timeout: float) -> str:
    """A line from the parent; if it is gone (EOF) or silent, kill this process group."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    line = sys.stdin.readline() if ready else ""
    if not line:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    return line


def run_worker(args: argparse.Namespace) -> None:
    import torch

    from potluck.cli.tasks import make_model  # plain torch: importable from either venv

    torch.set_num_threads(1)
    x, y, x_test, y_test = torch.load(args.data)
    model = make_model()
    initial = [args.initial] if args.initial else []
    if args.worker == "hivemind":
        import hivemind
        dht = hivemind.DHT(start=True, initial_peers=initial or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        address, version = str(dht.get_visible_maddrs()[0]), hivemind.__version__
        opt = hivemind.Optimizer(dht=dht, run_id="training-bench", params=model.parameters(),
                                 optimizer=lambda p: torch.optim.Adam(p, LR), target_batch_size=TARGET_BATCH,
                                 batch_size_per_step=LOCAL_BATCH, average_state_every=AVERAGE_STATE_EVERY,
                                 matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
                                 verbose=False)
        closers = [opt.shutdown, dht.shutdown]
        zero_grad = opt.zero_grad  # hivemind's documented loop calls it (accumulates into its own buffers)
    else:
        import potluck
        peer = potluck.Peer(host="127.0.0.1", initial_peers=initial)
        address, version = (peer.addresses[0] if peer.addresses else None), None
        opt = potluck.Optimizer(peer, "training-bench", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                                target_batch_size=TARGET_BATCH, batch_size_per_step=LOCAL_BATCH,
                                average_state_every=AVERAGE_STATE_EVERY, matchmaking_time=args.matchmaking_time,
                                averaging_timeout=args.averaging_timeout)
        closers = [opt.shutdown, peer.shutdown]
        zero_grad = None  # potluck's step consumes the gradients
    say(event="ready", address=address, version=version)
    train_until_stopped(args, model, opt, zero_grad, closers, (x, y, x_test, y_test))


class Digits:
    """The digits task of every training benchmark: a batch, its loss, and the test accuracy the
    target is read against (at each new epoch and at least every EVAL_EVERY seconds)."""

    eval_every = EVAL_EVERY
    eval_at_epochs = True

    def __init__(self, data: tuple, target: float):
        self.x, self.y, self.x_test, self.y_test = data
        self.target = target

    def batch(self, generator: Any, size: int) -> tuple[Any, Any]:
        import torch
        index = torch.randint(0, len(self.y), (size,), generator=generator)
        return self.x[index], self.y[index]

    def loss(self, model: Any, x: Any, y: Any) -> Any:
        import torch
        return torch.nn.functional.cross_entropy(model(x), y)

    def score(self, model: Any) -> float:
        from potluck.cli.tasks import accuracy
        return accuracy(model, self.x_test, self.y_test)

    def reached(self, score: float) -> bool:
        return score >= self.target


def train_until_stopped(args: argparse.Namespace, model: Any, opt: Any, zero_grad: Any, closers: list,
                        data: tuple | None, local_batch: int = LOCAL_BATCH, slowdown: float = 1.0,
                        task: Any = None) -> None:
    """The worker's part after "ready": wait for "go", train and evaluate until "stop", report.

    `opt` needs `step()` and `local_epoch`; `zero_grad`, if not None, is called before each batch;
    with `slowdown` > 1, each batch takes that many times as long (a slower computer). `task`
    (default: the digits of `data`, against args.target) gives the batches, the loss and the score."""
    import torch

    task = task or Digits(data, args.target)
    t0 = float(read_line(WORKER_IDLE_TIMEOUT).split()[1])  # "go <common start, time.time()>"
    stop = threading.Event()
    threading.Thread(target=lambda: (read_line(WORKER_IDLE_TIMEOUT), stop.set()), daemon=True).start()
    generator = torch.Generator().manual_seed(1000 + args.rank)
    samples, last_eval, last_epoch, reached = 0, 0.0, -1, None
    in_step = 0.0  # seconds inside opt.step(): the wrapped optimizer's step, and any wait for the network
    in_step_cpu = 0.0  # of which this thread computed (wall minus CPU: waiting for the network, a core or the GIL)
    thread_cpu, process_cpu = time.thread_time(), time.process_time()  # the loop's CPU, and the process's
    curve: list[tuple[float, int, float]] = []
    error = None
    try:
        while not stop.is_set():
            started = time.perf_counter()
            x, y = task.batch(generator, local_batch)
            if zero_grad is not None:
                zero_grad()
            loss = task.loss(model, x, y)
            loss.backward()
            if slowdown > 1:
                time.sleep((time.perf_counter() - started) * (slowdown - 1))
            stepped, stepped_cpu = time.perf_counter(), time.thread_time()
            opt.step()
            in_step += time.perf_counter() - stepped
            in_step_cpu += time.thread_time() - stepped_cpu
            samples += local_batch
            epoch = opt.local_epoch
            if (epoch != last_epoch and task.eval_at_epochs) or time.monotonic() - last_eval >= task.eval_every:
                last_eval, last_epoch = time.monotonic(), epoch
                score = task.score(model)
                elapsed = time.time() - t0
                curve.append((round(elapsed, 2), epoch, round(score, 4)))
                if reached is None and task.reached(score):
                    reached = elapsed
                    say(event="reached", seconds=elapsed, epoch=epoch, accuracy=score, samples=samples)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        if not stop.is_set():  # after "stop", peers leaving mid-round is the shutdown, not a failure
            error = f"{type(e).__name__}: {e}"
    thread_cpu, process_cpu = time.thread_time() - thread_cpu, time.process_time() - process_cpu
    final = task.score(model)
    say(event="final", accuracy=final, epoch=opt.local_epoch, samples=samples, reached=reached,
        curve=curve[-400:], error=error, in_step_seconds=round(in_step, 2), in_step_cpu_seconds=round(in_step_cpu, 2),
        train_cpu_seconds=round(thread_cpu, 2), process_cpu_seconds=round(process_cpu, 2))
    for close in closers:
        with contextlib.suppress(Exception):
            close()


# == parent side ====================================================================================
def measure(system: str, python: str, peers: int, args: argparse.Namespace, data: str,
            matchmaking_time: float) -> dict:
    base = [python, __file__, "--worker", "hivemind" if system.startswith("hivemind") else "potluck",
            "--data", data, "--target", str(args.target), "--matchmaking-time", str(matchmaking_time),
            "--averaging-timeout", str(args.averaging_timeout)]
    return run_swarm(lambda rank, initial: [*base, "--rank", str(rank), *(["--initial", initial] if initial else [])],
                     peers, args.cap)


def run_swarm(command: Callable[[int, str | None], list[str]], peers: int, cap: float,
              beside: Sequence[list[str]] = ()) -> dict:
    """Start `peers` worker processes (`command(rank, first's address or None)`), then run them
    together from a common start until all reached the target or `cap` seconds passed.

    `beside`: commands of processes that share the machine from the same start (one training
    alone, with a peer's share of the cores), run until they too reach the target or the cap;
    their events come back apart, under "beside" (one dict per command)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    workers: list[Worker] = []
    try:
        workers.append(Worker(command(0, None), env))
        first = workers[0].expect("ready", STARTUP_TIMEOUT)
        for rank in range(1, peers):
            workers.append(Worker(command(rank, first["address"]), env))
        workers.extend(Worker(cmd, env) for cmd in beside)
        for w in workers[1:]:
            w.expect("ready", STARTUP_TIMEOUT)
        t0 = time.time()
        for w in workers:
            w.send(f"go {t0!r}")
        reached: dict[int, dict] = {}
        finals: dict[int, dict] = {}
        while time.time() - t0 < cap and len(reached) < len(workers):
            for i, w in enumerate(workers):
                with contextlib.suppress(queue.Empty):
                    while True:
                        got = w.events.get_nowait()
                        if got is None:
                            raise RuntimeError(f"process {i} exited during training:\n" + "".join(w.stderr[-15:]))
                        if got["event"] == "reached":
                            reached[i] = got
                        elif got["event"] == "final":
                            finals[i] = got
            time.sleep(0.05)
        stopped = time.time() - t0
        for w in workers:
            w.send("stop")
        for i, w in enumerate(workers):
            if i not in finals:
                with contextlib.suppress(RuntimeError):
                    finals[i] = w.expect("final", STOP_TIMEOUT)
        return {"reached": {i: r for i, r in reached.items() if i < peers},
                "finals": {i: f for i, f in finals.items() if i < peers}, "stopped": stopped,
                "version": first.get("version"), "stderr": [w.stderr[-5:] for w in workers],
                "beside": [{"reached": reached.get(i), "final": finals.get(i)} for i in range(peers, len(workers))]}
    finally:
        for w in workers:
            w.kill()


def rows_for(system: str, peers: int, raw: dict, common: dict) -> tuple[list[dict], float | None]:
    times = sorted(r["seconds"] for r in raw["reached"].values())
    finals = raw["finals"]
    first = times[0] if times else None
    params = {"system": system, "peers": peers, **common}
    if raw.get("version"):
        params["version"] = raw["version"]
    errors = sorted({f["error"] for f in finals.values() if f.get("error")})
    epochs = [f["epoch"] for f in finals.values()]
    row = {"metric": "time_to_accuracy", "value": None if first is None else round(first, 2), "unit": "s",
           "measured": "wall time from the common start until the first peer's test accuracy >= target",
           "all_peers_seconds": round(times[-1], 2) if len(times) == peers else None,
           "per_peer_seconds": [round(t, 2) for t in times],
           "epoch_at_target": min((r["epoch"] for r in raw["reached"].values()), default=None),
           "trained_seconds": round(raw["stopped"], 1),
           "final_accuracy": [round(f["accuracy"], 4) for f in finals.values()],
           "final_epochs": epochs, "samples": sum(f["samples"] for f in finals.values()),
           "per_peer_samples": [f["samples"] for f in finals.values()],
           "per_peer_in_step_seconds": [f.get("in_step_seconds") for f in finals.values()],
           **{f"per_peer_{k}": [f.get(k) for f in finals.values()]
              for k in ("in_step_cpu_seconds", "train_cpu_seconds", "process_cpu_seconds")}, **params}
    if first is None:
        row["result"] = f"not reached within {common['cap_s']} s"
    if errors:
        row["error"] = "; ".join(errors)[:2000]
    curves = {i: f.get("curve", []) for i, f in finals.items()}
    curve_row = {"metric": "accuracy_curve", "value": None, "unit": "(s, epoch, test accuracy)",
                 "peer_0": curves.get(0, [])[::max(1, len(curves.get(0, [])) // 40)], **params}
    return [row, curve_row], first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="target 0.85, cap 12 s per system, no hivemind_tuned: about a minute")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--cap", type=float, default=75.0, help="seconds of training per system at most")
    parser.add_argument("--systems", default=None, help="default: potluck,alone,hivemind,hivemind_tuned")
    parser.add_argument("--tuned-matchmaking-time", type=float, default=3.0,
                        help="matchmaking_time of hivemind_tuned (s)")
    parser.add_argument("--matchmaking-time", type=float, default=0.5,
                        help="matchmaking_time of both potluck.Optimizer and hivemind.Optimizer (s)")
    parser.add_argument("--averaging-timeout", type=float, default=20.0,
                        help="averaging_timeout of both optimizers (s)")
    parser.add_argument("--hivemind-python", default=str(DEFAULT_HIVEMIND_PYTHON))
    args = parse_or_run_worker(parser, run_worker, ["potluck", "hivemind"], data=True)
    if args is None:
        return
    if args.quick:
        args.target, args.cap = 0.85, 12.0
    if args.systems is None:
        args.systems = "potluck,alone,hivemind" + ("" if args.quick else ",hivemind_tuned")
    import torch

    from potluck.cli.tasks import load_data
    common = {"target": args.target, "cap_s": args.cap, "target_batch_size": TARGET_BATCH,
              "batch_size_per_step": LOCAL_BATCH, "lr": LR, "optimizer": "Adam",
              "average_state_every": AVERAGE_STATE_EVERY, "matchmaking_time": args.matchmaking_time,
              "averaging_timeout": args.averaging_timeout, "torch_threads_per_process": 1,
              "schedule": "systems run one after another", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/training.py", *sys.argv[1:]])}
    figures: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "digits.pt")
        torch.save(load_data(), data)  # the hivemind venv has no scikit-learn: every process loads this
        for system in args.systems.split(","):
            peers = 1 if system == "alone" else args.peers
            hive = system.startswith("hivemind")
            python = args.hivemind_python if hive else sys.executable
            mm = args.tuned_matchmaking_time if system == "hivemind_tuned" else args.matchmaking_time
            params = {"system": system, "peers": peers, **common, "matchmaking_time": mm}
            if hive and not Path(python).exists():
                emit({"metric": "time_to_accuracy", "value": None, "unit": "s", **params,
                      "error": f"no {python}; create it with scripts/hivemind-venv.sh"})
                continue
            try:
                raw = measure(system, python, peers, args, data, mm)
            except Exception as e:  # noqa: BLE001 - report and go on with the other systems
                emit({"metric": "time_to_accuracy", "value": None, "unit": "s", **params,
                      "error": f"{type(e).__name__}: {e}"[-3000:]})
                continue
            rows, figures[system] = rows_for(system, peers, raw, {**common, "matchmaking_time": mm})
            for row in rows:
                emit(row)
    for other in ("hivemind", "hivemind_tuned", "alone"):
        if "potluck" not in figures or other not in figures:
            continue
        row = {"metric": "time_to_accuracy_ratio", "value": None, "unit": f"{other}/potluck", "peers": args.peers,
               **common}
        if other == "hivemind_tuned":
            row["hivemind_matchmaking_time"] = args.tuned_matchmaking_time
        if figures["potluck"] and figures[other]:
            row["value"] = round(figures[other] / figures["potluck"], 2)
        elif figures["potluck"]:
            row["at_least"] = round(args.cap / figures["potluck"], 2)
            row["note"] = f"{other} did not reach the target within {args.cap} s"
        else:
            row["note"] = "potluck did not reach the target within the cap"
        emit(row)

if __name__ == "__main__":
    main()
