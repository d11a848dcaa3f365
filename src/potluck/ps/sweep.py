"""Hyperparameter sweeps: independent trials shared out among peers through the DHT, with leases.

Every peer derives the same trial list from the sweep's spec (grid, or random with a seed), so only
two things cross the DHT, each a dictionary keyed by trial index (DHT subkeys):
- leases: `{index: holder}` that expire `lease_seconds` after they were last renewed. A peer runs a
  trial only while it holds an unexpired lease and renews it as it goes; a peer that dies stops
  renewing, so its trial is free again at most one lease later and another peer re-runs it.
- results: `{index: {params, metrics, peer, seconds}}`. A trial has one subkey, so it appears once
  in the results however many peers ran it (two peers can both claim a trial in the same instant;
  the later result replaces the earlier, and the table still has one row per trial).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.core import compat
from potluck.core.errors import NetworkError, PotluckError
from potluck.dht import DHT

logger = logging.getLogger(__name__)

# A lease lasts this long unless renewed (every third of it, while the trial runs): how long a dead
# peer's trial waits before another peer takes it over.
LEASE_SECONDS = 30.0
# Results live this long in the DHT: longer than any sweep we expect, within the DHT's one-day TTL.
RESULT_TTL = 20 * 3600.0
# How often a peer with nothing to claim looks again (trials of live peers may still fail).
POLL_SECONDS = 2.0
# Trials in one sweep: the results dictionary is read whole at every claim.
MAX_TRIALS = 1000

Objective = Callable[[dict[str, Any]], dict[str, float] | Awaitable[dict[str, float]]]


class SweepError(PotluckError, ValueError):
    """A sweep spec is malformed (unknown kind, empty space, bad ranges, too many trials)."""


@dataclass(frozen=True)
class Trial:
    """One point of the search space; `index` is its place in the sweep's trial list."""

    index: int
    params: dict[str, Any]


