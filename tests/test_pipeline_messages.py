"""Pipeline wire messages: each round-trips, and each malformed field is refused by name."""

from __future__ import annotations

import pytest
import torch

from potluck.core.errors import MalformedMessage
from potluck.core.names import RunNames
from potluck.net.identity import Identity
from potluck.pipeline.layout import Layout, Span
from potluck.pipeline.messages import (
    MAX_STAGE_LAYERS,
    Ack,
    Activation,
    Configure,
    FailureReport,
    GetLayers,
    GetStats,
    Gradient,
    LayerStates,
    Ping,
    ProbeRequest,
    Route,
    StageReport,
    parse_control,
)
from potluck.pipeline.profiling import LayerCost, NodeProfile
from potluck.pipeline.ring import PartKey, RingPart, RingStatus, RingStatusQuery, parse_ring

A, B, C = (str(Identity.generate().peer_id) for _ in range(3))


def route(**changes) -> Route:
    base = Route(epoch=3, cluster="c0", stage=1, start=2, end=4, prev_peer=A, next_peer=B, in_shape=(16,),
                 out_shape=(16,), controller=A, report_method=RunNames("r").pipeline.report("c0"), compute_seconds=0.01,
                 sources={2: (C,)})
    return Route(**{**base.__dict__, **changes})


