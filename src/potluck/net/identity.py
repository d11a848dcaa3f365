"""Peer identities: an Ed25519 key pair whose public half *is* the peer id.

A peer proves who it is by signing with its private key; anyone can check that proof with
nothing but the peer id. The same key also signs a self-signed TLS certificate, so a TLS
peer's id can be read straight from the certificate it presents.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import ssl
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import NameOID

from potluck.core.errors import HandshakeError, IdentityError

__all__ = [
    "Identity",
    "PeerID",
    "base58_decode",
    "base58_encode",
    "make_certificate",
    "make_ssl_contexts",
    "peer_id_from_certificate",
]

logger = logging.getLogger(__name__)

# An Ed25519 public key is exactly 32 bytes (RFC 8032); the peer id is that key verbatim.
PEER_ID_BYTES = 32
# base58 of 32 bytes is at most 44 characters; checking first keeps decoding of hostile
# input cheap (big-int base conversion is quadratic in the length).
PEER_ID_MAX_CHARS = 44
# An Ed25519 signature is exactly 64 bytes (RFC 8032); anything else cannot verify.
SIGNATURE_BYTES = 64
# A PEM PKCS8 Ed25519 key is ~120 bytes; refuse to slurp a large file that is surely not a key.
MAX_KEY_FILE_BYTES = 64 * 1024
# Key files must not be accessible by group or others: the key is the peer's whole identity.
KEY_FILE_MODE = 0o600
# Mode for key directories we create ourselves, for the same reason.
KEY_DIR_MODE = 0o700
# Certificates start an hour in the past so peers with slightly slow clocks accept them.
CERT_BACKDATE = datetime.timedelta(hours=1)
# Long lifetime: trust comes from the in-band peer id check, not from certificate expiry.
CERT_LIFETIME = datetime.timedelta(days=3650)

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {ch: i for i, ch in enumerate(_B58_ALPHABET)}
# How many characters of a peer id the short repr shows at each end.
_REPR_CHARS = 4
_EXAMPLE_ID = "a base58 (bitcoin alphabet) string of 32 bytes, 43-44 chars like '8Xk3...QzL1'"


def base58_encode(data: bytes) -> str:
    """Encode bytes in base58 (bitcoin alphabet): compact, and no look-alike characters."""
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, rest = divmod(number, 58)
        digits.append(_B58_ALPHABET[rest])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(digits))


def base58_decode(text: str) -> bytes:
    """Decode base58 (bitcoin alphabet); ValueError names the first bad character."""
    number = 0
    for position, ch in enumerate(text):
        digit = _B58_INDEX.get(ch)
        if digit is None:
            raise ValueError(f"character {ch!r} at position {position} is not base58")
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    return b"\0" * zeros + number.to_bytes((number.bit_length() + 7) // 8, "big")


@functools.total_ordering
class PeerID:
    """A peer's name: its 32-byte Ed25519 public key, shown as base58 text."""

    __slots__ = ("_hash", "_key", "_public_key", "_text")

    def __init__(self, key_bytes: bytes):
        if not isinstance(key_bytes, (bytes, bytearray, memoryview)):
            raise IdentityError(f"a peer id is built from bytes, got {type(key_bytes).__name__}")
        key = bytes(key_bytes)
        if len(key) != PEER_ID_BYTES:
            raise IdentityError(
                f"a peer id is a {PEER_ID_BYTES}-byte Ed25519 public key, got {len(key)} bytes"
            )
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_text", None)
        object.__setattr__(self, "_public_key", None)
        object.__setattr__(self, "_hash", hash((PeerID, key)))  # ids are dict keys everywhere: hash once

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse the base58 text form, saying exactly what is wrong with a bad one."""
        if not isinstance(text, str):
            raise IdentityError(f"a peer id string must be str, got {type(text).__name__}")
        if not text:
            raise IdentityError(f"empty peer id; expected {_EXAMPLE_ID}")
        if len(text) > PEER_ID_MAX_CHARS:
            raise IdentityError(
                f"bad peer id {text[:64]!r}: {len(text)} characters, more than the "
                f"{PEER_ID_MAX_CHARS} of a 32-byte key; expected {_EXAMPLE_ID}"
            )
        try:
            raw = base58_decode(text)
        except ValueError as exc:
            raise IdentityError(
                f"bad peer id {text[:64]!r}: {exc}; expected {_EXAMPLE_ID}"
            ) from None
        if len(raw) != PEER_ID_BYTES:
            raise IdentityError(
                f"bad peer id {text[:64]!r}: decodes to {len(raw)} bytes, "
                f"not {PEER_ID_BYTES}; expected {_EXAMPLE_ID}"
            )
        return cls(raw)

    def to_bytes(self) -> bytes:
        """The raw 32 public key bytes (the binary wire form)."""
        return self._key

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True if `signature` is this peer's signature of `data`; never raises on bad input."""
        if not isinstance(signature, (bytes, bytearray, memoryview)):
            return False
        signature = bytes(signature)
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            public_key = self._public_key
            if public_key is None:
                public_key = Ed25519PublicKey.from_public_bytes(self._key)
                object.__setattr__(self, "_public_key", public_key)
            public_key.verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = base58_encode(self._key)
            object.__setattr__(self, "_text", text)
        return text

    def __repr__(self) -> str:
        text = str(self)
        return f"PeerID({text[:_REPR_CHARS]}...{text[-_REPR_CHARS:]})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PeerID is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("PeerID is immutable")

    def __copy__(self) -> PeerID:
        return self

    def __deepcopy__(self, memo: dict) -> PeerID:
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._key == other._key

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._key < other._key


