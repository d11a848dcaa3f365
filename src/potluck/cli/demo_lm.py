"""`potluck demo --task lm`: a local swarm of peer processes trains a byte-level language model
on the Python standard library's source (potluck.workloads.lm), beside one process alone.

Every peer trains the same small GPT with `potluck.Optimizer` (the swarm's global batch, or its
inner steps); a separate process trains it with the same Adam alone (in sync mode on batches of the
swarm's global size). Every few seconds each measures its validation loss on the
same held-out windows. The parent shows a progress line and writes report.json (validation loss
and bits per byte of both, against wall time and against samples processed) and lm.png.
The peers' worker (`_worker`) is also what benchmarks/lm.py starts, with other optimizer options.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from potluck.cli.processes import WorkerProcess, missing_demo_packages, spawn, verdict

REPORT_KEYS = ("val_loss", "bits_per_byte", "single_peer_val_loss", "single_peer_bits_per_byte", "verdict",
               "unigram_bits_per_byte", "at_equal_samples", "samples", "single_peer_samples", "wall_seconds",
               "mode", "peers", "model", "data", "bytes_sent_per_sample", "curves")
LOCAL_BATCH = 16  # windows per step() on each peer
LEARNING_RATE = 3e-3  # Adam; higher rates stall this model at the unigram loss for minutes
# Sync mode's global batch (one epoch): a few local batches per peer, so the swarm steps often
# while one averaging round still carries several peers' samples.
TARGET_BATCH = 128
DILOCO_LOCAL_STEPS = 20  # inner steps between DiLoCo's outer steps
# DiLoCo's outer step for a run this short (about 40 outer steps): the plain average of the peers'
# changes, each round travelling while the peers take OUTER_DELAY more inner steps. The paper's
# Nesterov momentum 0.9 (the library's default, for long runs) left the swarm behind one process
# alone (2.31 against 1.68 nats); with these the swarm is ahead (docs/diloco.md, choosing the outer
# settings; benchmarks/diloco_settings.py).
OUTER_LR, OUTER_MOMENTUM, OUTER_DELAY = 1.0, 0.0, 4
# Seconds a round waits for its group: peers that share two busy cores reach a round seconds apart;
# with 0.5 s, 8 of the default demo's DiLoCo rounds failed and the late peers downloaded the state.
MATCHMAKING_TIME = 2.0
# Seconds between validation measurements: often enough for a curve, rare enough to cost
# under a tenth of a peer's compute (one evaluation is about two training steps).
EVAL_INTERVAL = 4.0
# How long the parent waits for a process to start (import torch, read the corpus, join) or to
# finish its last evaluation after being told to stop.
START_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
# DiLoCo reached a lower validation loss than sync mode in the same wall time on a busy 2-core
# machine (the default 4 peers, 150 s: 2.45 against 2.52 nats per byte), at a seventh of the bytes
# per sample (docs/benchmarks.md, "potluck demo --task lm").
DEFAULT_MODE = "diloco"
DEFAULT_DURATION = 150.0  # seconds of training: about 3 minutes in all on a 2-core machine


def optimizer_options(mode: str) -> dict:
    """potluck.Optimizer's options for the demo's modes (benchmarks/lm.py passes its own)."""
    # load_state=False: every peer builds the same initial model and all start training together,
    # so there is no state to download (a search for donors would only delay the start)
    options = {"mode": mode, "target_batch_size": TARGET_BATCH, "matchmaking_time": MATCHMAKING_TIME,
               "averaging_timeout": 20.0, "load_state": False}
    if mode in ("diloco", "moshpit"):
        options["local_steps"] = DILOCO_LOCAL_STEPS
    if mode == "diloco":
        options.update(outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, outer_delay=OUTER_DELAY)
    return options


# -- the worker: one peer (or the lone process) ------------------------------------------------------
def _emit(message: dict) -> None:
    print(json.dumps(message), flush=True)


def _worker(spec: dict) -> int:
    """Train until told to stop (a line on stdin) or until spec's max_samples; emit JSON rows."""
    import threading

    import torch

    import potluck
    from potluck.workloads import lm
    torch.set_num_threads(1)
    go, stop = threading.Event(), threading.Event()

    def follow_parent() -> None:  # the first line says go (all are ready), the second stop
        sys.stdin.readline()
        go.set()
        sys.stdin.readline()
        stop.set()
    threading.Thread(target=follow_parent, daemon=True).start()
    corpus = lm.load_corpus()
    config = lm.LMConfig(**spec.get("model", {}))
    sample = lm.validation_sample(corpus, config.context)
    model = lm.make_lm(config)
    data = lm.batches(corpus, LOCAL_BATCH, config.context, rank=spec["rank"], seed=spec.get("seed", 0))
    max_samples = spec.get("max_samples") or math.inf
    options = dict(spec["options"])
    peer = opt = None
    if spec["role"] == "alone":
        opt = torch.optim.Adam(model.parameters(), LEARNING_RATE)
        _emit({"address": None})
    else:
        peer = potluck.Peer(initial_peers=[spec["initial_peer"]] if spec.get("initial_peer") else [], host="127.0.0.1")
        opt = potluck.Optimizer(peer, spec.get("run_id", "lm"), model.parameters(),
                                lambda p: torch.optim.Adam(p, LEARNING_RATE), batch_size_per_step=LOCAL_BATCH,
                                **options)
        _emit({"address": peer.addresses[0], "peer_id": peer.peer_id})
    # alone: one Adam step per `accumulate` local batches, the global batch the swarm steps on
    accumulate = options.get("target_batch_size", LOCAL_BATCH) // LOCAL_BATCH if options.get("mode") == "sync" else 1
    go.wait()
    samples, steps, started, last_eval, last_row = 0, 0, time.time(), -math.inf, 0.0
    wire_at_go = (peer.stats.bytes_sent, peer.stats.bytes_received) if peer else (0, 0)

    def row(**extra: float) -> dict:  # bytes: the wire's since go (training, not joining)
        sent = peer.stats.bytes_sent - wire_at_go[0] if peer else 0
        return {"samples": samples, "epoch": opt.local_epoch if peer else steps // accumulate,
                "sps": samples / max(time.time() - started, 1e-9), "bytes_sent": sent, "time": time.time(), **extra}
    try:
        while not stop.is_set() and samples < max_samples:
            if time.monotonic() - last_eval >= EVAL_INTERVAL:
                last_eval = time.monotonic()
                _emit(row(loss=lm.evaluate(model, sample)["val_loss"]))  # "loss": the parent's curve
            x, y = next(data)
            (lm.lm_loss(model, x, y) / (1 if peer else accumulate)).backward()
            samples += LOCAL_BATCH
            steps += 1
            if peer or steps % accumulate == 0:
                opt.step()
                opt.zero_grad()
            if time.monotonic() - last_row > 0.5:
                last_row = time.monotonic()
                _emit(row())
        result = lm.evaluate(model, sample)
        final = row(**result, final=True, train_seconds=time.time() - started)
        if peer:
            final["bytes_received"] = peer.stats.bytes_received - wire_at_go[1]
        _emit(final)
    finally:
        if peer:
            opt.shutdown()
            peer.shutdown()
    return 0


