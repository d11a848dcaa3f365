"""Every message of the mixture-of-experts protocol, declared once (`potluck.core.wire.Message`).

Each class gets `to_wire()` (plain msgpack-able data) and `from_wire(msg, **context)`, which
checks types, sizes and ranges with the shared checks (`potluck.core.wire`) and raises
`MalformedMessage` naming the field; the expert server's handlers and the client only ever see
these classes.

Requests are checked against the expert they address (`experts=` and `max_rows=` in the context:
the experts the server hosts and its rows per call): exactly its declared number of tensors,
each of its declared dtype and per-sample shape, 1 to `max_rows` rows, and finite (a NaN or
infinite input or gradient would end up in the expert's weights at its next optimizer step). So
a request's tensors hold at most `max_rows` times the declared elements per sample. A refused
request raises `BadExpertRequest` (a `MalformedMessage`) that also names the expert; an unknown
uid raises `ExpertNotFound`. Replies are checked by the client against what it sent (`rows=`,
`inputs=`) and must be finite too, so a broken server's answer is dropped like a failed call;
their errors name the expert (`uid=`).

The checks cost a few comparisons per tensor and one min/max pass over its values; nothing is
copied. The DHT records of the expert grid are `ExpertLocation` (in `grid`); the on-disk
checkpoint of an expert is `ExpertCheckpoint`, parsed with the same checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from potluck.core.errors import MalformedMessage
from potluck.core.tensors import all_finite
from potluck.core.wire import Bool, Field, Int, List, Message, Raw, Text, int_value, list_value
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- field types of the MoE's own shapes (the generic ones are potluck.core.wire's) ----------------
class ExpertUid(Text):
    """The uid of an expert this server hosts (`experts` in the context; ExpertNotFound if it
    hosts no such expert). The fields after it are checked against that expert, which it puts in
    the context as `expert`."""

    def __init__(self) -> None:
        super().__init__("uid", MAX_UID_CHARS)

    def check(self, value: Any, key: str, what: str, context: dict[str, Any]) -> str:
        uid = super().check(value, key, what, context)
        expert = context["experts"].get(uid)
        if expert is None:
            raise ExpertNotFound(f"expert {uid[:200]!r} is not served by this peer")
        context["expert"] = expert
        return uid

    def fast(self, v: str) -> str | None:
        return None  # the check also finds the expert


class SchemaTensors(Field):
    """One tensor per entry of the addressed expert's `schema` ("input_schema" or "output_schema"),
    each of its dtype and per-sample shape, all with the same number of rows, 1 to `max_rows` (in
    the context) of them, and finite."""

    def __init__(self, key: str, schema: str, **options: Any):
        super().__init__(key, **options)
        self.schema = schema

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        schema: Sequence[TensorSchema] = getattr(context["expert"], self.schema)
        if not isinstance(value, (list, tuple)) or len(value) != len(schema):
            got = f"{len(value)}" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
            raise MalformedMessage(what, f"{key!r} must hold {len(schema)} tensor(s) "
                                         f"({', '.join(s.describe() for s in schema)}); got {got}")
        rows = -1
        for i, (t, s) in enumerate(zip(value, schema, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise MalformedMessage(what, f"{key!r}[{i}] must be a tensor, got {type(t).__name__}")
            if t.dtype != s.dtype:
                raise MalformedMessage(what, f"{key!r}[{i}] has dtype {_dtype_name(t.dtype)}; expected {s.describe()}")
            if t.dim() != len(s.shape) + 1 or t.shape[1:] != s.shape:
                raise MalformedMessage(what, f"{key!r}[{i}] has shape {list(t.shape)}; expected {s.describe()}")
            if rows >= 0 and t.shape[0] != rows:
                raise MalformedMessage(what, f"{key!r}[{i}] has {t.shape[0]} rows; {key!r}[0] has {rows}")
            rows = t.shape[0]
        max_rows = context["max_rows"]
        if not 0 < rows <= max_rows:
            raise MalformedMessage(what, f"{key!r} has {max(rows, 0)} rows; this server takes 1 to {max_rows} rows "
                                         "per call (split larger batches)")
        for i, t in enumerate(value):  # after the cheap checks: this one reads every value
            if not all_finite(t):
                raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values (NaN or infinity)")
        return tuple(value)


class NeedsGrad(Field):
    """Which of the addressed expert's inputs the caller wants gradients for (absent: all), so the
    server skips work that local autograd would skip too (e.g. the gradient of a batch of raw data)."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[bool, ...]:
        count = len(context["expert"].input_schema)
        if value is None:
            return (True,) * count
        if not isinstance(value, (list, tuple)) or len(value) != count or not all(
                v is True or v is False for v in value):
            raise MalformedMessage(what, f"{key!r} must be a list of {count} booleans, one per input")
        return tuple(value)


