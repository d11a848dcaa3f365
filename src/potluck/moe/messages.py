"""Every message of the mixture-of-experts protocol, as typed values checked once, at parse time.

Each class has `to_wire()` (plain msgpack-able data) and `from_wire()`, which checks types, sizes
and ranges with the shared checks (`potluck.core.wire`) and raises `MalformedMessage` naming the
field; the expert server's handlers and the client only ever see these classes.

Requests are checked against the expert they address: exactly its declared number of tensors,
each of its declared dtype and per-sample shape, 1 to `max_rows` rows, and finite (a NaN or
infinite input or gradient would end up in the expert's weights at its next optimizer step). So
a request's tensors hold at most `max_rows` times the declared elements per sample. A refused
request raises `BadExpertRequest` (a `MalformedMessage`) that also names the expert; an unknown
uid raises `ExpertNotFound`. Replies are checked by the client against what it sent (rows, input
shapes) and must be finite too, so a broken server's answer is dropped like a failed call.

The checks cost a few comparisons per tensor and one min/max pass over its values; nothing is
copied. The DHT records of the expert grid are `ExpertLocation` (in `grid`); the on-disk
checkpoint of an expert is `ExpertCheckpoint`, parsed with the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.tensors import all_finite
from potluck.core.wire import bool_field, int_field, int_value, list_field, list_value, text_field, wire_map
from potluck.moe.errors import BadExpertRequest, ExpertNotFound
from potluck.moe.experts import TensorSchema

__all__ = [
    "BackwardReply", "BackwardRequest", "ExpertCheckpoint", "ExpertInfo", "ExpertShapes", "ForwardReply",
    "ForwardRequest", "InfoRequest", "MAX_CALL_ID", "MAX_EXPERT_TENSORS", "MAX_UID_CHARS",
]

# Uids are DHT keys (at most 1 KiB) made of a grid name and a few coordinates (`ffn.3.14`);
# 256 characters is room for any sane one and keeps a hostile uid out of logs and error texts.
MAX_UID_CHARS = 256
# Call ids are 62 random bits (`expert.new_call_id`): unique per caller and within msgpack's int64.
MAX_CALL_ID = 2**62
# Inputs or outputs one expert declares: a handful in any real model; bounds an info reply and
# the outputs a forward reply may carry.
MAX_EXPERT_TENSORS = 64
# Per-sample shapes: batch aside, expert inputs have a few dims (a transformer block's are 2).
MAX_SHAPE_DIMS = 8
MAX_DIM = 2**31
# Rows per call an info reply may announce, and optimizer steps an expert may have made: counters
# that never wrap in a run and must fit msgpack's int64.
MAX_COUNTER = 2**62
# Names and tensors of a checkpoint's model state (a transformer block has about 20).
MAX_STATE_TENSORS = 100_000

# Tensor dtypes an info reply may name (torch's own names, without the "torch." prefix).
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_NO_GRADIENT = torch.zeros(0)  # what the wire carries for "no gradient of this input"


class ExpertShapes(Protocol):
    """What a request is checked against: the expert's declared inputs and outputs."""

    input_schema: tuple[TensorSchema, ...]
    output_schema: tuple[TensorSchema, ...]


