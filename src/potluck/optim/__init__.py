"""Collaborative training: the `Optimizer` (DeDLOC sync mode, Moshpit SGD, DiLoCo), progress
tracking through the DHT, and large-batch tools (LAMB, LARS, linear scaling with warmup).

Imports from `potluck.core`, `potluck.net`, `potluck.dht` and `potluck.averaging` only.
"""

from potluck.optim.large_batch import LAMB, LARS, linear_scaling, warmup_linear_scaling
from potluck.optim.optimizer import Optimizer
from potluck.optim.progress import GlobalProgress, ProgressTracker

__all__ = ["LAMB", "LARS", "GlobalProgress", "Optimizer", "ProgressTracker", "linear_scaling",
           "warmup_linear_scaling"]
