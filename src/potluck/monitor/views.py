"""What the monitor shows: the typed rows its ledger answers with and its web page and CLI render.

The ledger (`potluck.monitor.ledger`) produces these from its SQLite database; the dashboard, the HTTP
API (`potluck.monitor.web`), `potluck status` and `potluck contributors` only read them, so each can be
tested against hand-made rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SwarmNow:
    """The run at this moment, as the DHT shows it."""

    run_id: str
    time: float  # unix time of this view
    peers_online: int
    samples_per_second: float  # the swarm's, summed over live peers
    epoch: int  # the newest epoch any live peer reports
    samples: int  # accumulated towards `epoch`'s global batch
    target_batch_size: int | None  # None until a peer has said it
    eta_seconds: float | None  # until the global batch is full; None when unknown

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PeerState:
    """One peer the monitor has seen. A refused peer (`refused`: why) trains another model or
    with other settings than the run's peers (`potluck.optim.schema`): it is never online, never
    counted in the swarm and never credited."""

    peer_id: str
    name: str | None  # from its membership token, if the run has an authority
    online: bool
    epoch: int
    samples_per_second: float
    client_mode: bool
    first_seen: float  # unix time
    last_seen: float
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Contributor:
    """A peer's credit: samples that were really averaged, online time, and its share of the run."""

    peer_id: str
    name: str | None
    samples: int
    online_hours: float
    share: float  # samples / all credited samples (0 when none are)
    epochs: int  # epochs in which it was credited

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EpochRow:
    """One finished epoch of the run."""

    epoch: int
    time: float  # unix time the monitor saw it finish
    samples: int  # credited samples of the epoch
    group_sizes: tuple[int, ...]  # the averaging groups that made it
    failed_rounds: int
    metrics: dict[str, float]  # mean over the peers that published them (e.g. loss)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "group_sizes": list(self.group_sizes)}


@dataclass(frozen=True)
class HistoryPoint:
    """A sample of the swarm over time, for the charts."""

    time: float
    epoch: int
    peers_online: int
    samples_per_second: float
    loss: float | None  # mean of the published losses at that time, if any

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class MonitorView(Protocol):
    """What the dashboard and the CLI read; `potluck.monitor.ledger.Ledger` implements it."""

    def swarm_now(self) -> SwarmNow: ...

    def peers(self) -> list[PeerState]: ...

    def contributors(self) -> list[Contributor]: ...

    def epochs(self, limit: int = 100) -> list[EpochRow]: ...

    def history(self, since: float | None = None) -> list[HistoryPoint]: ...