# -- field checks of the MoE's own shapes (the generic ones are potluck.core.wire's) ----------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _schema_tensors(msg: Mapping, key: str, what: str, schema: Sequence[TensorSchema], max_rows: int,
                    ) -> tuple[tuple[torch.Tensor, ...], int]:
    """`msg[key]`: one tensor per entry of `schema`, each of its dtype and per-sample shape, all
    with the same number of rows, 1 to `max_rows` of them, and finite; and that number of rows."""
    values = msg.get(key)
    if not isinstance(values, (list, tuple)) or len(values) != len(schema):
        got = f"{len(values)}" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise MalformedMessage(what, f"{key!r} must hold {len(schema)} tensor(s) "
                                     f"({', '.join(s.describe() for s in schema)}); got {got}")
    rows = -1
    for i, (t, s) in enumerate(zip(values, schema, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise MalformedMessage(what, f"{key!r}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype != s.dtype:
            raise MalformedMessage(what, f"{key!r}[{i}] has dtype {_dtype_name(t.dtype)}; expected {s.describe()}")
        if t.dim() != len(s.shape) + 1 or t.shape[1:] != s.shape:
            raise MalformedMessage(what, f"{key!r}[{i}] has shape {list(t.shape)}; expected {s.describe()}")
        if rows >= 0 and t.shape[0] != rows:
            raise MalformedMessage(what, f"{key!r}[{i}] has {t.shape[0]} rows; {key!r}[0] has {rows}")
        rows = t.shape[0]
    if not 0 < rows <= max_rows:
        raise MalformedMessage(what, f"{key!r} has {max(rows, 0)} rows; this server takes 1 to {max_rows} rows "
                                     "per call (split larger batches)")
    for i, t in enumerate(values):  # after the cheap checks: this one reads every value
        if not all_finite(t):
            raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values (NaN or infinity)")
    return tuple(values), rows


def _needs_grad(msg: Mapping, what: str, count: int) -> tuple[bool, ...]:
    """Which inputs the caller wants gradients for ("grad"; absent: all), so the server skips work
    that local autograd would skip too (e.g. the gradient of a batch of raw data)."""
    if msg.get("grad") is None:
        return (True,) * count

    def flag(value: Any) -> bool:
        if value is not True and value is not False:
            raise MalformedMessage(what, f"'grad' must be a list of {count} booleans, one per input")
        return value
    return tuple(list_field(msg, "grad", what, count, length=count, each=flag))


def _expert(msg: Any, what: str, experts: Mapping[str, ExpertShapes]) -> tuple[Mapping, str, ExpertShapes]:
    """The request as a map, its uid and the expert it addresses (ExpertNotFound if not served)."""
    try:
        msg = wire_map(msg, what)
        uid = text_field(msg, "uid", what, MAX_UID_CHARS)
    except MalformedMessage as e:
        raise BadExpertRequest(what, e.field) from None
    expert = experts.get(uid)
    if expert is None:
        raise ExpertNotFound(f"expert {uid[:200]!r} is not served by this peer")
    return msg, uid, expert


def _schema_list(schema: Sequence[TensorSchema]) -> list:
    return [[_dtype_name(s.dtype), list(s.shape)] for s in schema]


def _schema_field(msg: Mapping, key: str, what: str) -> tuple[TensorSchema, ...]:
    def one(entry: Any) -> TensorSchema:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] not in _DTYPES:
            raise MalformedMessage(what, f"{key!r} entries must be [dtype, shape] with a known torch dtype")
        shape = list_value(entry[1], key, what, MAX_SHAPE_DIMS, each=lambda d: int_value(d, key, what, 0, MAX_DIM))
        return TensorSchema(tuple(shape), _DTYPES[entry[0]])
    return tuple(list_field(msg, key, what, MAX_EXPERT_TENSORS, each=one))


def _reply_what(kind: str, uid: str) -> str:
    return f"{kind} from expert {uid!r}" if uid else kind


# -- client -> server ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardRequest:
    """Run expert `uid` on `inputs` (batch first); `call_id` pairs it with the backward call, and
    `needs_grad` says which inputs will want gradients."""

    uid: str
    call_id: int
    inputs: tuple[torch.Tensor, ...]
    needs_grad: tuple[bool, ...]

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0] if self.inputs else 0

    def to_wire(self) -> dict:
        return {"uid": self.uid, "call": self.call_id, "inputs": list(self.inputs), "grad": list(self.needs_grad)}

    @classmethod
    def from_wire(cls, msg: Any, experts: Mapping[str, ExpertShapes], max_rows: int) -> ForwardRequest:
        """Checked against the addressed expert's input schema (`experts[uid]`) and the server's
        rows per call; BadExpertRequest naming the field, or ExpertNotFound."""
        msg, uid, expert = _expert(msg, "forward request", experts)
        what = f"forward request to expert {uid!r}"
        try:
            call_id = int_field(msg, "call", what, 0, MAX_CALL_ID)
            inputs, _ = _schema_tensors(msg, "inputs", what, expert.input_schema, max_rows)
            return cls(uid, call_id, inputs, _needs_grad(msg, what, len(inputs)))
        except MalformedMessage as e:
            raise BadExpertRequest(what, e.field, uid) from None


@dataclass(frozen=True)
class BackwardRequest:
    """The gradients of call `call_id`'s outputs; `inputs` again (else None) if the server did not
    keep the forward graph, so it can recompute it."""

    uid: str
    call_id: int
    grads: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...] | None
    needs_grad: tuple[bool, ...]

    @property
    def rows(self) -> int:
        return self.grads[0].shape[0] if self.grads else 0

    def to_wire(self) -> dict:
        wire = {"uid": self.uid, "call": self.call_id, "grads": list(self.grads), "grad": list(self.needs_grad)}
        if self.inputs is not None:
            wire["inputs"] = list(self.inputs)
        return wire

    @classmethod
    def from_wire(cls, msg: Any, experts: Mapping[str, ExpertShapes], max_rows: int) -> BackwardRequest:
        """Gradients checked against the expert's output schema, inputs (if sent) against its input
        schema, both with the same rows; BadExpertRequest naming the field, or ExpertNotFound."""
        msg, uid, expert = _expert(msg, "backward request", experts)
        what = f"backward request to expert {uid!r}"
        try:
            call_id = int_field(msg, "call", what, 0, MAX_CALL_ID)
            grads, rows = _schema_tensors(msg, "grads", what, expert.output_schema, max_rows)
            inputs = None
            if msg.get("inputs") is not None:
                inputs, input_rows = _schema_tensors(msg, "inputs", what, expert.input_schema, max_rows)
                if input_rows != rows:
                    raise MalformedMessage(what, f"'inputs' has {input_rows} rows; 'grads' has {rows}")
            return cls(uid, call_id, grads, inputs, _needs_grad(msg, what, len(expert.input_schema)))
        except MalformedMessage as e:
            raise BadExpertRequest(what, e.field, uid) from None


