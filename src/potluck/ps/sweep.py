"""Hyperparameter sweeps: independent trials shared out among peers through the DHT, with leases.

Every peer derives the same trial list from the sweep's spec (grid, or random with a seed), so only
two records cross the DHT, each a dictionary whose subkeys are `trial_subkey(index, peer)`, i.e.
`f"{index}[owner:<peer id>]"`: owner-signed, so each peer writes only its own entries and nobody
can overwrite or squat another peer's lease or result (the DHT keeps the entry that expires
latest, so an unsigned shared subkey could be held for a day by one store).
- leases (`TrialLease`): `{holder, since}` that expire `lease_seconds` after they were last
  renewed. A peer runs a trial only while it holds an unexpired lease and renews it as it goes; a
  peer that dies stops renewing, so its trial is free again at most one lease later and another
  peer re-runs it. When several peers hold leases on one trial, the earliest claim (`since`, then
  the smaller peer id) has it. A lease expiring more than `LEASE_HORIZON` lease periods ahead is
  ignored (no honest peer writes one), so one store cannot block a trial for long: whoever holds a
  trial has to keep renewing it, as a peer running it does.
- results (`TrialResult`): `{metrics, peer, seconds, error}`; the parameters are the trial's own,
  so they are not sent. Two peers can both claim a trial in the same instant and both store a
  result; the table still has one row per trial: the result that expires first (stored first),
  then the smaller peer id.
Readers take the peer from the subkey's owner marker (the DHT checked the signature) and skip any
entry of another form, or whose holder/peer is not its signer. Both are declared messages
(`potluck.core.wire`); a malformed record is logged and ignored (its trial is re-run).
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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from potluck.core import compat
from potluck.core.errors import MalformedMessage, NetworkError, PotluckError
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.wire import Field, FromContext, Message, Number, Text
from potluck.dht import DHT, owner_marker, subkey_owner
from potluck.net.identity import PeerID
from potluck.net.wire import PeerIdField

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
# A lease counts for at most this many lease periods ahead (peers of one sweep may be configured
# with somewhat different leases); one expiring later is ignored, so that a stranger cannot hold a
# trial for a day (the DHT's longest expiry) with a single store.
LEASE_HORIZON = 4.0
# Metrics one trial reports: an objective reports a handful of figures, and every peer reads
# every result at every claim.
MAX_METRICS = 64
# Longest metric name and failure text kept in a result (a traceback's last line fits).
MAX_METRIC_CHARS = 128
MAX_ERROR_CHARS = 1000

Objective = Callable[[dict[str, Any]], dict[str, float] | Awaitable[dict[str, float]]]


class SweepError(PotluckError, ValueError):
    """A sweep spec is malformed (unknown kind, empty space, bad ranges, too many trials)."""


@dataclass(frozen=True)
class Trial:
    """One point of the search space; `index` is its place in the sweep's trial list."""

    index: int
    params: dict[str, Any]


