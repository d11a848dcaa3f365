"""Time per training step of a lone peer's `potluck.Optimizer` against the wrapped torch optimizer,
on the demo's CNN (digits, batches of 32 drawn at random), alone on the machine and with
`--processes` copies of the same run started together (a loaded machine: the demos put five
processes on two cores).

The processes train `--steps` steps each (after 20 warm-up steps), torch limited to one thread:
first all with plain torch.optim.Adam, then all with a lone peer's Optimizer around it in `--mode`
(diloco: `--local-steps` inner steps per outer step; sync: an epoch every 32 steps), so that each
case meets the same load. Prints one JSON object per (mode, processes): the median over the
processes of the milliseconds per step of each case, and their ratio.

Usage: python benchmarks/step_overhead.py [--mode diloco,sync] [--processes 1,5] [--steps 1000]
           [--local-steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

WARMUP = 20
BATCH = 32


def worker(args: argparse.Namespace) -> None:
    import torch

    import potluck
    from potluck.cli.tasks import load_data, make_model
    from potluck.optim import Optimizer
    torch.set_num_threads(1)
    x, y, _, _ = load_data()
    generator = torch.Generator().manual_seed(0)
    times = {}
    with potluck.Peer(host="127.0.0.1") as peer:
        for case in (args.case,):
            model = make_model()
            if case == "torch":
                opt = torch.optim.Adam(model.parameters(), 1e-3)
            else:
                options = {"mode": "diloco", "local_steps": args.local_steps} if args.mode == "diloco" else {}
                opt = Optimizer(peer, f"step-overhead-{args.mode}", model.parameters(),
                                lambda p: torch.optim.Adam(p, 1e-3), target_batch_size=32 * BATCH,
                                batch_size_per_step=BATCH, load_state=False, **options)
            for k in range(WARMUP + args.steps):
                if k == WARMUP:
                    started = time.perf_counter()
                batch = torch.randint(0, len(y), (BATCH,), generator=generator)
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
                opt.zero_grad()
            times[case] = (time.perf_counter() - started) / args.steps * 1e3
            if case == "potluck":
                opt.shutdown()
    print(json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="diloco,sync")
    parser.add_argument("--processes", default="1,5")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="torch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for mode in args.mode.split(","):
        for n in (int(v) for v in args.processes.split(",")):
            ms = {}
            for case in ("torch", "potluck"):
                command = [sys.executable, __file__, "--worker", "--case", case, "--mode", mode,
                           "--steps", str(args.steps), "--local-steps", str(args.local_steps)]
                procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(n)]
                ms[case] = statistics.median(json.loads(p.communicate()[0].strip().splitlines()[-1])[case]
                                             for p in procs)
            torch_ms, potluck_ms = ms["torch"], ms["potluck"]
            print(json.dumps({"metric": "step_ms", "mode": mode, "processes": n, "torch_ms": round(torch_ms, 3),
                              "potluck_ms": round(potluck_ms, 3), "ratio": round(potluck_ms / torch_ms, 3),
                              "local_steps": args.local_steps if mode == "diloco" else None,
                              "steps": args.steps}), flush=True)


if __name__ == "__main__":
    main()
