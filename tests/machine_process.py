"""One local rank of a machine that joins a run as one peer (`MachineOptimizer`, Gloo).

Rank 0 of machine 0 writes its address to DIR/address; rank 0 of the other machines reads it.
Every rank appends a JSON line to DIR/m<machine>r<rank>.jsonl at each new epoch (its parameters'
digest; on rank 0, the peers it sees), and {"lost": ...} if its machine leaves the run.
"""

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import potluck
from potluck.optim.machine import LocalGroupLost, MachineOptimizer
from potluck.optim.state import tensor_digest

BATCH, TARGET = 8, 64  # two machines of two ranks: 32 samples per step, two steps an epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("machine", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("--port", type=int, required=True, help="this machine's rendezvous port")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.dir)
    log = open(out / f"m{args.machine}r{args.rank}.jsonl", "a")  # noqa: SIM115 - lines until the end
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=30))
    peer = None
    if args.rank == 0:
        initial = []
        if args.machine > 0:
            deadline = time.monotonic() + 30
            while not (out / "address").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # a file written by another process: nothing to wait on instead
            initial = [(out / "address").read_text()]
        peer = potluck.Peer(host="127.0.0.1", initial_peers=initial)
        if args.machine == 0:
            (out / "address.tmp").write_text(peer.addresses[0])
            (out / "address.tmp").rename(out / "address")
    torch.manual_seed(0)  # the same initial model everywhere (rank 0's is broadcast anyway)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = MachineOptimizer(peer, "machines", model.parameters(), lambda p: torch.optim.SGD(p, 0.1),
                           target_batch_size=TARGET, batch_size_per_step=BATCH, load_state=False,
                           matchmaking_time=0.5, averaging_timeout=5.0, local_timeout=15.0)
    if peer is not None:
        deadline = time.monotonic() + 30
        while len(opt.optimizer.progress().reports) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # our own view of the DHT: nothing to wait on instead
    generator = torch.Generator().manual_seed(10 * args.machine + args.rank)
    x, y = torch.randn(512, 8, generator=generator), torch.randint(0, 3, (512,), generator=generator)
    epoch = opt.local_epoch
    try:
        while opt.local_epoch < args.epochs:
            batch = torch.randint(0, 512, (BATCH,), generator=generator)
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            if opt.local_epoch != epoch:
                epoch = opt.local_epoch
                record = {"epoch": epoch, "digest": tensor_digest(list(model.parameters()))}
                if opt.optimizer is not None:
                    record["peers"] = len(opt.optimizer.progress().reports)
                log.write(json.dumps(record) + "\n")
                log.flush()
    except LocalGroupLost as e:
        log.write(json.dumps({"lost": str(e)}) + "\n")
        log.flush()
        sys.exit(3)
    finally:
        if peer is not None:
            opt.shutdown()
            peer.shutdown()
        # torch's rule for every process-group script: without it, Gloo's worker threads can
        # abort the exit ("terminate called without an active exception", SIGABRT): CI saw it once.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
