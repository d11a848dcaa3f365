"""Tests for potluck.compression: error bounds, refusal of bad input, wire safety, the registry,
top-k error feedback and PowerSGD driven like a 4-peer all-reduce."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from potluck.compression import Codec, PowerSGD, TopK, get_codec, known_codecs, register_codec
from potluck.compression.checks import MAX_DENSE_ELEMENTS
from potluck.core import serialization
from potluck.core.errors import CompressionError

pytestmark = pytest.mark.timeout(30)

STATELESS = ["none", "fp16", "scaled_fp16", "uniform8", "quantile8", "blockwise8", "blockwise4", "sparse"]
# Shapes: 0-dim, one element, odd sizes that are not a multiple of any block, several dims,
# exactly one default block, and ~1M elements (over quantile8's sample size).
SHAPES = [(), (1,), (7,), (4097,), (3, 5, 7), (4096,), (1021, 1031)]


def codec_for(name: str) -> Codec:
    # A small block so that small shapes also span several blocks and a short tail.
    return get_codec({"name": name, "block": 64}) if name.startswith("blockwise") else get_codec(name)


def round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Encode, send through the real serializer, decode."""
    return codec.decode(serialization.loads(serialization.dumps(codec.encode(x))))


def max_error(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - y.double()).abs().max().item()


def sample(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(shape, generator=gen)
    if kind == "offset":  # a narrow range far from zero
        return 1000 + 0.01 * torch.rand(shape, generator=gen)
    # heavy tails: one outlier per few hundred values
    x = torch.randn(shape, generator=gen)
    return x / torch.rand(shape, generator=gen).clamp_min(0.003)


@pytest.mark.parametrize("name", STATELESS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_error_is_within_bound(name: str, shape: tuple[int, ...]) -> None:
    codec = codec_for(name)
    for seed, kind in enumerate(["normal", "offset", "heavy"]):
        x = sample(shape, kind, seed)
        if name == "fp16" and kind == "heavy":
            x = x.clamp(-60000, 60000)
        y = round_trip(codec, x)
        assert y.shape == x.shape and y.dtype == torch.float32
        assert max_error(x, y) <= codec.error_bound(x), (kind, max_error(x, y), codec.error_bound(x))


def test_bounds_are_tight_on_a_large_tensor() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    span = (x.max() - x.min()).item()
    absmax = x.abs().max().item()
    formulas = {"uniform8": span / 510, "blockwise8": absmax / 254}
    for name in STATELESS[1:]:
        codec = get_codec(name)
        bound, actual = codec.error_bound(x), max_error(x, codec.decode(codec.encode(x)))
        assert 0.5 * bound <= actual <= bound, (name, actual, bound)
        if name in formulas:
            assert bound <= formulas[name] * 1.001, (name, bound, formulas[name])


def test_quantile8_shrugs_off_outliers_that_ruin_uniform8() -> None:
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(2))
    x[::10000] = 1e4  # a few outliers stretch uniform8's step to ~40
    x[12345] = -50.0  # a lone minimum that quantile8's sample of the data may well miss
    bulk = x.abs() < 10
    errors = {}
    for name in ("uniform8", "quantile8"):
        codec = get_codec(name)
        y = codec.decode(codec.encode(x))
        errors[name] = (y - x)[bulk].abs().mean().item()
    assert y.min() == -50.0 and y.max() == 1e4  # quantile8 keeps the extremes exactly
    assert errors["quantile8"] < errors["uniform8"] / 100, errors


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(name: str, bad: float) -> None:
    for position in (0, 500, 999):
        x = torch.randn(1000)
        x[position] = bad
        codec = codec_for(name)
        with pytest.raises(CompressionError, match="non-finite"):
            codec.encode(x)
        with pytest.raises(CompressionError, match="non-finite"):
            codec.error_bound(x)


def test_float64_values_beyond_float32_are_refused_as_non_finite() -> None:
    x = torch.tensor([1.0, 1e300], dtype=torch.float64)
    for name in STATELESS[1:]:
        with pytest.raises(CompressionError, match="inf"):
            get_codec(name).encode(x)


def test_topk_refusal_leaves_residual_untouched() -> None:
    codec = TopK(0.1)
    codec.encode(torch.randn(100))
    before = codec.residual.clone()
    bad = torch.randn(100)
    bad[3] = math.nan
    with pytest.raises(CompressionError):
        codec.encode(bad)
    assert torch.equal(codec.residual, before)


@pytest.mark.parametrize("name", ["none", "scaled_fp16", "uniform8", "quantile8", "blockwise8"])
@pytest.mark.parametrize("scale", [1e30, 1e38])
def test_huge_values_stay_within_bound(name: str, scale: float) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)).mul_(scale / 4).clamp_(-3e38, 3e38)
    codec = codec_for(name)
    y = round_trip(codec, x)
    assert bool(torch.isfinite(y).all())
    assert max_error(x, y) <= codec.error_bound(x)
    # Relative precision, not just "finite" (quantile8's worst case sits in the sparse tails).
    assert codec.error_bound(x) <= x.abs().max().item() * (0.2 if name == "quantile8" else 0.01)