@dataclass
class SweepSpec:
    """What to try. `space` maps a name to a list of values (grid, or a random choice) or, for
    random sweeps, to `{"low": a, "high": b, "log": bool, "int": bool}`. `fixed` values are passed
    to every trial unchanged."""

    name: str
    space: dict[str, Any]
    kind: str = "grid"
    trials: int = 0  # random: how many
    seed: int = 0
    fixed: dict[str, Any] = field(default_factory=dict)
    metric: str = "test_accuracy"  # what the plot and the "best" row use
    goal: str = "max"

    def __post_init__(self) -> None:
        for key, kind, article in (("name", str, "a"), ("kind", str, "a"), ("trials", int, "an"), ("seed", int, "an"),
                                   ("fixed", dict, "a"), ("metric", str, "a"), ("goal", str, "a")):
            value = getattr(self, key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SweepError(f"{key} must be {article} {kind.__name__}, got {value!r}")
        if self.kind not in ("grid", "random"):
            raise SweepError(f"kind must be 'grid' or 'random', not {self.kind!r}")
        if not self.name or not isinstance(self.space, dict) or not self.space:
            raise SweepError("a sweep needs a name and a non-empty space")
        if self.goal not in ("max", "min"):
            raise SweepError(f"goal must be 'max' or 'min', not {self.goal!r}")
        for key, values in self.space.items():
            if isinstance(values, list):
                if not values:
                    raise SweepError(f"space.{key} is an empty list")
            elif isinstance(values, dict) and self.kind == "random":
                low, high = values.get("low"), values.get("high")
                if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or not low < high:
                    raise SweepError(f"space.{key} needs numbers low < high, got {values}")
                if values.get("log") and low <= 0:
                    raise SweepError(f"space.{key}: a log range needs low > 0")
            else:
                raise SweepError(f"space.{key} must be a list of values"
                                 + (" or {low, high}" if self.kind == "random" else " in a grid sweep"))
        if self.kind == "random" and not 0 < self.trials <= MAX_TRIALS:
            raise SweepError(f"a random sweep needs 1 <= trials <= {MAX_TRIALS}")
        if self.kind == "grid" and math.prod(len(v) for v in self.space.values()) > MAX_TRIALS:
            raise SweepError(f"the grid has more than {MAX_TRIALS} points")

    @classmethod
    def from_file(cls, path: str | Path) -> SweepSpec:
        """Read a spec from TOML or JSON (by extension; see `potluck sweep --help`)."""
        path = Path(path)
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else compat.tomllib.loads(text)
        except (OSError, ValueError) as e:
            raise SweepError(f"cannot read sweep config {path}: {e}") from e
        known = {"name", "space", "kind", "trials", "seed", "fixed", "metric", "goal"}
        unknown = set(data) - known
        if unknown:
            raise SweepError(f"unknown keys in {path}: {sorted(unknown)} (known: {sorted(known)})")
        return cls(**data)

    def trial_list(self) -> list[Trial]:
        """Every trial, in an order every peer agrees on."""
        names = sorted(self.space)
        if self.kind == "grid":
            points = [dict(zip(names, values, strict=True))
                      for values in itertools.product(*(self.space[n] for n in names))]
        else:
            rng = random.Random(self.seed)
            points = [{n: _draw(rng, self.space[n]) for n in names} for _ in range(self.trials)]
        return [Trial(i, {**self.fixed, **p}) for i, p in enumerate(points)]

    @property
    def sweep_id(self) -> str:
        """The DHT name of this sweep: its name and a digest of its trials, so peers that were
        given different configs under one name do not mix their results."""
        digest = hashlib.sha256(json.dumps([t.params for t in self.trial_list()], sort_keys=True).encode())
        return f"{self.name}.{digest.hexdigest()[:12]}"


def _draw(rng: random.Random, values: Any) -> Any:
    if isinstance(values, list):
        return rng.choice(values)
    low, high = values["low"], values["high"]
    x = math.exp(rng.uniform(math.log(low), math.log(high))) if values.get("log") else rng.uniform(low, high)
    return int(round(x)) if values.get("int") else x


@dataclass
class _Board:
    """The sweep's shared state as read from the DHT."""

    results: dict[int, dict[str, Any]]
    leases: dict[int, tuple[str, float]]  # index -> (holder, expiration)


async def run_sweep(dht: DHT, spec: SweepSpec, objective: Objective, *, lease_seconds: float = LEASE_SECONDS,
                    poll_seconds: float = POLL_SECONDS,
                    on_result: Callable[[Trial, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Take part in the sweep until every trial has a result; return the results, one per trial
    in trial order (`{"index", "params", "metrics", "peer", "seconds"}`).

    `objective(params) -> {metric: float}` runs one trial; a plain function runs in a worker
    thread, a coroutine function on the loop. If it raises, the trial's result records the error
    (it is not retried: a failing configuration fails everywhere).
    """
    trials = spec.trial_list()
    me = str(dht.peer_id)
    keys = (f"sweep.{spec.sweep_id}.results", f"sweep.{spec.sweep_id}.leases")
    # Each peer starts its search at a different place in the list, so peers that start together
    # rarely claim the same trial.
    offset = int.from_bytes(hashlib.sha256(me.encode()).digest()[:4], "big")
    while True:
        board = await _read(dht, keys, len(trials))
        if len(board.results) == len(trials):
            return [board.results[t.index] for t in trials]
        now = dht.get_time()
        free = [t for t in trials if t.index not in board.results
                and (t.index not in board.leases or board.leases[t.index][1] <= now)]
        if not free:
            pending = [exp for i, (_, exp) in board.leases.items() if i not in board.results]
            wait = min([poll_seconds] + [max(0.0, exp - now) for exp in pending])
            await asyncio.sleep(max(wait, 0.01))  # periodic re-check of other peers' leases
            continue
        trial = free[offset % len(free)]
        if not await _claim(dht, keys[1], trial.index, me, lease_seconds):
            continue
        result = await _run_trial(dht, keys[1], trial, objective, me, lease_seconds)
        await dht.astore(keys[0], result, dht.get_time() + RESULT_TTL, subkey=trial.index)
        if on_result is not None:
            on_result(trial, result)


async def _read(dht: DHT, keys: tuple[str, str], count: int) -> _Board:
    found = await dht.aget_many(keys, latest=True)
    results: dict[int, dict[str, Any]] = {}
    leases: dict[int, tuple[str, float]] = {}
    entries = found[keys[0]].value if found[keys[0]] is not None else {}
    for index, item in (entries.items() if isinstance(entries, dict) else ()):
        value = item.value
        if isinstance(index, int) and 0 <= index < count and isinstance(value, dict) \
                and isinstance(value.get("metrics"), dict):
            results[index] = value
        else:
            logger.warning("sweep: ignoring a malformed result under %r (it will be re-run)", index)
    entries = found[keys[1]].value if found[keys[1]] is not None else {}
    for index, item in (entries.items() if isinstance(entries, dict) else ()):
        if isinstance(index, int) and isinstance(item.value, str):
            leases[index] = (item.value, item.expiration_time)
    return _Board(results, leases)


async def _claim(dht: DHT, key: str, index: int, me: str, lease_seconds: float) -> bool:
    """Take the lease of trial `index`; True if it is ours once read back."""
    await dht.astore(key, me, dht.get_time() + lease_seconds, subkey=index)
    found = await dht.aget(key, latest=True)
    entry = found.value.get(index) if found is not None and isinstance(found.value, dict) else None
    return entry is not None and entry.value == me


async def _run_trial(dht: DHT, key: str, trial: Trial, objective: Objective, me: str,
                     lease_seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()

    async def renew() -> None:
        while True:
            await asyncio.sleep(lease_seconds / 3)
            try:
                await dht.astore(key, me, dht.get_time() + lease_seconds, subkey=trial.index)
            except NetworkError as e:
                logger.warning("sweep: could not renew the lease of trial %d: %s", trial.index, e)

    started = time.perf_counter()
    renewal = asyncio.create_task(renew())
    try:
        if inspect.iscoroutinefunction(objective):
            metrics = await objective(dict(trial.params))
        else:
            metrics = await loop.run_in_executor(None, objective, dict(trial.params))
        metrics = {str(k): float(v) for k, v in dict(metrics).items()}
        error = None
    except Exception as e:  # noqa: BLE001 - the trial's failure is its result
        logger.warning("sweep: trial %d %s failed: %s", trial.index, trial.params, e)
        metrics, error = {}, f"{type(e).__name__}: {e}"
    finally:
        renewal.cancel()
        await asyncio.gather(renewal, return_exceptions=True)
    result = {"index": trial.index, "params": trial.params, "metrics": metrics, "peer": me,
              "seconds": round(time.perf_counter() - started, 3)}
    if error is not None:
        result["error"] = error
    return result
