"""Every message of the pipeline protocol, declared once (`potluck.core.wire.Message`).

Each class gets `to_wire()` (plain msgpack-able data, short keys) and `from_wire(msg, **context)`,
which checks types, sizes and ranges and raises `MalformedMessage` naming the field; handlers only
ever see these classes. A stage that knows its model's size parses with `num_layers=` in the
context, so a layer past the model is refused before anything is built or read. Control calls
share one method per stage and are told apart by their tag (`parse_control`). The DHT records
(layouts, profiles, plans) live with their directories (`layout`, `profiling`, `planning`) and are
declared the same way, with the field types of this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.wire import Bool, Dict, Field, Int, List, Message, Nested, Number, OneOf, Text
from potluck.net.wire import PeerIdField

__all__ = [
    "Ack", "Activation", "CONTROL", "Configure", "ControlMessage", "FailureReport", "GetLayers", "GetStats",
    "Gradient", "LayerKey", "LayerStates", "Payload", "Ping", "ProbeRequest", "Route", "StageReport",
    "TensorField", "parse_control",
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


# -- field types of the pipeline's own shapes (the generic ones are potluck.core.wire's) -----------
class TensorField(Field):
    """A tensor (its values are checked by whoever uses it: labels by the loss)."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise MalformedMessage(what, f"{key!r} must be a tensor")
        return value


class Payload(Field):
    """A codec payload, passed on as a map: its contents are checked when decoded (`Codec.decode`)."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> Mapping:
        if not isinstance(value, Mapping):
            raise MalformedMessage(what, f"{key!r} must be a codec payload (a map)")
        return value

    def fast(self, v: str) -> str | None:
        return f"{v}.__class__ is dict"


class LayerKey(Field):
    """A layer index as a map key: its decimal text on the wire (msgpack and JSON maps alike)."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> int:
        if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 7:
            raise MalformedMessage(what, f"{key!r} keys must be layer numbers")
        return int(value)

    def encode(self, value: int) -> str:
        return str(value)


class TensorMap(Field):
    """At most `max_items` names mapped to tensors (a state dict: `load_state_dict` checks the rest)."""

    def __init__(self, key: str | None = None, max_items: int = MAX_TENSORS_PER_LAYER, **options: Any):
        super().__init__(key, **options)
        self.max_items = max_items

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if not isinstance(value, Mapping) or len(value) > self.max_items or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()):
            raise MalformedMessage(what, f"{key!r} entries must map at most {self.max_items} names to tensors")
        return dict(value)


def model_layers(context: Mapping[str, Any]) -> int:
    """The layers a message may name: the model's (`num_layers` in the context, if the reader
    knows it), at most MAX_LAYER_INDEX."""
    num_layers = context.get("num_layers")
    return MAX_LAYER_INDEX if num_layers is None else min(num_layers, MAX_LAYER_INDEX)


class LayerBound(Int):
    """A stage's first layer or end, at most the model's size; past it is refused saying so."""

    def __init__(self, key: str, low: int):
        super().__init__(key, low, lambda context: model_layers(context) + 1)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> int:
        num_layers = context.get("num_layers")
        if num_layers is not None and value.__class__ is int and value > num_layers:
            raise MalformedMessage(what, f"{key!r} is {value}, past the model's {num_layers} layers")
        return super().check(value, key, what, context)


def shape(key: str) -> List:
    """A per-sample shape (batch aside)."""
    return List(key, Int(None, 1, MAX_DIM), MAX_SHAPE_DIMS)


# -- replies and the route -------------------------------------------------------------------------
class Ack(Message, what="ack"):
    """The reply to a message that needs no answer: `ok` False if it was dropped (old epoch)."""

    ok: bool = Bool("ok", default=True)


class Route(Message, what="route"):
    """What a stage is told to be: layers [start, end) of cluster `cluster` in `epoch`, its
    neighbours (None at the ends), the per-sample shapes it receives and sends, who to report
    failures to and where to fetch layers it lacks. Peers are named by id only: the transport
    finds their addresses through their signed peer records in the DHT. With `num_layers` in the
    context (the model's size), layers past it are refused too."""

    epoch: int = Int("epoch", 0, MAX_COUNTER)
    cluster: str = Text("cluster", MAX_NAME_CHARS)
    stage: int = Int("stage", 0, MAX_STAGES)
    start: int = LayerBound("start", 0)
    end: int = LayerBound("end", 1)
    prev_peer: str | None = PeerIdField("prev", text=True, optional=True)
    next_peer: str | None = PeerIdField("next", text=True, optional=True)
    in_shape: tuple[int, ...] = shape("in_shape")
    out_shape: tuple[int, ...] = shape("out_shape")
    controller: str | None = PeerIdField("controller", text=True, default=None)
    report_method: str | None = Text("report_method", MAX_NAME_CHARS, default=None)
    # profiled seconds per sample, forward + backward (emulate_compute)
    compute_seconds: float = Number("compute_seconds", default=0.0)
    # layer -> holders elsewhere
    sources: Mapping[int, tuple[str, ...]] = Dict("sources", LayerKey(),
                                                  List(None, PeerIdField(text=True), MAX_CLUSTERS + 1),
                                                  MAX_STAGE_LAYERS, pairs=False)

    @property
    def first(self) -> bool:
        return self.prev_peer is None

    @property
    def last(self) -> bool:
        return self.next_peer is None

    def validate(self, context: Mapping[str, Any]) -> None:
        last = min(self.start + MAX_STAGE_LAYERS, model_layers(context))
        if not self.start < self.end <= last:
            raise self.refuse(f"'end' must be an integer in [{self.start + 1}, {last + 1})")
        if not all(self.start <= layer < self.end for layer in self.sources):
            raise self.refuse(f"'sources' keys must be layers in [{self.start}, {self.end})")


