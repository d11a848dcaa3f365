"""One process alone on `wan.py`'s lm workload, over a grid of batch sizes and Adam learning rates:
how many steps, and how much CPU, each takes to the target validation loss.

A swarm is only worth its links if it beats the best one machine can do, so `wan.py --alone` must
be given the best settings, not the swarm's. This workload's step costs mostly Adam's pass over the
6.3M-parameter table, whatever the batch: a larger batch buys fewer steps for little more CPU, up
to the batch where the loss stops falling faster per step. One torch thread, no network; each
setting scores the model every `--every` steps and stops at the first score at or below the target
(or at `--max-steps`). CPU seconds (this thread's) are what a process capped at some share of a
core (`wan.py --cpus`) turns into time; the steps do not depend on the machine.

Prints one JSON object per setting, then the best by CPU:
  {"metric": "lm_alone", "batch": 256, "lr": 0.016, "steps": 245, "samples": 62720, "cpu_s": 50.7,
   "cpu_per_step_ms": 206.8, "reached": true, "val_loss": 1.3997}
  {"metric": "lm_alone_best", "batch": 256, "lr": 0.016, "cpu_s": 50.7, "steps": 245, "against_32_1e-3": null}
(against_32_1e-3: the CPU of batches of 32 at lr 1e-3, wan.py's settings until 2026-12-07, over the
best's, where the grid has that setting.)

Usage: python benchmarks/lm_alone.py [--batches 32,128,256,512] [--lrs 1e-3,4e-3,1.6e-2] [--every 5]
           [--max-steps 3000] [--target 1.4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import wan


def steps_to_target(task: wan.LMTask, batch: int, lr: float, every: int, max_steps: int) -> dict:
    """Train a fresh model (the swarms' start) alone until the target; what it took."""
    model = wan.make_lm()
    opt = torch.optim.Adam(model.parameters(), lr)
    generator = torch.Generator().manual_seed(1000)  # the lone process's batches in wan.py
    steps, cpu, score = 0, 0.0, float("inf")
    while steps < max_steps:
        started = time.thread_time()
        x, y = task.batch(generator, batch)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        cpu += time.thread_time() - started
        steps += 1
        if steps % every == 0:
            score = task.score(model)
            if task.reached(score):
                break
    return {"metric": "lm_alone", "batch": batch, "lr": lr, "steps": steps, "samples": steps * batch,
            "cpu_s": round(cpu, 1), "cpu_per_step_ms": round(1e3 * cpu / steps, 1), "reached": task.reached(score),
            "val_loss": round(score, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,128,256,512")
    parser.add_argument("--lrs", default="1e-3,4e-3,1.6e-2")
    parser.add_argument("--every", type=int, default=5, help="steps between scores")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--target", type=float, default=wan.LM_TARGET)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = wan.LMTask(wan.lm_data(), args.target)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for lr in (float(r) for r in args.lrs.split(",")):
            rows.append(steps_to_target(task, batch, lr, args.every, args.max_steps))
            print(json.dumps(rows[-1]), flush=True)
    reached = [r for r in rows if r["reached"]]
    if reached:
        best = min(reached, key=lambda r: r["cpu_s"])
        before = next((r for r in reached if (r["batch"], r["lr"]) == (32, 1e-3)), None)  # wan.py's until 2026-12-07
        print(json.dumps({"metric": "lm_alone_best", "batch": best["batch"], "lr": best["lr"], "cpu_s": best["cpu_s"],
                          "steps": best["steps"],
                          "against_32_1e-3": round(before["cpu_s"] / best["cpu_s"], 2) if before else None}),
              flush=True)


if __name__ == "__main__":
    main()
