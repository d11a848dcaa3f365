"""A user's model, data and loss, defined outside potluck (what `--model tests.user_model:make_layers`
names): a small MLP that learns which of 4 classes a fixed random teacher assigns to 8-d points."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

FEATURES = 8
HIDDEN = 32
CLASSES = 4
BATCH = 16
# One epoch of `batches` (finite, so a consumer has to handle epoch ends).
EPOCH_BATCHES = 5
TEACHER_SEED = 12345
NOT_CALLABLE = 3  # for the test that a reference must name a callable


def make_layers() -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU()),
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()),
            nn.Linear(HIDDEN, CLASSES)]


def make_sequential() -> nn.Sequential:
    return nn.Sequential(*make_layers())


class Residual(nn.Module):
    """Not a Sequential: torch.fx traces it, and it can be cut only where no skip connection crosses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + torch.relu(self.b(torch.relu(self.a(h))))  # the skip spans a and b: no cut between them
        return self.out(h)


def make_residual() -> Residual:
    return Residual()


def _labels(x: torch.Tensor) -> torch.Tensor:
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(TEACHER_SEED))
    return (x @ teacher).argmax(dim=1)


def batches(rank: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of micro-batches for peer `rank`, drawn from its own stream."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    for _ in range(EPOCH_BATCHES):
        x = torch.randn(BATCH, FEATURES, generator=g)
        yield x, _labels(x)


def no_batches(rank: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return iter(())


def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing: a user-defined loss."""
    return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)


def accuracy(layers: list[nn.Module], samples: int = 512) -> float:
    x = torch.randn(samples, FEATURES, generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        return (nn.Sequential(*layers)(x).argmax(dim=1) == _labels(x)).float().mean().item()
