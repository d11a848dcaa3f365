"""potluck: train neural networks together on computers nobody controls centrally."""

from potluck.core.errors import (
    ConnectionLost,
    DeadlineExceeded,
    HandshakeError,
    NetworkError,
    PeerUnreachable,
    PotluckError,
    ProtocolError,
    RemoteError,
)
from potluck.peer import Peer

__version__ = "0.1.0"

__all__ = [
    "ConnectionLost", "DeadlineExceeded", "HandshakeError", "NetworkError", "Peer",
    "PeerUnreachable", "PotluckError", "ProtocolError", "RemoteError", "__version__",
]