@dataclass(frozen=True)
class Range:
    """A random sweep's numeric dimension: uniform in [low, high] (log-uniform if `log`), rounded
    to an integer if `integer`. Written `{low = a, high = b, log = true, int = true}` in a config."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    @classmethod
    def from_config(cls, name: str, values: dict[str, Any]) -> Range:
        unknown = set(values) - {"low", "high", "log", "int"}
        if unknown:
            raise SweepError(f"space.{name}: unknown range keys {sorted(unknown)} (known: low, high, log, int)")
        low, high = values.get("low"), values.get("high")
        log, integer = values.get("log", False), values.get("int", False)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (low, high)) or not low < high:
            raise SweepError(f"space.{name} needs numbers low < high, got {values}")
        if not isinstance(log, bool) or not isinstance(integer, bool):
            raise SweepError(f"space.{name}: log and int must be true or false")
        if log and low <= 0:
            raise SweepError(f"space.{name}: a log range needs low > 0")
        return cls(float(low), float(high), log, integer)

    def draw(self, rng: random.Random) -> float | int:
        x = math.exp(rng.uniform(math.log(self.low), math.log(self.high))) if self.log \
            else rng.uniform(self.low, self.high)
        return int(round(x)) if self.integer else x


@dataclass
class SweepSpec:
    """What to try. `space` maps a name to a list of values (grid, or a random choice) or, for
    random sweeps, to a `Range` (in a config: `{"low": a, "high": b, "log": bool, "int": bool}`).
    `fixed` values are passed to every trial unchanged."""

    run_id: str
    space: dict[str, Any]
    kind: str = "grid"
    trials: int = 0  # random: how many
    seed: int = 0
    fixed: dict[str, Any] = field(default_factory=dict)
    metric: str = "test_accuracy"  # what the plot and the "best" row use
    goal: str = "max"

    def __post_init__(self) -> None:
        for key, kind, article in (("run_id", str, "a"), ("kind", str, "a"), ("trials", int, "an"), ("seed", int, "an"),
                                   ("fixed", dict, "a"), ("metric", str, "a"), ("goal", str, "a")):
            value = getattr(self, key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SweepError(f"{key} must be {article} {kind.__name__}, got {value!r}")
        if self.kind not in ("grid", "random"):
            raise SweepError(f"kind must be 'grid' or 'random', not {self.kind!r}")
        if not self.run_id or not isinstance(self.space, dict) or not self.space:
            raise SweepError("a sweep needs a run_id and a non-empty space")
        if self.goal not in ("max", "min"):
            raise SweepError(f"goal must be 'max' or 'min', not {self.goal!r}")
        self.space = dict(self.space)  # ranges are parsed in place: the caller's dict stays as it was
        for key, values in list(self.space.items()):
            if isinstance(values, list):
                if not values:
                    raise SweepError(f"space.{key} is an empty list")
            elif isinstance(values, dict) and self.kind == "random":
                self.space[key] = Range.from_config(key, values)
            elif isinstance(values, Range) and self.kind == "random":
                pass
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
        known = {"run_id", "space", "kind", "trials", "seed", "fixed", "metric", "goal"}
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
    def trials_digest(self) -> str:
        """A digest of the trials: part of the sweep's DHT keys, so peers that were given
        different configs under one run id do not mix their results."""
        digest = hashlib.sha256(json.dumps([t.params for t in self.trial_list()], sort_keys=True).encode())
        return digest.hexdigest()[:12]

    @property
    def sweep_id(self) -> str:
        """This sweep's name in reports: its run id and its trials' digest (not a DHT key: those
        are `RunNames.sweep_leases` and `sweep_results`)."""
        return f"{self.run_id}/{self.trials_digest}"


def _draw(rng: random.Random, values: list | Range) -> Any:
    return rng.choice(values) if isinstance(values, list) else values.draw(rng)


def trial_subkey(index: int, peer: PeerID) -> str:
    """The subkey of `peer`'s own lease or result for trial `index` (only `peer` can write it)."""
    return f"{int(index)}{owner_marker(peer)}"


def parse_trial_subkey(subkey: Any, trials: int) -> tuple[int, PeerID] | None:
    """(trial index, writer) of a subkey written by `trial_subkey`; None for any other form
    (an unsigned index, a marker naming nobody, an index outside the sweep)."""
    if not isinstance(subkey, str):
        return None
    head, marker, _ = subkey.partition("[owner:")
    if not marker or not head.isascii() or not head.isdigit() or len(head) > 6:
        return None
    index = int(head)
    peer = subkey_owner(subkey[len(head):])
    if peer is None or not 0 <= index < trials or subkey != trial_subkey(index, peer):
        return None
    return index, peer


class TrialLease(Message, what="trial lease"):
    """Who runs a trial, until when (the DHT entry's expiration: `expires=` when read), claimed
    at `since` (DHT time): renewed while the trial runs."""

    holder: PeerID = PeerIdField("holder")
    expires: float = FromContext("expires")
    since: float = Number("since", signed=True, default=0.0)


