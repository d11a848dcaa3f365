"""Train the demo's CNN on digits together with other machines.

First machine:   python examples/train_digits.py --port 31337
                 (prints the address to join with)
Other machines:  python examples/train_digits.py --initial-peers /ip4/<first machine's IP>/tcp/31337/p2p/<peer id>
Behind NAT:      add --client-mode (the peer only dials out)

Every machine trains on its own random batches; the swarm steps the optimizer together every
`--target-batch-size` samples. Stop with Ctrl-C (or --duration); the peer prints its test accuracy.

--verified: verified training (sync mode): every peer trains on the batches a public seed draws
for it (`opt.batch()`), and peers recompute a tenth of each other's gradients; a peer whose
gradients are not those of its batches is banned (docs/security.md, "Verified training").

Keep the result: --save DIR writes DIR/model.pt (the model's state dict: plain
`model.load_state_dict(torch.load("DIR/model.pt"))`) and DIR/checkpoint.potluck (the run's epoch and
optimizer state) every 10 epochs and at the end. --resume DIR starts from that checkpoint: the peer
continues from its epoch, and rejoins the swarm (taking the swarm's newer state if it moved on).
"""

import argparse
import os
import time
from pathlib import Path

import torch

import potluck
from potluck.cli.tasks import accuracy, load_data, make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--identity", default=None, help="key file, so the peer id survives restarts")
    parser.add_argument("--target-batch-size", type=int, default=1024)
    parser.add_argument("--mode", choices=["sync", "moshpit", "diloco"], default="sync")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: at Ctrl-C)")
    parser.add_argument("--save", metavar="DIR", help="save model.pt and checkpoint.potluck here")
    parser.add_argument("--resume", metavar="DIR", help="resume from DIR/checkpoint.potluck")
    parser.add_argument("--verified", action="store_true", help="verified training: public batches, validators")
    args = parser.parse_args()
    if args.verified and args.mode != "sync":
        parser.error("--verified needs --mode sync")

    x, y, x_test, y_test = load_data()
    model = make_model()
    with potluck.Peer(initial_peers=args.initial_peers, host=args.host, port=args.port,
                      client_mode=args.client_mode, identity_path=args.identity) as peer:
        for address in peer.addresses:
            print(f"others join with: --initial-peers {address}", flush=True)
        verify = potluck.optim.Verified(model, loss_of, list(zip(x, y, strict=True))) if args.verified else None
        opt = potluck.Optimizer(peer, "digits-example", model.parameters(), lambda p: torch.optim.Adam(p, 6e-3),
                                target_batch_size=args.target_batch_size, batch_size_per_step=32, mode=args.mode,
                                role=potluck.Role.CLIENT if args.client_mode else potluck.Role.NODE,
                                average_state_every=5, verify=verify)
        if args.resume:
            opt.load_checkpoint(Path(args.resume) / "checkpoint.potluck")
            print(f"resumed at epoch {opt.local_epoch} from {args.resume}", flush=True)
        generator = torch.Generator().manual_seed(int.from_bytes(peer.peer_id.encode()[:4], "little"))
        started, shown = time.monotonic(), opt.local_epoch
        try:
            while not args.duration or time.monotonic() - started < args.duration:
                if args.verified:
                    loss_of(model, opt.batch()).backward()  # the batch the swarm expects from this peer
                else:
                    batch = torch.randint(0, len(y), (32,), generator=generator)
                    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
                if opt.local_epoch >= shown + 10:
                    shown = opt.local_epoch
                    print(f"epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.1%}", flush=True)
                    save(args.save, model, opt)
        except KeyboardInterrupt:
            print()
        finally:
            save(args.save, model, opt)
            print(f"stopped at epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.4%}"
                  + (f"; saved to {args.save}" if args.save else ""), flush=True)
            opt.shutdown()


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def save(directory: str | None, model: torch.nn.Module, opt: potluck.Optimizer) -> None:
    """The model for plain PyTorch, and the checkpoint to resume from (each written whole)."""
    if directory is None:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(directory) / "model.tmp")
    os.replace(Path(directory) / "model.tmp", Path(directory) / "model.pt")
    opt.save_checkpoint(Path(directory) / "checkpoint.potluck")


if __name__ == "__main__":
    main()
