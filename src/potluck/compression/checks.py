"""Input checks shared by the codecs: finite inputs on the way out, strict payloads on the way in.

Payloads arrive from other peers, so every field is checked for type, dtype, shape and range
before any arithmetic; each problem raises `CompressionError` naming the codec and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from potluck.core.errors import CompressionError
from potluck.core.serialization import MAX_DIMS
from potluck.core.tensors import all_finite

# Machine epsilon of float32; error bounds use multiples of it as slack for float rounding.
F32_EPS = torch.finfo(torch.float32).eps
# Largest finite float32: decoded values beyond it would become inf.
F32_MAX = torch.finfo(torch.float32).max
# Absolute slack for subnormal float32 rounding (the smallest subnormal is 2**-149).
SUBNORMAL_SLACK = 2.0**-140
# A payload may not make us allocate a dense tensor bigger than this (1 GiB of float32): it
# bounds the memory a peer can make us spend with a small sparse payload, and keeps indices
# within int32. The averager shards larger vectors long before this.
MAX_DENSE_ELEMENTS = 2**28


@dataclass(frozen=True, slots=True)
class FiniteTensor:
    """A detached contiguous float32 copy (or view) of an input, with its checked range."""

    values: torch.Tensor
    lo: float
    hi: float

    @property
    def absmax(self) -> float:
        return max(abs(self.lo), abs(self.hi))


def type_name(obj: object) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def check_float_tensor(tensor: object, codec: str) -> torch.Tensor:
    """Refuse anything but a dense real floating-point tensor; return it detached."""
    if not isinstance(tensor, torch.Tensor):
        raise CompressionError(f"{codec}: expected a torch.Tensor, got {type_name(tensor)}")
    if tensor.layout != torch.strided:
        raise CompressionError(f"{codec}: expected a dense tensor, got {tensor.layout}")
    if not tensor.is_floating_point():
        raise CompressionError(f"{codec}: expected a floating-point tensor, got {tensor.dtype}")
    return tensor.detach()


def value_range(tensor: torch.Tensor, codec: str) -> tuple[float, float]:
    """(min, max) of a floating tensor; CompressionError if any value is nan or +-inf.

    One `aminmax` pass (it propagates nan) is much cheaper than `isfinite().all()`.
    """
    if tensor.numel() == 0:
        return 0.0, 0.0
    lo, hi = (v.item() for v in torch.aminmax(tensor))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise _non_finite_error(tensor, codec)
    return lo, hi


def _non_finite_error(tensor: torch.Tensor, codec: str) -> CompressionError:
    nan = int(torch.isnan(tensor).sum())
    pos_inf = int(torch.isposinf(tensor).sum())
    neg_inf = int(torch.isneginf(tensor).sum())
    return CompressionError(
        f"{codec}: refusing to encode a tensor of shape {list(tensor.shape)} with {nan} nan, "
        f"{pos_inf} +inf and {neg_inf} -inf values (float32 overflow counts as inf); non-finite "
        "values are never sent to other peers. Look for a diverged loss or overflowing gradients."
    )


def finite_float32(tensor: object, codec: str) -> FiniteTensor:
    """The input as float32 (no copy when it already is), refusing non-finite values."""
    x = check_float_tensor(tensor, codec).to(torch.float32).contiguous()
    lo, hi = value_range(x, codec)
    return FiniteTensor(x, lo, hi)


def to_float32(value: float) -> float:
    """`value` rounded to the nearest float32, so encoder and decoder use the same scalar."""
    return torch.tensor(value, dtype=torch.float32).item()


# ---- payload validation (data from the network) ----


def check_fields(payload: object, codec: str, fields: tuple[str, ...]) -> Mapping[str, Any]:
    """The payload must be a dict with exactly these keys."""
    if not isinstance(payload, Mapping):
        raise CompressionError(f"{codec} payload must be a dict, got {type_name(payload)}")
    keys = set(payload)
    if keys != set(fields):
        missing = sorted(set(fields) - keys, key=str)
        unknown = sorted(keys - set(fields), key=str)
        raise CompressionError(
            f"{codec} payload must have fields {sorted(fields)}; missing {missing}, unknown {unknown!r:.200}"
        )
    return payload


def tensor_field(
    payload: Mapping[str, Any], key: str, codec: str, dtype: torch.dtype, ndim: int | None = None
) -> torch.Tensor:
    """A dense tensor field of exactly `dtype` (and `ndim` dims if given)."""
    value = payload[key]
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise CompressionError(f"{codec} payload field {key!r} must be a dense tensor, got {type_name(value)}")
    if value.dtype != dtype:
        raise CompressionError(f"{codec} payload field {key!r} must be {dtype}, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise CompressionError(f"{codec} payload field {key!r} must have {ndim} dims, got shape {list(value.shape)}")
    if value.dim() > MAX_DIMS:
        raise CompressionError(f"{codec} payload field {key!r} has {value.dim()} dims (max {MAX_DIMS})")
    return value


def float_field(payload: Mapping[str, Any], key: str, codec: str, *, nonnegative: bool = False) -> float:
    """A finite float field that fits float32 (scales, offsets)."""
    value = payload[key]
    if not isinstance(value, float):
        raise CompressionError(f"{codec} payload field {key!r} must be a float, got {type_name(value)}")
    if not math.isfinite(value) or abs(value) > F32_MAX:
        raise CompressionError(f"{codec} payload field {key!r} must be a finite float32 value, got {value}")
    if nonnegative and value < 0:
        raise CompressionError(f"{codec} payload field {key!r} must be >= 0, got {value}")
    return value


def shape_field(payload: Mapping[str, Any], key: str, codec: str) -> torch.Size:
    """A shape given as a list of non-negative ints, no bigger than MAX_DENSE_ELEMENTS."""
    value = payload[key]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIMS:
        raise CompressionError(f"{codec} payload field {key!r} must be a list of at most {MAX_DIMS} ints")
    numel = 1
    for dim in value:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise CompressionError(f"{codec} payload field {key!r} has a bad dimension {dim!r:.50}")
        numel *= dim
        if numel > MAX_DENSE_ELEMENTS:
            raise CompressionError(f"{codec} payload shape is over {MAX_DENSE_ELEMENTS} elements")
    return torch.Size(value)


def check_finite_field(tensor: torch.Tensor, key: str, codec: str) -> None:
    """A float tensor field must hold only finite values."""
    if not all_finite(tensor):
        raise CompressionError(f"{codec} payload field {key!r} holds non-finite values")
