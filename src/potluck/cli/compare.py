"""`potluck compare`: the same model and data under every training mode, on one emulated network.

Four workers (one 4x slower than the others) train the demo's CNN on digits for the same wall time
under each mode; midway one of the fast workers dies. Parameter-server modes (`potluck.ps`) use a
separate server; DeDLOC, Moshpit and DiLoCo are `potluck.Optimizer` peers on the same emulated
network. A worker's speed is modeled by a compute delay inside its step, so the slow worker is slow
the same way in every mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.cli.help import HelpFormatter
from potluck.cli.tasks import accuracy, load_data, make_model

logger = logging.getLogger(__name__)

MODES = ("ps_sync", "ps_async", "ssp", "backup", "dedloc", "moshpit", "diloco")
REPORT_KEYS = ("final_loss", "test_accuracy", "wall_seconds", "train_seconds", "samples", "updates",
               "loss_curve", "bytes_per_sample", "bytes_curve")
LEARNING_RATE = 3e-3
BATCH = 32
# Emulated links: a home connection's 10 MB/s each way and 10 ms one-way latency.
BANDWIDTH = 10e6
LATENCY = 0.01
# How often the parameter-server modes' bytes on the wire are read (their steps run inside the
# simulation): the loss-vs-bytes curve has 40 bins over a run of a few seconds or more.
TRAFFIC_SAMPLE_SECONDS = 0.05


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare", help="compare parameter-server and collaborative training modes on one emulated network",
        description="Train the demo's CNN on digits under each mode (" + ", ".join(MODES) + ") on an "
                    "emulated network: the same workers, one of them --slow times slower, and one fast "
                    "worker killed midway; with the defaults it takes about 2.5 minutes. Prints a table "
                    "and writes DIR/report.json, which maps each mode to: " + ", ".join(REPORT_KEYS)
                    + " (final_loss: cross-entropy of the final model on the training set; test_accuracy "
                    "on held-out digits; wall_seconds: the whole run of the mode, start-up included; "
                    "train_seconds: the training part; samples: processed by all workers; updates: "
                    "server steps (PS modes), global steps (dedloc) or the evaluated worker's local steps "
                    "(moshpit, diloco); loss_curve: [seconds, smoothed training loss] pairs; bytes_per_sample: "
                    "{sent, received}, the bytes on the workers' links per sample they processed (a parameter "
                    "server's own link not counted); bytes_curve: [MB the workers sent, smoothed training "
                    "loss] pairs), plus "
                    "'settings', 'findings' (computed from those figures: target_loss, the median of the "
                    "modes' final smoothed losses; seconds_to_target per mode, null if never reached; "
                    "fastest_to_target; most_accurate; least_accurate; samples_per_second per mode) and "
                    "'explanation' (the findings in words); and DIR/loss.png (training loss against time, and "
                    "against the bytes the workers sent).",
        formatter_class=HelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of training per mode")
    parser.add_argument("--workers", type=int, default=4, help="workers (peers) per mode; at least 3")
    parser.add_argument("--slow", type=float, default=4.0, help="how many times slower the slow worker is")
    parser.add_argument("--step-seconds", type=float, default=0.05,
                        help="modeled compute time of one step of batch 32 on a fast worker")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                        help="modes to run, from: " + " ".join(MODES))
    parser.add_argument("--no-failure", action="store_true", help="do not kill a worker midway")
    parser.add_argument("--out", default="potluck-compare", metavar="DIR", help="report folder")
    parser.set_defaults(run=run)


@dataclass
class Scenario:
    """The shared conditions of every mode."""

    duration: float = 20.0
    workers: int = 4
    slow: float = 4.0
    step_seconds: float = 0.05
    failure: bool = True

    def compute_times(self) -> list[float]:
        """Modeled compute seconds per step: the last worker is the slow one."""
        return [self.step_seconds] * (self.workers - 1) + [self.step_seconds * self.slow]

    @property
    def victim(self) -> int | None:
        """The fast worker that dies midway (never worker 0, whose model is evaluated)."""
        return 1 if self.failure else None


@dataclass
class ModeResult:
    losses: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, loss)
    final_loss: float = float("nan")
    test_accuracy: float = float("nan")
    wall_seconds: float = 0.0
    train_seconds: float = 0.0
    samples: int = 0
    updates: int = 0
    bytes_sent: int = 0  # by all the workers, from their transports' counters
    bytes_received: int = 0
    traffic: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes the workers sent so far)

    def report(self) -> dict[str, Any]:
        samples = max(self.samples, 1)
        curve = smooth(self.losses)
        return {"final_loss": round(self.final_loss, 4), "test_accuracy": round(self.test_accuracy, 4),
                "wall_seconds": round(self.wall_seconds, 2), "train_seconds": round(self.train_seconds, 2),
                "samples": self.samples, "updates": self.updates, "loss_curve": curve,
                "bytes_per_sample": {"sent": round(self.bytes_sent / samples, 1),
                                     "received": round(self.bytes_received / samples, 1)},
                "bytes_curve": [[round(sent_by(self.traffic, t) / 1e6, 3), loss] for t, loss in curve]}

    def count_bytes(self, transports: list[Any]) -> None:
        self.bytes_sent = sum(t.stats.bytes_sent for t in transports)
        self.bytes_received = sum(t.stats.bytes_received for t in transports)


def sent_by(traffic: list[tuple[float, int]], seconds: float) -> int:
    """The bytes sent by `seconds` (the last reading at or before it; 0 before the first)."""
    return next((sent for t, sent in reversed(traffic) if t <= seconds), 0)


def smooth(losses: list[tuple[float, float]], bins: int = 40) -> list[list[float]]:
    """The training loss averaged over time bins: a curve a plot and a reader can use."""
    if not losses:
        return []
    end = max(t for t, _ in losses) or 1.0
    sums: dict[int, list[float]] = {}
    for t, loss in losses:
        sums.setdefault(min(bins - 1, int(t / end * bins)), []).append(loss)
    return [[round((b + 1) * end / bins, 2), round(sum(v) / len(v), 4)] for b, v in sorted(sums.items())]


class Data:
    """Digits, and one batch stream per worker."""

    def __init__(self) -> None:
        self.x, self.y, self.x_test, self.y_test = load_data()

    def batches(self, index: int) -> Callable[[], tuple[Any, Any]]:
        import torch
        generator = torch.Generator().manual_seed(1000 + index)

        def next_batch() -> tuple[Any, Any]:
            b = torch.randint(0, len(self.y), (BATCH,), generator=generator)
            return self.x[b], self.y[b]
        return next_batch

    def evaluate(self, model: Any, result: ModeResult) -> None:
        import torch
        with torch.no_grad():
            result.final_loss = float(torch.nn.functional.cross_entropy(model(self.x), self.y))
        result.test_accuracy = accuracy(model, self.x_test, self.y_test)


# -- parameter-server modes --------------------------------------------------------------------------
PS_CONFIG = {"ps_sync": {"consistency": "sync"}, "ps_async": {"consistency": "async"},
             "ssp": {"consistency": "ssp", "staleness_bound": 3},
             "backup": {"consistency": "backup", "backup_workers": 1}}
# The parameter server drops a silent worker after this long: several slow steps, so that a slow
# worker is never mistaken for a dead one.
PS_WORKER_TIMEOUT = 2.0


def run_ps(mode: str, scenario: Scenario, data: Data) -> ModeResult:
    import torch

    from potluck.core.runner import acquire_runner, release_runner
    from potluck.ps.server import ServerConfig
    from potluck.ps.simulation import PSSimulation

    result = ModeResult()
    started = time.perf_counter()
    config = ServerConfig(num_workers=scenario.workers, worker_timeout=PS_WORKER_TIMEOUT, **PS_CONFIG[mode])

    async def scenario_run() -> Any:
        sim = await PSSimulation.start(make_model, lambda p: torch.optim.Adam(p, LEARNING_RATE), config,
                                       scenario.compute_times(), bandwidth=BANDWIDTH, latency=LATENCY)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result.train_seconds = scenario.duration
        if scenario.victim is not None:
            loop.call_later(scenario.duration / 2, sim.crash_worker, scenario.victim)
        transports = [w.transport for w in sim.workers]

        async def meter() -> None:
            while True:
                result.traffic.append((loop.time() - t0, sum(t.stats.bytes_sent for t in transports)))
                await asyncio.sleep(TRAFFIC_SAMPLE_SECONDS)
        metering = asyncio.ensure_future(meter())
        try:
            await sim.run(data.batches, lambda: loop.time() - t0 >= scenario.duration)
            await sim.clients[0].apull()
        finally:
            metering.cancel()
            await sim.close()
        result.losses = [(t - t0, loss) for t, loss in sim.losses]
        result.count_bytes(transports)
        return sim

    runner = acquire_runner()
    try:
        sim = runner.run(scenario_run(), timeout=scenario.duration + 120)
    finally:
        release_runner()
    result.samples = BATCH * len(result.losses)
    result.updates = sim.primary.step
    data.evaluate(sim.models[0], result)
    result.wall_seconds = time.perf_counter() - started
    return result


# -- collaborative modes (potluck.Optimizer) ---------------------------------------------------------
# DeDLOC steps once per global batch of 512 samples, 16x a worker's batch: a larger learning rate
# (about the square-root scaling rule for Adam) keeps its progress per sample comparable.
DEDLOC_LEARNING_RATE = 1e-2
# Averaging windows of the collaborative modes: matchmaking short enough for sub-second global
# batches; an averaging round that takes longer than the timeout (a member died) is given up.
MATCHMAKING_SECONDS = 0.3
AVERAGING_TIMEOUT = 5.0
OPTIMIZER_OPTIONS = {
    "dedloc": {"mode": "sync", "target_batch_size": 512, "average_state_every": 10},
    "moshpit": {"mode": "moshpit", "local_steps": 10, "target_batch_size": 512},
    "diloco": {"mode": "diloco", "local_steps": 20, "target_batch_size": 512},
}


def run_collaborative(mode: str, scenario: Scenario, data: Data) -> ModeResult:
    import torch

    import potluck
    from potluck.net.emulated import EmulatedNetwork
    from potluck.optim import Optimizer

    result = ModeResult()
    started = time.perf_counter()
    network = EmulatedNetwork(latency=LATENCY)
    peers: list[Any] = []
    optimizers: list[Any] = []
    models = [make_model() for _ in range(scenario.workers)]
    stops = [threading.Event() for _ in models]
    lock = threading.Lock()
    local_steps = [0] * scenario.workers
    try:
        for _ in range(scenario.workers):
            transport = network.transport(upload=BANDWIDTH, download=BANDWIDTH)
            peers.append(potluck.Peer(initial_peers=peers[0].addresses if peers else [], transport=transport))
        options = dict(OPTIMIZER_OPTIONS[mode])
        lr = DEDLOC_LEARNING_RATE if mode == "dedloc" else LEARNING_RATE
        for peer, model in zip(peers, models, strict=True):
            optimizers.append(Optimizer(peer, f"compare-{mode}", model.parameters(),
                                        lambda p: torch.optim.Adam(p, lr), batch_size_per_step=BATCH,
                                        load_state=False, matchmaking_time=MATCHMAKING_SECONDS,
                                        averaging_timeout=AVERAGING_TIMEOUT,
                                        **options))
        t0 = time.perf_counter()
        compute = scenario.compute_times()

        def train(i: int) -> None:
            next_batch, model, opt = data.batches(i), models[i], optimizers[i]
            while not stops[i].is_set() and time.perf_counter() - t0 < scenario.duration:
                x, y = next_batch()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                time.sleep(compute[i])  # models this worker's compute time
                opt.step()
                local_steps[i] += 1
                with lock:
                    seconds = time.perf_counter() - t0
                    result.losses.append((seconds, loss.item()))
                    result.traffic.append((seconds, sum(p.transport.stats.bytes_sent for p in peers)))
        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(scenario.workers)]
        for t in threads:
            t.start()
        if scenario.victim is not None:
            threads[0].join(scenario.duration / 2)
            stops[scenario.victim].set()
            peers[0].run(_crash(network, peers[scenario.victim].transport.peer_id), 10)
        for t in threads:
            t.join(scenario.duration + 60)
        result.train_seconds = time.perf_counter() - t0
        data.evaluate(models[0], result)
        result.samples = BATCH * len(result.losses)
        result.count_bytes([p.transport for p in peers])
        # Updates of the evaluated model: global steps (dedloc), or its own local steps (moshpit, diloco).
        result.updates = optimizers[0].local_epoch if mode == "dedloc" else local_steps[0]
    finally:
        for opt in optimizers:
            _quietly(opt.shutdown)
        for peer in peers:
            _quietly(peer.shutdown)
    result.wall_seconds = time.perf_counter() - started
    return result


async def _crash(network: Any, peer_id: Any) -> None:
    network.crash(peer_id)  # on the loop thread: the emulated network is not thread-safe


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - a crashed peer may not shut down cleanly; the run is over
        logger.debug("shutdown after the comparison: %s", e)


# -- the command -------------------------------------------------------------------------------------
def compare(scenario: Scenario, modes: list[str], progress: Callable[[str], None] = lambda _: None
            ) -> dict[str, ModeResult]:
    """Run every mode under `scenario`; returns {mode: ModeResult}."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # workers share the machine's cores, as separate one-core machines would
    try:
        data = Data()
        results: dict[str, ModeResult] = {}
        for mode in modes:
            progress(f"{mode}: training for {scenario.duration:g} s ...")
            results[mode] = (run_ps if mode in PS_CONFIG else run_collaborative)(mode, scenario, data)
            r = results[mode]
            progress(f"{mode}: loss {r.final_loss:.3f}, test accuracy {r.test_accuracy:.3f}, "
                     f"{r.updates} updates, {r.wall_seconds:.1f} s")
        return results
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    if args.workers < 3:
        raise SystemExit("potluck compare: --workers must be at least 3 (one slow, one that dies, one left)")
    if args.duration <= 0 or args.step_seconds <= 0 or args.slow < 1:
        raise SystemExit("potluck compare: --duration and --step-seconds must be positive, --slow at least 1")
    scenario = Scenario(duration=args.duration, workers=args.workers, slow=args.slow,
                        step_seconds=args.step_seconds, failure=not args.no_failure)
    library = logging.getLogger("potluck")
    level = library.level
    if not getattr(args, "verbose", 0):  # the scenario's slow and dying workers are meant: the table tells them,
        library.setLevel(logging.ERROR)  # the library's warnings about them would only interleave with it
    try:
        results = compare(scenario, args.modes, progress=lambda line: print(line, flush=True))
    finally:
        library.setLevel(level)
    out = Path(args.out)
    report = write_report(out, scenario, results)
    print()
    print(table(report))
    print()
    print(report["explanation"])
    print(f"wrote {out / 'report.json'} and {out / 'loss.png'}")
    return 0


