"""The demo workload: scikit-learn's digits data, the small CNN the demos train, and test accuracy.

These helpers live in a module of their own because several commands (`demo` in all its modes,
`compare`, `sweep`), the tests and the benchmarks train on the same data and model. Keeping them
out of any one command's module means the commands import them from here instead of from each
other, and no command module imports another just for data. torch and scikit-learn are imported
inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any


def make_model() -> Any:
    """The demo's CNN for 8x8 digits, with the same initial weights on every call (seed 0)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def load_data() -> tuple[Any, Any, Any, Any]:
    """Digits as (x_train, y_train, x_test, y_test): images of shape (N, 1, 8, 8) scaled to [0, 1],
    with a fixed split of 360 test images."""
    import torch
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def accuracy(model: Any, x: Any, y: Any) -> float:
    """The fraction of `x` that `model` classifies as `y`, without gradients."""
    import torch
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


__all__ = ["accuracy", "load_data", "make_model"]
