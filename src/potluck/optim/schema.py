"""A run's model schema and its fingerprint: what peers must share to train together.

A `RunSchema` lists the trained parameters in order (each one's name where the user gave them,
`model.named_parameters()`, its dtype and shape) and the settings that must match (`settings`:
the training mode and its options that change the math, the target batch size, the codec, the
aggregation, the wrapped optimizer's class and constant hyperparameters; see `Optimizer`). Its
`fingerprint` (32 hex digits of BLAKE2b) rides in every progress record, round record and
matchmaking schema, and the whole schema in the state manifest's metadata; parameter servers and
pipeline nodes publish theirs (`ModelSignature`) with their announcements and profiles.

Peers with another fingerprint are not grouped, not counted in the run's progress and not asked
for the state. A peer that finds itself the odd one (`potluck.optim.context`) stops with
`ModelMismatch`, whose message names the first difference (`RunSchema.difference`), e.g.
"parameter 3 'fc1.weight': yours is float32 [128, 64], the run's is float32 [256, 64]".

The fingerprint is a declaration for mistakes, not a proof: anyone can copy a run's. What decides
that a peer is the odd one is in docs/security.md ("A wrong model").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import torch

from potluck.core.errors import MalformedMessage, PotluckError
from potluck.core.wire import Dict, Int, List, Message, Nested, Text, Tuple, encoded_value

__all__ = ["FINGERPRINT_CHARS", "MAX_SCHEMA_TENSORS", "ModelMismatch", "ModelSignature", "RunSchema",
           "optimizer_settings", "trained_parameters"]

# Hex digits of a fingerprint (BLAKE2b, 16 bytes): long enough never to collide by chance.
FINGERPRINT_CHARS = 32
# Parameter tensors a schema lists: large transformers have a few thousand (the parameter
# server's MAX_LAYOUT_TENSORS, for the same reason).
MAX_SCHEMA_TENSORS = 100_000
# A parameter's name (`model.named_parameters()`: dotted module paths, tens of characters).
MAX_PARAMETER_NAME_CHARS = 512
# Dimensions of one parameter (torch allows up to 64; models use 1 to 5).
MAX_DIMS = 64
# Settings one schema lists (a mode's options, the optimizer's hyperparameters per group: tens).
MAX_SETTINGS = 1024
MAX_SETTING_NAME_CHARS = 128
MAX_SETTING_CHARS = 1024
# Encoded bytes of a schema carried where space is shared: a DHT value of a shard server's
# announcement or a pipeline node's profile (64 KiB in all, `dht.validation`). A bigger schema is
# carried as its fingerprint only, and a mismatch is then reported without naming the tensor.
MAX_SIGNATURE_SCHEMA_BYTES = 16 * 2**10
# The same in a state manifest's metadata (1 MiB in all, `MAX_STATE_METADATA_BYTES`).
MAX_MANIFEST_SCHEMA_BYTES = 256 * 2**10
# Version tag hashed with every schema: a change of what is hashed changes every fingerprint.
SCHEMA_FORMAT = "potluck/run-schema/1"
# Hyperparameters of the wrapped optimizer's groups that are not part of the schema: the
# learning rate follows the schedule (a resumed peer holds a later one), and the rest choose an
# implementation, not the math.
UNSHARED_HYPERPARAMETERS = frozenset({"params", "param_names", "lr", "initial_lr", "foreach", "fused",
                                      "capturable", "differentiable"})


class ModelMismatch(PotluckError, ValueError):
    """This peer's model or run settings differ from the run's (the message names the first
    difference and what to do)."""


class RunSchema(Message, what="run schema"):
    """The parameters (name or None, dtype, shape) in order, and the settings that must match."""

    params: tuple[tuple[str | None, str, tuple[int, ...]], ...] = List(
        "params", Tuple(items=(Text(max_chars=MAX_PARAMETER_NAME_CHARS, optional=True), Text(max_chars=32),
                               List(None, Int(None, 0, 2**62), MAX_DIMS))), MAX_SCHEMA_TENSORS)
    settings: dict[str, str] = Dict("settings", Text(max_chars=MAX_SETTING_NAME_CHARS),
                                    Text(max_chars=MAX_SETTING_CHARS), MAX_SETTINGS, pairs=False)

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], names: Sequence[str | None] | None = None,
           settings: Mapping[str, Any] | None = None) -> RunSchema:
        """The schema of `params` (with their `names`, if known) and `settings` (any values that
        JSON can hold; written in canonical form)."""
        names = list(names) if names is not None else [None] * len(params)
        listed = tuple((name, str(p.dtype).removeprefix("torch."), tuple(p.shape)) for name, p in zip(
            names, params, strict=True))
        return cls(listed, {str(k): _setting_text(v) for k, v in (settings or {}).items()})

    @cached_property
    def fingerprint(self) -> str:
        text = json.dumps([SCHEMA_FORMAT, [[n, d, list(s)] for n, d, s in self.params], sorted(self.settings.items())])
        return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_CHARS // 2).hexdigest()

    def difference(self, run: RunSchema, whose: str = "the run's", names: bool = True) -> str | None:
        """The first difference between this (ours) and `run`'s schema, in one line (None if
        they are equal): the first parameter whose name, dtype or shape differs (`names`: names
        count too), else the first setting."""
        for i in range(max(len(self.params), len(run.params))):
            mine = self.params[i] if i < len(self.params) else None
            theirs = run.params[i] if i < len(run.params) else None
            if mine is None or theirs is None or mine[1:] != theirs[1:] or (names and mine[0] != theirs[0]):
                named = [p[0] for p in (mine, theirs) if p is not None and p[0] is not None]
                label = f"parameter {i}" + (f" {named[0]!r}" if named else "")
                renamed = names and mine is not None and theirs is not None and mine[0] != theirs[0]
                return f"{label}: yours is {_describe(mine, renamed)}, {whose} is {_describe(theirs, renamed)}"
        for key in sorted(self.settings.keys() | run.settings.keys()):
            mine, theirs = self.settings.get(key), run.settings.get(key)
            if mine != theirs:
                return f"setting {key!r}: yours is {mine or 'not set'}, {whose} is {theirs or 'not set'}"
        return None


class ModelSignature(Message, what="model signature"):
    """A schema's fingerprint, and the schema itself where it fits (`MAX_SIGNATURE_SCHEMA_BYTES`):
    what shard servers and pipeline nodes publish of their model."""

    fingerprint: str = Text("fp", FINGERPRINT_CHARS)
    schema: RunSchema | None = Nested("schema", RunSchema, default=None)

    @classmethod
    def of(cls, schema: RunSchema, max_bytes: int = MAX_SIGNATURE_SCHEMA_BYTES) -> ModelSignature:
        return cls(schema.fingerprint, schema if fits(schema, max_bytes) else None)

    def difference(self, mine: RunSchema, whose: str, names: bool = True) -> str:
        """What differs between `mine` and this signature's model, in one line."""
        found = None
        if self.schema is not None and self.schema.fingerprint == self.fingerprint:
            found = mine.difference(self.schema, whose, names)
        if found is not None:
            return found
        why = "too large to publish with it" if self.schema is None else "as another potluck version computes it"
        return f"your model's schema has fingerprint {mine.fingerprint}, {whose} {self.fingerprint} ({why})"


