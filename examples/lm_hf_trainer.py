"""The byte-level language model of `potluck demo --task lm`, trained by Hugging Face `Trainer`
with `potluck.Optimizer`: every machine runs this script, and their Trainers train one model.

First machine:   python examples/lm_hf_trainer.py --port 31337
Other machines:  python examples/lm_hf_trainer.py --initial-peers /ip4/<first machine's IP>/tcp/31337/p2p/<peer id>

`Trainer` drives the loop as usual (batches, backward, gradient clipping, `optimizer.step()`); the
optimizer it is handed is a `potluck.Optimizer` (DiLoCo by default), which averages with the other
machines. The model returns its loss in a dict, as Hugging Face models do. At the end each machine
prints its validation loss and bits per byte on the held-out files (potluck.workloads.lm).
Needs `pip install transformers accelerate`.
"""

import argparse

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import potluck
from potluck.workloads import lm

BATCH = 16


class ByteLM(torch.nn.Module):
    """potluck.workloads.lm's model with Hugging Face's calling convention."""

    def __init__(self):
        super().__init__()
        self.gpt = lm.make_lm()

    def forward(self, input_ids, labels=None):
        logits = self.gpt(input_ids)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                                              labels.reshape(-1))
        return {"loss": loss, "logits": logits}


class Windows(torch.utils.data.Dataset):
    """`size` random training windows, the same for the same seed."""

    def __init__(self, corpus: lm.Corpus, context: int, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(corpus.train) - context - 1, (size,), generator=generator)
        self.corpus, self.context = corpus, context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        x, y = lm.windows(self.corpus.train, self.starts[i:i + 1], self.context)
        return {"input_ids": x[0], "labels": y[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=["sync", "moshpit", "diloco"], default="diloco")
    parser.add_argument("--local-steps", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=500, help="Trainer steps on this machine")
    parser.add_argument("--out", default="lm-hf-trainer", help="Trainer's output_dir (nothing is saved in it)")
    args = parser.parse_args()

    corpus = lm.load_corpus()
    model = ByteLM()
    with potluck.Peer(initial_peers=args.initial_peers, host=args.host, port=args.port) as peer:
        for address in peer.addresses:
            print(f"others join with: --initial-peers {address}", flush=True)
        opt = potluck.Optimizer(peer, "lm-hf", model.parameters(), lambda p: torch.optim.Adam(p, 3e-3),
                                target_batch_size=4 * BATCH, batch_size_per_step=BATCH, mode=args.mode,
                                local_steps=args.local_steps)
        # Trainer steps a scheduler after each optimizer step; a constant one leaves the rate alone
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        seed = int.from_bytes(peer.peer_id.encode()[:4], "little")  # each machine its own windows
        training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=BATCH,
                                     max_steps=args.max_steps, report_to=[], save_strategy="no",
                                     logging_strategy="no", use_cpu=True, disable_tqdm=True,
                                     dataloader_num_workers=0, seed=seed % 2**31)

        class Progress(TrainerCallback):
            def on_step_end(self, training_args, state, control, **kwargs):
                if state.global_step % 100 == 0:
                    print(f"step {state.global_step}, swarm epoch {opt.local_epoch}", flush=True)
        try:
            Trainer(model=model, args=training, train_dataset=Windows(corpus, model.gpt.config.context,
                                                                       args.max_steps * BATCH, seed),
                    optimizers=(opt, scheduler), callbacks=[Progress()]).train()
        finally:
            opt.shutdown()
    result = lm.evaluate(model.gpt, lm.validation_sample(corpus, model.gpt.config.context))
    print(f"validation loss {result['val_loss']:.3f} ({result['bits_per_byte']:.2f} bits/byte) "
          f"after {opt.local_epoch} swarm epochs", flush=True)


if __name__ == "__main__":
    main()
