"""The training modes of a run: their options (`Sync`, `Moshpit`, `DiLoCo`) and the small
interface each one implements over the run's context (`TrainingMode`).

- `Sync` (DeDLOC, `potluck.optim.sync`): gradients accumulate until the swarm's global batch is
  full, then the peers average them and all take the same optimizer step.
- `Moshpit` (`potluck.optim.moshpit`): local SGD; every `local_steps` steps the parameters are
  averaged in Moshpit groups.
- `DiLoCo` (`potluck.optim.diloco`): `local_steps` inner steps, then an outer step with Nesterov
  momentum on the averaged change; with `fragments`, `outer_delay` or `outer_compression`,
  Streaming DiLoCo (`potluck.optim.streaming`): one fragment of the model at a time, overlapped.

`Optimizer(mode=...)` takes one of these, or its name with the options as keywords (`mode="diloco",
local_steps=64`), which `mode_options` turns into the same object.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from potluck.compression import Codec, TopK, get_codec
from potluck.optim.context import RunContext
from potluck.optim.schema import RunSchema, optimizer_settings, trained_parameters

__all__ = ["MAX_FRAGMENTS", "DiLoCo", "ModeOptions", "Moshpit", "Sync", "TrainingMode", "mode_options", "run_schema"]

# Each fragment runs two averagers (a matchmaking key and a round per epoch each); the paper's
# models use a few to a few dozen fragments (one per few layers). More is a misconfiguration.
MAX_FRAGMENTS = 64
# How Streaming DiLoCo cuts the parameters into fragments (`streaming.split_fragments`), part of
# the schema of runs with fragments: peers whose versions cut differently are told that their run
# differs, rather than averaging fragments that do not match. 2: between rows, inside tensors too.
FRAGMENT_SPLIT = 2


class TrainingMode(ABC):
    """How a run's peers train together: when to average what, over the run's `context`. The
    `Optimizer` calls `start()` once it has the swarm's state, `step()` after every local batch
    (its gradients in the parameters' `.grad`), and `shutdown()` at the end."""

    # Whether every step() begins with the wrapped optimizer's step (`context.inner_step()`): the
    # local-update modes. `Optimizer.step()` then takes it in the caller's thread before handing
    # the rest to the event loop, which saves a round trip to a worker thread per step.
    inner_step_first = False

    def __init__(self, context: RunContext):
        self.context = context

    @abstractmethod
    async def start(self) -> None:
        """Build what the mode holds beyond the model (buffers, averagers)."""

    @abstractmethod
    async def step(self) -> None:
        """Account for one local batch; average and update when it is time."""

    def quiet_step(self) -> bool:
        """In the caller's thread, after its inner step (`inner_step_first`): count this step
        there if it needs nothing of the event loop (True), else leave it to `step()`."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - a mode that holds nothing beyond the context has nothing to stop
        """Stop the mode's averagers and any round in flight (from any thread)."""


@dataclass(frozen=True)
class ModeOptions:
    """A training mode's own options (the subclasses); checked when the Optimizer is built."""

    name: ClassVar[str] = ""
    # The version donors announce is the epoch (else the state averager's count of its rounds).
    versions_follow_epochs: ClassVar[bool] = False
    # Options each peer may choose for itself: they change when it applies an update, not which
    # (every other option is part of the run's schema: `shared_settings`).
    own_choices: ClassVar[tuple[str, ...]] = ()

    def check(self, rows: int) -> None:
        """ValueError (or CompressionError for a codec) on options that cannot work, for trained
        parameters of `rows` rows in all (along their first dimension; a scalar is one)."""

    def shared_settings(self) -> dict[str, Any]:
        """The options every peer of a run must share (part of its schema), by `<mode>.<option>`:
        all but `own_choices`; codecs in their canonical form."""
        shared = {}
        for f in dataclasses.fields(self):
            if f.name not in self.own_choices:
                value = getattr(self, f.name)
                shared[f"{self.name}.{f.name}"] = get_codec(value).spec if f.name.endswith("compression") else value
        return shared

    def state_grid(self) -> tuple[int, ...] | None:
        """The Moshpit grid of the state averager, if the mode averages the state on one."""
        return None

    def state_codec(self, compression: Any) -> Any:
        """The codec of the state averager, given the run's `compression`: none, for a state
        averaged now and then beside the rounds that `compression` is for (gradients,
        pseudo-gradients). A lossy codec on Adam's second moments rounds the smallest to zero,
        and Adam then divides by eps: with 8 bits a sync run stayed at chance."""
        return "none"

    def extra_state(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors of the mode that are part of the run's state (averaged and downloaded with it)."""
        return []


@dataclass(frozen=True)
class Sync(ModeOptions):
    """DeDLOC: average the accumulated gradients once the global batch is full.

    average_state_every: average parameters and statistics every k epochs (also repairs drift;
        skipped when every member of the gradient round held the same state).
    delay_updates: average in the background while the next batches accumulate (DeDLOC's
        delayed updates: each update one or more steps stale).
    powersgd_rank: average rank-r PowerSGD approximations of the gradients with error feedback.
    """

    name: ClassVar[str] = "sync"
    versions_follow_epochs: ClassVar[bool] = True
    # A delayed update is the same average applied a step later: peers may differ in it.
    own_choices: ClassVar[tuple[str, ...]] = ("delay_updates",)
    average_state_every: int = 1
    delay_updates: bool = False
    powersgd_rank: int | None = None


@dataclass(frozen=True)
class Moshpit(ModeOptions):
    """Moshpit SGD: local steps, and every `local_steps` steps the parameters averaged in
    Moshpit groups. `grid`: the grid's sizes; default: one fitted to the swarm's size at each
    round (`potluck.averaging.moshpit_grid`), each peer in the cell of its rank."""

    name: ClassVar[str] = "moshpit"
    local_steps: int = 10
    grid: tuple[int, ...] | None = None

    def state_grid(self) -> tuple[int, ...] | None:
        return None if self.grid is None else tuple(self.grid)

    def state_codec(self, compression: Any) -> Any:
        return compression  # every round averages the state: the run's codec is for it


@dataclass(frozen=True)
class DiLoCo(ModeOptions):
    """DiLoCo: `local_steps` inner steps of the wrapped optimizer, then an outer step (Nesterov,
    `outer_lr`, `outer_momentum`) on the averaged change of the parameters.

    fragments: Streaming DiLoCo: split the parameters (in order, about equal sizes, cutting a
        tensor between rows where need be) into this many fragments; fragment i's outer round
        comes every `local_steps` steps, offset by i * local_steps / fragments (a multiple of
        fragments). An epoch is one fragment's round.
    outer_delay: inner steps a fragment's round runs in the background before it is applied
        (less than local_steps / fragments; fewer once another peer of the round has applied
        it); the local parameters then take
        `mixing * local + (1 - mixing) * outer` (paper: mixing 0.5).
    outer_compression: codec for the pseudo-gradients on the wire, e.g. "blockwise4",
        {"name": "topk", "ratio": 0.01} (top-k with error feedback per fragment).
    grid: Streaming DiLoCo: Moshpit groups for the fragment rounds.
    """

    name: ClassVar[str] = "diloco"
    local_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    outer_delay: int = 0
    mixing: float = 0.5
    outer_compression: Any = "none"
    grid: tuple[int, ...] | None = None

    @property
    def streaming(self) -> bool:
        """Anything beyond plain DiLoCo: fragments, a delay or a codec (Streaming DiLoCo)."""
        return self.fragments > 1 or self.outer_delay > 0 or get_codec(self.outer_compression).name != "none"

    def check(self, rows: int) -> None:
        fragments, delay, mixing = self.fragments, self.outer_delay, self.mixing
        if isinstance(fragments, bool) or not isinstance(fragments, int) \
                or not 1 <= fragments <= min(MAX_FRAGMENTS, max(rows, 1)):
            raise ValueError(f"fragments must be an int in 1..{min(MAX_FRAGMENTS, rows)} "
                             f"(at most one per row of the parameters), got {fragments!r}")
        if self.local_steps % fragments:
            raise ValueError(f"local_steps ({self.local_steps}) must be a multiple of fragments ({fragments}): "
                             "a fragment's round starts every local_steps / fragments steps")
        interval = self.local_steps // fragments
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < interval:
            raise ValueError(f"outer_delay must be an int in 0..{interval - 1} (less than local_steps / fragments: "
                             f"one fragment's round in flight at a time), got {delay!r}")
        if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0 <= mixing <= 1:
            raise ValueError(f"mixing must be a number in [0, 1], got {mixing!r}")
        get_codec(self.outer_compression)  # parsed (and refused) now, not at the first round

    def shared_settings(self) -> dict[str, Any]:
        shared = super().shared_settings()
        if self.fragments > 1:  # (left out otherwise: the schema of a run without fragments is unchanged)
            shared["diloco.fragment_split"] = FRAGMENT_SPLIT
        return shared

    def wire_codec(self) -> Codec:
        """What the fragment averagers send pseudo-gradients with: a top-k thins them before the
        round (with error feedback), and its chunks and averages travel as `sparse`, which loses
        nothing (a top-k per chunk would cut them again, without feedback)."""
        codec = get_codec(self.outer_compression)
        return get_codec("sparse") if isinstance(codec, TopK) else codec

    def extra_state(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        # The outer momentum is part of the state newcomers download and groups average: members
        # whose momentum differs would take different outer steps from one change.
        return [torch.zeros_like(p) for p in params]


MODES: dict[str, type[ModeOptions]] = {kind.name: kind for kind in (Sync, Moshpit, DiLoCo)}
# Streaming DiLoCo's options, which other modes refused by name rather than ignored.
_DILOCO_ONLY = ("fragments", "outer_delay", "mixing", "outer_compression")


def mode_options(mode: str | ModeOptions, options: dict[str, Any]) -> ModeOptions:
    """The mode `Optimizer(mode=..., **options)` asks for. A name takes the mode's options as
    keywords; as before options were grouped by mode, options of other modes are accepted and
    ignored (`local_steps` in sync mode), except Streaming DiLoCo's."""
    if isinstance(mode, ModeOptions):
        if options:
            raise TypeError(f"give the options of mode {mode.name!r} in {type(mode).__name__}(...), "
                            f"not as keywords: {sorted(options)}")
        return mode
    kind = MODES.get(mode) if isinstance(mode, str) else None
    if kind is None:
        raise ValueError(f"mode must be one of {tuple(MODES)} or one of potluck.optim's Sync, Moshpit, DiLoCo, "
                         f"not {mode!r}")
    known = {f.name for other in MODES.values() for f in dataclasses.fields(other)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"Optimizer got unexpected keyword argument(s) {unknown}; the options of each mode are "
                        f"those of potluck.optim.Sync, Moshpit and DiLoCo")
    own = {f.name for f in dataclasses.fields(kind)}
    refused = [name for name in _DILOCO_ONLY if name in options and name not in own
               and options[name] != getattr(DiLoCo, name)]
    if refused:
        raise ValueError("fragments, outer_delay, mixing and outer_compression are diloco options")
    return kind(**{name: value for name, value in options.items() if name in own})


def run_schema(optimizer: torch.optim.Optimizer, options: ModeOptions, target_batch_size: int, compression: Any,
               aggregation: str, verified: dict[str, Any] | None = None) -> RunSchema:
    """The schema peers of a run must share (`potluck.optim.schema`): the trained parameters, the
    mode and its shared options, the target batch size, the codec, the aggregation and the
    wrapped optimizer's class and constant hyperparameters; in verified training, the dataset's
    digest and the batch size."""
    settings = {"mode": options.name, "target_batch_size": target_batch_size,
                "compression": get_codec(compression).spec, "aggregation": aggregation,
                **options.shared_settings(), **optimizer_settings(optimizer)}
    if verified is not None:  # (left out otherwise: the schema of an unverified run is unchanged)
        settings["verified"] = verified
    return RunSchema.of(*trained_parameters(optimizer), settings)