def write_report(out: Path, scenario: Scenario, results: dict[str, ModeResult]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {mode: r.report() for mode, r in results.items()}
    report["settings"] = {"duration": scenario.duration, "workers": scenario.workers, "slow": scenario.slow,
                          "step_seconds": scenario.step_seconds, "failure": scenario.failure,
                          "bandwidth_bytes_per_s": BANDWIDTH, "latency_s": LATENCY, "batch": BATCH,
                          "learning_rate": LEARNING_RATE}
    report["findings"], report["explanation"] = explain(report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(out / "loss.png", results, scenario)
    return report


def seconds_to_loss(curve: list[list[float]], target: float) -> float | None:
    """When a smoothed loss curve first reaches `target` (the end of that time bin), or None."""
    return next((t for t, loss in curve if loss <= target), None)


def explain(report: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Findings computed from the report's own figures, and the same in words.

    Every claim about the results comes from the numbers in `report` (as written to report.json),
    so the text cannot disagree with the table; only the descriptions of how the modes work are
    fixed, and they say nothing about how well a mode did."""
    settings = report["settings"]
    modes = [m for m in MODES if m in report]
    accuracy_of = {m: report[m]["test_accuracy"] for m in modes if _finite(report[m]["test_accuracy"])}
    final_loss = {m: report[m]["loss_curve"][-1][1] for m in modes if report[m]["loss_curve"]}
    rate = {m: round(report[m]["samples"] / report[m]["train_seconds"], 1)
            for m in modes if report[m]["train_seconds"] > 0}
    target = statistics.median_high(final_loss.values()) if final_loss else None
    reached = {m: None if target is None else seconds_to_loss(report[m]["loss_curve"], target) for m in modes}
    order = sorted((m for m in modes if reached[m] is not None), key=lambda m: (reached[m], MODES.index(m)))
    findings = {
        "target_loss": target,
        "seconds_to_target": reached,
        "fastest_to_target": order[0] if order else None,
        "most_accurate": max(accuracy_of, key=accuracy_of.__getitem__) if accuracy_of else None,
        "least_accurate": min(accuracy_of, key=accuracy_of.__getitem__) if accuracy_of else None,
        "samples_per_second": rate,
    }

    failure = ", and one fast worker dies halfway" if settings["failure"] else ""
    lines = [f"What this run measured ({settings['workers']} workers, one {settings['slow']:g}x slower than "
             f"the others{failure}; {settings['duration']:g} s of training per mode):"]
    if accuracy_of:
        best, worst = findings["most_accurate"], findings["least_accurate"]
        lines.append(f"- Test accuracy: highest {best} ({accuracy_of[best]:.3f}), "
                     f"lowest {worst} ({accuracy_of[worst]:.3f}).")
    if order:
        first = order[0]
        line = (f"- Smoothed training loss {target:.4f} (the median of the modes' final ones) was reached "
                f"first by {first}, after {reached[first]:.1f} s")
        if len(order) > 1 and reached[first] > 0:
            second = order[1]
            line += f"; the next, {second}, took {reached[second] / reached[first]:.1f}x as long"
        line += "; in order: " + ", ".join(f"{m} {reached[m]:.1f} s" for m in order)
        missed = [m for m in modes if reached[m] is None]
        if missed:
            line += "; never reached by " + ", ".join(
                f"{m} (final {final_loss[m]:.4f})" if m in final_loss else f"{m} (no losses recorded)"
                for m in missed)
        lines.append(line + ".")
    if rate:
        most, least = max(rate, key=rate.__getitem__), min(rate, key=rate.__getitem__)
        line = f"- Samples per second, all workers together: most {most} ({rate[most]:.0f})"
        if least != most:
            line += f", least {least} ({rate[least]:.0f})"
        lines.append(line + ".")
    traffic = {m: report[m]["bytes_per_sample"]["sent"] for m in modes if "bytes_per_sample" in report[m]}
    if traffic:
        fewest, most = min(traffic, key=traffic.__getitem__), max(traffic, key=traffic.__getitem__)
        line = f"- Bytes each worker sent per sample it processed: fewest {fewest} ({traffic[fewest]:,.0f})"
        if most != fewest:
            line += f", most {most} ({traffic[most]:,.0f})"
        lines.append(line + "; in order: " + ", ".join(f"{m} {traffic[m]:,.0f}" for m in sorted(
            traffic, key=lambda m: (traffic[m], MODES.index(m)))) + ".")
    lines += _server_step_comparisons(report)
    lines.append("How the modes work:")
    notes = _mode_notes()
    lines += [f"- {m}: {notes[m]}." for m in modes]
    return findings, "\n".join(lines) + "\n"


def _server_step_comparisons(report: dict[str, Any]) -> list[str]:
    """What the parameter-server modes' step counts say (steps of one server are comparable)."""
    lines = []
    if "ps_sync" in report and "backup" in report:
        sync, backup = report["ps_sync"]["updates"], report["backup"]["updates"]
        if backup > sync:
            times = f"{backup / sync:.1f}x" if sync else "more than"
            lines.append(f"- backup made {times} the server steps of ps_sync ({backup} vs {sync}): not "
                         "waiting for the slowest gradient of each step let it go faster.")
        else:
            lines.append(f"- backup made no more server steps than ps_sync ({backup} vs {sync}): dropping the "
                         "slowest gradient of each step did not make it faster in this run.")
    if "ps_async" in report and "ssp" in report:
        free, bounded = report["ps_async"], report["ssp"]
        pace = ("fewer server steps than" if bounded["updates"] < free["updates"]
                else "at least as many server steps as")
        better = ("higher" if bounded["test_accuracy"] > free["test_accuracy"]
                  else "lower" if bounded["test_accuracy"] < free["test_accuracy"] else "the same")
        lines.append(f"- ssp made {pace} ps_async ({bounded['updates']} vs {free['updates']}) and reached "
                     f"{better} test accuracy ({bounded['test_accuracy']:.3f} vs {free['test_accuracy']:.3f}).")
    return lines


def _mode_notes() -> dict[str, str]:
    """How each mode works (its design, not its results)."""
    return {
        "ps_sync": "the server steps once it has a gradient from every live worker; it drops a worker "
                   f"silent for {PS_WORKER_TIMEOUT:g} s",
        "ps_async": "the server applies each gradient as it arrives, however stale",
        "ssp": f"like ps_async, but no worker may run more than {PS_CONFIG['ssp']['staleness_bound']} "
               "steps ahead of the slowest",
        "backup": "the server steps without the last " + (
            "gradient" if PS_CONFIG["backup"]["backup_workers"] == 1
            else f"{PS_CONFIG['backup']['backup_workers']} gradients") + " of each step",
        "dedloc": "potluck.Optimizer, sync: peers add samples to a global batch of "
                  f"{OPTIMIZER_OPTIONS['dedloc']['target_batch_size']} whatever their speed, then all-reduce "
                  "the gradients",
        "moshpit": f"potluck.Optimizer: {OPTIMIZER_OPTIONS['moshpit']['local_steps']} local steps between "
                   "rounds that average the parameters within groups of a grid",
        "diloco": f"potluck.Optimizer: {OPTIMIZER_OPTIONS['diloco']['local_steps']} local steps between "
                  "rounds that average the parameters' changes and apply them with an outer Nesterov step",
    }


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def table(report: dict[str, Any]) -> str:
    rows = [("mode", "final loss", "test acc", "updates", "samples", "bytes sent/sample", "wall s")]
    rows += [(m, f"{r['final_loss']:.3f}", f"{r['test_accuracy']:.3f}", str(r["updates"]), str(r["samples"]),
              f"{r['bytes_per_sample']['sent']:,.0f}" if "bytes_per_sample" in r else "-",
              f"{r['wall_seconds']:.1f}") for m, r in report.items() if m in MODES]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _plot(path: Path, results: dict[str, ModeResult], scenario: Scenario) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for mode, r in results.items():
        report = r.report()
        if report["loss_curve"]:
            ax.plot(*zip(*report["loss_curve"], strict=True), label=mode)
            sent = [point for point in report["bytes_curve"] if point[0] > 0]  # a log axis has no 0
            if sent:
                by_bytes.plot(*zip(*sent, strict=True), label=mode)
    ax.set_xlabel("seconds")
    ax.set_ylabel("training loss (smoothed)")
    ax.set_yscale("log")
    ax.legend()
    by_bytes.set_xlabel("MB sent by the workers")
    by_bytes.set_xscale("log")  # modes differ by orders of magnitude
    fig.suptitle(f"same model, data and workers; one worker {scenario.slow:g}x slower"
                 + ("; one dies halfway" if scenario.failure else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