def test_uniform8_and_blockwise8_cover_the_whole_float32_range() -> None:
    top = torch.finfo(torch.float32).max
    x = torch.tensor([-top, top, 0.0, 1.0, -1e38])
    for name in ("uniform8", "blockwise8", "quantile8"):
        codec = get_codec(name)
        y = round_trip(codec, x)
        assert bool(torch.isfinite(y).all()) and max_error(x, y) <= codec.error_bound(x)


def test_scaled_fp16_refuses_a_span_wider_than_float32_clearly() -> None:
    top = torch.finfo(torch.float32).max
    with pytest.raises(CompressionError, match="blockwise8"):
        get_codec("scaled_fp16").encode(torch.tensor([-top, -top, -top, top]))


def test_fp16_refuses_out_of_range_values_and_suggests_scaled_fp16() -> None:
    codec = get_codec("fp16")
    assert max_error(torch.tensor([65504.0]), round_trip(codec, torch.tensor([65504.0]))) == 0
    for value in (65505.0, -1e30):
        with pytest.raises(CompressionError, match="scaled_fp16"):
            codec.encode(torch.tensor([1.0, value]))


def test_tiny_ranges_and_subnormals_stay_within_bound() -> None:
    base = torch.linspace(0, 1, 1000)
    for x in (base * 1e-40, 1.0 + base * 1e-7, -1e-30 + base * 1e-37, base * 1e-44):
        for name in STATELESS:
            codec = codec_for(name)
            y = round_trip(codec, x)
            assert max_error(x, y) <= codec.error_bound(x), (name, x[:3])


@pytest.mark.parametrize("value", [0.0, 0.1, -3.7, 1e30, -2e-40])
def test_all_equal_inputs_decode_exactly(value: float) -> None:
    x = torch.full((3, 1000), value)
    for name in STATELESS:
        codec = codec_for(name)
        if name == "fp16" and abs(value) > 65504:
            continue
        y = round_trip(codec, x)
        if name == "fp16":  # rounding to float16 is the codec itself
            assert max_error(x, y) <= codec.error_bound(x)
        else:
            assert torch.equal(y, x), name
            assert codec.error_bound(x) == 0.0


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5)], ids=str)
def test_empty_tensors_round_trip(name: str, shape: tuple[int, ...]) -> None:
    codec = codec_for(name)
    y = round_trip(codec, torch.empty(shape))
    assert y.shape == shape and y.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_none_keeps_dtype_and_lossy_codecs_decode_float32(dtype: torch.dtype) -> None:
    x = torch.randn(10, 3).to(dtype)
    assert torch.equal(round_trip(get_codec("none"), x), x)
    assert round_trip(get_codec("none"), x).dtype == dtype
    for name in STATELESS[1:]:
        codec = codec_for(name)
        y = round_trip(codec, x)
        assert y.dtype == torch.float32 and max_error(x.float(), y) <= codec.error_bound(x)


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
def test_non_float_inputs_are_refused(name: str) -> None:
    for bad in (torch.arange(5), torch.ones(3, dtype=torch.bool), [1.0, 2.0], torch.ones(2, dtype=torch.complex64)):
        with pytest.raises(CompressionError):
            codec_for(name).encode(bad)


def test_compressed_sizes_per_element() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(4))
    expected = {"none": 4, "fp16": 2, "scaled_fp16": 2, "uniform8": 1, "quantile8": 1, "blockwise8": 1, "blockwise4": 0.5,
                "topk": 0.08}
    for name, bytes_per_element in expected.items():
        size = len(serialization.dumps(get_codec(name).encode(x))) / x.numel()
        assert bytes_per_element <= size <= bytes_per_element * 1.005, (name, size)


