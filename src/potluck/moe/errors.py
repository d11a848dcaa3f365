"""Errors of the mixture-of-experts layer, catchable by kind."""

from __future__ import annotations

from potluck.core.errors import PotluckError

__all__ = ["BadExpertRequest", "ExpertError", "ExpertNotFound", "NotEnoughExperts", "StashMissing"]


class ExpertError(PotluckError):
    """Base of expert-server and remote-expert errors."""


class BadExpertRequest(ExpertError, ValueError):
    """A request does not match the expert's declared inputs (count, shape, dtype, size)."""


class ExpertNotFound(ExpertError, LookupError):
    """No live server hosts this uid (not announced in the DHT, or not served by that peer)."""


class NotEnoughExperts(ExpertError):
    """Fewer than `k_min` experts answered for some sample."""


class StashMissing(ExpertError):
    """The server no longer holds this call's forward graph; resend the inputs to recompute it."""