class RowTensors(Field):
    """1 to MAX_EXPERT_TENSORS finite tensors of `rows` rows (in the context: the rows sent)."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        rows = context["rows"]
        outputs = list_value(value, key, what, MAX_EXPERT_TENSORS)
        if not outputs:
            raise MalformedMessage(what, f"{key!r} must hold at least one tensor")
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
                raise MalformedMessage(what, f"{key!r}[{i}] must be a tensor of {rows} rows")
            if not all_finite(t):
                raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values (NaN or infinity)")
        return tuple(outputs)


class InputGradients(Field):
    """One gradient per input sent (`inputs` in the context), of its shape and dtype, or empty (the
    caller wanted none: read as None); finite."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> tuple[torch.Tensor | None, ...]:
        inputs: Sequence[torch.Tensor] = context["inputs"]
        values = list_value(value, key, what, len(inputs), length=len(inputs))
        grads: list[torch.Tensor | None] = []
        for i, (g, x) in enumerate(zip(values, inputs, strict=True)):
            if not isinstance(g, torch.Tensor) or (g.numel() and (g.shape != x.shape or g.dtype != x.dtype)):
                raise MalformedMessage(what, f"{key!r}[{i}] must be a tensor of shape {list(x.shape)} "
                                             f"and dtype {_dtype_name(x.dtype)}, or empty")
            if not all_finite(g):
                raise MalformedMessage(what, f"{key!r}[{i}] has non-finite values (NaN or infinity)")
            grads.append(g if g.numel() or not x.numel() else None)
        return tuple(grads)

    def encode(self, value: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [_NO_GRADIENT if g is None else g for g in value]


class SchemaEntry(Field):
    """A `TensorSchema` on the wire: [dtype name, per-sample shape]."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> TensorSchema:
        if not isinstance(value, (list, tuple)) or len(value) != 2 or value[0] not in _DTYPES:
            raise MalformedMessage(what, f"{key!r} entries must be [dtype, shape] with a known torch dtype")
        shape = list_value(value[1], key, what, MAX_SHAPE_DIMS, each=lambda d: int_value(d, key, what, 0, MAX_DIM))
        return TensorSchema(tuple(shape), _DTYPES[value[0]])

    def encode(self, value: TensorSchema) -> list:
        return [_dtype_name(value.dtype), list(value.shape)]


class StateDict(Field):
    """A module's state: at most MAX_STATE_TENSORS names mapped to tensors (`load_state_dict`
    checks that they fit)."""

    encodes = True

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if not isinstance(value, Mapping) or len(value) > MAX_STATE_TENSORS or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()):
            raise MalformedMessage(what, f"{key!r} must map at most {MAX_STATE_TENSORS} names to tensors")
        return dict(value)

    def encode(self, value: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(value)


# -- whose refusals name the expert ----------------------------------------------------------------
Parse = Callable[..., Any]


def _naming_the_expert(parse: Parse, what: str, request: bool) -> Parse:
    """`parse` (a generated `from_wire`) whose refusals name the expert: a request's are
    `BadExpertRequest`s naming it if this server hosts the uid it gives; a reply's name the uid
    the caller gives (`uid` in the context)."""
    def parse_naming_the_expert(cls: type, msg: Any, **context: Any) -> Any:
        try:
            return parse(cls, msg, **context)
        except MalformedMessage as e:
            if not request:
                uid = context.get("uid")
                if not uid:
                    raise
                raise MalformedMessage(f"{what} from expert {uid!r}", e.field) from None
            uid = msg.get("uid") if isinstance(msg, Mapping) else None
            if isinstance(uid, str) and uid in context["experts"]:
                raise BadExpertRequest(f"{what} to expert {uid!r}", e.field, uid) from None
            raise BadExpertRequest(what, e.field) from None
    return parse_naming_the_expert


class ExpertRequest(Message):
    """A request to one expert (`uid`); refused as a `BadExpertRequest` (see `_naming_the_expert`)."""

    def __init_subclass__(cls, **options: Any):
        super().__init_subclass__(**options)
        cls.from_wire = classmethod(_naming_the_expert(cls.from_wire.__func__, cls.WHAT, request=True))


class ExpertReply(Message):
    """An expert's answer; a refusal names the expert (`uid` in the context)."""

    def __init_subclass__(cls, **options: Any):
        super().__init_subclass__(**options)
        cls.from_wire = classmethod(_naming_the_expert(cls.from_wire.__func__, cls.WHAT, request=False))