def refused(parse, wire, field: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        parse(wire)
    assert info.value.field.startswith(field), info.value.field


@pytest.mark.timeout(10)
def test_every_message_round_trips_through_its_wire_form():
    r = route()
    assert Route.from_wire(r.to_wire()) == r and r.first is False and route(next_peer=None).last
    for message in (Ping(), GetStats(), Configure(r), GetLayers((2, 3))):
        assert parse_control(message.to_wire()) == message
    x, y = {"name": "none", "data": torch.zeros(2, 16)}, torch.tensor([0, 1])
    a = Activation.from_wire(Activation(3, 7, x, y).to_wire())
    assert (a.epoch, a.micro_batch, a.payload) == (3, 7, x) and torch.equal(a.labels, y)
    assert Gradient.from_wire(Gradient(3, 7, x).to_wire()) == Gradient(3, 7, x)
    assert FailureReport.from_wire(FailureReport(B, 3).to_wire()) == FailureReport(B, 3)
    assert Ack.from_wire(Ack(False).to_wire()) == Ack(False)
    report = StageReport(busy_seconds=1.5, forwards=3, loss=0.25, stage=2)
    assert StageReport.from_wire(report.to_wire()) == report
    states = LayerStates.from_wire(LayerStates({2: {"weight": torch.ones(2)}}).to_wire(), wanted=(2,))
    assert torch.equal(states.states[2]["weight"], torch.ones(2))
    assert ProbeRequest.from_wire(ProbeRequest(5).to_wire(), limit=10) == ProbeRequest(5)
    layout = Layout(4, (Span(A, 0, 2), Span(B, 2, 6)))
    assert Layout.from_wire(layout.to_wire()) == layout
    assert "addresses" not in layout.to_wire() and "addresses" not in route().to_wire()  # peers by id only
    part = RingPart(PartKey(1, 0, 2, 0, f"{A},{B}", 3, 4), torch.ones(5))
    back = parse_ring(part.to_wire())
    assert back.key == part.key and torch.equal(back.data, part.data)
    assert parse_ring(RingStatusQuery().to_wire()) == RingStatusQuery()
    assert RingStatus.from_wire(RingStatus(9).to_wire()) == RingStatus(9)
    profile = NodeProfile("node0", 1e9, 2**30, bandwidth={"node1": 5e7}, latency={"node1": 0.01})
    assert NodeProfile.from_wire(profile.to_wire()) == profile


@pytest.mark.timeout(10)
@pytest.mark.parametrize("change, field", [
    ({"end": 200000}, "'end'"),  # far more layers than a stage may build
    ({"start": 5, "end": 5}, "'end'"),  # empty stage
    ({"start": -1}, "'start'"),
    ({"epoch": True}, "'epoch'"),
    ({"stage": 10**6}, "'stage'"),
    ({"cluster": "c" * 1000}, "'cluster'"),
    ({"prev": "not a peer id"}, "'prev'"),
    ({"next": 7}, "'next'"),
    ({"controller": A[:-1] + "0"}, "'controller'"),  # "0" is not base58: never an id (A + "x" could be)
    ({"in_shape": [16] * 9}, "'in_shape'"),
    ({"out_shape": [0]}, "'out_shape'"),
    ({"compute_seconds": float("nan")}, "'compute_seconds'"),
    ({"report_method": 5}, "'report_method'"),
    ({"sources": {"9": [C]}}, "'sources'"),  # a layer the stage does not hold
    ({"sources": {"2": "abc"}}, "'sources'"),
    ({"sources": {"2": [C] * 300}}, "'sources'"),
])
def test_malformed_route_fields_are_refused_by_name(change, field):
    refused(Route.from_wire, {**route().to_wire(), **change}, field)


@pytest.mark.timeout(10)
def test_layers_past_the_models_size_are_refused_when_parsed():
    """A stage knows its model's size: a route or a layer request past it is refused before
    anything is built or read, even within MAX_STAGE_LAYERS."""
    six = 6
    ok = Configure(route(start=4, end=6, sources={5: (C,)}))
    assert parse_control(ok.to_wire(), six) == ok
    for start, end, field in [(4, 7, "'end'"), (0, 64, "'end'"), (0, 200_000, "'end'"),
                              (196_000, 200_000, "'start'"), (6, 7, "'end'")]:
        wire = Configure(route(start=start, end=end, sources={})).to_wire()
        refused(lambda m: parse_control(m, six), wire, f"'route': {field}")
        refused(lambda m: Route.from_wire(m["route"], num_layers=six), wire, field)
    with pytest.raises(MalformedMessage, match="past the model's 6 layers"):
        parse_control(Configure(route(start=0, end=64, sources={})).to_wire(), six)
    refused(lambda m: parse_control(m, six), GetLayers((5, 6)).to_wire(), "'layers'")
    assert parse_control(GetLayers((4, 5)).to_wire(), six) == GetLayers((4, 5))


@pytest.mark.timeout(10)
def test_malformed_control_data_and_report_fields_are_refused_by_name():
    refused(parse_control, ["op", "ping"], "not a map")
    refused(parse_control, {"op": "format_disk"}, "'op'")
    refused(parse_control, {"op": "configure", "route": "x"}, "'route': not a map")
    refused(parse_control, {"op": "get_layers", "layers": list(range(MAX_STAGE_LAYERS + 1))}, "'layers'")
    refused(parse_control, {"op": "get_layers", "layers": [-1]}, "'layers'")
    refused(parse_control, {"op": "get_layers", "layers": ["0"]}, "'layers'")
    payload = {"name": "none", "data": torch.zeros(2, 16)}
    good = Activation(1, 2, payload, torch.zeros(2)).to_wire()
    for change, field in [({"epoch": -1}, "'epoch'"), ({"mb": 2**63}, "'mb'"), ({"mb": 1.0}, "'mb'"),
                          ({"x": torch.zeros(2)}, "'x'"), ({"y": [0, 1]}, "'y'")]:
        refused(Activation.from_wire, {**good, **change}, field)
    refused(Gradient.from_wire, {"epoch": 1, "mb": 2, "g": None}, "'g'")
    refused(Gradient.from_wire, {"epoch": "1", "mb": 2, "g": payload}, "'epoch'")
    refused(FailureReport.from_wire, {"op": "failure", "peer": 7, "epoch": 1}, "'peer'")
    refused(FailureReport.from_wire, {"op": "hello", "peer": A, "epoch": 1}, "'op'")
    refused(FailureReport.from_wire, {"op": "failure", "peer": A}, "'epoch'")
    refused(Ack.from_wire, {"ok": 1}, "'ok'")
    refused(StageReport.from_wire, {**StageReport().to_wire(), "updates": -1}, "'updates'")
    refused(StageReport.from_wire, {**StageReport().to_wire(), "busy_seconds": "x"}, "'busy_seconds'")
    refused(lambda m: LayerStates.from_wire(m, wanted=(2,)), {"state": {"3": {}}}, "'state'")
    refused(lambda m: LayerStates.from_wire(m, wanted=(2,)), {"state": {"2": {"w": [1.0]}}}, "'state'")
    refused(lambda m: ProbeRequest.from_wire(m, limit=10), {"reply_bytes": 11}, "'reply_bytes'")


@pytest.mark.timeout(10)
def test_malformed_ring_layout_and_profile_fields_are_refused_by_name():
    part = RingPart(PartKey(1, 0, 2, 0, f"{A},{B}", 3, 4), torch.ones(5)).to_wire()
    names = ("r", "a", "b", "t", "m", "s", "p")  # the part key's items, in their order on the wire
    for change, field in [({"r": -1}, "'r'"), ({"b": 0}, "'b'"), ({"t": 99}, "'t'"), ({"m": "x" * 10**5}, "'m'"),
                          ({"s": 10**6}, "'s'"), ({"p": None}, "'p'")]:
        key = {**dict(zip(names, part["k"], strict=True)), **change}
        refused(parse_ring, {**part, "k": [key[n] for n in names]}, f"'k': {field}")
    for change in ({"d": torch.ones(5, dtype=torch.int64)}, {"d": torch.ones(2, 2)}):
        refused(parse_ring, {**part, **change}, "'d'")
    refused(parse_ring, {**part, "k": part["k"][:6]}, "'k': not a list of 7")
    refused(parse_ring, {**part, "op": "format_disk"}, "'op'")
    refused(parse_ring, [1, 2], "not a map")
    refused(RingStatus.from_wire, {"round": "7"}, "'round'")
    layout = Layout(4, (Span(A, 0, 2),)).to_wire()
    for change, field in [({"stages": [[A, 0]]}, "'stages'"), ({"stages": [[A, 3, 2]]}, "'stages'"),
                          ({"stages": [["nobody", 0, 2]]}, "'stages'"), ({"stages": [[A, 0, 1]] * 300}, "'stages'"),
                          ({"epoch": None}, "'epoch'")]:
        refused(Layout.from_wire, {**layout, **change}, field)
    profile = NodeProfile("n0", 1e9, 100).to_wire()
    for change, field in [({"flops": 0}, "'flops'"), ({"flops": float("inf")}, "'flops'"), ({"memory": 1.5}, "'memory'"),
                          ({"peer_id": None}, "'peer_id'"), ({"bandwidth": {"n1": -1.0}}, "'n1'"),
                          ({"latency": {str(i): 0.1 for i in range(2000)}}, "'latency'"),
                          ({"default_bandwidth": "fast"}, "'default_bandwidth'")]:
        refused(NodeProfile.from_wire, {**profile, **change}, field)
    cost = LayerCost(1e-3, 1000, 64).to_wire()
    assert LayerCost.from_wire(cost) == LayerCost(1e-3, 1000, 64)
    for change, field in [({"seconds": -1.0}, "'seconds'"), ({"param_bytes": 1.5}, "'param_bytes'"),
                          ({"activation_bytes": None}, "'activation_bytes'")]:
        refused(LayerCost.from_wire, {**cost, **change}, field)
