"""`PeerLike`: what every public protocol object (Averager, Optimizer, ParameterServer, StageWorker,
ExpertServer, ...) takes as its `peer`.

`potluck.Peer` is one; tests and simulations pass emulated ones (a transport and a DHT on the
virtual clock). The types named here live in upper layers and are imported for annotations only,
so `core` still imports nothing else from potluck at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from potluck.dht import DHT
    from potluck.net.transport import Transport


@runtime_checkable
class PeerLike(Protocol):
    """A started transport plus the DHT that runs on it: all an object needs to take part in a run."""

    @property
    def transport(self) -> Transport: ...

    @property
    def dht(self) -> DHT: ...
