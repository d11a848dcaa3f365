"""DiLoCo's outer settings against the result: which `local_steps`, `outer_lr` and
`outer_momentum` make a swarm beat one process alone, on the demos' two workloads.

N peers on the emulated network, under the virtual clock, train with potluck's Optimizer in
DiLoCo mode (the real code path: rounds, averaging, outer step), each taking S inner steps of the
demo's Adam on its own batches; one process alone takes the same S Adam steps on batches of the
same size, which is what it does in the same wall time when a step costs the same everywhere.
The figure is the validation loss of peer 0's model after its last outer step (all peers hold the
same outer parameters then), against the lone process's.

Workloads: "lm", the byte-level GPT of `potluck demo --task lm` (Adam 3e-3, 16 windows a step,
validation windows of held-out standard-library files); "digits", the CNN of `potluck demo`
(Adam 6e-3, 32 images a step, test loss on the held-out digits); "wan_lm", the language model of
`benchmarks/wan.py --workload lm` (6.3M parameters, nearly all one table of hashed contexts; Adam
at `wan.LM_LR` on `wan.LM_BATCH` windows a step, one process's best: benchmarks/lm_alone.py),
whose settings that benchmark's runs over emulated links use.

Prints one JSON object per line, e.g.
  {"task": "lm", "setting": "H20 lr1.0 m0.0", "steps": 500, "val_loss": 2.0, "alone_val_loss": 2.2, ...}

Usage: python benchmarks/diloco_settings.py [--task lm] [--peers 4] [--steps 500]
           [--settings 20:0.7:0.9,20:1.0:0.0:mean,32:0.7:0.9:mean:fragments=2:outer_delay=1,...]
           (local_steps:outer_lr:outer_momentum[:aggregation][:option=value...]: options of Streaming
           DiLoCo, `potluck.optim.DiLoCo`'s fragments, outer_delay, mixing, outer_compression)
           [--alone-steps 2048 --alone-every 128] [--only-alone]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

import torch
from diloco_bytes import emulated_peers, run_in_virtual_time  # this directory: the same emulated swarm

from potluck.optim import DiLoCo, Optimizer

COMPUTE_SECONDS = 0.05  # modeled compute time of one inner step (virtual)
# The demo's DiLoCo default before this benchmark (the paper's), then the alternatives it compared.
DEFAULT_SETTINGS = "20:0.7:0.9,20:1.0:0.5,20:1.4:0.0,20:1.0:0.0,10:1.0:0.0,40:1.0:0.0"


class Task:
    """A workload: its model, each peer's batches, its optimizer and its validation loss."""

    def __init__(self, name: str):
        self.name = name
        if name == "wan_lm":
            import wan  # this directory

            from potluck.workloads import lm
            self.wan, self.corpus = wan, lm.load_corpus()
            self.sample = lm.validation_sample(self.corpus, wan.LM_CONTEXT, wan.LM_VALIDATION_WINDOWS)
            self.lr, self.batch = wan.LM_LR, wan.LM_BATCH
        elif name == "lm":
            from potluck.cli import demo_lm
            from potluck.workloads import lm
            self.corpus, self.config = lm.load_corpus(), lm.LMConfig()
            self.sample = lm.validation_sample(self.corpus, self.config.context)
            self.lr, self.batch = demo_lm.LEARNING_RATE, demo_lm.LOCAL_BATCH
        else:
            from potluck.cli import demo, tasks
            self.x, self.y, self.x_test, self.y_test = tasks.load_data()
            self.lr, self.batch = demo.LEARNING_RATE, demo.LOCAL_BATCH

    def model(self) -> torch.nn.Module:
        if self.name == "wan_lm":
            return self.wan.make_lm()
        if self.name == "lm":
            from potluck.workloads import lm
            return lm.make_lm(self.config)
        from potluck.cli import tasks
        torch.manual_seed(0)
        return tasks.make_model()

    def batches(self, rank: int):
        if self.name == "wan_lm":
            from potluck.workloads import lm
            generator, train = torch.Generator().manual_seed(100 + rank), self.corpus.train
            while True:
                starts = torch.randint(0, len(train) - self.wan.LM_CONTEXT - 1, (self.batch,), generator=generator)
                yield lm.windows(train, starts, self.wan.LM_CONTEXT)
        if self.name == "lm":
            from potluck.workloads import lm
            data = lm.batches(self.corpus, self.batch, self.config.context, rank=rank, seed=0)
            while True:
                yield next(data)
        generator = torch.Generator().manual_seed(100 + rank)
        while True:
            index = torch.randint(0, len(self.y), (self.batch,), generator=generator)
            yield self.x[index], self.y[index]

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.name in ("lm", "wan_lm"):
            from potluck.workloads import lm
            return lm.lm_loss(model, x, y)
        return torch.nn.functional.cross_entropy(model(x), y)

    def val_loss(self, model: torch.nn.Module) -> float:
        if self.name in ("lm", "wan_lm"):
            from potluck.workloads import lm
            return lm.evaluate(model, self.sample)["val_loss"]
        from potluck.cli import tasks
        return tasks.test_loss(model, self.x_test, self.y_test)


