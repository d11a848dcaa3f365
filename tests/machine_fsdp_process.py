"""One local rank of a lone machine whose model is sharded with FSDP (`fully_shard`, Gloo), under
`MachineOptimizer`; next to it, the same model unsharded, trained by hand with the machine's mean
gradient and SGD. After each epoch every rank writes to DIR/r<rank>.json the largest difference
between the two and the digest of the full sharded parameters.
"""

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import potluck
from potluck.optim.machine import MachineOptimizer
from potluck.optim.state import tensor_digest

BATCH, EPOCHS, LR = 8, 3, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2,
                            timeout=timedelta(seconds=30))
    peer = potluck.Peer(host="127.0.0.1") if args.rank == 0 else None
    model, reference = make_model(), make_model()
    fully_shard(model)
    reference_opt = torch.optim.SGD(reference.parameters(), LR)
    # one step of both ranks fills the target batch: an epoch, and one SGD step, every step
    opt = MachineOptimizer(peer, "fsdp", model.parameters(), lambda p: torch.optim.SGD(p, LR),
                           target_batch_size=2 * BATCH, batch_size_per_step=BATCH, load_state=False,
                           matchmaking_time=0.2, averaging_timeout=2.0, local_timeout=15.0)
    generator = torch.Generator().manual_seed(args.rank)
    x, y = torch.randn(256, 8, generator=generator), torch.randint(0, 3, (256,), generator=generator)
    errors, epochs = [], []
    try:
        while opt.local_epoch < EPOCHS:
            batch = torch.randint(0, 256, (BATCH,), generator=generator)
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            reference_opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[batch]), y[batch]).backward()
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
            reference_opt.step()
            full = [p.full_tensor().detach() for p in model.parameters()]
            errors.append(max(float((a - b.detach()).abs().max()) for a, b in zip(full, reference.parameters(), strict=True)))
            epochs.append(opt.local_epoch)
        record = {"errors": errors, "epochs": epochs, "digest": tensor_digest(full),
                  "sharded": all(p.to_local().numel() < p.numel() for p in model.parameters() if p.dim() and p.shape[0] > 1)}
        (Path(args.dir) / f"r{args.rank}.json").write_text(json.dumps(record))
    finally:
        opt.shutdown()
        if peer is not None:
            peer.shutdown()
        # both ranks tear Gloo down together: a rank that destroys its group while the other still
        # holds the connection can abort the other ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