# ---- malformed payloads ----


def valid_payload(name: str) -> tuple[Codec, dict[str, Any]]:
    codec = TopK(0.1) if name == "topk" else codec_for(name)
    payload = serialization.loads(serialization.dumps(codec.encode(torch.randn(5, 30))))
    return codec, payload


def with_field(payload: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    return {**payload, key: value}


MALFORMED: dict[str, list[Callable[[dict[str, Any]], object]]] = {
    "none": [
        lambda p: with_field(p, "data", p["data"].long()),
        lambda p: with_field(p, "data", p["data"].tolist()),
        lambda p: with_field(p, "data", torch.tensor([1.0, math.nan])),
    ],
    "fp16": [
        lambda p: with_field(p, "data", p["data"].float()),
        lambda p: with_field(p, "data", torch.tensor([1.0, math.inf], dtype=torch.float16)),
    ],
    "scaled_fp16": [
        lambda p: with_field(p, "std", math.nan),
        lambda p: with_field(p, "std", -1.0),
        lambda p: with_field(p, "std", 1e39),
        lambda p: with_field(p, "mean", math.inf),
        lambda p: with_field(p, "mean", "0"),
        lambda p: with_field(p, "mean", 0),
        lambda p: with_field(p, "data", p["data"].float()),
        lambda p: {**with_field(p, "data", torch.full((3,), 65504.0, dtype=torch.float16)), "std": 1e37},
    ],
    "uniform8": [
        lambda p: with_field(p, "codes", p["codes"].to(torch.int8)),
        lambda p: with_field(p, "lo", p["hi"] + 1.0),
        lambda p: with_field(p, "lo", math.nan),
        lambda p: with_field(p, "hi", math.inf),
        lambda p: with_field(p, "hi", [1.0]),
    ],
    "quantile8": [
        lambda p: with_field(p, "levels", p["levels"][:255]),
        lambda p: with_field(p, "levels", p["levels"].double()),
        lambda p: with_field(p, "levels", p["levels"].view(16, 16)),
        lambda p: with_field(p, "levels", torch.full((256,), math.nan)),
        lambda p: with_field(p, "codes", p["codes"].float()),
    ],
    "blockwise8": [
        lambda p: with_field(p, "scales", p["scales"][:-1]),
        lambda p: with_field(p, "scales", torch.cat([p["scales"], p["scales"][:1]])),
        lambda p: with_field(p, "scales", torch.full_like(p["scales"], math.nan)),
        lambda p: with_field(p, "scales", -p["scales"]),
        lambda p: with_field(p, "scales", p["scales"].view(1, -1)),
        lambda p: with_field(p, "codes", p["codes"].to(torch.uint8)),
        lambda p: with_field(p, "codes", torch.full_like(p["codes"], -128)),
    ],
    "blockwise4": [
        lambda p: with_field(p, "scales", p["scales"][:-1]),
        lambda p: with_field(p, "scales", torch.full_like(p["scales"], math.nan)),
        lambda p: with_field(p, "scales", -p["scales"]),
        lambda p: with_field(p, "codes", p["codes"].to(torch.int8)),
        lambda p: with_field(p, "codes", p["codes"][:-1]),
        lambda p: with_field(p, "codes", torch.full_like(p["codes"], 0xFF)),  # nibble 15: code 8
        lambda p: with_field(p, "shape", [6, 30]),
        lambda p: with_field(p, "shape", [2**40]),
    ],
    "sparse": [
        lambda p: with_field(p, "shape", [2, 30]),  # fewer elements than values sent
        lambda p: with_field(p, "indices", p["indices"].long()),
        lambda p: with_field(p, "indices", p["indices"][:-1]),
        lambda p: with_field(p, "indices", p["indices"].flip(0)),
        lambda p: with_field(p, "indices", p["indices"] + 150),
        lambda p: with_field(p, "values", torch.full_like(p["values"], math.inf)),
    ],
    "topk": [
        lambda p: with_field(p, "shape", [-1, 30]),
        lambda p: with_field(p, "shape", [5, "30"]),
        lambda p: with_field(p, "shape", [True, 150]),
        lambda p: with_field(p, "shape", [2**40]),
        lambda p: with_field(p, "shape", "5x30"),
        lambda p: with_field(p, "shape", [6, 30]),  # needs more values than sent
        lambda p: with_field(p, "indices", p["indices"].long()),
        lambda p: with_field(p, "indices", p["indices"][:-1]),
        lambda p: with_field(p, "indices", p["indices"].flip(0)),
        lambda p: with_field(p, "indices", torch.zeros_like(p["indices"])),
        lambda p: with_field(p, "indices", p["indices"] + 150),
        lambda p: with_field(p, "indices", p["indices"] - 1000),
        lambda p: with_field(p, "values", p["values"].double()),
        lambda p: with_field(p, "values", torch.full_like(p["values"], math.inf)),
        lambda p: with_field(p, "values", p["values"].view(1, -1)),
    ],
}


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
def test_malformed_payloads_raise_compression_error(name: str) -> None:
    codec, payload = valid_payload(name)
    codec.decode(payload)  # the unmodified payload is fine
    generic = [
        lambda p: {**p, "extra": 1},
        lambda p: {k: v for k, v in list(p.items())[1:]},
        lambda p: list(p.values()),
        lambda p: None,
        lambda p: b"\x00",
        lambda p: {1: 2},
    ]
    for index, corrupt in enumerate(generic + MALFORMED[name]):
        with pytest.raises(CompressionError):
            codec.decode(corrupt(payload))
            pytest.fail(f"case {index} decoded")


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
def test_any_field_replacement_gives_a_tensor_or_compression_error(name: str) -> None:
    codec, payload = valid_payload(name)
    junk = [None, "x", 7, -1, 1.5, -1e300, True, [1, 2], {"a": 1}, b"xx",
            torch.zeros(3, dtype=torch.int64), torch.tensor(math.nan), torch.zeros(0), torch.zeros(2, 2)]
    for key in payload:
        for value in junk:
            try:
                out = codec.decode(with_field(payload, key, value))
            except CompressionError:
                continue
            assert isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())


