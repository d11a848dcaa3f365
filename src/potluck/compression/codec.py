"""The codec interface and the registry that names codecs by string on the wire.

A codec choice travels as `{"name": ..., **params}` (plain msgpack values), never as an enum, so
adding a codec is one `@register_codec` class and no change to any protocol.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import torch

from potluck.compression.checks import shape_field, type_name, value_range
from potluck.core.errors import CompressionError

__all__ = ["Codec", "get_codec", "known_codecs", "register_codec"]

# Codec names travel in every group's schema; short lowercase names keep them readable in logs.
MAX_CODEC_NAME_LENGTH = 64
_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_.-]*")


class Codec(ABC):
    """Turns a tensor into a msgpack-able dict (tensors inside travel out of band) and back.

    `encode` refuses non-finite input; `decode` treats its payload as hostile and raises only
    `CompressionError`; `error_bound` is the max abs elementwise error of a round trip.
    """

    name: ClassVar[str]
    # True when encode keeps state (error feedback): use one instance per tensor.
    stateful: ClassVar[bool] = False
    # About how many bytes one float32 element takes on the wire (the all-reduce sizes its
    # chunks by the time their bytes take on a link); 4 where it depends on the values.
    wire_bytes: ClassVar[float] = 4.0

    def params(self) -> dict[str, Any]:
        """The constructor parameters, msgpack-able; `get_codec(self.spec)` rebuilds the codec."""
        return {}

    @property
    def spec(self) -> dict[str, Any]:
        """The wire form of this codec choice."""
        return {"name": self.name, **self.params()}

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        """The payload for `tensor`; CompressionError if it holds nan/inf or cannot be encoded."""

    def encode_received(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """`encode(tensor)`, and the tensor a peer decodes from that payload: what a sender digests
        and signs as sent. Codecs that can skip the checks of their own payload override it."""
        payload = self.encode(tensor)
        return payload, self.decode(payload, tensor.numel())

    def decode(self, payload: Mapping[str, Any], numel: int | None = None, *, most: int | None = None,
               ) -> torch.Tensor:
        """The tensor a payload stands for, after strict checks; CompressionError on any flaw.

        Lossy codecs return float32, "none" the dtype it was sent in. The shape is the payload's:
        callers compare it with the shape they agreed on. `numel` (exactly) and `most` (at most):
        the elements the caller expects, checked against what the payload declares before anything
        is rebuilt; a sparse payload of a few bytes can declare 2^28 zeros.
        """
        if not isinstance(payload, Mapping):
            raise CompressionError(f"{self.name} payload must be a dict, got {type_name(payload)}")
        if numel is not None or most is not None:
            declared = _declared_elements(payload, self.name)
            if declared is not None and numel is not None and declared != numel:
                raise CompressionError(f"{self.name} payload stands for {declared} elements, not the {numel} expected")
            if declared is not None and most is not None and declared > most:
                raise CompressionError(f"{self.name} payload stands for {declared} elements, over the {most} expected")
        try:
            out = self._decode(payload)
        except CompressionError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as exc:
            # The field checks should catch everything first; this keeps the contract if not.
            raise CompressionError(f"{self.name} payload is malformed: {exc}") from exc
        if out.is_floating_point():
            try:
                value_range(out, self.name)
            except CompressionError:
                raise CompressionError(f"{self.name} payload decodes to non-finite values") from None
        return out

    @abstractmethod
    def _decode(self, payload: Mapping[str, Any]) -> torch.Tensor:
        """Check the payload's fields and rebuild the tensor."""

    @abstractmethod
    def error_bound(self, tensor: torch.Tensor) -> float:
        """Max abs elementwise error of decode(encode(tensor)) against `tensor.float()`."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"


def _declared_elements(payload: Mapping[str, Any], codec: str) -> int | None:
    """How many elements a payload says it stands for, read without rebuilding anything: its
    "shape" field, else the size of its "data" or "codes" (one per element); None if neither."""
    if "shape" in payload:
        return shape_field(payload, "shape", codec).numel()
    for key in ("data", "codes"):
        value = payload.get(key)
        if isinstance(value, torch.Tensor):
            return value.numel()
    return None


_CODECS: dict[str, type[Codec]] = {}
CodecType = TypeVar("CodecType", bound=type[Codec])


def register_codec(cls: CodecType) -> CodecType:
    """Make `cls` available to `get_codec` under `cls.name` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or len(name) > MAX_CODEC_NAME_LENGTH or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(f"codec name must match {_NAME_PATTERN.pattern} (max {MAX_CODEC_NAME_LENGTH}), got {name!r}")
    if _CODECS.get(name, cls) is not cls:
        raise ValueError(f"codec name {name!r} is already taken by {_CODECS[name].__qualname__}")
    _CODECS[name] = cls
    return cls


def known_codecs() -> list[str]:
    """Names of all registered codecs, sorted."""
    return sorted(_CODECS)


def get_codec(spec: str | Mapping[str, Any] | Codec) -> Codec:
    """A codec from its name, its wire form `{"name": ..., **params}`, or a ready instance.

    Unknown names or parameters raise CompressionError listing what is known. Each call builds a
    fresh instance, which matters for stateful codecs (one per tensor).
    """
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", None)
    else:
        raise CompressionError(f"a codec spec is a name or a dict with a 'name', got {type_name(spec)}")
    cls = _CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CompressionError(f"unknown codec {name!r:.80}; known codecs: {', '.join(known_codecs())}")
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted_names = {p.name for p in inspect.signature(cls).parameters.values() if p.kind in keyword_kinds}
    unknown = [key for key in params if key not in accepted_names]
    if unknown:
        raise CompressionError(
            f"codec {name!r} does not take parameter(s) {unknown!r:.200}; it takes: {sorted(accepted_names) or 'none'}"
        )
    return cls(**params)
