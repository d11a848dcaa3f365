"""Built-in expert types and a registry for custom ones, so a server can be started by type name.

An expert type is a factory `(hidden_dim) -> nn.Module` plus the per-sample shapes and dtypes of
its inputs (the batch dimension excluded); servers check every request against that schema.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ExpertType", "FeedForwardExpert", "TensorSchema", "TransformerBlockExpert", "expert_types",
           "make_expert", "register_expert_type"]

# Sequence length the built-in transformer expert's schema declares (a server takes a fixed shape).
TRANSFORMER_SEQUENCE_LENGTH = 16


@dataclass(frozen=True)
class TensorSchema:
    """One input or output of an expert: per-sample shape (batch dim excluded) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[batch, {', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class ExpertType:
    """How to build an expert of this type and what it takes."""

    factory: Callable[[int], nn.Module]
    input_schema: Callable[[int], tuple[TensorSchema, ...]]


class FeedForwardExpert(nn.Module):
    """Transformer-style feed-forward block: x + W2 gelu(W1 x), then LayerNorm (4x wide inside)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x), approximate="tanh")))


class TransformerBlockExpert(nn.Module):
    """One pre-norm transformer encoder block over [batch, sequence, hidden] (no dropout)."""

    def __init__(self, hidden: int, heads: int | None = None):
        super().__init__()
        heads = heads or max(1, hidden // 64)
        self.block = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, dropout=0.0,
                                                activation="gelu", batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


_REGISTRY: dict[str, ExpertType] = {
    "ffn": ExpertType(FeedForwardExpert, lambda h: (TensorSchema((h,)),)),
    "transformer": ExpertType(TransformerBlockExpert,
                              lambda h: (TensorSchema((TRANSFORMER_SEQUENCE_LENGTH, h)),)),
}


def register_expert_type(name: str, factory: Callable[[int], nn.Module],
                         input_schema: Callable[[int], tuple[TensorSchema, ...]]) -> None:
    """Make a custom expert available by name (to `make_expert` and `potluck expert-server`)."""
    if not name.isidentifier():
        raise ValueError(f"expert type names are identifiers, got {name!r}")
    _REGISTRY[name] = ExpertType(factory, input_schema)


def expert_types() -> list[str]:
    return sorted(_REGISTRY)


def make_expert(name: str, hidden: int) -> tuple[nn.Module, tuple[TensorSchema, ...]]:
    """A fresh expert of a registered type and its input schema."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown expert type {name!r}; known: {', '.join(expert_types())}")
    return kind.factory(hidden), kind.input_schema(hidden)
