"""Top-k sparsification with error feedback, for gradients; and `sparse`, which sends exactly the
nonzero values of a tensor (what carries tensors that a top-k already thinned, e.g. Streaming
DiLoCo's pseudo-gradients, through an all-reduce whose chunks and averages a top-k would cut again).

Each encode sends the largest-magnitude fraction of (gradient + residual) and keeps the rest as
the residual for the next call, so nothing is lost, only delayed: over any number of calls,
sum(decoded) == sum(inputs) - residual (up to float32 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from potluck.compression.checks import (
    MAX_DENSE_ELEMENTS,
    check_fields,
    check_finite_field,
    finite_float32,
    shape_field,
    tensor_field,
    value_range,
)
from potluck.compression.codec import Codec, register_codec
from potluck.core.errors import CompressionError

__all__ = ["Sparse", "TopK"]


def _sparse_fields(payload: Mapping[str, Any], codec: str) -> tuple[torch.Size, torch.Tensor, torch.Tensor]:
    """A sparse payload's shape, int32 indices and float32 values, each checked for type."""
    check_fields(payload, codec, ("shape", "indices", "values"))
    return (shape_field(payload, "shape", codec), tensor_field(payload, "indices", codec, torch.int32, ndim=1),
            tensor_field(payload, "values", codec, torch.float32, ndim=1))


def _scatter(shape: torch.Size, indices: torch.Tensor, values: torch.Tensor, codec: str) -> torch.Tensor:
    """A zero tensor of `shape` with finite `values` at `indices`, strictly increasing within it."""
    check_finite_field(values, "values", codec)
    numel = shape.numel()
    if indices.numel():
        if indices[0].item() < 0 or indices[-1].item() >= numel:
            raise CompressionError(f"{codec} payload has indices outside 0..{numel - 1}")
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise CompressionError(f"{codec} payload indices must be strictly increasing")
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[indices.long()] = values
    return out.view(shape)


@register_codec
class TopK(Codec):
    """Sends ceil(ratio * n) (at least 1) largest |values| as sorted int32 indices + float32 values.

    Stateful: one instance per tensor (or flattened group) on the sending side; any instance with
    the same ratio decodes. ~8 * ratio bytes/element. `error_bound(t)` is the largest magnitude
    the next `encode(t)` will hold back: its result differs from t + residual by at most that.
    """

    name = "topk"
    stateful = True

    def __init__(self, ratio: float = 0.01):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise CompressionError(f"topk: ratio must be a number in (0, 1], got {ratio!r:.50}")
        self.ratio = float(ratio)
        self._residual: torch.Tensor | None = None

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def kept(self, numel: int) -> int:
        """How many values a tensor of `numel` elements sends."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    @property
    def residual(self) -> torch.Tensor | None:
        """What has been held back so far (None before the first encode)."""
        return self._residual

    def reset(self) -> None:
        """Forget the residual (e.g. after loading a fresh state from peers)."""
        self._residual = None

    def _corrected(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor + residual, checked to be finite; leaves the state untouched."""
        if isinstance(tensor, torch.Tensor) and tensor.numel() > MAX_DENSE_ELEMENTS:
            raise CompressionError(f"topk: {tensor.numel()} elements is over {MAX_DENSE_ELEMENTS}; split the tensor")
        x = finite_float32(tensor, self.name).values
        if self._residual is None:
            return x.clone()
        if self._residual.shape != x.shape:
            raise CompressionError(
                f"topk: this instance holds the residual of a {list(self._residual.shape)} tensor, "
                f"got {list(x.shape)}; use one instance per tensor"
            )
        corrected = x + self._residual
        value_range(corrected, self.name)  # finite inputs can still overflow when added
        return corrected

    def _top_indices(self, flat: torch.Tensor) -> torch.Tensor:
        k = self.kept(flat.numel())
        if k == flat.numel():
            return torch.arange(k, device=flat.device)
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        corrected = self._corrected(tensor)
        flat = corrected.view(-1)
        indices = self._top_indices(flat)
        values = flat[indices]
        flat[indices] = 0  # what stays behind is the new residual
        self._residual = corrected
        return {"shape": list(corrected.shape), "indices": indices.to(torch.int32), "values": values}

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        shape, indices, values = _sparse_fields(payload, self.name)
        numel = shape.numel()
        expected = self.kept(numel) if numel else 0
        if indices.numel() != expected or values.numel() != expected:
            raise CompressionError(
                f"topk payload has {indices.numel()} indices and {values.numel()} values; "
                f"ratio {self.ratio} of {numel} elements needs {expected}"
            )
        return _scatter(shape, indices, values, self.name)

    def error_bound(self, tensor: torch.Tensor) -> float:
        flat = self._corrected(tensor).view(-1)
        k = self.kept(flat.numel())
        if k >= flat.numel():
            return 0.0
        return torch.topk(flat.abs(), k + 1).values[-1].item()


@register_codec
class Sparse(Codec):
    """Sends the nonzero values as sorted int32 indices + float32 values: exact (float32), 8 bytes
    per nonzero. For tensors that are mostly zeros; a dense one costs twice "none"."""

    name = "sparse"

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        if isinstance(tensor, torch.Tensor) and tensor.numel() > MAX_DENSE_ELEMENTS:
            raise CompressionError(f"sparse: {tensor.numel()} elements is over {MAX_DENSE_ELEMENTS}; split the tensor")
        flat = finite_float32(tensor, self.name).values.reshape(-1)
        indices = flat.nonzero().view(-1)
        return {"shape": list(tensor.shape), "indices": indices.to(torch.int32), "values": flat[indices]}

    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        shape, indices, values = _sparse_fields(payload, self.name)
        numel = shape.numel()
        if indices.numel() != values.numel() or indices.numel() > numel:
            raise CompressionError(f"sparse payload has {indices.numel()} indices and {values.numel()} values "
                                   f"for {numel} elements")
        return _scatter(shape, indices, values, self.name)

    def error_bound(self, tensor: torch.Tensor) -> float:
        value_range(finite_float32(tensor, self.name).values, self.name)
        return 0.0
