"""Every message of the pipeline protocol, as typed values checked once, at parse time.

Each class has `to_wire()` (plain msgpack-able data, short keys) and `from_wire()`, which checks
types, sizes and ranges and raises `MalformedMessage` naming the field; handlers only ever see
these classes. Control calls share one method per stage, so their tag is read from one table
(`CONTROL_MESSAGES`) in `parse_control`. The DHT records (layouts, profiles) live with their
directories (`layout`, `profiling`) and use the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.wire import (
    bool_field,
    int_field,
    int_value,
    list_field,
    list_value,
    number_field,
    text_field,
    wire_map,
)
from potluck.net.wire import peer_id_value

__all__ = [
    "Ack", "Activation", "CONTROL_MESSAGES", "Configure", "ControlMessage", "FailureReport", "GetLayers", "GetStats",
    "Gradient", "LayerStates", "Ping", "ProbeRequest", "Route", "StageReport", "parse_control",
]

# Counters (epochs, micro-batch ids, ring rounds) never wrap in a run and must fit msgpack's int64.
MAX_COUNTER = 2**62
# Layer indices: 2^20 layers is far past any model split into stages (GPT-3 has 96 blocks).
MAX_LAYER_INDEX = 2**20
# A stage builds one module per layer it is given, so a route or request naming more layers than
# this (e.g. end=200000) is refused before anything is built. A stage that knows its model's size
# (`StageWorker` always does) also refuses any layer past it, at parse time (`parse_control`).
MAX_STAGE_LAYERS = 4096
# Stages per cluster: a pipeline deeper than this spends longer filling than computing.
MAX_STAGES = 256
# Clusters whose layouts are read (and so members of one ring); each adds a copy of the model.
MAX_CLUSTERS = 256
# Per-sample shapes at stage boundaries: batch aside, activations have at most a handful of dims.
MAX_SHAPE_DIMS = 8
MAX_DIM = 2**31
# Cluster ids and method names are chosen by the controller; this is room for any sane one.
MAX_NAME_CHARS = 256
# Parameters and buffers per layer in a `get_layers` reply (a transformer block has about 20).
MAX_TENSORS_PER_LAYER = 4096


# -- field checks of the pipeline's own shapes (the generic ones are potluck.core.wire's) ----------
def peer_text(value: Any, key: str, what: str, *, optional: bool = False) -> str | None:
    """A peer id kept in its text form (routes and layouts name peers as text), parsed so a later
    dial cannot fail on it; None if None and `optional`."""
    if value is None and optional:
        return None
    peer_id_value(value, key, what)
    return value


def shape_field(msg: Mapping, key: str, what: str) -> tuple[int, ...]:
    return tuple(list_field(msg, key, what, MAX_SHAPE_DIMS, each=lambda d: int_value(d, key, what, 1, MAX_DIM)))


def _tensor(msg: Mapping, key: str, what: str) -> torch.Tensor:
    value = msg.get(key)
    if not isinstance(value, torch.Tensor):
        raise MalformedMessage(what, f"'{key}' must be a tensor")
    return value


def _payload(msg: Mapping, key: str, what: str) -> Mapping:
    """A codec payload: its contents are checked when decoded (`Codec.decode`)."""
    value = msg.get(key)
    if not isinstance(value, Mapping):
        raise MalformedMessage(what, f"'{key}' must be a codec payload (a map)")
    return value


# -- replies and the route -------------------------------------------------------------------------
@dataclass(frozen=True)
class Ack:
    """The reply to a message that needs no answer: `ok` False if it was dropped (old epoch)."""

    ok: bool = True

    def to_wire(self) -> dict:
        return {"ok": self.ok}

    @classmethod
    def from_wire(cls, msg: Any) -> Ack:
        return cls(bool_field(wire_map(msg, "ack"), "ok", "ack"))


@dataclass(frozen=True)
class Route:
    """What a stage is told to be: layers [start, end) of cluster `cluster` in `epoch`, its
    neighbours (None at the ends), the per-sample shapes it receives and sends, who to report
    failures to and where to fetch layers it lacks. Peers are named by id only: the transport
    finds their addresses through their signed peer records in the DHT."""

    epoch: int
    cluster: str
    stage: int
    start: int
    end: int
    prev_peer: str | None
    next_peer: str | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    controller: str | None = None
    report_method: str | None = None
    compute_seconds: float = 0.0  # profiled seconds per sample, forward + backward (emulate_compute)
    sources: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # layer -> holders elsewhere

    @property
    def first(self) -> bool:
        return self.prev_peer is None

    @property
    def last(self) -> bool:
        return self.next_peer is None

    def to_wire(self) -> dict:
        return {"epoch": self.epoch, "cluster": self.cluster, "stage": self.stage, "start": self.start,
                "end": self.end, "prev": self.prev_peer, "next": self.next_peer, "in_shape": list(self.in_shape),
                "out_shape": list(self.out_shape), "controller": self.controller,
                "report_method": self.report_method, "compute_seconds": self.compute_seconds,
                "sources": {str(i): list(p) for i, p in self.sources.items()}}

    @classmethod
    def from_wire(cls, msg: Any, num_layers: int | None = None) -> Route:
        """Parsed and checked; with `num_layers` (the model's size), layers past it are refused too."""
        what = "route"
        msg = wire_map(msg, what)
        model_end = MAX_LAYER_INDEX if num_layers is None else min(num_layers, MAX_LAYER_INDEX)
        for key in ("start", "end"):
            value = msg.get(key)
            if num_layers is not None and isinstance(value, int) and value > num_layers:
                raise MalformedMessage(what, f"{key!r} is {value}, past the model's {num_layers} layers")
        start = int_field(msg, "start", what, 0, model_end)
        end = int_field(msg, "end", what, start + 1, min(start + MAX_STAGE_LAYERS, model_end) + 1)
        raw_sources = msg.get("sources", {})
        if not isinstance(raw_sources, Mapping) or len(raw_sources) > end - start:
            raise MalformedMessage(what, "'sources' must map at most one entry per layer of the stage")
        sources = {}
        for layer, holders in raw_sources.items():
            if not isinstance(layer, str) or not layer.isdigit() or not start <= int(layer) < end:
                raise MalformedMessage(what, f"'sources' keys must be layers in [{start}, {end})")
            sources[int(layer)] = tuple(list_value(holders, "sources", what, MAX_CLUSTERS + 1,
                                                   each=lambda p: peer_text(p, "sources", what)))
        return cls(epoch=int_field(msg, "epoch", what, 0, MAX_COUNTER),
                   cluster=text_field(msg, "cluster", what, MAX_NAME_CHARS),
                   stage=int_field(msg, "stage", what, 0, MAX_STAGES), start=start, end=end,
                   prev_peer=peer_text(msg.get("prev"), "prev", what, optional=True),
                   next_peer=peer_text(msg.get("next"), "next", what, optional=True),
                   in_shape=shape_field(msg, "in_shape", what), out_shape=shape_field(msg, "out_shape", what),
                   controller=peer_text(msg.get("controller"), "controller", what, optional=True),
                   report_method=text_field(msg, "report_method", what, MAX_NAME_CHARS, optional=True),
                   compute_seconds=number_field(msg, "compute_seconds", what, default=0.0), sources=sources)


@dataclass(frozen=True)
class StageReport:
    """A stage's counters, as `stats` returns them (busy seconds, updates, staleness...)."""

    busy_seconds: float = 0.0
    forwards: int = 0
    backwards: int = 0
    updates: int = 0
    max_in_flight: int = 0
    max_version_lag: int = 0
    rounds: int = 0
    rounds_applied: int = 0
    loss: float | None = None  # mean of the last losses (last stage only)
    stage: int | None = None

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> StageReport:
        what = "stage report"
        msg = wire_map(msg, what)
        counts = {k: int_field(msg, k, what, 0, MAX_COUNTER) for k in
                  ("forwards", "backwards", "updates", "max_in_flight", "max_version_lag", "rounds",
                   "rounds_applied")}
        loss = number_field(msg, "loss", what, optional=True, signed=True)
        stage = None if msg.get("stage") is None else int_field(msg, "stage", what, 0, MAX_STAGES)
        return cls(busy_seconds=number_field(msg, "busy_seconds", what), loss=loss, stage=stage, **counts)


@dataclass(frozen=True)
class LayerStates:
    """The reply to `GetLayers`: each layer's state dict (checked strictly again by `load_state_dict`)."""

    states: Mapping[int, Mapping[str, torch.Tensor]]

    def to_wire(self) -> dict:
        return {"state": {str(i): dict(s) for i, s in self.states.items()}}

    @classmethod
    def from_wire(cls, msg: Any, wanted: tuple[int, ...]) -> LayerStates:
        what = "layer states"
        state = wire_map(msg, what).get("state")
        if not isinstance(state, Mapping) or set(state) != {str(i) for i in wanted}:
            raise MalformedMessage(what, f"'state' must hold exactly layers {list(wanted)}")
        out = {}
        for i in wanted:
            tensors = state[str(i)]
            if not isinstance(tensors, Mapping) or len(tensors) > MAX_TENSORS_PER_LAYER or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
                raise MalformedMessage(what, f"'state' of layer {i} must map at most {MAX_TENSORS_PER_LAYER} "
                                             "names to tensors")
            out[i] = dict(tensors)
        return cls(out)


# -- control: one method per stage, a tag per message ----------------------------------------------
@dataclass(frozen=True)
class Ping:
    """Are you alive? (heartbeats, ring members checking a silent neighbour)."""

    TAG: ClassVar[str] = "ping"

    def to_wire(self) -> dict:
        return {"op": self.TAG}

    @classmethod
    def from_wire(cls, msg: Mapping) -> Ping:
        return cls()


@dataclass(frozen=True)
class GetStats:
    """Ask for the stage's `StageReport`."""

    TAG: ClassVar[str] = "stats"

    def to_wire(self) -> dict:
        return {"op": self.TAG}

    @classmethod
    def from_wire(cls, msg: Mapping) -> GetStats:
        return cls()


@dataclass(frozen=True)
class Configure:
    """Take the stage `route` describes (from the cluster's controller)."""

    route: Route
    TAG: ClassVar[str] = "configure"

    def to_wire(self) -> dict:
        return {"op": self.TAG, "route": self.route.to_wire()}

    @classmethod
    def from_wire(cls, msg: Mapping, num_layers: int | None = None) -> Configure:
        return cls(Route.from_wire(msg.get("route"), num_layers))


@dataclass(frozen=True)
class GetLayers:
    """Send me these layers' weights (a stage taking over layers this node holds or held)."""

    layers: tuple[int, ...]
    TAG: ClassVar[str] = "get_layers"

    def to_wire(self) -> dict:
        return {"op": self.TAG, "layers": list(self.layers)}

    @classmethod
    def from_wire(cls, msg: Mapping, num_layers: int | None = None) -> GetLayers:
        what = "get_layers"
        end = MAX_LAYER_INDEX if num_layers is None else min(num_layers, MAX_LAYER_INDEX)
        return cls(tuple(list_field(msg, "layers", what, MAX_STAGE_LAYERS,
                                    each=lambda i: int_value(i, "layers", what, 0, end))))


ControlMessage = Ping | GetStats | Configure | GetLayers
# The wire tag of each control message: the one place a tag is compared.
CONTROL_MESSAGES: dict[str, type[ControlMessage]] = {c.TAG: c for c in (Ping, GetStats, Configure, GetLayers)}


def parse_control(msg: Any, num_layers: int | None = None) -> ControlMessage:
    """The control message `msg` is; with `num_layers` (the model's size), a `Configure` or
    `GetLayers` naming a layer past the model is refused here, before anything is built or read."""
    op = wire_map(msg, "control message").get("op")
    kind = CONTROL_MESSAGES.get(op) if isinstance(op, str) else None
    if kind is None:
        raise MalformedMessage("control message", f"'op' must be one of {sorted(CONTROL_MESSAGES)}")
    if kind is Configure or kind is GetLayers:
        return kind.from_wire(msg, num_layers)
    return kind.from_wire(msg)


# -- the pipeline's data ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Activation:
    """Micro-batch `micro_batch`'s activation (a codec payload) and labels, sent to the next stage."""

    epoch: int
    micro_batch: int
    payload: Mapping[str, Any]
    labels: torch.Tensor

    def to_wire(self) -> dict:
        return {"epoch": self.epoch, "mb": self.micro_batch, "x": self.payload, "y": self.labels}

    @classmethod
    def from_wire(cls, msg: Any) -> Activation:
        what = "activation"
        msg = wire_map(msg, what)
        return cls(int_field(msg, "epoch", what, 0, MAX_COUNTER), int_field(msg, "mb", what, 0, MAX_COUNTER),
                   _payload(msg, "x", what), _tensor(msg, "y", what))


@dataclass(frozen=True)
class Gradient:
    """The gradient of micro-batch `micro_batch`'s activation (a codec payload), sent back."""

    epoch: int
    micro_batch: int
    payload: Mapping[str, Any]

    def to_wire(self) -> dict:
        return {"epoch": self.epoch, "mb": self.micro_batch, "g": self.payload}

    @classmethod
    def from_wire(cls, msg: Any) -> Gradient:
        what = "gradient"
        msg = wire_map(msg, what)
        return cls(int_field(msg, "epoch", what, 0, MAX_COUNTER), int_field(msg, "mb", what, 0, MAX_COUNTER),
                   _payload(msg, "g", what))


@dataclass(frozen=True)
class FailureReport:
    """A stage tells its controller that sending to `peer` failed in `epoch`."""

    peer: str
    epoch: int
    TAG: ClassVar[str] = "failure"

    def to_wire(self) -> dict:
        return {"op": self.TAG, "peer": self.peer, "epoch": self.epoch}

    @classmethod
    def from_wire(cls, msg: Any) -> FailureReport:
        what = "cluster report"
        msg = wire_map(msg, what)
        if msg.get("op") != cls.TAG:
            raise MalformedMessage(what, f"'op' must be {cls.TAG!r}")
        return cls(peer_text(msg.get("peer"), "peer", what), int_field(msg, "epoch", what, 0, MAX_COUNTER))


# -- profiling probes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeRequest:
    """A bandwidth / latency probe: answer with `reply_bytes` bytes (capped by the caller's limit)."""

    reply_bytes: int = 0

    def to_wire(self) -> dict:
        return {"reply_bytes": self.reply_bytes} if self.reply_bytes else {}

    @classmethod
    def from_wire(cls, msg: Any, limit: int) -> ProbeRequest:
        msg = wire_map(msg, "probe")
        return cls(int_field(msg, "reply_bytes", "probe", 0, limit + 1) if "reply_bytes" in msg else 0)