class Metrics(Field):
    """What an objective reports: at most MAX_METRICS names mapped to numbers (any: a diverged
    loss is a result too), read as floats."""

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> dict[str, float]:
        if not isinstance(value, dict) or len(value) > MAX_METRICS or not all(
                isinstance(k, str) and len(k) <= MAX_METRIC_CHARS and isinstance(v, (int, float))
                and not isinstance(v, bool) for k, v in value.items()):
            raise MalformedMessage(what, f"{key!r} must map at most {MAX_METRICS} names of at most "
                                         f"{MAX_METRIC_CHARS} characters to numbers")
        return {k: float(v) for k, v in value.items()}


class TrialResult(Message, what="trial result"):
    """One trial's outcome: its metrics (empty if it failed, with `error` saying why), the peer
    that ran it and how long the objective took. Stored under the trial's subkey, and read with
    `trial=` (the trial it belongs to): its index and parameters are the trial's own, not sent."""

    index: int = FromContext(lambda context: context["trial"].index)
    params: dict[str, Any] = FromContext(lambda context: context["trial"].params)
    metrics: dict[str, float] = Metrics("metrics")
    peer: PeerID = PeerIdField("peer")
    seconds: float = Number("seconds")
    error: str | None = Text("error", MAX_ERROR_CHARS, default=None)

    def to_record(self) -> dict[str, Any]:
        """The row written to results.json: index, params, metrics, peer, seconds (and error)."""
        row = {"index": self.index, "params": self.params, "metrics": self.metrics, "peer": str(self.peer),
               "seconds": self.seconds}
        if self.error is not None:
            row["error"] = self.error
        return row


@dataclass
class _Board:
    """The sweep's shared state as read from the DHT."""

    results: dict[int, TrialResult]
    leases: dict[int, TrialLease]


async def run_sweep(peer: PeerLike, spec: SweepSpec, objective: Objective, *, lease_seconds: float = LEASE_SECONDS,
                    poll_seconds: float = POLL_SECONDS,
                    on_result: Callable[[TrialResult], None] | None = None) -> list[TrialResult]:
    """Take part in the sweep on `peer`'s DHT until every trial has a result; return the
    results, one per trial in trial order.

    `objective(params) -> {metric: float}` runs one trial; a plain function runs in a worker
    thread, a coroutine function on the loop. If it raises, the trial's result records the error
    (it is not retried: a failing configuration fails everywhere).
    """
    dht = peer.dht
    trials = spec.trial_list()
    me = dht.peer_id
    names = RunNames(spec.run_id)
    keys = (names.sweep_results(spec.trials_digest), names.sweep_leases(spec.trials_digest))
    # Each peer starts its search at a different place in the list, so peers that start together
    # rarely claim the same trial.
    offset = int.from_bytes(hashlib.sha256(str(me).encode()).digest()[:4], "big")
    while True:
        board = await _read(dht, keys, trials, lease_seconds)
        if len(board.results) == len(trials):
            return [board.results[t.index] for t in trials]
        now = dht.get_time()
        free = [t for t in trials if t.index not in board.results
                and (t.index not in board.leases or board.leases[t.index].expires <= now)]
        if not free:
            pending = [lease.expires for i, lease in board.leases.items() if i not in board.results]
            wait = min([poll_seconds] + [max(0.0, expires - now) for expires in pending])
            await asyncio.sleep(max(wait, 0.01))  # periodic re-check of other peers' leases
            continue
        trial = free[offset % len(free)]
        since = await _claim(dht, keys[1], trial.index, me, lease_seconds, len(trials))
        if since is None:
            continue
        result = await _run_trial(dht, keys[1], trial, objective, me, lease_seconds, since)
        await dht.astore(keys[0], result.to_wire(), dht.get_time() + RESULT_TTL, subkey=trial_subkey(trial.index, me))
        if on_result is not None:
            on_result(result)


