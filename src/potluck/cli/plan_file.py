"""The plan file `potluck pipeline plan --write-plan FILE` writes and `potluck pipeline run --plan
FILE` reads: what to train (the run spec), the layer costs it was planned from, and the clusters
with their stages by peer id. Versioned, and checked when read: a plan is often edited by hand
or carried between machines, and a stale or broken one should fail before any node starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from potluck.cli.spec import RunSpec, SpecError
from potluck.core.errors import MalformedMessage
from potluck.core.wire import int_field, list_field, list_value, number_field, text_field, wire_map
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_LAYER_INDEX, MAX_NAME_CHARS, MAX_STAGES
from potluck.pipeline.profiling import MAX_PROFILES, LayerCost

# Bumped when a field changes meaning; a reader refuses other versions rather than guess.
PLAN_FILE_VERSION = 1
# A plan file is a few KiB per hundred nodes; this bounds what `read` loads (MAX_PROFILES nodes fit).
MAX_PLAN_BYTES = 16 * 2**20
WHAT = "plan file"


@dataclass(frozen=True)
class PlannedStage:
    """Layers [start, end) of one cluster, held by `peer`."""

    peer: str
    start: int
    end: int

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer, "start": self.start, "end": self.end}

    @classmethod
    def from_wire(cls, data: Any) -> PlannedStage:
        data = wire_map(data, WHAT)
        return cls(text_field(data, "peer", WHAT, MAX_NAME_CHARS), int_field(data, "start", WHAT, 0, MAX_LAYER_INDEX),
                   int_field(data, "end", WHAT, 1, MAX_LAYER_INDEX + 1))


@dataclass(frozen=True)
class PlanFile:
    run_id: str
    spec: RunSpec
    layer_costs: tuple[LayerCost, ...]
    reference_flops: float              # FLOP/s of the node that measured layer_costs
    micro_batch: int
    staleness_bound: int
    clusters: tuple[tuple[PlannedStage, ...], ...]
    standby: tuple[str, ...] = ()
    version: int = PLAN_FILE_VERSION

    @property
    def num_layers(self) -> int:
        return len(self.layer_costs)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "run_id": self.run_id, "spec": self.spec.to_dict(),
                "layer_costs": [c.to_wire() for c in self.layer_costs], "reference_flops": self.reference_flops,
                "micro_batch": self.micro_batch, "staleness_bound": self.staleness_bound,
                "clusters": [[s.to_wire() for s in stages] for stages in self.clusters],
                "standby": list(self.standby)}

    @classmethod
    def from_wire(cls, data: Any) -> PlanFile:
        data = wire_map(data, WHAT)
        version = int_field(data, "version", WHAT, 0, 2**31)
        if version != PLAN_FILE_VERSION:
            raise MalformedMessage(WHAT, f"version {version}, this potluck reads version {PLAN_FILE_VERSION}")
        try:
            spec = RunSpec.from_dict(dict(wire_map(data.get("spec"), WHAT)), f"{WHAT} 'spec'")
        except SpecError as e:
            raise MalformedMessage(WHAT, str(e)) from None
        plan = cls(
            run_id=text_field(data, "run_id", WHAT, MAX_NAME_CHARS), spec=spec,
            layer_costs=tuple(list_field(data, "layer_costs", WHAT, MAX_LAYER_INDEX, each=LayerCost.from_wire)),
            reference_flops=number_field(data, "reference_flops", WHAT, positive=True),
            micro_batch=int_field(data, "micro_batch", WHAT, 1, 2**31),
            staleness_bound=int_field(data, "staleness_bound", WHAT, 1, 2**31),
            clusters=tuple(tuple(list_value(c, "clusters", WHAT, MAX_STAGES, each=PlannedStage.from_wire))
                           for c in list_field(data, "clusters", WHAT, MAX_CLUSTERS)),
            standby=tuple(list_field(data, "standby", WHAT, MAX_PROFILES,
                                     each=lambda p: text_field({"standby": p}, "standby", WHAT, MAX_NAME_CHARS))),
            version=version)
        plan._check()
        return plan

    def _check(self) -> None:
        """Every cluster's stages cover the layers in order, and no peer has two places."""
        if not self.clusters:
            raise MalformedMessage(WHAT, "'clusters' is empty")
        for c, stages in enumerate(self.clusters):
            ends = [0] + [s.end for s in stages]
            if not stages or [s.start for s in stages] != ends[:-1] or ends[-1] != self.num_layers \
                    or any(s.start >= s.end for s in stages):
                raise MalformedMessage(WHAT, f"cluster {c}'s stages do not cover layers 0-{self.num_layers - 1} "
                                             "in order")
        peers = [s.peer for stages in self.clusters for s in stages] + list(self.standby)
        if len(set(peers)) != len(peers):
            raise MalformedMessage(WHAT, "a peer appears twice")

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_wire(), indent=1) + "\n")

    @classmethod
    def read(cls, path: Path) -> PlanFile:
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_PLAN_BYTES + 1)
        except OSError as e:
            raise SpecError(f"plan {path}: {e.strerror}") from e
        if len(raw) > MAX_PLAN_BYTES:
            raise SpecError(f"plan {path}: larger than {MAX_PLAN_BYTES} bytes")
        try:
            return cls.from_wire(json.loads(raw))
        except (ValueError, MalformedMessage) as e:
            raise SpecError(f"plan {path}: {e}") from e
