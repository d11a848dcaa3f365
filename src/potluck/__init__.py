"""potluck: train neural networks together on computers nobody controls centrally."""

from potluck import moe, pipeline, ps
from potluck.averaging import Averager, Role, StepResult
from potluck.core.dht_time import get_dht_time
from potluck.core.errors import (
    AveragingError,
    ConnectionLost,
    DeadlineExceeded,
    HandshakeError,
    NetworkError,
    PeerUnreachable,
    PotluckError,
    ProtocolError,
    RemoteError,
)
from potluck.dht import DHT, ValueWithExpiration
from potluck.optim import Optimizer
from potluck.peer import Peer

__version__ = "0.1.0"

__all__ = [
    "Averager", "AveragingError", "Optimizer", "Role", "StepResult",
    "DHT", "ConnectionLost", "DeadlineExceeded", "HandshakeError", "NetworkError", "Peer",
    "PeerUnreachable", "PotluckError", "ProtocolError", "RemoteError", "ValueWithExpiration",
    "__version__", "get_dht_time", "moe", "pipeline", "ps",
]