class StageReport(Message, what="stage report"):
    """A stage's counters, as `stats` returns them (busy seconds, updates, staleness...)."""

    busy_seconds: float = Number("busy_seconds", default=0.0)
    forwards: int = Int("forwards", 0, MAX_COUNTER, default=0)
    backwards: int = Int("backwards", 0, MAX_COUNTER, default=0)
    updates: int = Int("updates", 0, MAX_COUNTER, default=0)
    max_in_flight: int = Int("max_in_flight", 0, MAX_COUNTER, default=0)
    max_version_lag: int = Int("max_version_lag", 0, MAX_COUNTER, default=0)
    rounds: int = Int("rounds", 0, MAX_COUNTER, default=0)
    rounds_applied: int = Int("rounds_applied", 0, MAX_COUNTER, default=0)
    loss: float | None = Number("loss", signed=True, default=None)  # mean of the last losses (last stage only)
    stage: int | None = Int("stage", 0, MAX_STAGES, default=None)


class LayerStates(Message, what="layer states"):
    """The reply to `GetLayers`: each layer's state dict (checked strictly again by
    `load_state_dict`); parsed with `wanted=` (the layers asked for) in the context."""

    states: Mapping[int, Mapping[str, torch.Tensor]] = Dict(
        "state", LayerKey(), TensorMap(), lambda context: len(context["wanted"]), pairs=False)

    def validate(self, context: Mapping[str, Any]) -> None:
        if set(self.states) != set(context["wanted"]):
            raise self.refuse(f"'state' must hold exactly layers {list(context['wanted'])}")


# -- control: one method per stage, a tag per message ----------------------------------------------
class Ping(Message, what="ping", tag=("op", "ping")):
    """Are you alive? (heartbeats, ring members checking a silent neighbour)."""


class GetStats(Message, what="stats request", tag=("op", "stats")):
    """Ask for the stage's `StageReport`."""


class Configure(Message, what="configure", tag=("op", "configure")):
    """Take the stage `route` describes (from the cluster's controller)."""

    route: Route = Nested("route", Route)


class GetLayers(Message, what="get_layers", tag=("op", "get_layers")):
    """Send me these layers' weights (a stage taking over layers this node holds or held)."""

    layers: tuple[int, ...] = List("layers", Int(None, 0, model_layers), MAX_STAGE_LAYERS)


ControlMessage = Ping | GetStats | Configure | GetLayers
CONTROL = OneOf("control message", Ping, GetStats, Configure, GetLayers)


def parse_control(msg: Any, num_layers: int | None = None) -> ControlMessage:
    """The control message `msg` is; with `num_layers` (the model's size), a `Configure` or
    `GetLayers` naming a layer past the model is refused here, before anything is built or read."""
    return CONTROL.from_wire(msg, num_layers=num_layers)


# -- the pipeline's data ---------------------------------------------------------------------------
class Activation(Message, what="activation"):
    """Micro-batch `micro_batch`'s activation (a codec payload) and labels, sent to the next stage."""

    epoch: int = Int("epoch", 0, MAX_COUNTER)
    micro_batch: int = Int("mb", 0, MAX_COUNTER)
    payload: Mapping[str, Any] = Payload("x")
    labels: torch.Tensor = TensorField("y")


class Gradient(Message, what="gradient"):
    """The gradient of micro-batch `micro_batch`'s activation (a codec payload), sent back."""

    epoch: int = Int("epoch", 0, MAX_COUNTER)
    micro_batch: int = Int("mb", 0, MAX_COUNTER)
    payload: Mapping[str, Any] = Payload("g")


class FailureReport(Message, what="cluster report", tag=("op", "failure")):
    """A stage tells its controller that sending to `peer` failed in `epoch`."""

    peer: str = PeerIdField("peer", text=True)
    epoch: int = Int("epoch", 0, MAX_COUNTER)


# -- profiling probes -------------------------------------------------------------------------------
class ProbeRequest(Message, what="probe"):
    """A bandwidth / latency probe: answer with `reply_bytes` bytes (at most the `limit` the
    answering node gives in the context)."""

    reply_bytes: int = Int("reply_bytes", 0, lambda context: context["limit"] + 1, default=0)
