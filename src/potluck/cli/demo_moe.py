"""`potluck demo --mode moe`: two expert servers and two trainers learn digits with a remote MoE layer.

Each trainer's model is input layer -> RemoteMixtureOfExperts over a 2x4 grid of ffn experts ->
classifier. The experts live on two expert-server processes (grid rows 0 and 1) and learn from
both trainers' gradients with the servers' own optimizers; the trainers' own parameters (input
layer, gate, classifier) are trained data parallel with `potluck.Optimizer` (sync mode), so after
every update both take they are the same on both trainers. Midway one server is killed: its
experts vanish from the DHT and the trainers go on with the survivors. The parent prints a
progress line and writes report.json and loss.png.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from potluck.cli.processes import WorkerProcess, missing_demo_packages, spawn
from potluck.cli.tasks import accuracy, load_data

REPORT_KEYS = ("test_accuracy", "experts_alive_at_end", "experts_at_start", "trainer_accuracies", "killed",
               "wall_seconds", "steps", "experts_per_sample", "loss_curves", "shared_parameters")
GRID = (2, 4)
HIDDEN = 64
BATCH = 32
K_BEST = 4
TRAINERS = 2
LEARNING_RATE = 3e-3
# Samples per epoch of the trainers' shared parameters (sync mode: their gradients are averaged
# and every trainer takes the same step): 4 local batches each, so a round (tens of ms here) is a
# small share of the time, while the gate still steps often enough to keep up with the experts.
TARGET_BATCH = BATCH * 4 * TRAINERS
# Every trainer builds its shared parameters from this seed: they start equal (a late trainer
# would download them from the others instead).
SHARED_SEED = 0
EXPERT_LEARNING_RATE = 1e-3
# Announcements expire this long after a server dies, so the demo sees its experts disappear.
ANNOUNCE_TTL = 6.0
# Per-call deadlines of the trainers' MoE layer: a killed server is noticed at once (connection
# reset); a frozen one would be dropped after this.
CALL_TIMEOUT = 5.0
# How long the parent waits for a process to start or to finish its last evaluation.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


# -- workers ------------------------------------------------------------------------------------------
def _emit(message: dict) -> None:
    print(json.dumps(message), flush=True)


def _stop_event() -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    return stop


def _server(spec: dict) -> int:
    import torch

    import potluck
    from potluck.moe import ExpertServer
    torch.set_num_threads(1)
    stop = _stop_event()
    initial = [spec["initial_peer"]] if spec.get("initial_peer") else []
    uids = [f"ffn.{spec['row']}.{j}" for j in range(GRID[1])]
    with potluck.Peer(initial_peers=initial, host="127.0.0.1") as peer, ExpertServer.from_type(
            peer, uids, "ffn", HIDDEN, lambda p: torch.optim.Adam(p, EXPERT_LEARNING_RATE), seed=spec["row"] * 100,
            announce_ttl=ANNOUNCE_TTL) as server:
        _emit({"address": peer.addresses[0], "experts": uids})
        while not stop.wait(1.0):
            stats = server.stats.values()
            _emit({"calls": sum(s.forward_calls + s.backward_calls for s in stats),
                   "updates": sum(s.updates for s in stats), "time": time.time()})
    return 0


def _model(peer: Any) -> tuple[Any, Any]:
    from torch import nn

    from potluck.moe import RemoteMixtureOfExperts
    moe = RemoteMixtureOfExperts(peer, HIDDEN, GRID, "ffn", k_best=K_BEST, k_min=1,
                                 forward_timeout=CALL_TIMEOUT, backward_timeout=CALL_TIMEOUT)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), moe, nn.Linear(HIDDEN, 10)), moe


def _shared_optimizer(peer: Any, model: Any) -> Any:
    """Sync data parallelism over the trainer's own parameters (the gate among them); experts are
    not among them: their servers train them."""
    import torch

    from potluck.optim import Optimizer
    return Optimizer(peer, "moe-demo", model.parameters(), lambda p: torch.optim.Adam(p, LEARNING_RATE),
                     target_batch_size=TARGET_BATCH, batch_size_per_step=BATCH, mode="sync",
                     matchmaking_time=0.5, averaging_timeout=20.0)


async def _alive_experts(peer: Any) -> list[str]:
    """Experts the DHT lists under the grid that also answer a call now."""
    import asyncio

    from potluck.moe.expert import ainfo
    from potluck.moe.grid import GridDirectory
    directory = GridDirectory(peer.dht, 0.0, CALL_TIMEOUT)
    rows = (await directory.children(["ffn."]))["ffn."]
    keys = [f"ffn.{r}." for r in sorted(rows)]
    locations = [loc for entries in (await directory.children(keys)).values() for loc in entries.values()
                 if loc is not None]
    answers = await asyncio.gather(*(ainfo(peer.transport, loc, CALL_TIMEOUT) for loc in locations),
                                   return_exceptions=True)
    return sorted(loc.uid for loc, a in zip(locations, answers, strict=True) if not isinstance(a, BaseException))


def _trainer(spec: dict) -> int:
    import torch

    import potluck
    from potluck.cli.ps import params_digest
    from potluck.moe import NotEnoughExperts
    torch.set_num_threads(1)
    stop = _stop_event()
    x, y, x_test, y_test = load_data()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    # Not client mode: the trainers average their shared parameters with each other.
    with potluck.Peer(initial_peers=spec["initial_peers"], host="127.0.0.1") as peer:
        torch.manual_seed(SHARED_SEED)
        model, moe = _model(peer)
        opt = _shared_optimizer(peer, model)
        _emit({"address": peer.addresses[0], "experts_at_start": len(peer.run(_alive_experts(peer), 30))})
        generator = torch.Generator().manual_seed(spec["seed"])
        # The shared parameters after each epoch this trainer reached by an update (a round
        # with the other, or alone). One that reached an epoch by catching up (it started late,
        # or missed a round) holds no update of it: a state download, or its own parameters
        # until its next round repairs them (sync mode's rejoin), so those are not compared.
        digests: dict[int, str] = {}
        updates: set[int] = set()
        opt.register_epoch_hook(lambda event: updates.add(event.epoch) if event.how == "update" else None)
        loss_ema, step, failed, last, started = None, 0, 0, 0.0, time.time()
        while not stop.is_set():
            batch = torch.randint(0, len(y), (BATCH,), generator=generator)
            try:
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            except NotEnoughExperts:
                failed += 1  # every expert of some sample failed at once; skip this batch
                continue
            loss.backward()
            epoch = opt.local_epoch
            opt.step()
            if opt.local_epoch != epoch and opt.local_epoch in updates:
                digests[opt.local_epoch] = params_digest(list(model.parameters()))
            step += 1
            loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
            if time.monotonic() - last > 0.5:
                last = time.monotonic()
                _emit({"step": step, "loss": loss_ema, "experts_per_sample": moe.last_answered,
                       "sps": step * BATCH / (time.time() - started), "time": time.time()})
        opt.shutdown()
        model.eval()
        alive = peer.run(_alive_experts(peer), 60)
        _emit({"final": True, "accuracy": accuracy(model, x_test, y_test), "step": step, "failed_batches": failed,
               "experts_alive": alive, "digests": digests})
    return 0


# -- the parent -----------------------------------------------------------------------------------------
def _spawn(name: str, role: str, spec: dict, out: Path) -> WorkerProcess:
    return spawn(name, role, ["demo", "--mode", "moe", "--worker", json.dumps({"role": role, **spec})], out,
                 needs_final=role != "server")


def _ready(worker: WorkerProcess, out: Path) -> None:
    if not worker.ready.wait(START_TIMEOUT) or not worker.hello:
        raise RuntimeError(f"{worker.name} failed to start; see {out}/{worker.name}.log")


def _line(workers: list[WorkerProcess], elapsed: float) -> str:
    parts = [f"{elapsed:4.0f}s"]
    for w in workers:
        if w.role == "trainer" and "loss" in w.last:
            parts.append(f"{w.name} step {w.last['step']} loss {w.last['loss']:.3f} "
                         f"experts/sample {w.last['experts_per_sample']:.1f}")
        elif w.role == "server":
            parts.append(f"{w.name} {w.status}" + (f" ({w.last.get('updates', 0)} updates)" if w.last else ""))
        else:
            parts.append(f"{w.name} {w.status}")
    return " | ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        spec = json.loads(args.worker)
        return _server(spec) if spec["role"] == "server" else _trainer(spec)
    if missing_demo_packages("matplotlib", "sklearn"):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(f"potluck demo (moe): 2 expert servers host a {GRID[0]}x{GRID[1]} grid of experts; 2 trainers learn "
          f"digits through them for {args.duration:.0f} s" + ("" if args.no_churn else "; one server is killed midway")
          + f"; logs in {out}/", flush=True)
    workers: list[WorkerProcess] = []
    killed = None
    try:
        first = _spawn("server-0", "server", {"row": 0}, out)
        workers.append(first)
        _ready(first, out)
        workers.append(_spawn("server-1", "server", {"row": 1, "initial_peer": first.hello["address"]}, out))
        _ready(workers[1], out)
        addresses = [w.hello["address"] for w in workers]
        workers += [_spawn(f"trainer-{i}", "trainer", {"seed": i, "initial_peers": addresses}, out)
                    for i in range(TRAINERS)]
        for w in workers[2:]:
            _ready(w, out)
        training_started, last_line = time.time(), 0.0
        while (elapsed := time.time() - training_started) < args.duration:
            if not args.no_churn and killed is None and elapsed > 0.5 * args.duration:
                killed = workers[1]
                killed.proc.send_signal(signal.SIGKILL)
                killed.status = "killed"
                print(f"{elapsed:4.0f}s killed server-1 (experts ffn.1.*); the trainers go on with server-0",
                      flush=True)
            if time.time() - last_line > 5:
                last_line = time.time()
                print(_line(workers, elapsed), flush=True)
            time.sleep(0.25)
        # Trainers first, all at once (one left alone would wait for the other in its next
        # round); they evaluate while the surviving server still runs.
        for group in (workers[2:], workers[:2]):
            for w in group:
                if w.proc.poll() is None:
                    w.proc.stdin.write("stop\n")
                    w.proc.stdin.flush()
            for w in group:
                if w.status != "killed":
                    w.proc.wait(STOP_TIMEOUT)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    return _report(args, out, workers, started, killed)


def _report(args: argparse.Namespace, out: Path, workers: list[WorkerProcess], started: float,
            killed: WorkerProcess | None) -> int:
    trainers = [w for w in workers if w.role == "trainer"]
    if not trainers or any(t.final is None for t in trainers):
        print(f"the demo failed: a trainer did not finish; see the logs in {out}/", file=sys.stderr)
        return 1
    alive = sorted(set().union(*(t.final["experts_alive"] for t in trainers)))
    report = {
        "test_accuracy": round(sum(t.final["accuracy"] for t in trainers) / len(trainers), 4),
        "experts_alive_at_end": len(alive),
        "experts_alive": alive,
        "experts_at_start": max(t.hello.get("experts_at_start", 0) for t in trainers),
        "trainer_accuracies": {t.name: round(t.final["accuracy"], 4) for t in trainers},
        "killed": killed.name if killed else None,
        "wall_seconds": round(time.time() - started, 1),
        "steps": {t.name: t.final["step"] for t in trainers},
        "failed_batches": {t.name: t.final["failed_batches"] for t in trainers},
        "experts_per_sample": {t.name: t.last.get("experts_per_sample") for t in trainers},
        "mode": "moe", "grid": list(GRID), "k_best": K_BEST,
        "loss_curves": {t.name: t.curve for t in trainers},
        "shared_parameters": _shared_parameters(trainers),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out / "loss.png", trainers, started, killed)
    each = ", ".join(f"{k} {v:.1%}" for k, v in report["trainer_accuracies"].items())
    print(f"\ntest accuracy {report['test_accuracy']:.1%} ({each}); "
          f"experts alive at the end: {report['experts_alive_at_end']} of {report['experts_at_start']}")
    shared = report["shared_parameters"]
    if shared["last_epoch"] is not None:
        print(f"shared parameters (input layer, gate, classifier): the trainers' sha256 digests "
              f"{'agree' if shared['agree_at_last_epoch'] else 'DIFFER'} after epoch {shared['last_epoch']} "
              f"(they agreed after {shared['epochs_agreeing']} of the {shared['epochs_compared']} updates "
              f"all took)")
    print(f"report: {out / 'report.json'}, plot: {out / 'loss.png'} ({report['wall_seconds']} s)")
    return 0


def _shared_parameters(trainers: list[WorkerProcess]) -> dict:
    """Whether the trainers' shared parameters were identical after the updates they all took
    (one may have started or stopped an epoch later than another, or caught up with a round it
    missed, so the last common one is compared)."""
    digests = [{int(e): d for e, d in t.final["digests"].items()} for t in trainers]
    common = sorted(set.intersection(*(set(d) for d in digests)))
    agreeing = [e for e in common if len({d[e] for d in digests}) == 1]
    last = common[-1] if common else None
    return {"last_epoch": last, "agree_at_last_epoch": last in agreeing, "epochs_compared": len(common),
            "epochs_agreeing": len(agreeing), "digest": digests[0][last] if last is not None else None}


def _plot(path: Path, trainers: list[WorkerProcess], started: float, killed: WorkerProcess | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t in trainers:
        if t.curve:
            times, loss = zip(*t.curve, strict=True)
            ax.plot([s - started for s in times], loss, label=t.name)
    if killed is not None and killed.last.get("time"):
        ax.axvline(killed.last["time"] - started, color="red", linestyle="--", label="server-1 killed")
    ax.set_xlabel("seconds")
    ax.set_ylabel("training loss (moving average)")
    ax.set_yscale("log")
    ax.set_title("potluck demo (moe): trainers sharing remote experts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
