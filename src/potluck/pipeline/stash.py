"""`StashedWeights`: exact weight stashing for an asynchronous pipeline stage.

A micro-batch's backward must use the weights its forward used, although updates happen in
between. Each forward runs on an immutable snapshot of the weights (a *version*); the autograd
graph keeps references to that snapshot, so the backward differentiates exactly the function
the forward computed. Updates go to the master parameters (what the optimizer owns), after which
`advance()` publishes a new snapshot. A snapshot lives while a micro-batch needs it.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

__all__ = ["StashedWeights"]


class StashedWeights:
    """Versioned, reference-counted snapshots of a module's parameters."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.version = 0
        self._lock = threading.Lock()
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self._users: dict[int, int] = {0: 0}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone().requires_grad_(p.requires_grad)
                for name, p in self.module.named_parameters()}

    def acquire(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The current version and its weights, held until `release(version)`."""
        with self._lock:
            self._users[self.version] += 1
            return self.version, self._snapshots[self.version]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of a version still held (the caller holds it, or it is the current one)."""
        return self._snapshots[version]

    def release(self, version: int) -> None:
        with self._lock:
            self._users[version] -= 1
            self._collect()

    def advance(self) -> int:
        """The master parameters changed: snapshot them as the next version."""
        snapshot = self._snapshot()
        with self._lock:
            self.version += 1
            self._snapshots[self.version] = snapshot
            self._users[self.version] = 0
            self._collect()
            return self.version

    def _collect(self) -> None:
        for v in [v for v, n in self._users.items() if n == 0 and v != self.version]:
            del self._snapshots[v], self._users[v]

    @property
    def versions_held(self) -> int:
        """How many weight copies are kept (the current one included): the stash's memory cost."""
        return len(self._snapshots)
