"""Experts plus data parallelism: train digits through remote experts, with the rest of the model
shared by every trainer.

Expert servers (any machines):
    potluck expert-server --experts 'ffn.[0:2].[0:4]' --hidden 64 --port 31337
    potluck expert-server --experts 'ffn.[2:4].[0:4]' --hidden 64 --initial-peers <the first one's address>
Trainers (any number, any machines):
    python examples/moe_train.py --initial-peers <any server's or trainer's address>

The experts learn on their servers from every trainer's gradients. Each trainer's own parameters
(input layer, gate, classifier) are trained with `potluck.Optimizer` in sync mode: the trainers
average their gradients every `--target-batch-size` samples and take the same step, so those
parameters stay identical everywhere (the script prints their digest at each report). Stop with
Ctrl-C.
"""

import argparse
import hashlib

import torch

import potluck
from potluck.cli.tasks import accuracy, load_data
from potluck.moe import NotEnoughExperts, RemoteMixtureOfExperts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--grid", type=int, nargs="+", default=[4, 4], help="the servers' grid of experts")
    parser.add_argument("--hidden", type=int, default=64, help="the experts' width (--hidden of the servers)")
    parser.add_argument("--target-batch-size", type=int, default=256)
    args = parser.parse_args()

    x, y, x_test, y_test = load_data()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    # Trainers average with each other, so they must accept connections (no --client-mode here).
    with potluck.Peer(initial_peers=args.initial_peers, host=args.host, port=args.port) as peer:
        torch.manual_seed(0)  # the same shared parameters on every trainer (a late one downloads them)
        moe = RemoteMixtureOfExperts(peer, args.hidden, args.grid, "ffn", k_best=4, k_min=1,
                                     forward_timeout=10, backward_timeout=10)
        model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), moe,
                                    torch.nn.Linear(args.hidden, 10))
        opt = potluck.Optimizer(peer, "moe-example", model.parameters(), lambda p: torch.optim.Adam(p, 3e-3),
                                target_batch_size=args.target_batch_size, batch_size_per_step=32, mode="sync")
        generator = torch.Generator().manual_seed(int.from_bytes(peer.peer_id.encode()[:4], "little"))
        try:
            while True:
                batch = torch.randint(0, len(y), (32,), generator=generator)
                try:
                    loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                except NotEnoughExperts as e:  # every expert of a sample failed at once
                    print(f"skipped a batch: {e}", flush=True)
                    continue
                loss.backward()  # the experts step on their servers during this call
                epoch = opt.local_epoch
                opt.step()
                if opt.local_epoch != epoch and opt.local_epoch % 20 == 0:
                    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
                    print(f"epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.1%}, "
                          f"shared parameters {digest.hexdigest()[:16]}", flush=True)
        except KeyboardInterrupt:
            print(f"\nstopped at epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.1%}")
        finally:
            opt.shutdown()


if __name__ == "__main__":
    main()