def alone(task: Task, steps: int, every: int = 0, at: int = 0) -> list[tuple[int, float]]:
    """The lone process's validation loss after `steps` steps, after step `at` and after every
    `every` (0: neither) as (steps, loss) pairs: how many steps alone match a swarm's loss."""
    model = task.model()
    opt = torch.optim.Adam(model.parameters(), task.lr)
    data = task.batches(0)
    curve = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        task.loss(model, *next(data)).backward()
        opt.step()
        if step in (steps, at) or (every and step % every == 0):
            curve.append((step, round(task.val_loss(model), 4)))
    return curve


async def swarm(task: Task, peers: int, steps: int, mode: DiLoCo, aggregation: str | None = None) -> dict[str, Any]:
    async with emulated_peers(peers) as nodes:
        return await train_swarm(task, nodes, steps, mode, aggregation)


async def train_swarm(task: Task, nodes: list[Any], steps: int, mode: DiLoCo,
                      aggregation: str | None = None) -> dict[str, Any]:
    peers = len(nodes)
    models = [task.model() for _ in nodes]
    optimizers = [Optimizer(peer, "settings", model.parameters(), lambda p: torch.optim.Adam(p, task.lr),
                            target_batch_size=peers * task.batch, batch_size_per_step=task.batch, mode=mode,
                            matchmaking_time=1.0, load_state=False, start=False, aggregation=aggregation)
                  for peer, model in zip(nodes, models, strict=True)]
    for opt in optimizers:
        await opt.astart()
    await asyncio.sleep(2)  # the peers see each other before training

    async def train(index: int) -> None:
        data = task.batches(index)
        for _ in range(steps):
            task.loss(models[index], *next(data)).backward()
            await asyncio.sleep(COMPUTE_SECONDS)
            await optimizers[index].astep()
            optimizers[index].zero_grad()

    try:
        await asyncio.gather(*(train(i) for i in range(peers)))
        return {"val_loss": round(task.val_loss(models[0]), 4), "epochs": optimizers[0].local_epoch,
                "failed_rounds": sum(opt.context.failed_rounds for opt in optimizers)}
    finally:
        for opt in optimizers:
            opt.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["lm", "digits", "wan_lm"], default="lm")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500, help="inner steps per peer (and the lone process's steps)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help="local_steps:outer_lr:outer_momentum[:aggregation][:option=value...], ... "
                             "(aggregation: the Optimizer's default, or mean, centered_clip, trimmed_mean; "
                             "options: Streaming DiLoCo's fragments, outer_delay, mixing, outer_compression)")
    parser.add_argument("--alone-steps", type=int, default=0,
                        help="let the lone process train on to this many steps (its curve: --alone-every)")
    parser.add_argument("--alone-every", type=int, default=0,
                        help="also report the lone process's loss every this many steps")
    parser.add_argument("--only-alone", action="store_true", help="run the lone process only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    task = Task(args.task)
    curve = alone(task, max(args.steps, args.alone_steps), args.alone_every, at=args.steps)
    baseline = dict(curve)[args.steps]
    print(json.dumps({"task": args.task, "setting": "alone", "steps": args.steps, "val_loss": baseline,
                      **({"curve": curve} if args.alone_every else {})}), flush=True)
    for setting in [] if args.only_alone else args.settings.split(","):
        h, lr, momentum, *rest = setting.split(":")
        aggregation = [r for r in rest if "=" not in r]
        streaming = dict(r.split("=", 1) for r in rest if "=" in r)
        options = {k: v if k == "outer_compression" else float(v) if k == "mixing" else int(v)
                   for k, v in streaming.items()}
        mode = DiLoCo(local_steps=int(h), outer_lr=float(lr), outer_momentum=float(momentum), **options)
        result = run_in_virtual_time(swarm(task, args.peers, args.steps, mode, *aggregation))
        label = " ".join([f"H{h} lr{lr} m{momentum}", *aggregation, *(f"{k}={v}" for k, v in streaming.items())])
        print(json.dumps({"task": args.task, "setting": label, "peers": args.peers,
                          "steps": args.steps, **result, "alone_val_loss": baseline,
                          "swarm_ahead": result["val_loss"] < baseline}), flush=True)


if __name__ == "__main__":
    main()
