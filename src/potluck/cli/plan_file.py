"""The plan file `potluck pipeline plan --write-plan FILE` writes and `potluck pipeline run --plan
FILE` reads: what to train (the run spec), the layer costs it was planned from, and the clusters
with their stages by peer id. Versioned, and checked when read: a plan is often edited by hand
or carried between machines, and a stale or broken one should fail before any node starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from potluck.cli.spec import RunSpec, SpecError
from potluck.core.errors import MalformedMessage
from potluck.core.wire import Field, Int, List, Message, Nested, Number, Text
from potluck.pipeline.messages import MAX_CLUSTERS, MAX_LAYER_INDEX, MAX_NAME_CHARS, MAX_STAGES
from potluck.pipeline.profiling import MAX_PROFILES, LayerCost

# Bumped when a field changes meaning; a reader refuses other versions rather than guess.
PLAN_FILE_VERSION = 1
# A plan file is a few KiB per hundred nodes; this bounds what `read` loads (MAX_PROFILES nodes fit).
MAX_PLAN_BYTES = 16 * 2**20
WHAT = "plan file"


class SpecField(Field):
    """The run spec (`RunSpec`), as plain data."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> RunSpec:
        if not isinstance(value, Mapping):
            raise MalformedMessage(what, f"{key!r} must be a map")
        try:
            return RunSpec.from_dict(dict(value), repr(key))
        except SpecError as e:
            raise MalformedMessage(what, str(e)) from None

    def encode(self, value: RunSpec) -> dict[str, Any]:
        return value.to_dict()


class Version(Int):
    """The plan file's format version: this potluck reads PLAN_FILE_VERSION only."""

    def __init__(self) -> None:
        super().__init__("version", 0, 2**31, default=PLAN_FILE_VERSION)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> int:
        version = super().check(value, key, what, context)
        if version != PLAN_FILE_VERSION:
            raise MalformedMessage(what, f"{key!r}: version {version}, this potluck reads version {PLAN_FILE_VERSION}")
        return version

    def fast(self, v: str) -> str | None:
        return None  # the check refuses other versions


class PlannedStage(Message, what=WHAT):
    """Layers [start, end) of one cluster, held by `peer`."""

    peer: str = Text("peer", MAX_NAME_CHARS)
    start: int = Int("start", 0, MAX_LAYER_INDEX)
    end: int = Int("end", 1, MAX_LAYER_INDEX + 1)


class PlanFile(Message, what=WHAT):
    """What `potluck pipeline run --plan` needs: the run, its spec, the layer costs measured on a
    node of `reference_flops`, and every cluster's stages (checked: they cover the layers in order,
    and no peer has two places)."""

    run_id: str = Text("run_id", MAX_NAME_CHARS)
    spec: RunSpec = SpecField("spec")
    layer_costs: tuple[LayerCost, ...] = List("layer_costs", Nested(None, LayerCost), MAX_LAYER_INDEX)
    reference_flops: float = Number("reference_flops", positive=True)  # FLOP/s of the node that measured layer_costs
    micro_batch: int = Int("micro_batch", 1, 2**31)
    staleness_bound: int = Int("staleness_bound", 1, 2**31)
    clusters: tuple[tuple[PlannedStage, ...], ...] = List(
        "clusters", List(None, Nested(None, PlannedStage), MAX_STAGES), MAX_CLUSTERS)
    standby: tuple[str, ...] = List("standby", Text(None, MAX_NAME_CHARS), MAX_PROFILES)
    version: int = Version()

    @property
    def num_layers(self) -> int:
        return len(self.layer_costs)

    def validate(self, context: Mapping[str, Any]) -> None:
        if not self.clusters:
            raise self.refuse("'clusters' is empty")
        for c, stages in enumerate(self.clusters):
            ends = [0] + [s.end for s in stages]
            if not stages or [s.start for s in stages] != ends[:-1] or ends[-1] != self.num_layers \
                    or any(s.start >= s.end for s in stages):
                raise self.refuse(f"'clusters': cluster {c}'s stages do not cover layers 0-{self.num_layers - 1} "
                                  "in order")
        peers = [s.peer for stages in self.clusters for s in stages] + list(self.standby)
        if len(set(peers)) != len(peers):
            raise self.refuse("a peer appears twice")

    def write(self, path: Path) -> None:
        # the version first and always, for whoever reads or edits the file
        path.write_text(json.dumps({"version": self.version, **self.to_wire()}, indent=1) + "\n")

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