# -- client -> server ------------------------------------------------------------------------------
class ForwardRequest(ExpertRequest, what="forward request"):
    """Run expert `uid` on `inputs` (batch first); `call_id` pairs it with the backward call, and
    `needs_grad` says which inputs will want gradients."""

    uid: str = ExpertUid()
    call_id: int = Int("call", 0, MAX_CALL_ID)
    inputs: tuple[torch.Tensor, ...] = SchemaTensors("inputs", "input_schema")
    needs_grad: tuple[bool, ...] = NeedsGrad("grad")

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0] if self.inputs else 0


class BackwardRequest(ExpertRequest, what="backward request"):
    """The gradients of call `call_id`'s outputs (checked against the expert's outputs); `inputs`
    again (else None) if the server did not keep the forward graph, so it can recompute it."""

    uid: str = ExpertUid()
    call_id: int = Int("call", 0, MAX_CALL_ID)
    grads: tuple[torch.Tensor, ...] = SchemaTensors("grads", "output_schema")
    inputs: tuple[torch.Tensor, ...] | None = SchemaTensors("inputs", "input_schema", optional=True)
    needs_grad: tuple[bool, ...] = NeedsGrad("grad")

    @property
    def rows(self) -> int:
        return self.grads[0].shape[0] if self.grads else 0

    def validate(self, context: Mapping[str, Any]) -> None:
        if self.inputs is not None and self.inputs[0].shape[0] != self.rows:
            raise self.refuse(f"'inputs' has {self.inputs[0].shape[0]} rows; 'grads' has {self.rows}")


class InfoRequest(ExpertRequest, what="info request"):
    """Ask for expert `uid`'s `ExpertInfo`."""

    uid: str = ExpertUid()


# -- server -> client ------------------------------------------------------------------------------
class ForwardReply(ExpertReply, what="forward reply"):
    """The expert's outputs for a forward call (as many rows as sent: `rows=`); `kept`: the server
    kept the forward graph, so the backward call need not resend the inputs."""

    outputs: tuple[torch.Tensor, ...] = RowTensors("outputs")
    kept: bool = Bool("kept")


class BackwardReply(ExpertReply, what="backward reply"):
    """The gradients of a backward call's inputs (`inputs=`: those sent), None where the caller
    wanted none."""

    grads: tuple[torch.Tensor | None, ...] = InputGradients("grads")


class ExpertInfo(ExpertReply, what="info reply"):
    """An expert's declared inputs and outputs (per sample, batch dim excluded), the rows per call
    its server takes and the optimizer steps it has made."""

    inputs: tuple[TensorSchema, ...] = List("inputs", SchemaEntry(), MAX_EXPERT_TENSORS)
    outputs: tuple[TensorSchema, ...] = List("outputs", SchemaEntry(), MAX_EXPERT_TENSORS)
    max_batch_size: int = Int("max_batch_size", 1, MAX_COUNTER)
    updates: int = Int("updates", 0, MAX_COUNTER)


# -- on disk ----------------------------------------------------------------------------------------
class ExpertCheckpoint(Message, what="expert checkpoint"):
    """One expert's weights, optimizer state and counters, as `ExpertServer` saves them (safe
    format, no pickle). The optimizer state is torch's own nested dict: its shape is checked by
    `load_state_dict`."""

    uid: str = Text("uid", MAX_UID_CHARS)
    version: int = Int("version", 0, MAX_COUNTER)
    updates: int = Int("updates", 0, MAX_COUNTER)
    model: Mapping[str, torch.Tensor] = StateDict("model")
    optimizer: Mapping[str, Any] | None = Raw("optimizer", Mapping, "a torch optimizer state dict", default=None)
