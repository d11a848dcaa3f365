"""Tests for potluck.net.identity: peer ids, key files, signatures and TLS certificates."""

from __future__ import annotations

import asyncio
import copy
import os
import ssl
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from potluck.core.errors import HandshakeError, IdentityError
from potluck.net.identity import (
    Identity,
    PeerID,
    base58_decode,
    base58_encode,
    make_certificate,
    make_ssl_contexts,
    peer_id_from_certificate,
)


def test_base58_known_vectors() -> None:
    assert base58_encode(b"") == ""
    assert base58_encode(b"\0\0\x01") == "112"
    assert base58_encode(b"hello world") == "StV1DL6CwTryKyV"
    assert base58_decode("StV1DL6CwTryKyV") == b"hello world"
    assert base58_decode("112") == b"\0\0\x01"
    for data in (b"\0" * 32, b"\xff" * 32, os.urandom(32), b"\0\0" + os.urandom(30)):
        assert base58_decode(base58_encode(data)) == data


def test_peer_id_text_roundtrip() -> None:
    pid = Identity.generate().peer_id
    text = str(pid)
    assert 40 <= len(text) <= 44
    again = PeerID.from_string(text)
    assert again == pid and hash(again) == hash(pid)
    assert again.to_bytes() == pid.to_bytes() and len(pid.to_bytes()) == 32
    assert repr(pid) == f"PeerID({text[:4]}...{text[-4:]})"
    zero = PeerID(b"\0" * 32)
    assert PeerID.from_string(str(zero)) == zero


def test_peer_id_is_immutable_ordered_hashable() -> None:
    a, b = PeerID(b"\x01" * 32), PeerID(b"\x02" * 32)
    assert a < b and b > a and a <= PeerID(a.to_bytes()) and sorted([b, a]) == [a, b]
    assert len({a, b, PeerID(b"\x01" * 32)}) == 2
    assert a != b"\x01" * 32
    with pytest.raises(AttributeError):
        a._key = b"\x03" * 32  # type: ignore[misc]
    assert copy.deepcopy(a) is a


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_peer_id_wrong_length(length: int) -> None:
    with pytest.raises(IdentityError, match="32-byte"):
        PeerID(b"\x01" * length)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("0OIl" + "1" * 40, "not base58"),
        ("abc", "decodes to"),
        ("z" * 44, "decodes to"),
        ("2" * 45, "characters"),
        ("z" * 10_000, "characters"),
        ("hello world", "not base58"),
    ],
)
def test_peer_id_malformed_text(text: str, words: str) -> None:
    with pytest.raises(IdentityError, match=words) as info:
        PeerID.from_string(text)
    assert "base58" in str(info.value)


def test_sign_and_verify() -> None:
    me, other = Identity.generate(), Identity.generate()
    sig = me.sign(b"payload")
    assert len(sig) == 64
    assert me.peer_id.verify(sig, b"payload")
    assert not me.peer_id.verify(sig, b"payload!")
    assert not other.peer_id.verify(sig, b"payload")
    forged = bytes([sig[0] ^ 1]) + sig[1:]
    assert not me.peer_id.verify(forged, b"payload")
    assert not me.peer_id.verify(b"", b"payload")
    assert not me.peer_id.verify(sig[:63], b"payload")
    assert not me.peer_id.verify("not bytes", b"payload")  # type: ignore[arg-type]
    # A peer id that is not a valid curve point verifies nothing, and does not raise.
    assert not PeerID(b"\xff" * 32).verify(sig, b"payload")


def test_save_load_keeps_peer_id_and_mode(tmp_path) -> None:
    identity = Identity.generate()
    path = tmp_path / "sub" / "dir" / "key.pem"
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == identity.peer_id
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert [p.name for p in path.parent.iterdir()] == ["key.pem"]  # no temp file left
    # Saving over an existing file keeps the mode tight.
    Identity.generate().save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_load_refuses_group_readable_key(tmp_path) -> None:
    path = tmp_path / "key.pem"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"chmod 600") as info:
        Identity.load(path)
    assert str(path) in str(info.value)


def test_load_refuses_non_ed25519_key(tmp_path) -> None:
    path = tmp_path / "ec.pem"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="Ed25519"):
        Identity.load(path)


def test_load_refuses_garbage_and_missing(tmp_path) -> None:
    path = tmp_path / "junk.pem"
    path.write_bytes(b"not a key at all")
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="not a readable PEM"):
        Identity.load(path)
    with pytest.raises(IdentityError, match="cannot read"):
        Identity.load(tmp_path / "missing.pem")


def test_load_or_create(tmp_path) -> None:
    path = tmp_path / "keys" / "node.pem"
    first = Identity.load_or_create(path)
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    second = Identity.load_or_create(path)
    assert second.peer_id == first.peer_id
    assert sorted(p.name for p in path.parent.iterdir()) == ["node.pem"]


def test_certificate_carries_peer_id() -> None:
    identity = Identity.generate()
    cert_pem, key_pem = make_certificate(identity)
    assert cert_pem.startswith(b"-----BEGIN CERTIFICATE-----")
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    der = ssl.PEM_cert_to_DER_cert(cert_pem.decode())
    assert peer_id_from_certificate(der) == identity.peer_id


def test_peer_id_from_bad_certificate() -> None:
    with pytest.raises(HandshakeError, match="no TLS certificate"):
        peer_id_from_certificate(b"")
    with pytest.raises(HandshakeError, match="unreadable"):
        peer_id_from_certificate(b"\x30\x03garbage")


def test_peer_id_from_non_ed25519_certificate() -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(HandshakeError, match="Ed25519"):
        peer_id_from_certificate(cert.public_bytes(serialization.Encoding.DER))


def test_tls13_handshake_reveals_server_peer_id() -> None:
    server_identity, client_identity = Identity.generate(), Identity.generate()
    server_ctx, _ = make_ssl_contexts(server_identity)
    _, client_ctx = make_ssl_contexts(client_identity)

    async def scenario() -> tuple[PeerID, str | None, bytes]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(4))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=client_ctx), timeout=10
            )
            sslobj = writer.get_extra_info("ssl_object")
            der = sslobj.getpeercert(binary_form=True)
            version = sslobj.version()
            writer.write(b"ping")
            await writer.drain()
            echoed = await asyncio.wait_for(reader.readexactly(4), timeout=10)
            writer.close()
            await writer.wait_closed()
        return peer_id_from_certificate(der), version, echoed

    seen, version, echoed = asyncio.run(scenario())
    assert seen == server_identity.peer_id
    assert version == "TLSv1.3"
    assert echoed == b"ping"


def test_ssl_contexts_are_tls13_only() -> None:
    server_ctx, client_ctx = make_ssl_contexts(Identity.generate())
    for ctx in (server_ctx, client_ctx):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_NONE
    assert client_ctx.check_hostname is False


def test_ssl_contexts_without_memfd(monkeypatch, tmp_path) -> None:
    # The portable fallback writes the key to a private temp dir and removes it at once.
    monkeypatch.delattr(os, "memfd_create", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    server_ctx, _ = make_ssl_contexts(Identity.generate())
    assert server_ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert list(tmp_path.iterdir()) == []
