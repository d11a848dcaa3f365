"""What a run trains, named on the command line: `--model`, `--data`, `--loss`, `--optimizer`, `--lr`,
`--seed`, or the same keys in a `--spec FILE.toml` (command-line values override the file).

Models, data and losses are user code, named by reference: "pkg.module:name", imported the way
`python -m` would (the current directory is on the path). Every peer of a run names the same
references and seed, so every peer builds the same initial weights without sending any.

- `--model REF`: a function of no arguments returning a list of layers, an `nn.Sequential`, or a
  module torch.fx can trace (split into layers at its top-level submodules).
- `--data REF`: a function `(rank, seed) -> iterator of (inputs, targets)` micro-batches; `rank`
  tells peers apart so they draw different batches.
- `--loss REF|NAME`: a function `(outputs, targets) -> scalar`, or one of `LOSSES`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from potluck.core import compat
from potluck.core.errors import PotluckError

# Loss names `--loss` accepts, and the torch.nn.functional function each means.
LOSSES = {"cross_entropy": "cross_entropy", "mse": "mse_loss", "l1": "l1_loss", "nll": "nll_loss",
          "smooth_l1": "smooth_l1_loss", "bce_with_logits": "binary_cross_entropy_with_logits"}
# Optimizer names `--optimizer` accepts, and the torch.optim class each means.
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
# A spec file larger than this is refused: specs are a handful of lines, anything bigger is a mistake.
MAX_SPEC_BYTES = 64 * 1024
# The demo's model stands in when no --model is given (what `potluck demo --mode pipeline` trains).
DEMO_MODEL = "potluck.cli.spec:demo_model"


class SpecError(PotluckError, ValueError):
    """A run spec names something that cannot be loaded or used (the message says what and why)."""


def load_ref(ref: str, what: str = "reference") -> Callable[..., Any]:
    """The callable `ref` ("pkg.module:name", dots after the colon walk attributes) names.
    `what` ("--model", ...) starts every error message, which says which step failed."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{what} {ref!r}: expected 'pkg.module:name'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # like `python -m`: modules in the current directory resolve
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise SpecError(f"{what} {ref!r}: module {e.name!r} not found (from {os.getcwd()})") from e
        raise SpecError(f"{what} {ref!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise SpecError(f"{what} {ref!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"{what} {ref!r}: {path!r} has no attribute {part!r}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    if not callable(obj):
        raise SpecError(f"{what} {ref!r}: {path} is a {type(obj).__name__}, not callable")
    return obj


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """The run-spec options. Defaults are None here so `RunSpec.from_args` can tell a value given
    on the command line (overrides the file) from one left out."""
    group = parser.add_argument_group("run spec (what to train; also settable in --spec FILE.toml)")
    group.add_argument("--spec", metavar="FILE.toml", help="TOML file with any of the keys below (no dashes)")
    group.add_argument("--model", metavar="REF",
                       help="pkg.module:fn returning a list of layers, an nn.Sequential or an fx-traceable "
                            "module (default: the demo's 6-block MLP)")
    group.add_argument("--data", metavar="REF", help="pkg.module:fn (rank, seed) -> iterator of (inputs, targets)")
    group.add_argument("--loss", metavar="REF|NAME",
                       help=f"pkg.module:fn (outputs, targets) -> loss, or one of {', '.join(LOSSES)} "
                            "(default: cross_entropy)")
    group.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="default: adam")
    group.add_argument("--lr", type=float, help="learning rate (default: 0.001)")
    group.add_argument("--seed", type=int, help="seeds the initial weights and the data (default: 0)")


@dataclass(frozen=True)
class RunSpec:
    """What a run trains. Holds references, not objects, so it can be printed, written to a plan
    file and sent to other peers as it is."""

    model: str = DEMO_MODEL
    data: str | None = None
    loss: str = "cross_entropy"
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if ":" not in self.loss and self.loss not in LOSSES:
            raise SpecError(f"loss {self.loss!r}: expected 'pkg.module:fn' or one of {', '.join(LOSSES)}")
        if not self.lr > 0:
            raise SpecError(f"lr must be positive, got {self.lr}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSpec:
        """Defaults, then the --spec file, then the options given on the command line."""
        spec = cls.from_toml(Path(args.spec)) if getattr(args, "spec", None) else cls()
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return replace(spec, **given)

    @classmethod
    def from_toml(cls, path: Path) -> RunSpec:
        try:
            text = path.read_bytes()[:MAX_SPEC_BYTES + 1]
        except OSError as e:
            raise SpecError(f"--spec {path}: {e.strerror}") from e
        if len(text) > MAX_SPEC_BYTES:
            raise SpecError(f"--spec {path}: larger than {MAX_SPEC_BYTES} bytes")
        try:
            values = parse_toml(text.decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise SpecError(f"--spec {path}: {e}") from e
        return cls.from_dict(values, f"--spec {path}")

    @classmethod
    def from_dict(cls, values: dict[str, Any], origin: str = "spec") -> RunSpec:
        """From plain data (a TOML file, a plan file), checking names and types."""
        types = {"model": str, "data": str, "loss": str, "optimizer": str, "lr": (int, float), "seed": int}
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise SpecError(f"{origin}: unknown keys {', '.join(unknown)} (known: {', '.join(types)})")
        for key, value in values.items():
            if value is not None and (not isinstance(value, types[key]) or isinstance(value, bool)):
                raise SpecError(f"{origin}: {key} = {value!r} has the wrong type")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def check(self) -> None:
        """Load every reference now, so a typo fails before any peer starts."""
        load_ref(self.model, "--model")
        if self.data is not None:
            load_ref(self.data, "--data")
        self.loss_fn  # noqa: B018 (loading it is the check)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def layers(self) -> list[Any]:
        """The whole model as a list of layers, with the run's initial weights."""
        import torch
        build = load_ref(self.model, "--model")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = build()
        return as_layers(model, self.model)

    def make_layers(self, indices: Sequence[int]) -> list[Any]:
        """Layers `indices` of the model (fresh copies, the same on every peer): a StageWorker's
        `make_layers`. Builds the whole model each time; the rest is dropped."""
        layers = self.layers()
        try:
            return [layers[i] for i in indices]
        except IndexError:
            raise SpecError(f"--model {self.model!r} has {len(layers)} layers, asked for {list(indices)}") from None

    def batches(self, rank: int, seed: int | None = None) -> Iterator[tuple[Any, Any]]:
        """The micro-batches of peer `rank` (seeded with the run's seed unless `seed` is given)."""
        if self.data is None:
            raise SpecError("no --data given: name a function (rank, seed) -> iterator of (inputs, targets)")
        return iter(load_ref(self.data, "--data")(rank, self.seed if seed is None else seed))

    def source(self, rank: int) -> Callable[[int], tuple[Any, Any]]:
        """Micro-batch `mb` of peer `rank`: a StageWorker's `source` (see `BatchSource`)."""
        return BatchSource(self, rank)

    def sample(self, rank: int = 0) -> Any:
        """The inputs of the first micro-batch (what profiling runs the layers on)."""
        return self.source(rank)(0)[0]

    @property
    def loss_fn(self) -> Callable[[Any, Any], Any]:
        if ":" in self.loss:
            return load_ref(self.loss, "--loss")
        from torch.nn import functional
        return getattr(functional, LOSSES[self.loss])

    def make_optimizer(self, params: Any) -> Any:
        import torch
        return getattr(torch.optim, OPTIMIZERS[self.optimizer])(params, lr=self.lr)


class BatchSource:
    """Micro-batch `mb` of one peer, read from `spec.batches` in order; when the iterator ends, the
    next epoch is `batches(rank, seed + epoch)`. Deterministic, so asking for an earlier
    micro-batch (a restarted stage) replays from the start."""

    def __init__(self, spec: RunSpec, rank: int):
        self.spec, self.rank = spec, rank
        self._restart()

    def _restart(self) -> None:
        self.next, self.epoch, self.read_this_epoch = 0, 0, 0
        self.it = self.spec.batches(self.rank)

    def __call__(self, mb: int) -> tuple[Any, Any]:
        if mb < self.next:
            self._restart()
        while True:
            batch = next(self.it, None)
            if batch is None:
                if not self.read_this_epoch:
                    raise SpecError(f"--data {self.spec.data!r} yielded no batches (epoch {self.epoch})")
                self.epoch, self.read_this_epoch = self.epoch + 1, 0
                self.it = self.spec.batches(self.rank, self.spec.seed + self.epoch)
                continue
            self.next, self.read_this_epoch = self.next + 1, self.read_this_epoch + 1
            if self.next > mb:
                return batch


def as_layers(model: Any, ref: str = "model") -> list[Any]:
    """A list of layers from what a model function returned: a list/tuple of modules, an
    nn.Sequential (its children), or another module, traced with torch.fx and cut after each
    top-level submodule call where only that call's output lives on (so each cut passes one tensor)."""
    from torch import nn
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple)):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise SpecError(f"--model {ref!r}: returned a {type(model).__name__} that is not a non-empty list of "
                            "nn.Module layers")
        return list(model)
    if not isinstance(model, nn.Module):
        raise SpecError(f"--model {ref!r}: returned a {type(model).__name__}, expected a list of layers, "
                        "an nn.Sequential or an nn.Module")
    return _split_traced(model, ref)


def _split_traced(model: Any, ref: str) -> list[Any]:
    import torch.fx
    from torch.fx.passes.split_module import split_module
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception as e:
        raise SpecError(f"--model {ref!r}: torch.fx cannot trace it ({type(e).__name__}: {e}); return a list of "
                        "layers or an nn.Sequential instead") from e
    nodes = list(traced.graph.nodes)
    if sum(n.op == "placeholder" for n in nodes) != 1:
        raise SpecError(f"--model {ref!r}: forward must take exactly one input to be split into layers")
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=i) for i, n in enumerate(nodes)}
    part, parts = 0, {}
    for i, node in enumerate(nodes):
        parts[node] = part
        live = [n for n in nodes[:i + 1] if last_use[n] > i and n.op != "get_attr"]
        if node.op == "call_module" and live == [node] and nodes[i + 1].op != "output":
            part += 1
    if part == 0:
        return [model]
    split = split_module(traced, model, lambda n: parts[n])
    return [getattr(split, f"submod_{p}") for p in range(part + 1)]


def demo_model() -> list[Any]:
    """The demo's 6-block MLP (the default --model)."""
    from potluck.cli import demo_pipeline
    return demo_pipeline.make_layers(range(demo_pipeline.LAYERS))


def parse_toml(text: str) -> dict[str, Any]:
    """A TOML document (`compat.tomllib`: the standard library's on 3.11+, tomli on 3.10)."""
    try:
        return compat.tomllib.loads(text)
    except compat.tomllib.TOMLDecodeError as e:
        raise ValueError(str(e)) from e
