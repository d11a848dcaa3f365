"""Every DHT key and RPC method name of a run, derived from its run id in this one place.

A run id names one training run: the Optimizer's, an Averager's, a pipeline's, a parameter
server's, a sweep's. Each protocol that serves a run takes its names from `RunNames(run_id)`, so
following a run id through the code means reading this file, and `dht.key_kinds` builds the
patterns of its key rules from the same templates (`pattern`). A run's averagers are told apart
by name (`RunNames.averager("grads")`): the Optimizer's state, gradients and DiLoCo deltas, and
an `Averager` of the user's, all live in one namespace, the run's.

Names that belong to no run (the DHT's methods, the all-reduce service that every run's averagers
share, relays, hole punching, expert uids) are declared by their protocols; the one DHT key among
them that a key rule names (`RELAYS`) is here, and so is `PS_RUNS`, the method that asks a peer
which parameter-server runs it serves (a worker whose run id names no servers calls it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["AVERAGER_NAME", "MAX_RUN_ID_CHARS", "PS_RUNS", "RELAYS", "TEMPLATES", "AveragerNames",
           "PipelineNames", "RunNames", "check_run_id", "pattern"]

# Run ids travel in every key and method of the run, and in membership tokens; 128 characters is
# plenty for a name a person chooses.
MAX_RUN_ID_CHARS = 128
# An averager's name within its run: a word (no dot), so that key patterns can tell it apart.
AVERAGER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# The templates, by what they name. DHT keys:
PROGRESS = "{run}.progress"  # progress records (optim.progress)
ROUNDS = "{run}.rounds"  # round records, for monitors (optim.progress)
DECLARATIONS = "{run}.avg.{averager}.match.{group}"  # matchmaking declarations (averaging.matchmaking)
DONORS = "{run}.avg.{averager}.donors"  # state donor records (averaging.state_transfer)
PIPELINE_PROFILES = "{run}.pipeline.profiles"  # node profiles (pipeline.profiling)
PIPELINE_LAYOUT = "{run}.pipeline.layout"  # cluster layouts (pipeline.layout)
PIPELINE_PLAN = "{run}.pipeline.plan"  # the published plan (pipeline.planning)
PS_SERVERS = "{run}.ps.servers"  # shard server announcements (ps.discovery)
SWEEP_LEASES = "{run}.sweep.{sweep}.leases"  # trial leases (ps.sweep)
SWEEP_RESULTS = "{run}.sweep.{sweep}.results"  # trial results (ps.sweep)
REVOKED = "{run}.membership.revoked{authority}"  # an authority's revocation list (membership)
RELAYS = "nat.relays"  # relay announcements (nat.relays): every run's, so no run's
# RPC methods:
PROGRESS_PUSH = "{run}.progress.push"  # reports sent straight to the last group's members
JOIN = "{run}.avg.{averager}.join"  # asking a matchmaking leader to join its group
MANIFEST = "{run}.avg.{averager}.manifest"  # a state donor's manifest
CHUNKS = "{run}.avg.{averager}.chunks"  # a state donor's chunks (a stream)
PIPELINE_FORWARD = "{run}.pipeline.fwd"  # activations to a stage
PIPELINE_BACKWARD = "{run}.pipeline.bwd"  # gradients back to a stage
PIPELINE_CONTROL = "{run}.pipeline.ctl"  # a stage's control calls (and its ring's)
PIPELINE_RING = "{run}.pipeline.ring"  # multi-ring all-reduce parts
PIPELINE_CLAIM = "{run}.pipeline.claim"  # standby claims
PIPELINE_REPORT = "{run}.pipeline.cluster.{cluster}"  # failure reports to a cluster's controller
PS_SHARD = "{run}.ps.{shard}.{verb}"  # a parameter server shard's calls
PS_RUNS = "ps.runs"  # which parameter-server runs a peer serves (ps.runs): asked before the run is known

# Every template, for the key rules and for the test that every name of a run comes from here.
TEMPLATES: tuple[str, ...] = (
    PROGRESS, ROUNDS, DECLARATIONS, DONORS, PIPELINE_PROFILES, PIPELINE_LAYOUT, PIPELINE_PLAN, PS_SERVERS,
    SWEEP_LEASES, SWEEP_RESULTS, REVOKED, RELAYS, PROGRESS_PUSH, JOIN, MANIFEST, CHUNKS, PIPELINE_FORWARD,
    PIPELINE_BACKWARD, PIPELINE_CONTROL, PIPELINE_RING, PIPELINE_CLAIM, PIPELINE_REPORT, PS_SHARD, PS_RUNS,
)

# What each field of a template may hold, in a pattern: a run id anything (it comes first), an
# averager's name one word, and the rest anything up to the next dot (the last: anything).
_FIELD_PATTERNS = {"run": ".+", "averager": "[^.]+", "shard": "[0-9]+"}
_FIELD = re.compile(r"\{(\w+)\}")


def check_run_id(run_id: str) -> str:
    """`run_id` if it can name a run (ValueError otherwise): a non-empty string of at most
    MAX_RUN_ID_CHARS printable characters, no spaces."""
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_CHARS or not run_id.isprintable() \
            or any(c.isspace() for c in run_id):
        raise ValueError(f"a run id must be 1 to {MAX_RUN_ID_CHARS} printable characters without spaces, "
                         f"got {run_id!r:.200}")
    return run_id


def pattern(template: str, **fixed: str) -> re.Pattern[str]:
    """A regular expression that matches exactly the names `template` makes (whole names), with
    the `fixed` fields (e.g. `run="my-run"`) holding exactly those values."""
    parts, last = [], 0
    for match in _FIELD.finditer(template):
        parts.append(re.escape(template[last:match.start()]))
        at_end = match.end() == len(template)
        field = match.group(1)
        parts.append(re.escape(fixed[field]) if field in fixed
                     else _FIELD_PATTERNS.get(field, ".+" if at_end else "[^.]*"))
        last = match.end()
    parts.append(re.escape(template[last:]))
    return re.compile(r"\A" + "".join(parts) + r"\Z")


@dataclass(frozen=True)
class AveragerNames:
    """The names of one averager of a run: its matchmaking, its state donors."""

    run_id: str
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or AVERAGER_NAME.fullmatch(self.name) is None:
            raise ValueError(f"an averager's name must be 1 to 64 letters, digits, '_' or '-', got {self.name!r:.100}")

    def _fill(self, template: str, **fields: object) -> str:
        return template.format(run=self.run_id, averager=self.name, **fields)

    def declarations(self, group: str) -> str:
        """The DHT key where peers averaging under `group` (an epoch, a grid line) declare themselves."""
        return self._fill(DECLARATIONS, group=group)

    @property
    def donors(self) -> str:
        return self._fill(DONORS)

    @property
    def join(self) -> str:
        return self._fill(JOIN)

    @property
    def manifest(self) -> str:
        return self._fill(MANIFEST)

    @property
    def chunks(self) -> str:
        return self._fill(CHUNKS)


@dataclass(frozen=True)
class PipelineNames:
    """The names of a run's Ravnest pipeline."""

    run_id: str

    @property
    def profiles(self) -> str:
        return PIPELINE_PROFILES.format(run=self.run_id)

    @property
    def layout(self) -> str:
        return PIPELINE_LAYOUT.format(run=self.run_id)

    @property
    def plan(self) -> str:
        return PIPELINE_PLAN.format(run=self.run_id)

    @property
    def forward(self) -> str:
        return PIPELINE_FORWARD.format(run=self.run_id)

    @property
    def backward(self) -> str:
        return PIPELINE_BACKWARD.format(run=self.run_id)

    @property
    def control(self) -> str:
        return PIPELINE_CONTROL.format(run=self.run_id)

    @property
    def ring(self) -> str:
        return PIPELINE_RING.format(run=self.run_id)

    @property
    def claim(self) -> str:
        return PIPELINE_CLAIM.format(run=self.run_id)

    def report(self, cluster: str) -> str:
        """Where a cluster's stages report failures to its controller."""
        return PIPELINE_REPORT.format(run=self.run_id, cluster=cluster)


