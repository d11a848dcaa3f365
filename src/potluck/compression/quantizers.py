"""Stateless codecs: exact, float16, scaled float16 and three 8-bit quantizers.

Lossy codecs decode to float32 with the input's shape; their error bounds are against
`tensor.float()` and include a few float32 roundings (`F32_EPS` terms) and `SUBNORMAL_SLACK`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from potluck.compression.checks import (
    F32_EPS,
    F32_MAX,
    MAX_DENSE_ELEMENTS,
    SUBNORMAL_SLACK,
    FiniteTensor,
    check_fields,
    check_finite_field,
    check_float_tensor,
    finite_float32,
    float_field,
    shape_field,
    tensor_field,
    to_float32,
    value_range,
)
from potluck.compression.codec import Codec, register_codec
from potluck.core.errors import CompressionError

__all__ = ["Blockwise4Bit", "Blockwise8Bit", "Float16", "NoCompression", "Quantile8Bit", "ScaledFloat16", "Uniform8Bit"]

# Largest finite float16.
FP16_MAX = 65504.0
# float16 has 10 stored mantissa bits, and its smallest normal exponent is -14.
_FP16_MANTISSA_BITS = 10
_FP16_MIN_EXPONENT = -14
# 8-bit codecs have 256 codes.
LEVELS = 256
# quantile8 takes its quantiles from at most this many elements: sorting a sample bounds the
# cost on big tensors, and 65536 samples place 256 quantiles within ~0.4% of their true rank.
QUANTILE_SAMPLE_SIZE = 2**16
# Fixed seed of that sample, so encoder and `error_bound` pick the same levels.
QUANTILE_SAMPLE_SEED = 0
# blockwise8 default block: one float32 scale per 4096 values is ~0.001 bytes/element overhead.
DEFAULT_BLOCK = 4096
# A bigger block is one scale for the whole tensor in practice (use uniform8); also keeps a
# codec spec from a peer from describing absurd blocks.
MAX_BLOCK = 2**24
# blockwise8 codes span -127..127 so that +-absmax map to +-127 exactly.
_INT8_MAX = 127
# blockwise4 codes span -7..7 (15 of the 16 nibble values, stored as code + 7: nibble 15 is
# invalid), so that +-absmax map to +-7 exactly and zero stays zero.
_INT4_MAX = 7
_NIBBLE_INVALID = 15
# uniform8 spans narrower than this are computed in float64: 255 / span would overflow float32.
_MIN_FLOAT32_SPAN = 2.0**-100


def half_ulp16(value: float) -> float:
    """Max error of rounding a float in [0, value] to float16 (half a float16 ulp at `value`)."""
    if value <= 0:
        return 0.0
    exponent = max(math.frexp(value)[1] - 1, _FP16_MIN_EXPONENT)
    return 2.0 ** (exponent - _FP16_MANTISSA_BITS - 1)


@register_codec
class NoCompression(Codec):
    """Sends the tensor as is, in its own floating dtype: exact, error bound 0.

    Decoding returns the payload's tensor itself (no copy).
    """

    name = "none"

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        x = check_float_tensor(tensor, self.name)
        value_range(x, self.name)
        return {"data": x}

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("data",))
        data = payload["data"]
        if not isinstance(data, torch.Tensor) or not data.is_floating_point():
            raise CompressionError(f"{self.name} payload field 'data' must be a floating-point tensor")
        return check_float_tensor(data, self.name)

    def error_bound(self, tensor: torch.Tensor) -> float:
        value_range(check_float_tensor(tensor, self.name), self.name)
        return 0.0


@register_codec
class Float16(Codec):
    """Rounds to float16 (2 bytes/element); refuses values beyond +-65504 (use scaled_fp16).

    Error bound: half a float16 ulp at max|x|, i.e. 2**(max(floor(log2 max|x|), -14) - 11).
    """

    name = "fp16"
    wire_bytes = 2.0

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        x = self._checked(tensor)
        return {"data": x.values.to(torch.float16)}

    def _checked(self, tensor: torch.Tensor) -> FiniteTensor:
        x = finite_float32(tensor, self.name)
        if x.absmax > FP16_MAX:
            raise CompressionError(
                f"fp16: values up to {x.absmax:.3g} are outside the float16 range (+-{FP16_MAX:g}); "
                "use 'scaled_fp16' or 'blockwise8', which rescale before rounding"
            )
        return x

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("data",))
        return tensor_field(payload, "data", self.name, torch.float16).to(torch.float32)

    def error_bound(self, tensor: torch.Tensor) -> float:
        return half_ulp16(self._checked(tensor).absmax)


@register_codec
class ScaledFloat16(Codec):
    """float16 of (x - mean) / std: any float32 range at 2 bytes/element, with float16's
    relative precision around the mean. All-equal inputs decode exactly (std 0 is sent as 0).

    Error bound: std * (half_ulp16(zmax) + 2 eps zmax) + eps max|x| + SUBNORMAL_SLACK, where
    zmax = max|x - mean| / std and eps = float32 epsilon (zmax <= sqrt(n) for n elements).
    """

    name = "scaled_fp16"
    wire_bytes = 2.0

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        x = finite_float32(tensor, self.name)
        mean, std, _ = self._scaling(x)
        if std == 0:
            data = torch.zeros_like(x.values, dtype=torch.float16)
        else:
            data = (x.values - mean).div_(std).to(torch.float16)
        return {"data": data, "mean": mean, "std": std}

    def _scaling(self, x: FiniteTensor) -> tuple[float, float, float]:
        """(mean, std, zmax) as float32 values; std is 0 exactly when all values are equal."""
        if x.lo == x.hi:
            return x.lo, 0.0, 0.0
        std_t, mean_t = torch.std_mean(x.values, correction=0)  # float64 accumulation on CPU
        mean = min(max(mean_t.item(), x.lo), x.hi)
        std = std_t.item()
        if not (0 < std < math.inf):  # tiny spans can underflow the variance
            std = to_float32(x.hi / 2 - x.lo / 2)
        deviation = max(x.hi - mean, mean - x.lo)
        if deviation > F32_MAX:
            raise CompressionError(
                f"scaled_fp16: values span {x.lo:.3g}..{x.hi:.3g}, wider than float32 can subtract; "
                "use 'blockwise8' or 'none'"
            )
        zmax = deviation / std
        if zmax > FP16_MAX:
            raise CompressionError(f"scaled_fp16: an outlier {zmax:.3g} stds from the mean overflows float16")
        return mean, std, zmax

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("data", "mean", "std"))
        data = tensor_field(payload, "data", self.name, torch.float16)
        mean = float_field(payload, "mean", self.name)
        std = float_field(payload, "std", self.name, nonnegative=True)
        return data.to(torch.float32).mul_(std).add_(mean)

    def error_bound(self, tensor: torch.Tensor) -> float:
        x = finite_float32(tensor, self.name)
        _, std, zmax = self._scaling(x)
        if std == 0:
            return 0.0
        fp16_error = half_ulp16(zmax * (1 + F32_EPS)) + 2 * F32_EPS * zmax
        return std * fp16_error + F32_EPS * x.absmax + SUBNORMAL_SLACK


def _uniform_grid(lo: float, hi: float) -> tuple[float, float]:
    """(mid, step) as float32: code c stands for mid + (c - 127.5) * step.

    Centering keeps (c - 127.5) * step within half the span, so even a span of 2 * F32_MAX
    decodes without overflow.
    """
    half_span = hi / 2 - lo / 2
    step = to_float32(half_span / ((LEVELS - 1) / 2))
    if step * (LEVELS - 1) / 2 > half_span:  # rounded up: the end levels would overshoot (or overflow)
        step = torch.nextafter(torch.tensor(step), torch.tensor(0.0)).item()
    return to_float32(lo / 2 + hi / 2), step


@register_codec
class Uniform8Bit(Codec):
    """256 evenly spaced levels from min to max: 1 byte/element plus two floats.

    Error bound: (max - min) / 510 + 2 eps (max|x| + max - min) + SUBNORMAL_SLACK.
    """

    name = "uniform8"
    wire_bytes = 1.0

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        x = finite_float32(tensor, self.name)
        mid, step = _uniform_grid(x.lo, x.hi)
        self._check_extremes(mid, step)
        if step == 0:  # all equal (or a span below float32 resolution): every code decodes to mid
            codes = torch.zeros_like(x.values, dtype=torch.uint8)
        else:
            work = torch.float32 if x.hi - x.lo >= _MIN_FLOAT32_SPAN else torch.float64
            centered = x.values.to(work) - mid
            codes = centered.mul_(1 / step).add_((LEVELS - 1) / 2).round_().clamp_(0, LEVELS - 1).to(torch.uint8)
        return {"codes": codes, "lo": x.lo, "hi": x.hi}

    def _check_extremes(self, mid: float, step: float) -> None:
        # Decoding is monotone in the code, so finite end levels mean every level is finite.
        ends = self._levels(torch.tensor([0, LEVELS - 1], dtype=torch.uint8), mid, step)
        if not bool(torch.isfinite(ends).all()):
            raise CompressionError(f"{self.name}: range too wide to decode within float32; use 'blockwise8'")

    @staticmethod
    def _levels(codes: torch.Tensor, mid: float, step: float) -> torch.Tensor:
        return codes.to(torch.float32).sub_((LEVELS - 1) / 2).mul_(step).add_(mid)

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("codes", "lo", "hi"))
        codes = tensor_field(payload, "codes", self.name, torch.uint8)
        lo = float_field(payload, "lo", self.name)
        hi = float_field(payload, "hi", self.name)
        if lo > hi:
            raise CompressionError(f"{self.name} payload has lo {lo} above hi {hi}")
        mid, step = _uniform_grid(lo, hi)
        self._check_extremes(mid, step)
        return self._levels(codes, mid, step)

    def error_bound(self, tensor: torch.Tensor) -> float:
        x = finite_float32(tensor, self.name)
        span = x.hi - x.lo
        if span == 0:
            return 0.0
        return span / (2 * (LEVELS - 1)) + 2 * F32_EPS * (x.absmax + span) + SUBNORMAL_SLACK


@register_codec
class Quantile8Bit(Codec):
    """256 levels at quantiles of the data (min and max included); each value gets the nearest.

    Levels sit where the data is, so a few outliers cost a few levels instead of stretching
    every step as in uniform8; the worst case is set by the sparse tails. Encoding is a binary
    search (slower than uniform8). 1 byte/element plus 1 KiB of levels.

    Error bound: the largest distance from a level to the edge of the interval it covers
    (about half the widest gap between neighbouring levels), computed from the same levels.
    """

    name = "quantile8"
    wire_bytes = 1.0

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        x = finite_float32(tensor, self.name)
        levels = self._levels(x)
        flat = x.values.reshape(-1)
        codes = torch.bucketize(flat, self._boundaries(levels), out_int32=True).to(torch.uint8)
        return {"codes": codes.reshape(x.values.shape), "levels": levels}

    @staticmethod
    def _levels(x: FiniteTensor) -> torch.Tensor:
        flat = x.values.reshape(-1)
        if flat.numel() == 0:
            return torch.zeros(LEVELS, dtype=torch.float32, device=flat.device)
        if flat.numel() > QUANTILE_SAMPLE_SIZE:
            generator = torch.Generator().manual_seed(QUANTILE_SAMPLE_SEED)
            picks = torch.randint(flat.numel(), (QUANTILE_SAMPLE_SIZE,), generator=generator)
            flat = flat[picks.to(flat.device)]
        ordered = flat.sort().values
        ranks = torch.linspace(0, ordered.numel() - 1, LEVELS, dtype=torch.float64).round_().long()
        levels = ordered[ranks.to(ordered.device)]
        levels[0], levels[-1] = x.lo, x.hi  # the true extremes, which a sample may miss
        return levels

    @staticmethod
    def _boundaries(levels: torch.Tensor) -> torch.Tensor:
        """Midpoints between neighbouring levels (halved first so huge values cannot overflow)."""
        return levels[:-1] / 2 + levels[1:] / 2

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("codes", "levels"))
        codes = tensor_field(payload, "codes", self.name, torch.uint8)
        levels = tensor_field(payload, "levels", self.name, torch.float32, ndim=1)
        if levels.numel() != LEVELS:
            raise CompressionError(f"{self.name} payload must have {LEVELS} levels, got {levels.numel()}")
        check_finite_field(levels, "levels", self.name)
        return levels.index_select(0, codes.reshape(-1).int()).reshape(codes.shape)

    def error_bound(self, tensor: torch.Tensor) -> float:
        x = finite_float32(tensor, self.name)
        if x.lo == x.hi:
            return 0.0
        levels = self._levels(x)
        # Code i covers (edge[i], edge[i + 1]]: the boundaries, plus min and max at the ends.
        inner = self._boundaries(levels).double()
        levels = levels.double()
        lo_edge = torch.cat([levels.new_tensor([x.lo]), inner])
        hi_edge = torch.cat([inner, levels.new_tensor([x.hi])])
        reach = torch.maximum((levels - lo_edge).abs(), (hi_edge - levels).abs())
        return reach.max().item() + SUBNORMAL_SLACK


def _blocks(flat: torch.Tensor, block: int) -> list[torch.Tensor]:
    """2-D views of a flat tensor: the full blocks, then the shorter tail block if any."""
    full = flat.numel() // block * block
    views = [flat[:full].view(-1, block)]
    if full < flat.numel():
        views.append(flat[full:].view(1, -1))
    return views


class _BlockScaled(Codec):
    """What blockwise8 and blockwise4 share: codes -code_max..code_max, each block's scaled by its
    absmax (stored as code + offset), the block size, the scales' checks and the error bound."""

    code_max: int
    offset: int  # added to a code where it is stored (an unsigned nibble)

    def __init__(self, block: int = DEFAULT_BLOCK):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
            raise CompressionError(f"{self.name}: block must be an int in 1..{MAX_BLOCK}, got {block!r:.50}")
        self.block = block

    def params(self) -> dict[str, Any]:
        return {"block": self.block}

    def _stored(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat stored codes (code + offset) as float32, and the blocks' scales; refuses
        non-finite input. The blocks' max and min both check the values and give their absmax,
        and the codes are computed in one buffer (temporaries cost page faults)."""
        x = check_float_tensor(tensor, self.name).to(torch.float32).contiguous()
        values = x.reshape(-1)
        stored = torch.empty_like(values)
        scales = []
        for block, out in zip(_blocks(values, self.block), _blocks(stored, self.block), strict=True):
            # (a nan or inf in a block shows in its max or min; abs: +0.0, never -0.0, for zeros;
            # amax and amin together: 10x faster than aminmax over a dimension, 1.3x abs().amax())
            absmax = torch.maximum(block.amax(dim=1).abs_(), block.amin(dim=1).abs_())
            safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)  # all-zero blocks stay 0
            torch.div(block, safe, out=out).mul_(self.code_max).round_()
            scales.append(absmax)
        scales = torch.cat(scales) if scales else values.new_empty(0)
        if scales.numel() and not torch.isfinite(scales).all():
            value_range(x, self.name)  # raises, counting the non-finite values
        if self.offset:
            stored.add_(self.offset)
        return stored, scales

    def _check_scales(self, scales: torch.Tensor, count: int, what: str) -> None:
        expected = -(-count // self.block)
        if scales.numel() != expected:
            raise CompressionError(
                f"{self.name} payload has {scales.numel()} scales for {count} {what} "
                f"(block {self.block} needs {expected})"
            )
        check_finite_field(scales, "scales", self.name)
        if scales.numel() and scales.min().item() < 0:
            raise CompressionError(f"{self.name} payload has negative scales")

    def _values(self, payload: Mapping[str, Any], numel: int) -> torch.Tensor:
        """Each code as code / code_max (a float32 division, so every decoder gets the same bits),
        flat in a new buffer; CompressionError for an invalid code."""
        raise NotImplementedError

    def _scaled(self, payload: Mapping[str, Any], numel: int) -> torch.Tensor:
        """The flat float32 values of a payload whose fields were checked (or that we encoded):
        (code / code_max) * its block's scale, in place in one buffer (a temporary per pass cost
        2-4x the time, in page faults)."""
        out = self._values(payload, numel)
        scales = payload["scales"]
        full = numel // self.block * self.block
        if full:
            out[:full].view(-1, self.block).mul_(scales[:full // self.block].unsqueeze(1))
        if full < numel:
            out[full:].mul_(scales[-1])
        return out

    def encode_received(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        payload = self.encode(tensor)
        return payload, self._scaled(payload, tensor.numel()).view(payload.get("shape", tensor.shape))

    def error_bound(self, tensor: torch.Tensor) -> float:
        x = finite_float32(tensor, self.name)
        if x.lo == x.hi:  # every value is +-absmax of its block: exact
            return 0.0
        return x.absmax / (2 * self.code_max) + 2 * F32_EPS * x.absmax + SUBNORMAL_SLACK


@register_codec
class Blockwise8Bit(_BlockScaled):
    """int8 codes scaled by each block's absmax (the bitsandbytes idea, in plain torch).

    An outlier only costs precision in its own block. 1 byte/element plus 4 bytes per block.
    Error bound: max|x| / 254 + 2 eps max|x| + SUBNORMAL_SLACK (per block it is absmax / 254).
    """

    name = "blockwise8"
    wire_bytes = 1.0
    code_max, offset = _INT8_MAX, 0

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        stored, scales = self._stored(tensor)
        return {"codes": stored.to(torch.int8).view(tensor.shape), "scales": scales}

    def _values(self, payload: Mapping[str, Any], numel: int) -> torch.Tensor:
        return payload["codes"].reshape(-1).to(torch.float32).div_(self.code_max)

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("codes", "scales"))
        codes = tensor_field(payload, "codes", self.name, torch.int8)
        scales = tensor_field(payload, "scales", self.name, torch.float32, ndim=1)
        self._check_scales(scales, codes.numel(), "codes")
        if codes.numel() and codes.min().item() < -_INT8_MAX:
            raise CompressionError(f"{self.name} payload has code -128, outside -127..127")
        return self._scaled(payload, codes.numel()).view(codes.shape)


@register_codec
class Blockwise4Bit(_BlockScaled):
    """4-bit codes (-7..7, two per byte) scaled by each block's absmax: blockwise8 at half the
    bytes, for what tolerates coarse values (DiLoCo's pseudo-gradients: the Streaming DiLoCo
    paper trains as well with 4-bit outer gradients). 0.5 byte/element plus 4 bytes per block.
    Error bound: max|x| / 14 + 2 eps max|x| + SUBNORMAL_SLACK (per block it is absmax / 14).
    """

    name = "blockwise4"
    wire_bytes = 0.5
    code_max, offset = _INT4_MAX, _INT4_MAX

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        if isinstance(tensor, torch.Tensor) and tensor.numel() > MAX_DENSE_ELEMENTS:
            raise CompressionError(f"blockwise4: {tensor.numel()} elements is over {MAX_DENSE_ELEMENTS}; split it")
        stored, scales = self._stored(tensor)
        numel, pairs = stored.numel(), stored.numel() // 2
        codes = torch.empty(pairs + numel % 2, dtype=torch.uint8, device=stored.device)
        # each byte: the even value's nibble, then the odd one's times 16 (exact in float32)
        codes[:pairs] = torch.add(stored[0:2 * pairs:2], stored[1:2 * pairs:2], alpha=16)
        if numel % 2:
            codes[pairs] = stored[-1]  # (the padding nibble is 0)
        return {"shape": list(tensor.shape), "codes": codes, "scales": scales}

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        check_fields(payload, self.name, ("shape", "codes", "scales"))
        shape = shape_field(payload, "shape", self.name)
        codes = tensor_field(payload, "codes", self.name, torch.uint8, ndim=1)
        scales = tensor_field(payload, "scales", self.name, torch.float32, ndim=1)
        numel = shape.numel()
        if codes.numel() != -(-numel // 2):
            raise CompressionError(f"{self.name} payload has {codes.numel()} bytes of codes for {numel} values")
        self._check_scales(scales, numel, "values")
        return self._scaled(payload, numel).view(shape)

    def _values(self, payload: Mapping[str, Any], numel: int) -> torch.Tensor:
        codes = payload["codes"]
        nibbles = torch.empty(codes.numel(), 2, dtype=torch.uint8, device=codes.device)
        torch.bitwise_and(codes, 0x0F, out=nibbles[:, 0])
        torch.bitwise_right_shift(codes, 4, out=nibbles[:, 1])
        stored = nibbles.view(-1)[:numel]
        if numel and stored.max().item() == _NIBBLE_INVALID:
            raise CompressionError(f"{self.name} payload has code 8, outside -7..7")
        return stored.to(torch.float32).sub_(self.offset).div_(self.code_max)
