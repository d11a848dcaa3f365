#!/usr/bin/env python3
"""One trainer of the dashboard check's swarm: `potluck.Optimizer` on the digits, publishing its loss.

Prints `address ADDR` (others join with it) and `peer ID`, then trains a small MLP until SIGTERM,
reporting the mean loss of its recent batches with `opt.report_metrics(loss=...)` after each step.
Each step is followed by a short pause, so that several trainers, a monitor and a browser share a
two-core machine.
"""

from __future__ import annotations

import argparse
import logging

import torch

import potluck
from potluck.cli.signals import StopSignal
from potluck.cli.tasks import load_data

BATCH = 32
TARGET_BATCH = 256  # a global batch every 8 steps of the swarm: epochs and rounds come often
LR = 1e-2
STEP_PAUSE = 0.05  # seconds after each step (CPU for the others)
LOSS_WINDOW = 8  # batches averaged into the reported loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("index", type=int, help="seeds this trainer's batches")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    args = parser.parse_args()
    stop = StopSignal()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"trainer {args.index} %(name)s: %(message)s")
    x, y, _, _ = load_data()
    torch.manual_seed(0)  # every trainer starts from the same weights
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with potluck.Peer(initial_peers=args.initial_peers, host="127.0.0.1", client_mode=False) as peer:
        print(f"address {peer.addresses[0]}", flush=True)
        print(f"peer {peer.peer_id}", flush=True)
        opt = potluck.Optimizer(peer, args.run_id, model.parameters(), lambda p: torch.optim.Adam(p, LR),
                                target_batch_size=TARGET_BATCH, batch_size_per_step=BATCH, load_state=False)
        generator = torch.Generator().manual_seed(args.index)
        losses: list[float] = []
        while not stop.is_set():
            batch = torch.randint(0, len(y), (BATCH,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()  # consumes the gradients
            losses = [*losses[-LOSS_WINDOW + 1:], loss.item()]
            opt.report_metrics(loss=sum(losses) / len(losses))
            stop.wait(STEP_PAUSE)
        opt.shutdown()


if __name__ == "__main__":
    main()
