"""Train the byte-level language model of `potluck demo --task lm` together with other machines.

First machine:   python examples/lm_train.py --port 31337 --identity peer.key
                 (prints the address to join with)
Other machines:  python examples/lm_train.py --initial-peers /ip4/<first machine's IP>/tcp/31337/p2p/<peer id>
Behind NAT:      add --client-mode (the peer only dials out)

The data is this machine's Python standard library (potluck.workloads.lm; no download). Machines
with the same Python version train and validate on the same bytes (the corpus digest printed at
start tells); another version gives another corpus, which still trains the same model.
Every `--report-every` seconds the peer prints its validation loss, bits per byte and bytes sent
per sample; `--duration` (or Ctrl-C) ends it, and `--save` writes the model's weights.
Mode diloco (the default) with `--fragments 4 --outer-compression blockwise4` is Streaming DiLoCo.
"""

import argparse
import time

import torch

import potluck
from potluck.workloads import lm

LOCAL_BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--identity", default=None, help="key file, so the peer id survives restarts")
    parser.add_argument("--run-id", default="lm-example")
    parser.add_argument("--mode", choices=["sync", "moshpit", "diloco"], default="diloco")
    parser.add_argument("--local-steps", type=int, default=64, help="diloco/moshpit: inner steps per round")
    parser.add_argument("--fragments", type=int, default=1, help="diloco: >1 is Streaming DiLoCo")
    parser.add_argument("--outer-compression", default="none", help="diloco: e.g. blockwise4, blockwise8")
    parser.add_argument("--target-batch-size", type=int, default=256, help="sync: the global batch")
    parser.add_argument("--duration", type=float, default=None, help="seconds of training (default: until Ctrl-C)")
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument("--save", default=None, help="write the model's state_dict here at the end")
    args = parser.parse_args()

    corpus = lm.load_corpus()
    print(f"corpus: {corpus.digest[:16]} ({len(corpus.train)} training bytes, {len(corpus.val_files)} held-out files)",
          flush=True)
    model = lm.make_lm()
    sample = lm.validation_sample(corpus, model.config.context)
    diloco = {}
    if args.mode == "diloco":  # with fragments, each fragment's round overlaps 2 inner steps
        diloco = {"fragments": args.fragments, "outer_delay": 2 if args.fragments > 1 else 0,
                  "outer_compression": args.outer_compression}
    with potluck.Peer(initial_peers=args.initial_peers, host=args.host, port=args.port,
                      client_mode=args.client_mode, identity_path=args.identity) as peer:
        for address in peer.addresses:
            print(f"others join with: --initial-peers {address}", flush=True)
        opt = potluck.Optimizer(peer, args.run_id, model.parameters(), lambda p: torch.optim.Adam(p, 3e-3),
                                target_batch_size=args.target_batch_size, batch_size_per_step=LOCAL_BATCH,
                                mode=args.mode, local_steps=args.local_steps,
                                role=potluck.Role.CLIENT if args.client_mode else potluck.Role.NODE, **diloco)
        rank = int.from_bytes(peer.peer_id.encode()[:4], "little")  # each machine its own batches
        data = lm.batches(corpus, LOCAL_BATCH, model.config.context, rank=rank)
        started = last = time.time()

        def report() -> None:
            result = lm.evaluate(model, sample)
            sent, _ = opt.bytes_per_sample()
            print(f"{time.time() - started:6.0f} s epoch {opt.local_epoch}: validation loss {result['val_loss']:.3f} "
                  f"({result['bits_per_byte']:.2f} bits/byte), {sent:.0f} bytes sent per sample", flush=True)
        try:
            while args.duration is None or time.time() - started < args.duration:
                x, y = next(data)
                lm.lm_loss(model, x, y).backward()
                opt.step()
                if time.time() - last > args.report_every:
                    last = time.time()
                    report()
        except KeyboardInterrupt:
            pass
        finally:
            report()
            opt.shutdown()
        if args.save:
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
