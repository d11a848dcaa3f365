"""Errors the DHT raises on purpose. Remote peers see the class name in `RemoteError.remote_type`."""

from __future__ import annotations

from potluck.core.errors import PotluckError


class DHTError(PotluckError):
    """Base of all DHT errors."""


class RecordRejected(DHTError, ValueError):
    """A record breaks a rule: bad types, too large, expiring too far ahead, bad signature, or a
    value that does not match its key's schema. Raised at the caller before anything is sent, and
    reported by every node that receives such a record."""


class ValueTooLarge(RecordRejected):
    """A value is over the DHT's size limit (64 KiB by default)."""


class ExpirationTooFar(RecordRejected):
    """A record's expiration time is further in the future than the DHT allows."""


class NotOwner(RecordRejected):
    """A key or subkey names an owner (`[owner:<peer id>]`) and the record lacks that owner's
    valid signature."""


class BadRequest(DHTError):
    """A DHT request is malformed (wrong types, too many items); the node answers with this."""
