"""Collaborative training: the `Optimizer` (a torch front over one training mode: DeDLOC sync,
Moshpit SGD, DiLoCo, Streaming DiLoCo), the run context the modes share, progress tracking
through the DHT, and large-batch tools (LAMB, LARS, linear scaling with warmup).

Layers inside: `machine` (a machine's local ranks as one peer: `MachineOptimizer`) ->
`optimizer` (the front) -> the modes (`sync`, `moshpit`, `diloco`, `streaming`) -> `verified`
(verified training: public batches, validators) -> `modes` (their options and interface) ->
`context` (the run) -> `vouching` (whose word counts when donors disagree), `state` (the model's
state) and `progress` (progress records, round notes) -> `schema` (the run schema and its
fingerprint, which parameter servers and pipelines use too). Imports from `potluck.core`,
`potluck.net`, `potluck.dht` and `potluck.averaging` only.
"""

from potluck.optim.context import EpochEvent
from potluck.optim.large_batch import LAMB, LARS, linear_scaling, warmup_linear_scaling
from potluck.optim.machine import LocalGroupLost, MachineOptimizer
from potluck.optim.modes import DiLoCo, Moshpit, Sync
from potluck.optim.optimizer import Optimizer
from potluck.optim.progress import GlobalProgress, ProgressTracker
from potluck.optim.schema import ModelMismatch, RunSchema
from potluck.optim.verified import Verified

__all__ = ["LAMB", "LARS", "DiLoCo", "EpochEvent", "GlobalProgress", "LocalGroupLost", "MachineOptimizer",
           "ModelMismatch", "Moshpit", "Optimizer", "ProgressTracker", "RunSchema", "Sync", "Verified",
           "linear_scaling", "warmup_linear_scaling"]
