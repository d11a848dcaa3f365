"""The demo workload: scikit-learn's digits data, the small CNN the demos train, and test accuracy.

These helpers live in a module of their own because several commands (`demo` in all its modes,
`compare`, `sweep`), the tests and the benchmarks train on the same data and model. Keeping them
out of any one command's module means the commands import them from here instead of from each
other, and no command module imports another just for data. torch is imported
inside the functions, so importing this module stays cheap; the digits are read from the file
scikit-learn ships, without importing scikit-learn (a second of start-up in every process).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def make_model() -> Any:
    """The demo's CNN for 8x8 digits, with the same initial weights on every call (seed 0)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def digits() -> tuple[Any, Any]:
    """scikit-learn's digits as (pixels, labels) numpy arrays, exactly as `load_digits` gives them."""
    import numpy as np
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    locations = spec.submodule_search_locations if spec is not None else None
    path = Path(locations[0], "datasets", "data", "digits.csv.gz") if locations else None
    if path is None or not path.is_file():  # another layout: the slow way, which says what is missing
        from sklearn.datasets import load_digits
        return load_digits(return_X_y=True)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def load_data() -> tuple[Any, Any, Any, Any]:
    """Digits as (x_train, y_train, x_test, y_test): images of shape (N, 1, 8, 8) scaled to [0, 1],
    with a fixed split of 360 test images."""
    import torch
    x, y = digits()
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def accuracy(model: Any, x: Any, y: Any) -> float:
    """The fraction of `x` that `model` classifies as `y`, without gradients."""
    import torch
    with torch.no_grad():
        return _fraction(model(x).argmax(1) == y)


def _fraction(hits: Any) -> float:
    """Hits over the count, exact to the last bit of a Python float: a float32 mean made 342 of 360
    test digits 0.949999988, short of a 95% target that they meet."""
    return int(hits.sum()) / hits.numel()


def test_figures(model: Any, x: Any, y: Any) -> tuple[float, float]:
    """`accuracy` and `test_loss` of `model` on `x`, from one forward pass."""
    import torch
    with torch.no_grad():
        logits = model(x)
    return _fraction(logits.argmax(1) == y), float(torch.nn.functional.cross_entropy(logits, y))


def test_loss(model: Any, x: Any, y: Any) -> float:
    """Mean cross-entropy of `model` on `x`: a finer figure than accuracy, which 360 test digits
    make coarse (one digit is 0.3 points) and which saturates near 100% for every contender."""
    import torch
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


__all__ = ["accuracy", "load_data", "make_model", "test_figures", "test_loss"]
