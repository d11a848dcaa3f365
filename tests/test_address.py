"""Tests for potluck.net.address: parsing, canonical text and helpful errors."""

from __future__ import annotations

import copy

import pytest

from potluck.core.errors import AddressError
from potluck.net.address import Multiaddr
from potluck.net.identity import Identity, PeerID

PID = Identity.generate().peer_id
ID = str(PID)


@pytest.mark.parametrize(
    ("text", "kind", "host", "port", "peer_id"),
    [
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}", "ip4", "127.0.0.1", 31337, PID),
        ("/ip4/10.0.0.1/tcp/0", "ip4", "10.0.0.1", 0, None),
        (f"/ip6/::1/tcp/31337/p2p/{ID}", "ip6", "::1", 31337, PID),
        ("/ip6/2001:db8::7/tcp/65535", "ip6", "2001:db8::7", 65535, None),
        (f"/dns/example.org/tcp/443/p2p/{ID}", "dns", "example.org", 443, PID),
        ("/dns4/localhost/tcp/80", "dns4", "localhost", 80, None),
        ("/dns6/my-host.example/tcp/8080", "dns6", "my-host.example", 8080, None),
        (f"/emu/node-1_a.b/p2p/{ID}", "emu", "node-1_a.b", None, PID),
        ("/emu/alice", "emu", "alice", None, None),
    ],
)
def test_parse_and_roundtrip(
    text: str, kind: str, host: str, port: int | None, peer_id: PeerID | None
) -> None:
    addr = Multiaddr.parse(text)
    assert (addr.kind, addr.host, addr.port, addr.peer_id) == (kind, host, port, peer_id)
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr


def test_canonical_forms() -> None:
    long_v6 = "/ip6/2001:0db8:0000:0000:0000:0000:0000:0001/tcp/1"
    assert str(Multiaddr.parse(long_v6)) == "/ip6/2001:db8::1/tcp/1"
    assert str(Multiaddr.parse("/dns/Example.ORG/tcp/443")) == "/dns/example.org/tcp/443"
    assert str(Multiaddr.parse("/ip4/1.2.3.4/tcp/080")) == "/ip4/1.2.3.4/tcp/80"


def test_tcp_constructor() -> None:
    assert Multiaddr.tcp("127.0.0.1", 5) == Multiaddr("ip4", "127.0.0.1", 5)
    assert Multiaddr.tcp("::1", 5).kind == "ip6"
    assert Multiaddr.tcp("[::1]", 5) == Multiaddr("ip6", "::1", 5)
    assert Multiaddr.tcp("example.org", 443, PID) == Multiaddr("dns", "example.org", 443, PID)
    with pytest.raises(AddressError, match="port"):
        Multiaddr.tcp("127.0.0.1", 70000)
    with pytest.raises(AddressError, match="host must be a str"):
        Multiaddr.tcp(2130706433, 1)  # type: ignore[arg-type]


def test_peer_id_helpers_and_hashing() -> None:
    bare = Multiaddr.parse("/ip4/127.0.0.1/tcp/1")
    named = bare.with_peer_id(PID)
    assert named.peer_id == PID and str(named) == f"/ip4/127.0.0.1/tcp/1/p2p/{ID}"
    assert named.without_peer_id() == bare
    assert len({bare, named, Multiaddr.parse(str(named))}) == 2
    assert copy.deepcopy(named) == named
    with pytest.raises(AttributeError):
        bare.port = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (("udp", "1.2.3.4", 1), "unknown protocol"),
        (("ip4", "::1", 1), "bad IPv4 literal"),
        (("ip6", "1.2.3.4", 1), "bad IPv6 literal"),
        (("ip4", "1.2.3.4", None), "missing port"),
        (("ip4", "1.2.3.4", True), "not an int"),
        (("emu", "a", 1), "no port"),
        (("emu", "a/b"), "contains '/'"),
        (("dns", "bad host!", 1), "bad DNS name"),
    ],
)
def test_constructor_validates(fields: tuple, words: str) -> None:
    with pytest.raises(AddressError, match=words):
        Multiaddr(*fields)
    with pytest.raises(AddressError, match="peer_id must be a PeerID"):
        Multiaddr("emu", "a", None, ID)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "must start with '/'"),
        ("ip4/1.2.3.4/tcp/1", "must start with '/'"),
        ("/udp/1.2.3.4/tcp/1", "unknown protocol 'udp'"),
        (f"/p2p/{ID}", "unknown protocol 'p2p'"),
        ("/ip4", "missing host"),
        ("/ip4//tcp/1", "missing host"),
        ("/ip4/1.2.3/tcp/1", "bad IPv4 literal '1.2.3'"),
        ("/ip4/256.1.1.1/tcp/1", "bad IPv4 literal"),
        ("/ip4/::1/tcp/1", "bad IPv4 literal"),
        ("/ip6/1.2.3.4/tcp/1", "bad IPv6 literal"),
        ("/ip6/:::1/tcp/1", "bad IPv6 literal"),
        ("/dns/bad_host!/tcp/1", "bad DNS name"),
        ("/dns/" + "a" * 64 + ".org/tcp/1", "bad DNS name"),
        ("/emu/has space", "bad emulated node name"),
        ("/ip4/1.2.3.4", "missing port"),
        ("/ip4/1.2.3.4/udp/1", "expected 'tcp'"),
        ("/ip4/1.2.3.4/tcp", "missing port"),
        ("/ip4/1.2.3.4/tcp/", "missing port"),
        ("/ip4/1.2.3.4/tcp/65536", "port '65536' is not an int in 0..65535"),
        ("/ip4/1.2.3.4/tcp/-1", "not an int in 0..65535"),
        ("/ip4/1.2.3.4/tcp/http", "not an int"),
        ("/ip4/1.2.3.4/tcp/+80", "not an int"),
        ("/ip4/1.2.3.4/tcp/\u0661\u0662", "not an int"),
        ("/ip4/1.2.3.4/tcp/1/p2p", "missing peer id"),
        ("/ip4/1.2.3.4/tcp/1/p2p/", "missing peer id"),
        ("/ip4/1.2.3.4/tcp/1/p2p/0OIl", "bad peer id"),
        ("/ip4/1.2.3.4/tcp/1/p2p/abc", "bad peer id"),
        (f"/ip4/1.2.3.4/tcp/1/p2p/{ID}/", "trailing junk"),
        (f"/ip4/1.2.3.4/tcp/1/p2p/{ID}/extra", "trailing junk '/extra'"),
        ("/ip4/1.2.3.4/tcp/1/ws", "trailing junk"),
        ("/emu/alice/tcp/1", "trailing junk"),
        ("/emu/" + "x" * 2000, "longer than"),
    ],
)
def test_malformed_addresses(text: str, words: str) -> None:
    with pytest.raises(AddressError) as info:
        Multiaddr.parse(text)
    message = str(info.value)
    assert words in message
    assert repr(text[:20])[:-1] in message  # the input is quoted
    assert "/ip4/127.0.0.1/tcp/31337/p2p/<peer id>" in message  # an example is shown


