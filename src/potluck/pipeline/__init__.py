"""Ravnest-style training of a model no single node holds (`potluck.pipeline`).

Owns node profiling (`profiling`), cluster formation (`clustering`), model partitioning
(`partition`), the zero-bubble asynchronous pipeline (`schedule`: pure rules, `stash`: exact weight
stashing, `stage`: workers over the transport, `messages`: its typed wire messages), the parallel
multi-ring all-reduce between clusters (`ring`), cluster layouts in the DHT (`layout`) and failure
handling (`recovery`). Imports from `potluck.core`, `potluck.net`,
`potluck.dht` and `potluck.compression` only. See docs/pipeline.md.
"""

from potluck.pipeline.clustering import ClusterPlan, ModelDemand, form_clusters
from potluck.pipeline.layout import Layout, LayoutDirectory, Span
from potluck.pipeline.messages import Route
from potluck.pipeline.partition import Partition, Stage, boundary_shapes, partition_layers, sequential_layers
from potluck.pipeline.profiling import LayerCost, NodeProfile, profile_layers
from potluck.pipeline.recovery import ClusterController
from potluck.pipeline.ring import RingAllReduce, ring_segments
from potluck.pipeline.schedule import StageSchedule, simulate
from potluck.pipeline.stage import PipelineConfig, PipelineError, StageWorker
from potluck.pipeline.stash import StashedWeights

__all__ = [
    "ClusterController", "ClusterPlan", "LayerCost", "Layout", "LayoutDirectory", "ModelDemand", "NodeProfile",
    "Partition", "PipelineConfig", "PipelineError", "RingAllReduce", "Route", "Span", "Stage", "StageSchedule",
    "StageWorker", "StashedWeights", "boundary_shapes", "form_clusters", "partition_layers", "profile_layers",
    "ring_segments", "sequential_layers", "simulate",
]
