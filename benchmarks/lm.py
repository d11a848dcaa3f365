"""Language-model benchmark: validation loss after the same number of samples, and bytes per sample.

The task is `potluck demo --task lm`'s (potluck.workloads.lm: a byte-level GPT, 2 layers, d=128,
64-byte windows, on the Python standard library's source; validation on held-out whole files).
Four systems, run one after another on 127.0.0.1 (never concurrently: the standard machine has
2 cores), each until its processes together have processed the same number of samples:

  alone      one process, Adam(3e-3) on the sync swarm's global batch (it accumulates
             target_batch_size samples per step): what the swarm is compared with;
  sync       N peers, potluck.Optimizer in sync (DeDLOC) mode, the global batch above;
  diloco     N peers, DiLoCo: H inner Adam steps on each peer's own batches of 16, then an outer
             Nesterov step (lr 0.7, momentum 0.9) on the averaged pseudo-gradient, uncompressed;
  streaming  N peers, Streaming DiLoCo: the same H, the model in 4 fragments synchronized in turn,
             each round overlapped with 2 inner steps (mixing 0.5), pseudo-gradients in 4 bits
             (`outer_compression="blockwise4"`).

Each process is `potluck demo --task lm --worker` with one torch thread; all start from the same
weights (no state download: every peer builds the same model), and the parent starts them at once
and stops them when their samples add up to the budget. A system's validation loss is the mean of
its processes' final validation losses (each on its own model; 4096 held-out bytes); its bytes per
sample are the bytes all its processes sent on the wire from the start of training (transport.stats:
the averaging rounds, progress reports and DHT traffic) divided by the samples they processed.

Prints one JSON object per line: one per system, then the comparison the issue asks for:
  {"metric": "lm", "system": "sync", "val_loss": 2.61, "bits_per_byte": 3.77, "samples": 8192,
   "bytes_sent_per_sample": 54000.0, "failed_rounds": [0, 1], ...}
  {"metric": "streaming_vs_sync", "val_loss_ratio": 1.01, "bytes_ratio": 140.0, "goal_met": true, ...}
The goal: streaming's validation loss within 2% of sync's at >= 100x fewer bytes sent per sample.

Usage: python benchmarks/lm.py [--quick] [--peers 2] [--samples 8192] [--local-steps 128]
           [--systems alone,sync,diloco,streaming] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

from potluck.cli.demo_lm import LOCAL_BATCH, start_worker, stop_all, tell, wait_ready
from potluck.workloads import lm

SYSTEMS = ("alone", "sync", "diloco", "streaming")
FRAGMENTS = 4  # Streaming DiLoCo's fragments (the paper's smallest models use a few)
OUTER_DELAY = 2  # inner steps a fragment's round overlaps (less than local_steps / FRAGMENTS)
# Seconds a round waits for its group. Peers that reach a round further apart than this (a loaded
# machine) go on without each other; the demo's 0.5 s let most Streaming fragment rounds fail here.
MATCHMAKING_TIME = 2.0
# A round with a peer that stopped (at the end of a system's run) fails after this; short, so the
# last peers do not wait out the default 30 s.
AVERAGING_TIMEOUT = 10.0
# The most seconds one system may train before the parent stops it anyway (a stuck swarm).
SYSTEM_CAP = 900.0


def options(system: str, peers: int, local_steps: int) -> dict:
    """potluck.Optimizer's options for a system (alone: the batch it accumulates to)."""
    common = {"target_batch_size": 2 * LOCAL_BATCH * peers, "matchmaking_time": MATCHMAKING_TIME,
              "averaging_timeout": AVERAGING_TIMEOUT, "load_state": False}
    if system in ("alone", "sync"):
        return {**common, "mode": "sync"}
    diloco = {**common, "mode": "diloco", "local_steps": local_steps}
    if system == "diloco":
        return diloco
    return {**diloco, "fragments": FRAGMENTS, "outer_delay": OUTER_DELAY, "mixing": 0.5,
            "outer_compression": "blockwise4"}


