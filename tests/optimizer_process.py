"""A training peer in its own process: `potluck.Optimizer` on digits for a number of epochs.

Prints its address (or "client"); waits for a line on stdin; trains; prints one JSON line with the
digest of its parameters after every epoch it applied.
"""

import argparse
import hashlib
import json
import logging
import sys
import time

import torch

import potluck
from potluck.cli.tasks import load_data, make_model

BATCH, TARGET, LR = 32, 384, 3e-3


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--client", action="store_true")
    parser.add_argument("--peers", type=int, default=1, help="wait until this many peers report progress")
    parser.add_argument("--slowdown", type=float, default=1.0, help="compute this many times slower")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)6.0f {args.index} %(name)s: %(message)s")
    x, y, _, _ = load_data()
    model = make_model()
    initial = [args.initial_peer] if args.initial_peer else []
    with potluck.Peer(initial_peers=initial, host="127.0.0.1", client_mode=args.client) as peer:
        print(peer.addresses[0] if peer.addresses else "client", flush=True)
        opt = potluck.Optimizer(peer, "processes", model.parameters(), lambda p: torch.optim.Adam(p, LR),
                                target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False)
        digests: dict[int, str] = {}
        # the parameters at the end of each applied epoch, or once downloaded by a peer that missed a round
        opt.register_epoch_hook(lambda event: digests.__setitem__(event.epoch, digest(model)))
        print("ready", flush=True)
        sys.stdin.readline()
        deadline = time.monotonic() + 60
        while len(opt.progress().reports) < args.peers and time.monotonic() < deadline:
            time.sleep(0.05)  # polling our own view of the DHT: nothing to wait on instead
        generator = torch.Generator().manual_seed(args.index)
        while opt.local_epoch < args.epochs:
            started = time.perf_counter()
            batch = torch.randint(0, len(y), (BATCH,), generator=generator)
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            if args.slowdown > 1:  # models a slower computer: the batch takes this much longer
                time.sleep((time.perf_counter() - started) * (args.slowdown - 1))
            opt.step()
        print(json.dumps({"epoch": opt.local_epoch, "digests": digests}), flush=True)
        # stay a moment for peers still finishing their last round with us
        sys.stdin.readline()
        opt.shutdown()


if __name__ == "__main__":
    main()
