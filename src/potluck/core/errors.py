"""Every error potluck raises on purpose, in one place so callers can catch by kind."""

from __future__ import annotations

import copy


class PotluckError(Exception):
    """Base of all potluck errors."""


class SerializationError(PotluckError, ValueError):
    """Data could not be encoded or was refused while decoding (malformed, unsafe, too large)."""


class IdentityError(PotluckError):
    """A key file is unreadable or a peer id / signature is malformed."""


class AddressError(PotluckError, ValueError):
    """An address string could not be parsed."""


class NetworkError(PotluckError):
    """Base of transport errors: something between two peers went wrong."""


class ProtocolError(NetworkError):
    """The remote side broke the wire protocol (garbage, truncated or oversized frames)."""


class MalformedMessage(ProtocolError):
    """A peer's message failed validation at parse time; `field` names the part that was wrong."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(f"malformed {message}" + (f": {field}" if field else ""))
        self.field = field


class HandshakeError(NetworkError):
    """The remote side could not prove the peer id we dialed, or refused ours."""


class PeerUnreachable(NetworkError):
    """No connection to the peer could be made (no address, refused, or dial timed out)."""


class ConnectionLost(NetworkError):
    """An open connection broke (peer died, reset, keepalive expired, or it was closed)."""


class MessageTooLarge(NetworkError):
    """A frame is over the agreed maximum frame size."""


class RemoteError(NetworkError):
    """The remote handler raised; the message carries its type and text."""

    def __init__(self, message: str, remote_type: str = "Exception"):
        super().__init__(message)
        self.remote_type = remote_type


class MethodNotFound(RemoteError):
    """The remote peer has no handler for the requested method."""


class DeadlineExceeded(NetworkError, TimeoutError):
    """A call or stream did not finish before its deadline."""


class CallCancelled(NetworkError):
    """The other side cancelled the call or stream."""


class EndOfStream(NetworkError):
    """The other side finished sending on this stream; nothing more will arrive."""


class MembershipError(PotluckError):
    """This peer is not, or no longer, a member of an authority-governed run: no token, an expired,
    revoked, forged or foreign token, or credentials the authority refused. The text says which
    and what to do."""


class MembershipRefused(MembershipError, HandshakeError):
    """A handshake was refused for membership: the other side has no valid token for the run
    (or, seen from the dialer, we had none it accepts)."""


class CompressionError(PotluckError, ValueError):
    """A tensor cannot be compressed or decompressed safely (non-finite, out of range, malformed)."""


class AveragingError(PotluckError):
    """An averaging step failed for this peer; its local tensors were left untouched."""


def detached(error: BaseException) -> BaseException:
    """A copy of `error` to raise in place of a stored one (on a future, a stream, a queue).

    Raising an object attaches a traceback whose frames hold their locals; when one of those
    reaches the object again (the future or stream storing it), the two form a reference cycle
    that keeps everything those frames reference until the cyclic GC runs. A copy has no way back.
    """
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception type whose arguments do not round-trip
        return PotluckError(f"{type(error).__name__}: {error}")
