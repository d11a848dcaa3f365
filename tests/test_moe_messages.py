"""MoE wire messages: each round-trips, and each malformed field is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from potluck.core.errors import MalformedMessage
from potluck.moe import BadExpertRequest, ExpertNotFound, TensorSchema
from potluck.moe.grid import ExpertLocation, read_location
from potluck.moe.messages import (
    MAX_CALL_ID,
    MAX_EXPERT_TENSORS,
    MAX_UID_CHARS,
    BackwardReply,
    BackwardRequest,
    ExpertCheckpoint,
    ExpertInfo,
    ForwardReply,
    ForwardRequest,
    InfoRequest,
)
from potluck.net.identity import Identity

UID = "ffn.0.1"
ROWS = 4


@dataclass
class Shapes:
    input_schema: tuple[TensorSchema, ...]
    output_schema: tuple[TensorSchema, ...]


EXPERTS = {UID: Shapes((TensorSchema((8,)), TensorSchema((2,), torch.int64)), (TensorSchema((3,)),))}
MAX_ROWS = 16


def inputs(rows: int = ROWS) -> list[torch.Tensor]:
    return [torch.randn(rows, 8), torch.zeros(rows, 2, dtype=torch.int64)]


def forward(**changes) -> dict:
    return {**ForwardRequest(UID, 7, tuple(inputs()), (True, False)).to_wire(), **changes}


def backward(**changes) -> dict:
    return {**BackwardRequest(UID, 7, (torch.randn(ROWS, 3),), tuple(inputs()), (True, False)).to_wire(), **changes}


def refused(parse, wire, field: str, kind: type[Exception] = MalformedMessage) -> MalformedMessage:
    with pytest.raises(kind) as info:
        parse(wire)
    assert info.value.field.startswith(field), info.value.field
    return info.value


def parse_forward(wire):
    return ForwardRequest.from_wire(wire, experts=EXPERTS, max_rows=MAX_ROWS)


def parse_backward(wire):
    return BackwardRequest.from_wire(wire, experts=EXPERTS, max_rows=MAX_ROWS)


@pytest.mark.timeout(10)
def test_every_message_round_trips_through_its_wire_form():
    wire = forward()
    f = parse_forward(wire)
    assert (f.uid, f.call_id, f.needs_grad, f.rows) == (UID, 7, (True, False), ROWS)
    assert all(a is b for a, b in zip(f.inputs, wire["inputs"], strict=True))  # parsed as sent: no copy
    b = parse_backward(backward())
    assert b.inputs is not None and b.rows == ROWS and b.call_id == 7
    kept = parse_backward(backward(inputs=None))
    assert kept.inputs is None
    assert parse_forward({k: v for k, v in forward().items() if k != "grad"}).needs_grad == (True, True)
    assert InfoRequest.from_wire(InfoRequest(UID).to_wire(), experts=EXPERTS) == InfoRequest(UID)
    out = (torch.randn(ROWS, 3),)
    reply = ForwardReply.from_wire(ForwardReply(out, True).to_wire(), rows=ROWS, uid=UID)
    assert reply.kept and reply.outputs[0] is out[0]  # parsed as sent: no copy
    x = inputs()
    grads = BackwardReply.from_wire(BackwardReply((torch.ones(ROWS, 8), None)).to_wire(), inputs=x, uid=UID).grads
    assert torch.equal(grads[0], torch.ones(ROWS, 8)) and grads[1] is None
    info = ExpertInfo(EXPERTS[UID].input_schema, EXPERTS[UID].output_schema, MAX_ROWS, 3)
    assert ExpertInfo.from_wire(info.to_wire()) == info
    checkpoint = ExpertCheckpoint(UID, 2, 5, {"w": torch.ones(2)}, {"state": {}, "param_groups": []})
    parsed = ExpertCheckpoint.from_wire(checkpoint.to_wire())
    assert (parsed.uid, parsed.version, parsed.updates, parsed.optimizer) == (UID, 2, 5, checkpoint.optimizer)
    peer = Identity.generate().peer_id
    assert ExpertLocation.from_wire(ExpertLocation(UID, peer).to_wire(), uid=UID) == ExpertLocation(UID, peer)


@pytest.mark.timeout(10)
def test_malformed_requests_are_refused_naming_the_field_and_the_expert():
    refused(parse_forward, [1, 2], "not a map", BadExpertRequest)
    refused(parse_forward, forward(uid=7), "'uid'", BadExpertRequest)
    refused(parse_forward, forward(uid="x" * (MAX_UID_CHARS + 1)), "'uid'", BadExpertRequest)
    with pytest.raises(ExpertNotFound, match="'ffn.9.9' is not served"):
        parse_forward(forward(uid="ffn.9.9"))
    for call in (None, -1, MAX_CALL_ID, True, 1.0):
        error = refused(parse_forward, forward(call=call), "'call'", BadExpertRequest)
        assert error.uid == UID and UID in str(error)
    x = inputs()
    cases = {
        "'inputs' must hold 2 tensor(s)": [x[:1], x + x, "x", None],
        "'inputs'[0] must be a tensor": [["a", x[1]]],
        "'inputs'[0] has dtype float64": [[x[0].double(), x[1]]],
        "'inputs'[1] has shape [4, 3]": [[x[0], torch.zeros(ROWS, 3, dtype=torch.int64)]],
        "'inputs'[0] has shape [4]": [[torch.randn(ROWS), x[1]]],
        "'inputs'[1] has 5 rows": [[x[0], torch.zeros(5, 2, dtype=torch.int64)]],
        "'inputs' has 17 rows": [inputs(MAX_ROWS + 1)],
        "'inputs' has 0 rows": [inputs(0)],
        "'inputs'[0] has non-finite values": [[x[0].index_fill(0, torch.tensor([1]), float(v)), x[1]]
                                              for v in ("nan", "inf", "-inf")],
    }
    for field, values in cases.items():
        for value in values:
            refused(parse_forward, forward(inputs=value), field, BadExpertRequest)
    for flags in ([True], [True, 1], "yes", [True, False, True]):
        refused(parse_forward, forward(grad=flags), "'grad'", BadExpertRequest)

    refused(parse_backward, backward(grads=[torch.randn(ROWS, 4)]), "'grads'[0] has shape", BadExpertRequest)
    refused(parse_backward, backward(grads=[]), "'grads' must hold 1 tensor(s)", BadExpertRequest)
    refused(parse_backward, backward(grads=[torch.full((ROWS, 3), float("nan"))]), "'grads'[0] has non-finite",
            BadExpertRequest)
    refused(parse_backward, backward(inputs=inputs(ROWS + 1)), "'inputs' has 5 rows; 'grads' has 4",
            BadExpertRequest)
    refused(parse_backward, backward(inputs=[x[0].fill_(float("inf")), x[1]]), "'inputs'[0] has non-finite",
            BadExpertRequest)
    refused(parse_backward, backward(call="7"), "'call'", BadExpertRequest)
    refused(lambda w: InfoRequest.from_wire(w, experts=EXPERTS), {"uid": None}, "'uid'", BadExpertRequest)


@pytest.mark.timeout(10)
def test_malformed_replies_and_records_are_refused_naming_the_field():
    def parse_forward_reply(wire):
        return ForwardReply.from_wire(wire, rows=ROWS, uid=UID)
    good = ForwardReply((torch.randn(ROWS, 3),), False).to_wire()
    refused(parse_forward_reply, {**good, "kept": 1}, "'kept'")
    refused(parse_forward_reply, {**good, "outputs": []}, "'outputs' must hold at least one")
    refused(parse_forward_reply, {**good, "outputs": [torch.randn(ROWS, 1)] * (MAX_EXPERT_TENSORS + 1)}, "'outputs'")
    refused(parse_forward_reply, {**good, "outputs": [torch.randn(ROWS + 1, 3)]}, "'outputs'[0] must be a tensor of 4")
    refused(parse_forward_reply, {**good, "outputs": [torch.tensor(1.0)]}, "'outputs'[0]")
    refused(parse_forward_reply, {**good, "outputs": [torch.full((ROWS, 3), float("nan"))]}, "'outputs'[0] has non")

    x = inputs()

    def parse_backward_reply(wire):
        return BackwardReply.from_wire(wire, inputs=x, uid=UID)
    refused(parse_backward_reply, {"grads": [torch.zeros(0)]}, "'grads' must be a list of 2")
    refused(parse_backward_reply, {"grads": [torch.zeros(ROWS, 7), torch.zeros(0)]}, "'grads'[0] must be a tensor")
    refused(parse_backward_reply, {"grads": [torch.zeros(ROWS, 8, dtype=torch.float64), torch.zeros(0)]},
            "'grads'[0] must be a tensor of shape [4, 8] and dtype float32")
    refused(parse_backward_reply, {"grads": [torch.full((ROWS, 8), float("inf")), torch.zeros(0)]},
            "'grads'[0] has non-finite")

    info = ExpertInfo((TensorSchema((8,)),), (TensorSchema((8,)),), 16, 0).to_wire()
    refused(ExpertInfo.from_wire, {**info, "inputs": [["float99", [8]]]}, "'inputs' entries")
    refused(ExpertInfo.from_wire, {**info, "outputs": [["float32", [1] * 9]]}, "'outputs'")
    refused(ExpertInfo.from_wire, {**info, "inputs": [["float32", [8]]] * (MAX_EXPERT_TENSORS + 1)}, "'inputs'")
    refused(ExpertInfo.from_wire, {**info, "max_batch_size": 0}, "'max_batch_size'")
    refused(ExpertInfo.from_wire, {**info, "updates": -1}, "'updates'")

    checkpoint = ExpertCheckpoint(UID, 0, 0, {"w": torch.ones(1)}).to_wire()
    refused(ExpertCheckpoint.from_wire, {**checkpoint, "model": {"w": [1.0]}}, "'model'")
    refused(ExpertCheckpoint.from_wire, {**checkpoint, "optimizer": [1]}, "'optimizer'")
    refused(ExpertCheckpoint.from_wire, {**checkpoint, "version": "1"}, "'version'")

    for value in ({"peer": "not a peer id"}, {}, "garbage", None):
        refused(lambda v: ExpertLocation.from_wire(v, uid=UID), value, "'peer'" if isinstance(value, dict) else "not a")
        assert read_location(UID, value) is None