# ---- registry ----


def test_every_codec_spec_round_trips_through_the_wire() -> None:
    for name in known_codecs():
        codec = get_codec(name)
        spec = serialization.loads(serialization.dumps(codec.spec))
        assert spec["name"] == name and get_codec(spec).spec == codec.spec
    assert get_codec({"name": "blockwise8", "block": 128}).spec == {"name": "blockwise8", "block": 128}
    assert get_codec({"name": "topk", "ratio": 0.25}).spec == {"name": "topk", "ratio": 0.25}


def test_unknown_codec_error_lists_known_codecs() -> None:
    with pytest.raises(CompressionError) as info:
        get_codec("zstd9")
    for name in STATELESS:
        assert name in str(info.value)
    with pytest.raises(CompressionError, match="blockwise8"):
        get_codec({"block": 4})
    with pytest.raises(CompressionError, match="codec spec"):
        get_codec(42)  # type: ignore[arg-type]


def test_bad_codec_parameters_are_refused_clearly() -> None:
    with pytest.raises(CompressionError, match="takes: \\['block'\\]"):
        get_codec({"name": "blockwise8", "blocksize": 4})
    with pytest.raises(CompressionError, match="none"):
        get_codec({"name": "fp16", "block": 4})
    for block in (0, -1, 2**40, 1.5, True, "64"):
        with pytest.raises(CompressionError, match="block"):
            get_codec({"name": "blockwise8", "block": block})
    for ratio in (0, 1.5, math.nan, "0.1"):
        with pytest.raises(CompressionError, match="ratio"):
            get_codec({"name": "topk", "ratio": ratio})