def _results(found: Any, trials: list[Trial]) -> dict[int, TrialResult]:
    """One result per trial from the results dictionary: among the entries each peer signed about
    its own run, the one that expires first (stored first), then the smaller peer id."""
    results: dict[int, TrialResult] = {}
    order: dict[int, tuple[float, str]] = {}
    entries = found.value if found is not None else {}
    for subkey, item in (entries.items() if isinstance(entries, dict) else ()):
        cell = parse_trial_subkey(subkey, len(trials))
        if cell is None:
            logger.debug("sweep: ignoring a result under %r: not a trial subkey that its writer signed",
                         str(subkey)[:120])
            continue
        index, writer = cell
        try:
            result = TrialResult.from_wire(item.value, trial=trials[index])
        except MalformedMessage as e:
            logger.warning("sweep: ignoring %s's result of trial %d (it will be re-run): %s", writer, index, e)
            continue
        if result.peer != writer:
            logger.warning("sweep: ignoring a result of trial %d signed by %s in the name of %s", index, writer,
                           result.peer)
            continue
        rank = (item.expiration_time, str(writer))
        if index not in order or rank < order[index]:
            results[index], order[index] = result, rank
    return results


def _leases(found: Any, trials: int, now: float, lease_seconds: float) -> dict[int, TrialLease]:
    """The lease that holds each trial now: among unexpired leases that their holders signed and
    that expire within LEASE_HORIZON lease periods, the earliest claim (then the smaller peer id)."""
    leases: dict[int, TrialLease] = {}
    horizon = now + LEASE_HORIZON * lease_seconds
    entries = found.value if found is not None else {}
    for subkey, item in (entries.items() if isinstance(entries, dict) else ()):
        cell = parse_trial_subkey(subkey, trials)
        if cell is None or not now < item.expiration_time <= horizon:
            continue
        index, writer = cell
        try:
            lease = TrialLease.from_wire(item.value, expires=item.expiration_time)
        except MalformedMessage as e:
            logger.debug("sweep: ignoring %s's lease of trial %d: %s", writer, index, e)
            continue
        if lease.holder != writer:
            continue
        held = leases.get(index)
        if held is None or (lease.since, str(lease.holder)) < (held.since, str(held.holder)):
            leases[index] = lease
    return leases


async def _read(dht: DHT, keys: tuple[str, str], trials: list[Trial], lease_seconds: float) -> _Board:
    found = await dht.aget_many(keys, latest=True)
    return _Board(_results(found[keys[0]], trials), _leases(found[keys[1]], len(trials), dht.get_time(), lease_seconds))


async def _claim(dht: DHT, key: str, index: int, me: PeerID, lease_seconds: float, trials: int) -> float | None:
    """Take the lease of trial `index`; the claim's time if it is ours once read back, else None."""
    since = dht.get_time()
    expires = since + lease_seconds
    await dht.astore(key, TrialLease(me, expires, since).to_wire(), expires, subkey=trial_subkey(index, me))
    found = await dht.aget(key, latest=True)
    lease = _leases(found, trials, dht.get_time(), lease_seconds).get(index)
    return since if lease is not None and lease.holder == me else None


async def _run_trial(dht: DHT, key: str, trial: Trial, objective: Objective, me: PeerID,
                     lease_seconds: float, since: float) -> TrialResult:
    loop = asyncio.get_running_loop()

    async def renew() -> None:
        while True:
            await asyncio.sleep(lease_seconds / 3)
            try:
                expires = dht.get_time() + lease_seconds
                await dht.astore(key, TrialLease(me, expires, since).to_wire(), expires,
                                 subkey=trial_subkey(trial.index, me))
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
        if len(metrics) > MAX_METRICS or any(len(k) > MAX_METRIC_CHARS for k in metrics):
            raise SweepError(f"an objective reports at most {MAX_METRICS} metrics, with names of at most "
                             f"{MAX_METRIC_CHARS} characters (other peers would refuse this result)")
        error = None
    except Exception as e:  # noqa: BLE001 - the trial's failure is its result
        logger.warning("sweep: trial %d %s failed: %s", trial.index, trial.params, e)
        metrics, error = {}, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
    finally:
        renewal.cancel()
        await asyncio.gather(renewal, return_exceptions=True)
    return TrialResult(trial.index, trial.params, metrics, me, round(time.perf_counter() - started, 3), error)