@dataclass(frozen=True)
class InfoRequest:
    """Ask for expert `uid`'s `ExpertInfo`."""

    uid: str

    def to_wire(self) -> dict:
        return {"uid": self.uid}

    @classmethod
    def from_wire(cls, msg: Any, experts: Mapping[str, ExpertShapes]) -> InfoRequest:
        return cls(_expert(msg, "info request", experts)[1])


# -- server -> client ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardReply:
    """The expert's outputs for a forward call; `kept`: the server kept the forward graph, so the
    backward call need not resend the inputs."""

    outputs: tuple[torch.Tensor, ...]
    kept: bool

    def to_wire(self) -> dict:
        return {"outputs": list(self.outputs), "kept": self.kept}

    @classmethod
    def from_wire(cls, msg: Any, rows: int, uid: str = "") -> ForwardReply:
        """Checked against the `rows` sent: 1 to MAX_EXPERT_TENSORS finite tensors of that many rows."""
        what = _reply_what("forward reply", uid)
        msg = wire_map(msg, what)
        kept = bool_field(msg, "kept", what)
        outputs = list_field(msg, "outputs", what, MAX_EXPERT_TENSORS)
        if not outputs:
            raise MalformedMessage(what, "'outputs' must hold at least one tensor")
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
                raise MalformedMessage(what, f"'outputs'[{i}] must be a tensor of {rows} rows")
            if not all_finite(t):
                raise MalformedMessage(what, f"'outputs'[{i}] has non-finite values (NaN or infinity)")
        return cls(tuple(outputs), kept)


@dataclass(frozen=True)
class BackwardReply:
    """The gradients of a backward call's inputs, None where the caller wanted none."""

    grads: tuple[torch.Tensor | None, ...]

    def to_wire(self) -> dict:
        return {"grads": [_NO_GRADIENT if g is None else g for g in self.grads]}

    @classmethod
    def from_wire(cls, msg: Any, inputs: Sequence[torch.Tensor], uid: str = "") -> BackwardReply:
        """Checked against the `inputs` sent: one gradient each, of its shape and dtype (or empty:
        none), finite."""
        what = _reply_what("backward reply", uid)
        values = list_field(wire_map(msg, what), "grads", what, len(inputs), length=len(inputs))
        grads: list[torch.Tensor | None] = []
        for i, (g, x) in enumerate(zip(values, inputs, strict=True)):
            if not isinstance(g, torch.Tensor) or (g.numel() and (g.shape != x.shape or g.dtype != x.dtype)):
                raise MalformedMessage(what, f"'grads'[{i}] must be a tensor of shape {list(x.shape)} "
                                             f"and dtype {_dtype_name(x.dtype)}, or empty")
            if not all_finite(g):
                raise MalformedMessage(what, f"'grads'[{i}] has non-finite values (NaN or infinity)")
            grads.append(g if g.numel() or not x.numel() else None)
        return cls(tuple(grads))


@dataclass(frozen=True)
class ExpertInfo:
    """An expert's declared inputs and outputs (per sample, batch dim excluded), the rows per call
    its server takes and the optimizer steps it has made."""

    inputs: tuple[TensorSchema, ...]
    outputs: tuple[TensorSchema, ...]
    max_batch_size: int
    updates: int

    def to_wire(self) -> dict:
        return {"inputs": _schema_list(self.inputs), "outputs": _schema_list(self.outputs),
                "max_batch_size": self.max_batch_size, "updates": self.updates}

    @classmethod
    def from_wire(cls, msg: Any, uid: str = "") -> ExpertInfo:
        what = _reply_what("info reply", uid)
        msg = wire_map(msg, what)
        return cls(_schema_field(msg, "inputs", what), _schema_field(msg, "outputs", what),
                   int_field(msg, "max_batch_size", what, 1, MAX_COUNTER),
                   int_field(msg, "updates", what, 0, MAX_COUNTER))


# -- on disk ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertCheckpoint:
    """One expert's weights, optimizer state and counters, as `ExpertServer` saves them (safe
    format, no pickle). The optimizer state is torch's own nested dict: its shape is checked by
    `load_state_dict`."""

    uid: str
    version: int
    updates: int
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any] | None = None

    def to_wire(self) -> dict:
        wire: dict = {"uid": self.uid, "version": self.version, "updates": self.updates, "model": dict(self.model)}
        if self.optimizer is not None:
            wire["optimizer"] = self.optimizer
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> ExpertCheckpoint:
        what = "expert checkpoint"
        msg = wire_map(msg, what)
        model = msg.get("model")
        if not isinstance(model, Mapping) or len(model) > MAX_STATE_TENSORS or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
            raise MalformedMessage(what, f"'model' must map at most {MAX_STATE_TENSORS} names to tensors")
        optimizer = msg.get("optimizer")
        if optimizer is not None and not isinstance(optimizer, Mapping):
            raise MalformedMessage(what, "'optimizer' must be a torch optimizer state dict")
        return cls(text_field(msg, "uid", what, MAX_UID_CHARS), int_field(msg, "version", what, 0, MAX_COUNTER),
                   int_field(msg, "updates", what, 0, MAX_COUNTER), dict(model), optimizer)
