"""Soak benchmark: the hours-long runs of issue 12, made short. Does memory stay flat, do epochs keep
coming, do the peers stay identical?

Two scenarios, run one after another (the standard machine has 2 cores):

  processes  2 peer processes over TCP + TLS on 127.0.0.1, `potluck.Optimizer` in sync mode on a
             1.7M-parameter MLP (256-2048-512-256-10, random data), Adam(1e-3), target_batch_size=64,
             batch_size_per_step=16 (an epoch every 2 steps of each peer). The parent samples each
             process's RSS from /proc every --sample seconds.
  emulated   4 `potluck.Optimizer` peers in one process on `potluck.net.emulated` (10 ms links,
             100 MB/s), real time, each training in its own thread, same model and settings; RSS is
             the whole process's. (The virtual clock does not fit here: step() blocks a thread
             while the loop waits, and virtual time would jump past every deadline meanwhile.)

Each peer records the time of every epoch it reaches and the digest of its parameters at that
epoch. After --minutes of training the peers are told to finish at the swarm's epoch + 10, and their
digests at that epoch are compared.

Figures per scenario (one JSON object per line):
  rss_growth_after_warmup  MB: the peak RSS after --warmup seconds minus the peak RSS before (per
                           peer process; "peer": "all" for the emulated process)
  heap_growth_after_warmup MB: the same for the memory malloc has handed out and not had back (glibc's
                           mallinfo2: heap and mmapped chunks in use; null elsewhere). A leak grows
                           both; RSS growing alone is freed memory glibc keeps (fragmented arenas,
                           which `malloc_trim` would return), not a leak
  epochs_per_minute        epochs the swarm advanced per minute of training
  longest_stall            s: the longest time a peer saw no new epoch (from the start to the stop)
  params_identical         true if every peer's parameters have one digest at the final epoch
                           (null under --mode streaming, whose local parameters differ)
  catch_ups                state downloads of peers that fell behind: read RSS with it (see the row)
  rss_over_time            the samples: [seconds since start, MB, epoch]; heap_over_time likewise

Usage: python benchmarks/soak.py [--quick] [--minutes 10] [--warmup S] [--sample S]
           [--scenarios processes,emulated] [--mode sync|diloco|streaming] [--plot rss.png]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import hashlib
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from peer_processes import Worker, parse_or_run_worker
from training import ROOT, STARTUP_TIMEOUT, WORKER_IDLE_TIMEOUT, emit, read_line, say

MLP_SIZES = (256, 2048, 512, 256, 10)  # 1.7M parameters: the case issue 12 was measured on
LR = 1e-3
TARGET_BATCH = 64
LOCAL_BATCH = 16
PROCESS_PEERS = 2
EMULATED_PEERS = 4
EMULATED_LATENCY = 0.01  # s one way, a home connection
EMULATED_BANDWIDTH = 100e6  # bytes/s each way
FINISH_EPOCHS = 10  # the peers finish at the swarm's epoch + this: ~1 s of epochs, so that the order reaches
# every peer before it passes that epoch (the parent sees epochs up to 0.1 s late; a busy peer reads late)
FINISH_TIMEOUT = 60.0  # s for every peer to reach the finish epoch; past it, digests are compared as they are
MAX_WARMUP = 60.0  # s: Adam's state, averager buffers and connections are all made within the first epochs
MIN_WARMUP = 8.0  # s: RSS climbs for the first ~5 s (imports done, first rounds) even in short runs
WARMUP_FRACTION = 0.2  # of the run, when --warmup is not given (within MIN_WARMUP..MAX_WARMUP)
DEFAULT_SAMPLE = 2.0  # s between RSS samples
QUICK_SECONDS = 18.0  # per scenario: both under a minute
# --mode: the Optimizer's options. DiLoCo's rounds and Streaming DiLoCo's fragments, delayed
# landings and 4-bit codec keep state of their own (outer points, error feedback, the record of
# deviations per fragment) that sync mode never makes.
MODES = {"sync": {},
         "diloco": {"mode": "diloco", "local_steps": 8},
         "streaming": {"mode": "diloco", "local_steps": 8, "fragments": 2, "outer_delay": 2,
                       "outer_compression": "blockwise4"}}
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def make_mlp() -> Any:
    import torch
    torch.manual_seed(0)  # every peer starts from the same parameters
    layers: list[Any] = []
    for a, b in zip(MLP_SIZES, MLP_SIZES[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def digest(model: Any) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def rss_mb(pid: int | str = "self") -> float | None:
    """Resident set size of a process from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_MB
    except (OSError, IndexError, ValueError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_mb() -> float | None:
    """MB that glibc's malloc has handed out and not had back, heap and mmapped chunks (tensors,
    large buffers; Python's small objects live in arenas of their own): what this process holds.
    None without glibc 2.33's mallinfo2."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


class Trainer:
    """One peer's training loop: random batches, `opt.step()`, a record of every epoch reached."""

    def __init__(self, model: Any, opt: Any, seed: int, t0: float, on_epoch: Callable[[float, int], None]):
        import torch
        self.model, self.opt, self.t0, self.on_epoch = model, opt, t0, on_epoch
        self.generator = torch.Generator().manual_seed(seed)
        self.digests: dict[int, str] = {}
        self.finish_at: int | None = None
        self.finish_deadline = float("inf")
        self.stop = threading.Event()
        self.error: str | None = None

    def finish(self, epoch: int) -> None:
        self.finish_deadline = time.time() + FINISH_TIMEOUT
        self.finish_at = epoch

    def run(self) -> None:
        import torch
        epoch = self.opt.local_epoch
        try:
            while not self.stop.is_set():
                if self.finish_at is not None and (epoch >= self.finish_at or time.time() > self.finish_deadline):
                    if self.finish_at not in self.digests:
                        self.error = self.error or f"stopped at epoch {epoch} without a digest at {self.finish_at}"
                    break
                x = torch.randn(LOCAL_BATCH, MLP_SIZES[0], generator=self.generator)
                y = torch.randint(0, MLP_SIZES[-1], (LOCAL_BATCH,), generator=self.generator)
                torch.nn.functional.cross_entropy(self.model(x), y).backward()
                self.opt.step()
                if self.opt.local_epoch != epoch:
                    epoch = self.opt.local_epoch
                    if self.finish_at is not None:  # digests only where they are compared: hashing costs
                        self.digests[epoch] = digest(self.model)
                    self.on_epoch(time.time() - self.t0, epoch)
        except Exception as e:  # noqa: BLE001 - reported with the figures
            self.error = f"{type(e).__name__}: {e}"


# == worker process (scenario "processes") ========================================================
def run_worker(args: argparse.Namespace) -> None:
    import torch

    import potluck
    torch.set_num_threads(1)
    model = make_mlp()
    with potluck.Peer(initial_peers=[args.initial] if args.initial else [], host="127.0.0.1") as peer:
        opt = potluck.Optimizer(peer, "soak", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                                target_batch_size=TARGET_BATCH, batch_size_per_step=LOCAL_BATCH, load_state=False,
                                **MODES[args.mode])
        say(event="ready", address=peer.addresses[0])
        t0 = float(read_line(WORKER_IDLE_TIMEOUT).split()[1])  # "go <common start, time.time()>"
        trainer = Trainer(model, opt, 1000 + args.rank, t0, lambda t, e: say(event="epoch", t=t, epoch=e))

        def report_heap() -> None:  # the parent reads RSS from /proc; the heap only we can read
            while not trainer.stop.wait(args.sample):
                mb = heap_mb()
                if mb is not None:
                    say(event="heap", t=round(time.time() - t0, 2), mb=round(mb, 1))
        threading.Thread(target=report_heap, daemon=True).start()

        def listen() -> None:  # "finish <epoch>", then "stop"
            trainer.finish(int(read_line(WORKER_IDLE_TIMEOUT).split()[1]))
            read_line(WORKER_IDLE_TIMEOUT)
            trainer.stop.set()
        threading.Thread(target=listen, daemon=True).start()
        trainer.run()
        say(event="final", epoch=opt.local_epoch, digests=trainer.digests, error=trainer.error,
            catch_ups=opt.catch_ups)
        trainer.stop.wait(WORKER_IDLE_TIMEOUT)  # others may still need us for the finish epoch's rounds
        opt.shutdown()


# == parent side ==================================================================================
@dataclass
class PeerRecord:
    """What one peer (or, emulated, one process) showed: RSS samples, epochs, final digests."""

    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (s, MB, epoch)
    heap: list[tuple[float, float, int]] = field(default_factory=list)  # (s, MB in use by malloc, epoch)
    epochs: list[tuple[float, int]] = field(default_factory=list)  # (s, epoch) at each new epoch
    final: dict = field(default_factory=dict)

    @property
    def epoch(self) -> int:
        return self.epochs[-1][1] if self.epochs else 0


def run_processes(args: argparse.Namespace) -> tuple[list[PeerRecord], float, int]:
    """Train with real peer processes; returns their records, the training seconds and the finish epoch."""
    base = [sys.executable, __file__, "--worker", "--sample", str(args.sample), "--mode", args.mode]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    workers: list[Worker] = []
    records = [PeerRecord() for _ in range(PROCESS_PEERS)]
    try:
        workers.append(Worker([*base, "--rank", "0"], env))
        first = workers[0].expect("ready", STARTUP_TIMEOUT)
        for rank in range(1, PROCESS_PEERS):
            workers.append(Worker([*base, "--rank", str(rank), "--initial", first["address"]], env))
        for w in workers[1:]:
            w.expect("ready", STARTUP_TIMEOUT)
        t0 = time.time()
        for w in workers:
            w.send(f"go {t0!r}")

        def drain() -> None:
            for w, record in zip(workers, records, strict=True):
                with contextlib.suppress(queue.Empty):
                    while True:
                        got = w.events.get_nowait()
                        if got is None:
                            raise RuntimeError("a peer process exited during training:\n" + "".join(w.stderr[-15:]))
                        if got["event"] == "epoch":
                            record.epochs.append((got["t"], got["epoch"]))
                        elif got["event"] == "heap":
                            record.heap.append((got["t"], got["mb"], record.epoch))
                        elif got["event"] == "final":
                            record.final = got
        sample(lambda: [rss_mb(w.proc.pid) for w in workers], records, t0, args, drain)
        trained = time.time() - t0
        drain()
        finish = max(r.epoch for r in records) + FINISH_EPOCHS
        for w in workers:
            w.send(f"finish {finish}")
        while not all(r.final for r in records) and time.time() - t0 < trained + FINISH_TIMEOUT + 10:
            drain()
            time.sleep(0.05)
        for w in workers:
            w.send("stop")
        return records, trained, finish
    finally:
        for w in workers:
            w.kill()


def run_emulated(args: argparse.Namespace) -> tuple[list[PeerRecord], float, int]:
    """Train with emulated peers in this process; one record for the process (RSS), one per peer."""
    import torch

    import potluck
    from potluck.net.emulated import EmulatedNetwork
    torch.set_num_threads(1)
    network = EmulatedNetwork(latency=EMULATED_LATENCY)
    peers: list[Any] = []
    optimizers: list[Any] = []
    trainers: list[Trainer] = []
    process, records = PeerRecord(), [PeerRecord() for _ in range(EMULATED_PEERS)]
    try:
        for _ in range(EMULATED_PEERS):
            transport = network.transport(upload=EMULATED_BANDWIDTH, download=EMULATED_BANDWIDTH)
            peers.append(potluck.Peer(initial_peers=peers[0].addresses if peers else [], transport=transport))
        models = [make_mlp() for _ in peers]
        for peer, model in zip(peers, models, strict=True):
            optimizers.append(potluck.Optimizer(peer, "soak", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                                                target_batch_size=TARGET_BATCH, batch_size_per_step=LOCAL_BATCH,
                                                load_state=False, aggregation=args.aggregation,
                                                **MODES[args.mode]))
        t0 = time.time()
        trainers += [Trainer(model, opt, 1000 + i, t0, lambda t, e, r=record: r.epochs.append((t, e)))
                     for i, (model, opt, record) in enumerate(zip(models, optimizers, records, strict=True))]
        threads = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for t in threads:
            t.start()

        def drain() -> None:  # the process's epoch, for its RSS samples: the swarm's newest
            if max(r.epoch for r in records) > process.epoch:
                process.epochs.append((time.time() - t0, max(r.epoch for r in records)))
        sample(lambda: [rss_mb()], [process], t0, args, drain, heap=True)
        trained = time.time() - t0
        finish = max(r.epoch for r in records) + FINISH_EPOCHS
        for t in trainers:
            t.finish(finish)
        for t in threads:
            t.join(FINISH_TIMEOUT + 10)
        for record, t in zip(records, trainers, strict=True):
            record.final = {"epoch": t.opt.local_epoch, "digests": {str(k): v for k, v in t.digests.items()},
                            "error": t.error, "catch_ups": t.opt.catch_ups}
        process.final = {"epoch": max(r.final["epoch"] for r in records)}
        return [process, *records], trained, finish
    finally:
        for t in trainers:
            t.stop.set()
        for opt in optimizers:
            with contextlib.suppress(Exception):
                opt.shutdown()
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.shutdown()


def sample(read: Callable[[], list[float | None]], records: list[PeerRecord], t0: float,
           args: argparse.Namespace, drain: Callable[[], None], heap: bool = False) -> None:
    """Sample RSS (and with `heap`, this process's malloc in use, for its one record) every
    args.sample seconds until args.seconds of training have passed."""
    next_sample = t0
    while (now := time.time()) - t0 < args.seconds:
        drain()
        if now >= next_sample:
            for record, mb in zip(records, read(), strict=True):
                if mb is not None:
                    record.samples.append((round(now - t0, 2), round(mb, 1), record.epoch))
            if heap and (mb := heap_mb()) is not None:
                records[0].heap.append((round(now - t0, 2), round(mb, 1), records[0].epoch))
            next_sample = now + args.sample
        time.sleep(min(0.1, max(0.0, next_sample - time.time())))


def rss_rows(name: str, record: PeerRecord, warmup: float, params: dict) -> list[dict]:
    """RSS and heap growth: the peak after the warm-up over the peak during it. Peak over peak,
    because memory saw-tooths within an epoch or two (buffers freed and reused); growth means the
    teeth rise."""
    rows = []
    for what, samples, measured in (("rss", record.samples, "RSS"), ("heap", record.heap, "malloc's memory in use")):
        during = [mb for t, mb, _ in samples if t < warmup]
        after = [mb for t, mb, _ in samples if t >= warmup]
        row = {"metric": f"{what}_growth_after_warmup", "value": None, "unit": "MB", "peer": name, **params,
               "measured": f"peak {measured} after the warm-up minus the peak during it"}
        if during and after:
            row.update(value=round(max(after) - max(during), 1), warmup_peak_mb=max(during), peak_mb=max(after),
                       final_mb=after[-1], first_mb=during[0])
        rows += [row, {"metric": f"{what}_over_time", "value": None, "unit": "[s, MB, epoch]", "peer": name,
                       "samples": samples, **params}]
    return rows


def summarize(scenario: str, records: list[PeerRecord], trained: float, finish: int,
              args: argparse.Namespace, common: dict) -> list[dict]:
    """The figures of one scenario; for "emulated", records[0] is the process (RSS only)."""
    params = {"scenario": scenario, **common, "trained_s": round(trained, 1), "warmup_s": args.warmup}
    peers = records[1:] if scenario == "emulated" else records
    rows: list[dict] = []
    for name, record in ([("all", records[0])] if scenario == "emulated" else
                         [(str(i), r) for i, r in enumerate(records)]):
        rows += rss_rows(name, record, args.warmup, params)
    at_stop = [max((e for t, e in r.epochs if t <= trained), default=0) for r in peers]
    rows.append({"metric": "epochs_per_minute", "value": round(max(at_stop) / trained * 60, 1), "unit": "epochs/min",
                 "epochs_at_stop": at_stop, **params})
    stalls = []
    for r in peers:
        times = [0.0] + [t for t, _ in r.epochs if t <= trained] + [trained]
        stalls.append(round(max(b - a for a, b in zip(times, times[1:], strict=False)), 2))
    rows.append({"metric": "longest_stall", "value": max(stalls), "unit": "s", "per_peer": stalls,
                 "measured": "longest time without a new epoch, start to stop", **params})
    catch_ups = [r.final.get("catch_ups") for r in peers]
    rows.append({"metric": "catch_ups", "value": sum(c or 0 for c in catch_ups), "unit": "downloads",
                 "per_peer": catch_ups, **params,
                 "measured": "state downloads of peers that fell behind (a busy machine): each allocates "
                             "state-sized buffers that glibc keeps once freed, so RSS settles higher"})
    digests = [r.final.get("digests", {}).get(str(finish)) for r in peers]
    errors = sorted({r.final["error"] for r in peers if r.final.get("error")})
    row = {"metric": "params_identical", "value": None not in digests and len(set(digests)) == 1, "unit": "bool",
           "finish_epoch": finish, "final_epochs": [r.final.get("epoch") for r in peers], "digests": digests,
           **params}
    if args.mode == "streaming":  # each fragment lands mixed with the local parameters (`mixing`)
        row.update(value=None, measured="not compared: Streaming DiLoCo's local parameters differ between peers")
    if errors:
        row["error"] = "; ".join(errors)[:2000]
    rows.append(row)
    return rows


def plot(path: str, results: dict[str, list[dict]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for scenario, rows in results.items():
        for row in rows:
            if row["metric"] == "rss_over_time" and row["samples"]:
                ts, mbs, _ = zip(*row["samples"], strict=True)
                line, = ax.plot(ts, mbs, label=f"{scenario}, " + ("one process, all peers" if row["peer"] == "all"
                                                                  else f"peer {row['peer']}"))
                heap = next((r["samples"] for r in rows
                             if r["metric"] == "heap_over_time" and r["peer"] == row["peer"]), None)
                if heap:
                    ht, hmb, _ = zip(*heap, strict=True)
                    ax.plot(ht, hmb, linestyle="--", color=line.get_color(), label="  its malloc in use")
    ax.axvline(next(iter(results.values()))[0]["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("MB")
    ax.set_title("potluck soak: RSS (solid) and malloc's memory in use (dashed) over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s per scenario: under a minute")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time per scenario")
    parser.add_argument("--warmup", type=float, default=None,
                        help=f"seconds before RSS growth counts (default {WARMUP_FRACTION * 100:.0f}%% of the run, "
                             f"{MIN_WARMUP:g} to {MAX_WARMUP:g})")
    parser.add_argument("--sample", type=float, default=DEFAULT_SAMPLE, help="seconds between RSS samples")
    parser.add_argument("--scenarios", default="processes,emulated")
    parser.add_argument("--aggregation", default=None,
                        help="the emulated peers' (default: the Optimizer's, CenteredClip in these open runs)")
    parser.add_argument("--mode", choices=list(MODES), default="sync",
                        help="the peers' Optimizer: sync, DiLoCo (8 local steps) or Streaming DiLoCo "
                             "(2 fragments, delay 2, 4-bit)")
    parser.add_argument("--plot", help="write a PNG of RSS over time here")
    args = parse_or_run_worker(parser, run_worker)
    if args is None:
        return
    args.seconds = QUICK_SECONDS if args.quick else args.minutes * 60
    if args.warmup is None:
        args.warmup = round(min(MAX_WARMUP, max(MIN_WARMUP, WARMUP_FRACTION * args.seconds)), 1)
    common = {"model": "MLP " + "-".join(map(str, MLP_SIZES)), "mode": args.mode,
              "aggregation": args.aggregation or "default", "target_batch_size": TARGET_BATCH,
              "batch_size_per_step": LOCAL_BATCH, "optimizer": "Adam", "sample_s": args.sample,
              "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])}
    results: dict[str, list[dict]] = {}
    for scenario in args.scenarios.split(","):
        run = {"processes": run_processes, "emulated": run_emulated}[scenario]
        peers = PROCESS_PEERS if scenario == "processes" else EMULATED_PEERS
        try:
            records, trained, finish = run(args)
        except Exception as e:  # noqa: BLE001 - report and go on with the other scenario
            emit({"metric": "soak", "value": None, "unit": None, "scenario": scenario, "peers": peers, **common,
                  "error": f"{type(e).__name__}: {e}"[-3000:]})
            continue
        results[scenario] = summarize(scenario, records, trained, finish, args, {"peers": peers, **common})
        for row in results[scenario]:
            emit(row)
    if args.plot and results:
        plot(args.plot, results)


if __name__ == "__main__":
    main()
