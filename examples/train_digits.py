"""Train the demo's CNN on digits together with other machines.

First machine:   python examples/train_digits.py --port 31337
                 (prints the address to join with)
Other machines:  python examples/train_digits.py --initial-peers /ip4/<first machine's IP>/tcp/31337/p2p/<peer id>
Behind NAT:      add --client-mode (the peer only dials out)

Every machine trains on its own random batches; the swarm steps the optimizer together every
`--target-batch-size` samples. Stop with Ctrl-C; the peer prints its test accuracy.
"""

import argparse

import torch

import potluck
from potluck.cli.demo import accuracy, load_data, make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--identity", default=None, help="key file, so the peer id survives restarts")
    parser.add_argument("--target-batch-size", type=int, default=1024)
    parser.add_argument("--mode", choices=["sync", "moshpit", "diloco"], default="sync")
    args = parser.parse_args()

    x, y, x_test, y_test = load_data()
    model = make_model()
    with potluck.Peer(initial_peers=args.initial_peers, host=args.host, port=args.port,
                      client_mode=args.client_mode, identity_path=args.identity) as peer:
        for address in peer.addresses:
            print(f"others join with: --initial-peers {address}", flush=True)
        opt = potluck.Optimizer(peer, "digits-example", model.parameters(), lambda p: torch.optim.Adam(p, 6e-3),
                                target_batch_size=args.target_batch_size, batch_size_per_step=32, mode=args.mode,
                                role=potluck.Role.CLIENT if args.client_mode else potluck.Role.NODE,
                                average_state_every=5)
        generator = torch.Generator().manual_seed(int.from_bytes(peer.peer_id.encode()[:4], "little"))
        try:
            while True:
                batch = torch.randint(0, len(y), (32,), generator=generator)
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
                if opt.local_epoch and opt.local_epoch % 10 == 0 and opt.samples == 0:
                    print(f"epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.1%}", flush=True)
        except KeyboardInterrupt:
            print(f"\nstopped at epoch {opt.local_epoch}: test accuracy {accuracy(model, x_test, y_test):.1%}")
        finally:
            opt.shutdown()


if __name__ == "__main__":
    main()