def fits(schema: RunSchema, max_bytes: int) -> bool:
    """Whether `schema` encodes in at most `max_bytes` bytes."""
    try:
        encoded_value(schema.to_wire(), "schema", "run schema", max_bytes)
    except MalformedMessage:
        return False
    return True


def trained_parameters(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[str | None]]:
    """The parameters a run shares (those that require a gradient, in the optimizer's order) and
    their names, where the optimizer was given them (`model.named_parameters()`)."""
    params: list[torch.Tensor] = []
    names: list[str | None] = []
    for group in optimizer.param_groups:
        given = group.get("param_names") or [None] * len(group["params"])
        for name, p in zip(given, group["params"], strict=True):
            if p.requires_grad:
                params.append(p)
                names.append(name)
    return params, names


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The wrapped optimizer's part of the schema: its class and, per parameter group, the
    hyperparameters that stay constant (numbers, flags, strings and tuples of them), without those
    in UNSHARED_HYPERPARAMETERS."""
    kind = type(optimizer)
    settings: dict[str, Any] = {"optimizer": f"{kind.__module__}.{kind.__qualname__}",
                                "optimizer.groups": len(optimizer.param_groups)}
    for i, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            plain = _plain(value)
            if key not in UNSHARED_HYPERPARAMETERS and plain is not _UNSET:
                settings[f"optimizer.{i}.{key}"] = plain
    return settings


_UNSET = object()


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it, if it is a number, a flag, a string, None, a one-element
    tensor or a tuple of these; else _UNSET (an object: its text may differ between processes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return _UNSET if any(v is _UNSET for v in items) else items
    return _UNSET


def _setting_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _describe(param: tuple[str | None, str, Iterable[int]] | None, named: bool) -> str:
    """A parameter as the difference names it: dtype and shape, and its name if `named`."""
    if param is None:
        return "missing"
    name, dtype, shape = param
    text = f"{dtype} [{', '.join(str(d) for d in shape)}]"
    if not named:
        return text
    return f"{text} named {name!r}" if name is not None else f"{text} without a name (give every peer the same " \
        "parameters: model.named_parameters() or model.parameters())"
