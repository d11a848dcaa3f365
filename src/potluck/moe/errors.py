"""Errors of the mixture-of-experts layer, catchable by kind."""

from __future__ import annotations

from potluck.core.errors import MalformedMessage, PotluckError

__all__ = ["BadExpertRequest", "ExpertError", "ExpertNotFound", "NotEnoughExperts", "StashMissing"]


class ExpertError(PotluckError):
    """Base of expert-server and remote-expert errors."""


class BadExpertRequest(MalformedMessage, ExpertError, ValueError):
    """An expert server refused a request at parse time: not a map, a missing or ill-typed field,
    tensors that do not match the expert's declared inputs or outputs (count, dtype, shape, rows),
    or non-finite values. A `MalformedMessage` (catch every protocol's refusals by that kind) and
    an `ExpertError`; `field` names the part that was wrong (`'inputs'[0] has shape ...`) and `uid`
    the expert it addressed, if it named one this server hosts."""

    def __init__(self, message: str, field: str = "", uid: str | None = None):
        super().__init__(message, field)
        self.uid = uid


class ExpertNotFound(ExpertError, LookupError):
    """No live server hosts this uid (not announced in the DHT, or not served by that peer)."""


class NotEnoughExperts(ExpertError):
    """Fewer than `k_min` experts answered for some sample."""


class StashMissing(ExpertError):
    """The server no longer holds this call's forward graph; resend the inputs to recompute it."""