def test_parse_rejects_non_str() -> None:
    with pytest.raises(AddressError, match="must be a str"):
        Multiaddr.parse(b"/ip4/1.2.3.4/tcp/1")  # type: ignore[arg-type]


RELAY = Identity.generate().peer_id
RID = str(RELAY)


@pytest.mark.parametrize(
    "text",
    [
        f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p/{ID}",
        f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit",
        f"/dns/relay.example/tcp/443/p2p/{RID}/p2p-circuit/p2p/{ID}",
        f"/emu/relay/p2p/{RID}/p2p-circuit/p2p/{ID}",
    ],
)
def test_circuit_roundtrip(text: str) -> None:
    addr = Multiaddr.parse(text)
    assert addr.is_circuit and addr.relay == RELAY
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr
    assert addr.relay_address.peer_id == RELAY and not addr.relay_address.is_circuit
    assert Multiaddr.circuit(addr.relay_address, addr.peer_id) == addr
    assert addr.without_peer_id().relay == RELAY  # the relay is part of the transport address
    assert addr.without_peer_id().with_peer_id(PID) == Multiaddr.circuit(addr.relay_address, PID)


def test_direct_address_is_not_a_circuit() -> None:
    addr = Multiaddr.parse(f"/ip4/1.2.3.4/tcp/7/p2p/{ID}")
    assert not addr.is_circuit and addr.relay is None
    with pytest.raises(AddressError, match="not a circuit"):
        _ = addr.relay_address


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("/ip4/1.2.3.4/tcp/7/p2p-circuit", "needs the relay's /p2p/<relay id>"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p", "missing target peer id"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p/abc", "bad target peer id"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p/{RID}", "back to its own relay"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p-circuit", "nested circuits"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/p2p/{ID}/p2p-circuit", "nested circuits"),
        (f"/ip4/1.2.3.4/tcp/7/p2p/{RID}/p2p-circuit/x", "trailing junk '/x'"),
    ],
)
def test_malformed_circuits(text: str, words: str) -> None:
    with pytest.raises(AddressError, match="p2p-circuit") as info:
        Multiaddr.parse(text)
    assert words in str(info.value)


def test_circuit_constructor_checks() -> None:
    relay_addr = Multiaddr.parse(f"/ip4/1.2.3.4/tcp/7/p2p/{RID}")
    with pytest.raises(AddressError, match="must name the relay"):
        Multiaddr.circuit(relay_addr.without_peer_id(), PID)
    with pytest.raises(AddressError, match="nested circuits"):
        Multiaddr.circuit(Multiaddr.circuit(relay_addr, PID), PID)
    with pytest.raises(AddressError, match="relay must be a PeerID"):
        Multiaddr("ip4", "1.2.3.4", 7, PID, RID)  # type: ignore[arg-type]
    with pytest.raises(AddressError, match="back to its own relay"):
        Multiaddr.circuit(relay_addr, RELAY)