# -- the parent -----------------------------------------------------------------------------------------
def start_worker(name: str, spec: dict, out: Path) -> WorkerProcess:
    """One worker process (`potluck demo --task lm --worker SPEC`), followed by the parent."""
    return spawn(name, spec["role"], ["demo", "--task", "lm", "--worker", json.dumps(spec)], out)


def wait_ready(worker: WorkerProcess, out: Path) -> None:
    if not worker.ready.wait(START_TIMEOUT) or (worker.role != "alone" and not worker.address):
        raise RuntimeError(f"{worker.name} failed to start; see {out}/{worker.name}.log")


def tell(workers: list[WorkerProcess], word: str) -> None:
    """A line to every worker still running: the first one is go (start training), the second stop."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.stdin.write(word + "\n")
            w.proc.stdin.flush()


def stop_all(workers: list[WorkerProcess]) -> None:
    """Tell every worker to stop, wait for their final rows, and kill whoever does not exit."""
    tell(workers, "stop")
    deadline = time.time() + STOP_TIMEOUT
    for w in workers:
        try:
            w.proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:  # a stuck worker: killed below
            pass
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        return _worker(json.loads(args.worker))
    if missing_demo_packages("matplotlib"):
        return 2
    if args.peers < 2:
        print("--peers must be at least 2", file=sys.stderr)
        return 2
    mode = args.mode or DEFAULT_MODE
    if mode not in ("sync", "moshpit", "diloco"):
        print("--task lm trains with --mode sync, moshpit or diloco", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else DEFAULT_DURATION
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(f"potluck demo (lm): {args.peers} peers train a byte-level GPT on the Python standard library "
          f"({mode} mode, {duration:.0f} s), one process trains it alone; logs in {out}/", flush=True)
    options = optimizer_options(mode)
    workers: list[WorkerProcess] = []
    history: list[tuple[float, dict[str, int]]] = []  # (time, samples of each worker so far)
    # the lone process needs no address: it starts beside the first peer (and is listed last)
    alone = start_worker("alone", {"role": "alone", "rank": 0, "options": options}, out)
    try:
        first = start_worker("peer-0", {"role": "node", "rank": 0, "options": options}, out)
        workers.append(first)
        wait_ready(first, out)
        workers += [start_worker(f"peer-{i}", {"role": "node", "rank": i, "options": options,
                                               "initial_peer": first.address}, out) for i in range(1, args.peers)]
        workers.append(alone)
        for w in workers:
            wait_ready(w, out)
        tell(workers, "go")
        training_started, last_line = time.time(), 0.0
        while (elapsed := time.time() - training_started) < duration:
            history.append((time.time(), {w.name: w.last.get("samples", 0) for w in workers}))
            if time.time() - last_line > 10:
                last_line = time.time()
                print(_line(workers, elapsed), flush=True)
            time.sleep(0.25)
        stop_all(workers)
    finally:
        for w in [*workers, alone]:
            if w.proc.poll() is None:
                w.proc.kill()
    return _report(args, mode, duration, out, workers, history, started, training_started)


def _line(workers: list[WorkerProcess], elapsed: float) -> str:
    parts = [f"{elapsed:4.0f}s"]
    for w in workers:
        loss = f" val loss {w.curve[-1][1]:.3f}" if w.curve else ""
        parts.append(f"{w.name} {w.status} {w.last.get('samples', 0)} samples{loss}")
    return " | ".join(parts)


def _samples_at(history: list[tuple[float, dict[str, int]]], names: list[str], t: float) -> int:
    """Samples the named workers had processed by time t (from the parent's 4 Hz record)."""
    i = bisect.bisect_right([h[0] for h in history], t)
    return sum(history[max(i - 1, 0)][1].get(n, 0) for n in names) if history else 0


def _at_samples(curve: list[dict], samples: int) -> float | None:
    """The validation loss a curve had reached when it had processed `samples` (interpolated)."""
    for a, b in zip(curve, curve[1:], strict=False):
        if a["samples"] <= samples <= b["samples"]:
            f = (samples - a["samples"]) / max(b["samples"] - a["samples"], 1)
            return a["val_loss"] + f * (b["val_loss"] - a["val_loss"])
    return None


def _report(args: argparse.Namespace, mode: str, duration: float, out: Path, workers: list[WorkerProcess],
            history: list[tuple[float, dict[str, int]]], started: float, training_started: float) -> int:
    from potluck.workloads import lm
    swarm = [w for w in workers if w.role != "alone" and w.final]
    alone = workers[-1] if workers and workers[-1].role == "alone" else None
    if not swarm or alone is None or alone.final is None:
        print(f"the demo failed: a process did not finish; see the logs in {out}/", file=sys.stderr)
        return 1
    corpus = lm.load_corpus()
    names = [w.name for w in swarm]
    first = workers[0]  # peer-0's curve stands for the swarm (in sync mode all peers hold the same model)
    began = training_started  # curves count seconds of training (not the processes' start-up)
    curves = {
        "swarm": [{"seconds": round(t - began, 2), "samples": _samples_at(history, names, t), "val_loss": v}
                  for t, v in first.curve],
        "alone": [{"seconds": round(t - began, 2), "samples": _samples_at(history, ["alone"], t), "val_loss": v}
                  for t, v in alone.curve]}
    final_samples = sum(w.final["samples"] for w in swarm)
    curves["swarm"].append({"seconds": round(first.final["time"] - began, 2), "samples": final_samples,
                            "val_loss": first.final["val_loss"]})
    curves["alone"].append({"seconds": round(alone.final["time"] - began, 2), "samples": alone.final["samples"],
                            "val_loss": alone.final["val_loss"]})
    val_loss = sum(w.final["val_loss"] for w in swarm) / len(swarm)
    report = {
        "val_loss": round(val_loss, 4), "bits_per_byte": round(val_loss / math.log(2), 4),
        "single_peer_val_loss": round(alone.final["val_loss"], 4),
        "single_peer_bits_per_byte": round(alone.final["bits_per_byte"], 4),
        "unigram_bits_per_byte": round(lm.unigram_entropy(corpus) / math.log(2), 4),
        # the swarm's loss when it had processed as many samples as the lone process did in all
        "at_equal_samples": {"samples": alone.final["samples"],
                             "swarm_val_loss": _at_samples(curves["swarm"], alone.final["samples"]),
                             "single_peer_val_loss": alone.final["val_loss"]},
        "verdict": verdict(val_loss, alone.final["val_loss"], "validation loss"),
        "samples": final_samples, "single_peer_samples": alone.final["samples"],
        "wall_seconds": round(time.time() - started, 1), "training_seconds": duration,
        "mode": mode, "peers": args.peers, "model": vars(lm.LMConfig()), "data": corpus.describe(),
        "bytes_sent_per_sample": round(sum(w.final["bytes_sent"] for w in swarm) / max(final_samples, 1), 1),
        "curves": curves,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out / "lm.png", curves, report)
    print(f"\nswarm: validation loss {report['val_loss']:.3f} ({report['bits_per_byte']:.2f} bits/byte) after "
          f"{final_samples} samples; one process alone: {report['single_peer_val_loss']:.3f} "
          f"({report['single_peer_bits_per_byte']:.2f} bits/byte) after {alone.final['samples']} samples; "
          f"unigram entropy {report['unigram_bits_per_byte']:.2f} bits/byte")
    print(report["verdict"])
    print(f"report: {out / 'report.json'}, plot: {out / 'lm.png'} ({report['wall_seconds']} s)")
    return 0


def _plot(path: Path, curves: dict, report: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for name, points in curves.items():
        style = {"color": "black", "linewidth": 2.5} if name == "alone" else {"color": "tab:blue"}
        label = "one process alone" if name == "alone" else f"swarm of {report['peers']} ({report['mode']})"
        loss = [p["val_loss"] for p in points]
        axes[0].plot([p["seconds"] for p in points], loss, label=label, **style)
        axes[1].plot([p["samples"] for p in points], loss, label=label, **style)
    for ax in axes:
        ax.axhline(report["unigram_bits_per_byte"] * math.log(2), color="gray", linestyle=":",
                   label="unigram entropy")
    axes[0].set_xlabel("seconds of training")
    axes[1].set_xlabel(f"samples processed (windows of {report['model']['context']} bytes; swarm: all peers)")
    axes[0].set_ylabel("validation loss (nats per byte)")
    axes[1].legend()
    fig.suptitle("potluck demo --task lm: byte-level GPT on the Python standard library")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["REPORT_KEYS", "optimizer_options", "run", "start_worker", "stop_all", "wait_ready"]