def run_system(system: str, args: argparse.Namespace, out: Path) -> dict:
    """Train one system to the sample budget; its figures."""
    spec = {"options": options(system, args.peers, args.local_steps), "run_id": f"lm-{system}"}
    workers = []
    try:
        if system == "alone":
            workers.append(start_worker(f"{system}-alone", {**spec, "role": "alone", "rank": 0}, out))
        else:
            first = start_worker(f"{system}-0", {**spec, "role": "node", "rank": 0}, out)
            workers.append(first)
            wait_ready(first, out)
            workers += [start_worker(f"{system}-{i}", {**spec, "role": "node", "rank": i,
                                                       "initial_peer": first.address}, out)
                        for i in range(1, args.peers)]
        for w in workers:
            wait_ready(w, out)
        tell(workers, "go")
        started = time.time()
        while sum(w.last.get("samples", 0) for w in workers) < args.samples and time.time() - started < SYSTEM_CAP:
            time.sleep(0.1)
        stop_all(workers)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    finals = [w.final for w in workers if w.final]
    if len(finals) < len(workers):
        raise RuntimeError(f"{system}: a process did not finish; see {out}")
    samples = sum(f["samples"] for f in finals)
    val_loss = sum(f["val_loss"] for f in finals) / len(finals)
    return {"metric": "lm", "system": system, "val_loss": round(val_loss, 4),
            "bits_per_byte": round(val_loss / math.log(2), 4),
            "val_loss_per_process": [round(f["val_loss"], 4) for f in finals], "samples": samples,
            "bytes_sent_per_sample": round(sum(f["bytes_sent"] for f in finals) / samples, 1),
            "bytes_received_per_sample": round(sum(f.get("bytes_received", 0) for f in finals) / samples, 1),
            "seconds": round(max(f["train_seconds"] for f in finals), 1),
            # rounds a process went on without (it warns "averaging failed" in its log, then applies
            # its own change): they send no pseudo-gradient, so they lower the bytes and cost loss
            "failed_rounds": [_failed_rounds(out / f"{w.name}.log") for w in workers],
            "processes": len(workers), "options": spec["options"]}


def _failed_rounds(log: Path) -> int:
    return sum("averaging failed" in line for line in log.read_text(errors="replace").splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2048 samples, H=16: a smoke run of a few minutes")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192, help="samples (windows) per system, all processes")
    parser.add_argument("--local-steps", type=int, default=128, help="H: inner steps per outer round")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", default=None, help="folder for the processes' logs (default: a temporary one)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.local_steps = 2048, 16
    out = Path(args.out or tempfile.mkdtemp(prefix="potluck-lm-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    corpus = lm.load_corpus()
    print(json.dumps({"metric": "setup", "python": platform.python_version(), "machine": platform.machine(),
                      "peers": args.peers, "samples": args.samples, "local_steps": args.local_steps,
                      "local_batch": LOCAL_BATCH, "model": vars(lm.LMConfig()), **corpus.describe(),
                      "unigram_bits_per_byte": round(lm.unigram_entropy(corpus) / math.log(2), 4),
                      "logs": str(out)}), flush=True)
    rows = {}
    for system in args.systems.split(","):
        rows[system] = run_system(system, args, out)
        print(json.dumps(rows[system]), flush=True)
    if "sync" in rows and "streaming" in rows:
        sync, streaming = rows["sync"], rows["streaming"]
        loss_ratio = streaming["val_loss"] / sync["val_loss"]
        bytes_ratio = sync["bytes_sent_per_sample"] / max(streaming["bytes_sent_per_sample"], 1e-9)
        print(json.dumps({"metric": "streaming_vs_sync", "val_loss_ratio": round(loss_ratio, 4),
                          "bytes_ratio": round(bytes_ratio, 1), "goal": "val_loss_ratio <= 1.02, bytes_ratio >= 100",
                          "goal_met": loss_ratio <= 1.02 and bytes_ratio >= 100}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