class Sign8(Codec):
    """A test-only codec: signs as int8 times one float scale."""

    name: ClassVar[str] = "test_sign8"

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def params(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        return {"signs": torch.sign(tensor).to(torch.int8)}

    def _decode(self, payload: dict[str, Any]) -> torch.Tensor:
        return payload["signs"].float() * self.scale

    def error_bound(self, tensor: torch.Tensor) -> float:
        return (tensor.abs() - self.scale).abs().max().item()


def test_a_registered_custom_codec_works_through_get_codec() -> None:
    assert register_codec(Sign8) is Sign8
    assert "test_sign8" in known_codecs()
    codec = get_codec(serialization.loads(serialization.dumps({"name": "test_sign8", "scale": 2.0})))
    y = round_trip(codec, torch.tensor([-3.0, 0.5, 4.0]))
    assert torch.equal(y, torch.tensor([-2.0, 2.0, 2.0]))
    with pytest.raises(CompressionError, match="malformed"):  # the base class keeps decode's contract
        codec.decode({"wrong": 1})

    class Impostor(Sign8):
        pass

    with pytest.raises(ValueError, match="already taken"):
        register_codec(Impostor)
    with pytest.raises(ValueError):
        register_codec(type("Bad", (Sign8,), {"name": "Has Spaces"}))


# ---- top-k with error feedback ----


def test_topk_sends_the_largest_values_and_bounds_what_it_holds_back() -> None:
    codec = TopK(0.1)
    x = torch.randn(50, 20, generator=torch.Generator().manual_seed(5))
    bound = codec.error_bound(x)
    y = round_trip(codec, x)
    kept = y != 0
    assert int(kept.sum()) == 100
    assert x[kept].abs().min() >= x[~kept].abs().max()
    assert torch.equal(y[kept], x[kept])
    assert max_error(x, y) == bound


def test_topk_error_feedback_loses_nothing_over_many_steps() -> None:
    gen = torch.Generator().manual_seed(6)
    codec = TopK(0.05)
    sent = torch.zeros(40, 25, dtype=torch.float64)
    total = torch.zeros(40, 25, dtype=torch.float64)
    for _ in range(200):
        g = torch.randn(40, 25, generator=gen) + 0.3
        bound = codec.error_bound(g)
        corrected = g + (codec.residual if codec.residual is not None else 0)
        y = TopK(0.05).decode(serialization.loads(serialization.dumps(codec.encode(g))))
        assert max_error(corrected, y) <= bound
        sent += y.double()
        total += g.double()
    assert torch.allclose(sent + codec.residual.double(), total, atol=1e-3)
    assert (sent - total).norm() / total.norm() < 0.05  # the held-back part stays small


def test_topk_instance_is_bound_to_one_shape() -> None:
    codec = TopK(0.5)
    codec.encode(torch.randn(10))
    with pytest.raises(CompressionError, match="one instance per tensor"):
        codec.encode(torch.randn(11))
    codec.reset()
    codec.encode(torch.randn(11))


def test_topk_refuses_tensors_too_large_for_int32_indices() -> None:
    codec = TopK(0.5)
    with pytest.raises(CompressionError, match="split"):
        codec.encode(torch.ones(1).expand(MAX_DENSE_ELEMENTS + 1))  # no memory behind it


# ---- PowerSGD ----


def powersgd_step(states: list[PowerSGD], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One averaging step; torch.mean stands in for the all-reduce, through the serializer."""
    def allreduce(parts: list[torch.Tensor]) -> torch.Tensor:
        return serialization.loads(serialization.dumps(torch.stack(parts).mean(0)))

    mean_p = allreduce([s.phase1(g) for s, g in zip(states, grads, strict=True)])
    mean_q = allreduce([s.phase2(mean_p) for s in states])
    return [s.finish(mean_q) for s in states]


def run_peers(
    error_feedback: bool, steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[float], list[PowerSGD]]:
    """4 peers, noisy gradients around a full-rank target, rank 2.

    Returns sum(approx), sum(true mean) and their relative error after each step.
    """
    gen = torch.Generator().manual_seed(7)
    shape = (32, 6, 4)  # viewed as 32 x 24
    target = torch.randn(shape, generator=gen)  # full rank: rank 2 alone cannot carry it
    states = [PowerSGD(shape, rank=2, seed=11, error_feedback=error_feedback) for _ in range(4)]
    sum_approx = torch.zeros(shape, dtype=torch.float64)
    sum_true = torch.zeros(shape, dtype=torch.float64)
    history = []
    for _ in range(steps):
        grads = [target + 0.5 * torch.randn(shape, generator=gen) for _ in states]
        approx = powersgd_step(states, grads)
        assert all(torch.equal(a, approx[0]) for a in approx)  # every peer holds the same result
        sum_approx += approx[0].double()
        sum_true += torch.stack(grads).double().mean(0)
        history.append(relative_error(sum_approx, sum_true))
    return sum_approx, sum_true, history, states


def relative_error(approx: torch.Tensor, truth: torch.Tensor) -> float:
    return ((approx - truth).norm() / truth.norm()).item()


def test_powersgd_error_feedback_makes_accumulated_updates_converge() -> None:
    with_feedback = run_peers(error_feedback=True, steps=400)[2]
    without_feedback = run_peers(error_feedback=False, steps=400)[2]
    # The held-back residual stays bounded while the sums grow, so the error falls like 1/steps.
    assert with_feedback[-1] < 0.025 and with_feedback[-1] < with_feedback[99] / 3, with_feedback[::50]
    assert without_feedback[-1] > 0.3, without_feedback[-1]


def test_powersgd_holds_back_exactly_the_mean_residual() -> None:
    sum_approx, sum_true, _, states = run_peers(error_feedback=True, steps=20)
    # sum(approx) = sum(true mean) - mean(residuals): nothing is lost, only held back.
    mean_residual = torch.stack([s.residual for s in states]).double().mean(0).reshape(sum_true.shape)
    assert mean_residual.norm() > 0.1 * (sum_true - sum_approx).norm() > 0
    assert torch.allclose(sum_approx + mean_residual, sum_true, atol=1e-4)
    assert states[0].wire_elements == 2 * (32 + 24)


def test_powersgd_is_near_exact_on_rank_r_matrices() -> None:
    gen = torch.Generator().manual_seed(8)
    left = torch.randn(40, 3, generator=gen)
    grads = [left @ torch.randn(3, 30, generator=gen) for _ in range(4)]  # mean has rank 3
    states = [PowerSGD((40, 30), rank=3, seed=1) for _ in grads]
    approx = powersgd_step(states, grads)[0]
    truth = torch.stack(grads).mean(0)
    assert relative_error(approx, truth) < 1e-5
    assert all(s.residual.norm() / g.norm() < 1e-5 for s, g in zip(states, grads, strict=True))


def test_powersgd_survives_zero_and_rank_deficient_gradients() -> None:
    gen = torch.Generator().manual_seed(10)
    states = [PowerSGD((40, 30), rank=4, seed=2) for _ in range(2)]
    assert torch.equal(powersgd_step(states, [torch.zeros(40, 30)] * 2)[0], torch.zeros(40, 30))
    # Q did not collapse: a rank-1 mean (below the rank of 4) is still carried exactly.
    grads = [torch.outer(torch.randn(40, generator=gen), torch.randn(30, generator=gen)) for _ in states]
    grads = [grads[0], 2 * grads[0]]
    truth = torch.stack(grads).mean(0)
    assert relative_error(powersgd_step(states, grads)[0], truth) < 1e-5


def test_powersgd_passes_small_and_1d_tensors_through_exactly() -> None:
    for shape in [(10,), (3, 3), ()]:
        states = [PowerSGD(shape, rank=2) for _ in range(4)]
        assert not states[0].compressed
        grads = [torch.randn(shape) for _ in states]
        approx = powersgd_step(states, grads)
        assert torch.allclose(approx[0], torch.stack(grads).mean(0))


def test_powersgd_failed_step_leaves_state_as_before() -> None:
    gen = torch.Generator().manual_seed(9)
    g1, g2 = torch.randn(20, 30, generator=gen), torch.randn(20, 30, generator=gen)
    interrupted, clean = PowerSGD((20, 30), rank=2, seed=3), PowerSGD((20, 30), rank=2, seed=3)
    for state in (interrupted, clean):
        powersgd_step([state], [g1])
    interrupted.phase2(interrupted.phase1(g2 * 5))  # the all-reduce of Q fails: step abandoned
    assert torch.equal(powersgd_step([interrupted], [g2])[0], powersgd_step([clean], [g2])[0])
    assert torch.equal(interrupted.residual, clean.residual)
    interrupted.reset()
    assert not interrupted.residual.any()


def test_powersgd_refuses_bad_input_and_calls_out_of_order() -> None:
    state = PowerSGD((20, 30), rank=2)
    with pytest.raises(RuntimeError, match="order"):
        state.finish(torch.zeros(30, 2))
    bad = torch.randn(20, 30)
    bad[1, 1] = math.inf
    with pytest.raises(CompressionError, match="non-finite"):
        state.phase1(bad)
    with pytest.raises(CompressionError, match="shape"):
        state.phase1(torch.randn(30, 20))
    p = state.phase1(torch.randn(20, 30))
    for wrong in (p[:, :1], torch.full_like(p, math.nan), p.long(), p.tolist()):
        with pytest.raises(CompressionError):
            state.phase2(wrong)
    q = state.phase2(p)
    for wrong in (q.T, torch.full_like(q, math.inf), "q"):
        with pytest.raises(CompressionError):
            state.finish(wrong)
    assert state.finish(q).shape == (20, 30)
    # Finite averages whose product overflows float32 are refused too.
    state.phase1(torch.randn(20, 30))
    spread = torch.zeros(20, 2)
    spread[:2] = torch.tensor([[1.0, 1.0], [1.0, -1.0]])  # row 0 of the orthonormal P is [0.71, 0.71]
    state.phase2(spread)
    with pytest.raises(CompressionError, match="non-finite"):
        state.finish(torch.full((30, 2), 3e38))
    with pytest.raises(CompressionError, match="rank"):
        PowerSGD((20, 30), rank=0)


def test_blockwise4_packs_two_codes_per_byte_within_a_seventh_of_each_blocks_absmax() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    codec = get_codec({"name": "blockwise4", "block": 100})
    payload = codec.encode(x)
    assert payload["codes"].numel() == 501 and payload["scales"].numel() == 11
    y = round_trip(codec, x)
    for lo in range(0, 1001, 100):
        block = x[lo:lo + 100]
        assert max_error(block, y[lo:lo + 100]) <= block.abs().max().item() / 14 * (1 + 1e-6)
    assert torch.equal(round_trip(codec, torch.zeros(9)), torch.zeros(9))


def test_sparse_sends_exactly_the_nonzeros() -> None:
    x = torch.zeros(10_000)
    x[torch.arange(0, 10_000, 97)] = torch.randn(104, generator=torch.Generator().manual_seed(6))
    codec = get_codec("sparse")
    assert torch.equal(round_trip(codec, x), x)
    assert len(serialization.dumps(codec.encode(x))) < 8 * 104 + 100


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns (so that -0.0 and 0.0 differ)."""
    return t.detach().reshape(-1).contiguous().view(torch.int32)


@pytest.mark.parametrize("name", [*STATELESS, "topk"])
@pytest.mark.parametrize("shape", [(7,), (4097,), (3, 5, 7), (1021, 1031)], ids=str)
def test_encode_received_is_what_a_peer_decodes_bit_for_bit(name: str, shape: tuple[int, ...]) -> None:
    """A sender digests `encode_received`'s values as what its peers decode (the all-reduce's
    checks compare digests): a block codec computes them without decoding its own payload, and
    must get every bit a peer gets, the sign of zero included."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=generator)
    flat = x.view(-1)
    flat[: flat.numel() // 3] = 0.0  # whole blocks of zeros
    flat[1::7] = -0.0
    codec = codec_for(name)
    payload, received = codec.encode_received(x)
    decoded = codec_for(name).decode(serialization.loads(serialization.dumps(payload)))
    assert received.shape == decoded.shape == x.shape
    assert torch.equal(bits(received.float()), bits(decoded.float()))


@pytest.mark.parametrize("name", ["blockwise8", "blockwise4"])
def test_block_codecs_decode_each_code_over_code_max_times_its_scale(name: str) -> None:
    """What every version of potluck must decode alike (peers compare digests of it): value =
    float32(code / code_max) * its block's scale, bit for bit; an all-zero block's scale is +0.0."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64 * 9 + 5, generator=generator) * torch.logspace(-30, 30, 64 * 9 + 5)
    x[64:128] = -0.0
    codec = codec_for(name)
    payload = codec.encode(x)
    if name == "blockwise4":
        pairs = torch.stack([payload["codes"] & 0x0F, payload["codes"] >> 4], dim=1).reshape(-1)[: x.numel()]
        codes, code_max = pairs.to(torch.float32) - 7, 7
    else:
        codes, code_max = payload["codes"].to(torch.float32), 127
    scales = payload["scales"].repeat_interleave(64)[: x.numel()]
    assert torch.equal(bits(payload["scales"][1:2]), bits(torch.zeros(1)))
    expected = (codes / code_max) * scales
    assert torch.equal(bits(codec.decode(payload)), bits(expected))
    assert torch.equal(bits(codec.encode_received(x)[1]), bits(expected))


@pytest.mark.parametrize("name", ["blockwise8", "blockwise4"])
def test_block_codecs_refusing_non_finite_input_name_its_shape(name: str) -> None:
    x = torch.randn(100, 100)
    x[50, 7] = math.nan
    with pytest.raises(CompressionError, match=r"shape \[100, 100\] with 1 nan"):
        codec_for(name).encode(x)