class Identity:
    """This peer's Ed25519 private key: it signs for the peer id it derives."""

    __slots__ = ("_peer_id", "_private_key")

    def __init__(self, private_key: Ed25519PrivateKey):
        if not isinstance(private_key, Ed25519PrivateKey):
            raise IdentityError(
                f"an identity needs an Ed25519 private key, got {type(private_key).__name__}"
            )
        self._private_key = private_key
        raw = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = PeerID(raw)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key file, refusing ones others can read or that are not Ed25519 keys."""
        path = Path(path)
        try:
            with open(path, "rb") as file:
                _check_key_file_mode(path, os.fstat(file.fileno()).st_mode)
                data = file.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            raise IdentityError(f"cannot read key file {path}: {exc.strerror or exc}") from exc
        if len(data) > MAX_KEY_FILE_BYTES:
            raise IdentityError(
                f"{path} is over {MAX_KEY_FILE_BYTES} bytes, so it is not an Ed25519 PEM key"
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except TypeError as exc:
            raise IdentityError(
                f"{path} holds an encrypted key; potluck needs an unencrypted PKCS8 PEM key"
            ) from exc
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise IdentityError(
                f"{path} is not a readable PEM private key (expected unencrypted PKCS8 Ed25519)"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(
                f"{path} holds a {type(key).__name__.lstrip('_')} key, but potluck identities "
                "are Ed25519 keys"
            )
        return cls(key)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key atomically with mode 0600, so it is never briefly world-readable."""
        tmp = self._write_temp(Path(path))
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at `path`, creating it first if missing (never clobbering a rival's)."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        tmp = identity._write_temp(path)
        try:
            os.link(tmp, path)  # atomic create-if-absent: fails if another process won
        except FileExistsError:
            return cls.load(path)
        except OSError:
            os.replace(tmp, path)  # filesystem without hard links: plain atomic replace
        finally:
            _unlink_quietly(tmp)
        logger.info("created new identity %s at %s", identity.peer_id, path)
        return identity

    @property
    def peer_id(self) -> PeerID:
        """The public id other peers know this identity by."""
        return self._peer_id

    @property
    def private_key(self) -> Ed25519PrivateKey:
        """The underlying `cryptography` key object."""
        return self._private_key

    def sign(self, data: bytes) -> bytes:
        """A 64-byte signature that anyone holding the peer id can verify."""
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self._peer_id!r})"

    def _pem(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def _write_temp(self, path: Path) -> str:
        """Write the key to a fresh 0600 temp file next to `path`; return its name."""
        parent = path.parent
        try:
            parent.mkdir(mode=KEY_DIR_MODE, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        except OSError as exc:
            raise IdentityError(f"cannot write key file {path}: {exc.strerror or exc}") from exc
        try:
            with os.fdopen(fd, "wb") as file:
                if hasattr(os, "fchmod"):
                    os.fchmod(file.fileno(), KEY_FILE_MODE)
                file.write(self._pem())
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp


def _check_key_file_mode(path: Path, mode: int) -> None:
    if os.name == "posix" and stat.S_IMODE(mode) & 0o077:
        raise IdentityError(
            f"key file {path} is accessible by group/others (mode {stat.S_IMODE(mode):04o}); "
            f"run `chmod 600 {path}`"
        )


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def make_certificate(identity: Identity) -> tuple[bytes, bytes]:
    """A self-signed X.509 cert for TLS whose key is the identity key: (cert_pem, key_pem)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity.peer_id))])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CERT_BACKDATE)
        .not_valid_after(now + CERT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(identity.private_key, algorithm=None)  # Ed25519 hashes internally
    )
    return cert.public_bytes(serialization.Encoding.PEM), identity._pem()


def peer_id_from_certificate(der: bytes | None) -> PeerID:
    """The peer id a TLS peer proved by its certificate (DER, from getpeercert(True))."""
    if not der:
        raise HandshakeError("the remote peer presented no TLS certificate")
    try:
        cert = x509.load_der_x509_certificate(bytes(der))
        public_key = cert.public_key()
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise HandshakeError(f"the remote peer's TLS certificate is unreadable: {exc}") from exc
    if not isinstance(public_key, Ed25519PublicKey):
        raise HandshakeError(
            f"the remote peer's TLS certificate has a {type(public_key).__name__.lstrip('_')} "
            "key; potluck peers must use Ed25519 certificates"
        )
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PeerID(raw)


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path holding `data` only for the duration of the block (in RAM where possible)."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("potluck-tls", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="potluck-tls-") as tmpdir:  # created 0700
        path = os.path.join(tmpdir, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        yield path


def make_ssl_contexts(identity: Identity) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS 1.3 contexts presenting the identity's certificate.

    Neither side verifies certificates through a CA: callers read the peer's DER cert
    (``ssl_object.getpeercert(binary_form=True)``) and check it with
    `peer_id_from_certificate`; clients prove their id in-band by signatures.
    """
    cert_pem, key_pem = make_certificate(identity)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.maximum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_NONE
    with _pem_file(key_pem + cert_pem) as chain:
        server.load_cert_chain(chain)
        client.load_cert_chain(chain)
    return server, client
