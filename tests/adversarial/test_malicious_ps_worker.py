"""A registered parameter-server worker that lies (issue 15): within the push-norm caps it pushes
its gradient sign-flipped and scaled to 30 times the honest gradients' norm, every round. A sync server that averages with the mean follows it (the
step points against the honest gradients, tens of times their size); with a robust aggregation
the step stays bounded by the honest ones: the trimmed mean's lies coordinate by coordinate
between the smallest and largest honest gradient, CenteredClip's within the honest gradients'
spread of their mean.

Four workers on one sync server, on the emulated network under the virtual clock; each round
every worker computes its gradient on the parameters the server sent it, and the server's step is
read back from its parameters (plain SGD: step = -lr x aggregate).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from potluck.core.virtual_time import run_virtual
from potluck.ps import ServerConfig
from potluck.ps.simulation import PSSimulation

WORKERS = 4
ROUNDS = 12  # past the relative norm cap's warm-up (8 pushes): the cap is on and lets the lie through
LIE_NORM = 30.0  # times the honest pushes' median norm: inside the relative cap (100 x the median)
LR = 0.05
BATCH = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def gradient(model: torch.nn.Module, generator: torch.Generator, teacher: torch.Tensor) -> list[torch.Tensor]:
    x = torch.randn(BATCH, 8, generator=generator)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def attacked_rounds(aggregation: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Each round's (honest gradients stacked, the server's aggregate), and the pushes refused."""
    async def scenario():
        sim = await PSSimulation.start(make_model, sgd, ServerConfig(consistency="sync", num_workers=WORKERS,
                                                                     aggregation=aggregation),
                                       [0.01] * WORKERS, offload=False)
        try:
            teacher = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))
            generators = [torch.Generator().manual_seed(i) for i in range(WORKERS)]
            rounds = []
            for _ in range(ROUNDS):
                grads = [gradient(m, g, teacher) for m, g in zip(sim.models, generators, strict=True)]
                scale = LIE_NORM * float(torch.stack([flat(g).norm() for g in grads[1:]]).median())
                lie = [t * (-scale / float(flat(grads[0]).norm())) for t in grads[0]]
                pushed = [lie] + grads[1:]  # worker 0 lies
                before = flat(sim.primary.params).clone()
                await asyncio.gather(*(c.apush(g) for c, g in zip(sim.clients, pushed, strict=True)))
                step = (flat(sim.primary.params) - before) / -LR
                rounds.append((torch.stack([flat(g) for g in grads[1:]]), step))
            assert sim.primary.step == ROUNDS
            return rounds, sim.primary.refused_pushes
        finally:
            await sim.close()
    return run_virtual(scenario())


@pytest.mark.timeout(60)
def test_a_lying_worker_steers_the_mean_but_not_a_robust_aggregation():
    results = {kind: attacked_rounds(kind) for kind in ("mean", "trimmed_mean", "centered_clip")}
    for kind, (_, refused) in results.items():
        assert refused == 0, kind  # every lie passed the push-norm caps
    tolerance = 1e-5
    for honest, step in results["mean"][0]:
        mean = honest.mean(0)
        # The mean follows the liar: its step is far from the honest mean, against it.
        assert (step - mean).norm() > 5 * mean.norm()
        assert torch.dot(step, mean) < 0
    for honest, step in results["trimmed_mean"][0]:
        # Every coordinate between the honest gradients' smallest and largest.
        assert bool((step >= honest.min(0).values - tolerance).all())
        assert bool((step <= honest.max(0).values + tolerance).all())
    for honest, step in results["centered_clip"][0]:
        mean = honest.mean(0)
        spread = max(float((h - mean).norm()) for h in honest)
        # Within the honest gradients' spread of their mean, and pointing with it.
        assert float((step - mean).norm()) <= spread + tolerance
        assert torch.dot(step, mean) > 0


@pytest.mark.parametrize("consistency", ["async", "ssp"])
def test_a_robust_aggregation_is_refused_where_pushes_are_applied_one_at_a_time(consistency):
    with pytest.raises(ValueError, match="applies every push alone"):
        ServerConfig(consistency=consistency, aggregation="trimmed_mean")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        ServerConfig(consistency="sync", aggregation="median")
