"""Multiaddr-style peer addresses: where a peer listens, and optionally who it is.

Text forms (the ``/p2p/<peer id>`` suffix is optional)::

    /ip4/127.0.0.1/tcp/31337/p2p/<peer id>
    /ip6/::1/tcp/31337/p2p/<peer id>
    /dns/example.org/tcp/443/p2p/<peer id>      (also dns4 / dns6)
    /emu/<name>/p2p/<peer id>                   (the in-process emulated network)

A circuit address reaches a peer through a relay: the relay's own address (with its required
``/p2p/<relay id>``), then ``/p2p-circuit``, then optionally the target's ``/p2p/<peer id>``::

    /ip4/1.2.3.4/tcp/31337/p2p/<relay id>/p2p-circuit/p2p/<peer id>
    /emu/<relay name>/p2p/<relay id>/p2p-circuit/p2p/<peer id>

In a circuit `Multiaddr`, kind/host/port are the relay's transport address, `relay` the relay's
id and `peer_id` the target's. Circuits do not nest (a relay is always dialed directly).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from potluck.core.errors import AddressError, IdentityError
from potluck.net.identity import PeerID

__all__ = ["Multiaddr"]

# Addresses arrive from other peers (DHT records); bound the text we are willing to parse.
MAX_ADDRESS_CHARS = 1024
# Keep error messages readable when quoting an oversized or hostile input.
_MAX_QUOTED_CHARS = 200
# TCP ports are 16-bit.
_MAX_PORT = 65535
# A DNS name is at most 253 characters, each label at most 63 (RFC 1035).
_DNS_NAME = re.compile(
    r"(?=.{1,253}\.?$)"
    r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?",
    re.ASCII,
)
# Emulated-network node names: bounded, and free of '/' so they cannot break the text form.
_EMU_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}", re.ASCII)

_TCP_KINDS = ("ip4", "ip6", "dns", "dns4", "dns6")
_KINDS = (*_TCP_KINDS, "emu")
_EXAMPLES = (
    "e.g. '/ip4/127.0.0.1/tcp/31337/p2p/<peer id>', '/emu/<name>/p2p/<peer id>' or "
    "'/ip4/1.2.3.4/tcp/1/p2p/<relay id>/p2p-circuit/p2p/<peer id>'"
)
_CIRCUIT = "p2p-circuit"


class _PartError(Exception):
    """One part of an address is wrong; the caller adds which address it was."""


def _quote(text: str) -> str:
    if len(text) > _MAX_QUOTED_CHARS:
        return repr(text[:_MAX_QUOTED_CHARS]) + "..."
    return repr(text)


def _check_host(kind: str, host: object) -> str:
    """Validate `host` for `kind` and return its canonical spelling."""
    if not isinstance(host, str):
        raise _PartError(f"host must be a str, got {type(host).__name__}")
    if "/" in host:
        raise _PartError(f"host {_quote(host)} contains '/'")
    if kind == "ip4":
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise _PartError(f"bad IPv4 literal {_quote(host)}") from None
    if kind == "ip6":
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise _PartError(f"bad IPv6 literal {_quote(host)}") from None
    if kind == "emu":
        if not _EMU_NAME.fullmatch(host):
            raise _PartError(
                f"bad emulated node name {_quote(host)} (use 1-255 letters, digits, '-', '_', '.')"
            )
        return host
    if not _DNS_NAME.fullmatch(host):
        raise _PartError(f"bad DNS name {_quote(host)}")
    return host.lower()


def _check_port(kind: str, port: object) -> int | None:
    if kind == "emu":
        if port is not None:
            raise _PartError("emulated addresses have no port")
        return None
    if port is None:
        raise _PartError("missing port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= _MAX_PORT:
        raise _PartError(f"port {port!r} is not an int in 0..{_MAX_PORT}")
    return port


def _parse_port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(_MAX_PORT))):
        raise _PartError(f"port {_quote(text)} is not an int in 0..{_MAX_PORT}")
    port = int(text)
    if port > _MAX_PORT:
        raise _PartError(f"port {_quote(text)} is not an int in 0..{_MAX_PORT}")
    return port


def _parse_peer_id(rest: list[str], what: str) -> tuple[PeerID | None, list[str]]:
    """Read an optional `/p2p/<id>` from the front of `rest`."""
    if not rest or rest[0] != "p2p":
        return None, rest
    if len(rest) < 2 or not rest[1]:
        raise _PartError(f"missing {what} after /p2p")
    try:
        return PeerID.from_string(rest[1]), rest[2:]
    except IdentityError as exc:
        raise _PartError(f"bad {what}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Multiaddr:
    """A peer's network address; `str()` gives the canonical text that `parse` reads back."""

    kind: str
    host: str
    port: int | None = None
    peer_id: PeerID | None = None
    relay: PeerID | None = None

    def __post_init__(self) -> None:
        try:
            if self.kind not in _KINDS:
                raise _PartError(f"unknown protocol {self.kind!r} (known: {', '.join(_KINDS)})")
            object.__setattr__(self, "host", _check_host(self.kind, self.host))
            object.__setattr__(self, "port", _check_port(self.kind, self.port))
            if self.peer_id is not None and not isinstance(self.peer_id, PeerID):
                raise _PartError(f"peer_id must be a PeerID, got {type(self.peer_id).__name__}")
            if self.relay is not None and not isinstance(self.relay, PeerID):
                raise _PartError(f"relay must be a PeerID, got {type(self.relay).__name__}")
            if self.relay is not None and self.relay == self.peer_id:
                raise _PartError("a circuit cannot lead back to its own relay")
        except _PartError as exc:
            raise AddressError(
                f"bad address fields: {exc}; valid addresses look {_EXAMPLES}"
            ) from None

    @classmethod
    def parse(cls, text: str) -> Multiaddr:
        """Read the text form, with an error that says which part is wrong."""
        if not isinstance(text, str):
            raise AddressError(f"an address must be a str, got {type(text).__name__}")
        try:
            return cls._parse(text)
        except _PartError as exc:
            raise AddressError(
                f"bad address {_quote(text)}: {exc}; valid addresses look {_EXAMPLES}"
            ) from None

    @classmethod
    def _parse(cls, text: str) -> Multiaddr:
        if len(text) > MAX_ADDRESS_CHARS:
            raise _PartError(f"longer than {MAX_ADDRESS_CHARS} characters")
        if not text.startswith("/"):
            raise _PartError("must start with '/'")
        parts = text[1:].split("/")
        kind = parts[0]
        if kind not in _KINDS:
            raise _PartError(f"unknown protocol {kind!r} (known: {', '.join(_KINDS)})")
        if len(parts) < 2 or not parts[1]:
            raise _PartError(f"missing host after /{kind}")
        host = _check_host(kind, parts[1])
        rest = parts[2:]
        port = None
        if kind != "emu":
            if not rest:
                raise _PartError("missing port (add /tcp/<port>)")
            if rest[0] != "tcp":
                raise _PartError(f"expected 'tcp' after the host, got {_quote(rest[0])}")
            if len(rest) < 2 or not rest[1]:
                raise _PartError("missing port after /tcp")
            port = _parse_port(rest[1])
            rest = rest[2:]
        peer_id, rest = _parse_peer_id(rest, "peer id")
        relay = None
        if rest and rest[0] == _CIRCUIT:
            if peer_id is None:
                raise _PartError(f"/{_CIRCUIT} needs the relay's /p2p/<relay id> before it")
            relay = peer_id
            peer_id, rest = _parse_peer_id(rest[1:], "target peer id")
            if rest and rest[0] == _CIRCUIT:
                raise _PartError("nested circuits are not supported (one relay per address)")
            if peer_id == relay:
                raise _PartError("a circuit cannot lead back to its own relay")
        if rest:
            raise _PartError(f"trailing junk {_quote('/' + '/'.join(rest))}")
        return cls(kind, host, port, peer_id, relay)

    @classmethod
    def tcp(cls, host: str, port: int, peer_id: PeerID | None = None) -> Multiaddr:
        """A TCP address, choosing ip4/ip6 for IP literals and dns for anything else."""
        if not isinstance(host, str):
            raise AddressError(f"host must be a str, got {type(host).__name__}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # accept the bracketed IPv6 form used in URLs
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return cls("dns", host, port, peer_id)
        return cls("ip4" if ip.version == 4 else "ip6", str(ip), port, peer_id)

    @classmethod
    def circuit(cls, relay_address: Multiaddr, peer_id: PeerID | None = None) -> Multiaddr:
        """The address of `peer_id` (or of whoever holds a reservation) through the relay at
        `relay_address`, which must name the relay's id and not itself be a circuit."""
        if not isinstance(relay_address, Multiaddr):
            raise AddressError(f"relay_address must be a Multiaddr, got {type(relay_address).__name__}")
        if relay_address.is_circuit:
            raise AddressError(f"nested circuits are not supported: {relay_address} is already one")
        if relay_address.peer_id is None:
            raise AddressError(f"relay address {relay_address} must name the relay (/p2p/<relay id>)")
        return cls(relay_address.kind, relay_address.host, relay_address.port, peer_id,
                   relay_address.peer_id)

    @property
    def is_circuit(self) -> bool:
        """True when this address reaches its peer through a relay."""
        return self.relay is not None

    @property
    def relay_address(self) -> Multiaddr:
        """The relay's own (direct) address, with its /p2p/ id; only for circuit addresses."""
        if self.relay is None:
            raise AddressError(f"{self} is not a circuit address")
        return Multiaddr(self.kind, self.host, self.port, self.relay)

    def with_peer_id(self, peer_id: PeerID) -> Multiaddr:
        """The same address, naming the peer expected there."""
        return dataclasses.replace(self, peer_id=peer_id)

    def without_peer_id(self) -> Multiaddr:
        """The bare transport address (a circuit address keeps its relay)."""
        return dataclasses.replace(self, peer_id=None)

    def __str__(self) -> str:
        text = f"/{self.kind}/{self.host}"
        if self.port is not None:
            text += f"/tcp/{self.port}"
        if self.relay is not None:
            text += f"/p2p/{self.relay}/{_CIRCUIT}"
        if self.peer_id is not None:
            text += f"/p2p/{self.peer_id}"
        return text