@dataclass(frozen=True)
class RunNames:
    """Every DHT key and RPC method of the run `run_id` (checked: `check_run_id`)."""

    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def progress(self) -> str:
        return PROGRESS.format(run=self.run_id)

    @property
    def progress_push(self) -> str:
        return PROGRESS_PUSH.format(run=self.run_id)

    @property
    def rounds(self) -> str:
        return ROUNDS.format(run=self.run_id)

    def averager(self, name: str) -> AveragerNames:
        """The names of the run's averager `name` (peers average together under one run and name)."""
        return AveragerNames(self.run_id, name)

    @property
    def pipeline(self) -> PipelineNames:
        return PipelineNames(self.run_id)

    @property
    def ps_servers(self) -> str:
        return PS_SERVERS.format(run=self.run_id)

    def ps_shard(self, shard: int, verb: str) -> str:
        """A parameter server shard's method: several shards (and standbys) can share a peer."""
        return PS_SHARD.format(run=self.run_id, shard=int(shard), verb=verb)

    def sweep_leases(self, sweep: str) -> str:
        return SWEEP_LEASES.format(run=self.run_id, sweep=sweep)

    def sweep_results(self, sweep: str) -> str:
        return SWEEP_RESULTS.format(run=self.run_id, sweep=sweep)

    def revoked(self, authority_marker: str) -> str:
        """The key of an authority's revocation list (`authority_marker`: its owner marker)."""
        return REVOKED.format(run=self.run_id, authority=authority_marker)
