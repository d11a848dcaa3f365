"""Who the authority admits: the policy file and the credentials peers present.

The policy is a JSON file the authority reads at start and rewrites (atomically, mode 0600) when it
changes (an invite is used, a peer is revoked, `potluck authority add-user` ...)::

    {
      "format": "potluck-membership-policy/1",
      "allow":   {"<peer id>": "<name>"},                          # admitted on their key alone
      "invites": {"<sha256 hex of the code>": {"name": "<name>", "uses_left": 1}},
      "users":   {"<user name>": {"kdf": "scrypt", "n": 16384, "r": 8, "p": 1,
                                  "salt": "<hex>", "hash": "<hex>"}},
      "revoked": ["<peer id>", ...]
    }

Invite codes are random 128-bit strings, so a plain SHA-256 of them is as good as a slow hash;
passwords are chosen by people, so they get scrypt (memory-hard; standard library). A peer that
redeems an invite is added to "allow" under the invite's name, so it can come back later without
the code (a single-use invite binds the first peer id that uses it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from potluck.core.errors import IdentityError, MembershipError
from potluck.net.identity import PeerID
from potluck.net.membership import MAX_NAME_CHARS

__all__ = ["Credential", "Policy", "PolicyError", "SCRYPT_N", "SCRYPT_P", "SCRYPT_R"]

POLICY_FORMAT = "potluck-membership-policy/1"
# scrypt parameters for new password entries (each entry records its own, so they can be raised
# later without invalidating old ones). N=2^14, r=8 costs 16 MiB and ~50 ms per guess: the
# interactive-login setting recommended by scrypt's author and OWASP's minimum (N=2^17 would be
# 128 MiB per concurrent check, too much for a small authority host).
SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_SALT_BYTES = 16
SCRYPT_HASH_BYTES = 32
# Parameters a policy file may ask for: refuse entries that would make one check cost gigabytes.
MAX_SCRYPT_N = 2**20
MAX_SCRYPT_MEMORY = 256 * 2**20
# Invite codes: 16 random bytes (128 bits) cannot be guessed online or offline.
INVITE_BYTES = 16
# A credential's secret (password or invite code): long passphrases fit; more is not a password.
MAX_SECRET_CHARS = 256
# The policy file is a list of members, not data: refuse to read something absurdly large.
MAX_POLICY_BYTES = 16 * 2**20


class PolicyError(MembershipError):
    """The policy file is unreadable or malformed, or a change to it is invalid."""


def _hash_invite(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8")).hexdigest()


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p,
                          maxmem=MAX_SCRYPT_MEMORY + 2**20, dklen=SCRYPT_HASH_BYTES)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise PolicyError(f"a member name is 1 to {MAX_NAME_CHARS} printable characters, got {name!r:.80}")
    return name


@dataclass(frozen=True)
class Credential:
    """What a peer presents to the authority: `kind` is "peer" (its allowlisted key alone),
    "invite" (`secret` is the code) or "password" (`name` and `secret`)."""

    kind: str = "peer"
    name: str = ""
    secret: str = field(default="", repr=False)

    @classmethod
    def parse(cls, text: str | None) -> Credential:
        """`peer`, `invite:CODE`, `password:NAME:PASSWORD`, or `password:NAME` (the password is then
        read from the POTLUCK_PASSWORD environment variable, so it is not shown by `ps`)."""
        if text is None or text in ("", "peer"):
            return cls()
        kind, _, rest = text.partition(":")
        if kind == "invite" and rest:
            return cls("invite", "", rest)
        if kind == "password" and rest:
            name, sep, password = rest.partition(":")
            if not sep:
                password = os.environ.get("POTLUCK_PASSWORD", "")
                if not password:
                    raise MembershipError("credential 'password:NAME' reads the password from the POTLUCK_PASSWORD "
                                          "environment variable, which is empty")
            return cls("password", name, password)
        raise MembershipError(f"cannot read credential {text.split(':')[0]!r}...: use 'peer' (an allowlisted key), "
                              "'invite:CODE' or 'password:NAME[:PASSWORD]'")

    def to_wire(self) -> dict:
        return {"kind": self.kind, "name": self.name, "secret": self.secret}


@dataclass
class Policy:
    """The authority's members and how they prove it (see the module docstring)."""

    allow: dict[str, str] = field(default_factory=dict)
    invites: dict[str, dict] = field(default_factory=dict)
    users: dict[str, dict] = field(default_factory=dict)
    revoked: list[str] = field(default_factory=list)

    # -- file -------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy file; a missing file is an empty policy (nobody admitted)."""
        path = Path(path)
        try:
            with open(path, "rb") as file:
                data = file.read(MAX_POLICY_BYTES + 1)
        except FileNotFoundError:
            return cls()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {path}: {e.strerror or e}") from None
        if len(data) > MAX_POLICY_BYTES:
            raise PolicyError(f"policy file {path} is over {MAX_POLICY_BYTES} bytes")
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise PolicyError(f"policy file {path} is not JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != POLICY_FORMAT:
            raise PolicyError(f"policy file {path} lacks \"format\": \"{POLICY_FORMAT}\"; create it with "
                              "`potluck authority allow|add-invite|add-user --policy FILE`")
        policy = cls(dict(obj.get("allow", {})), dict(obj.get("invites", {})), dict(obj.get("users", {})),
                     list(obj.get("revoked", [])))
        policy._validate(path)
        return policy

    def _validate(self, path: Path) -> None:
        try:
            for peer, name in self.allow.items():
                PeerID.from_string(peer)
                _check_name(name)
            for peer in self.revoked:
                PeerID.from_string(peer)
            for digest, invite in self.invites.items():
                if len(digest) != 64 or not isinstance(invite, dict) or not isinstance(invite.get("uses_left"), int):
                    raise PolicyError(f"invite {digest[:16]!r}: needs a sha256 hex key and integer 'uses_left'")
                _check_name(invite.get("name"))
            for user, entry in self.users.items():
                _check_name(user)
                if not isinstance(entry, dict) or entry.get("kdf") != "scrypt":
                    raise PolicyError(f"user {user!r}: only 'scrypt' entries are understood")
                n, r, p = entry.get("n"), entry.get("r"), entry.get("p")
                if not all(isinstance(v, int) and v > 0 for v in (n, r, p)) or n > MAX_SCRYPT_N \
                        or 128 * n * r > MAX_SCRYPT_MEMORY:
                    raise PolicyError(f"user {user!r}: scrypt parameters n={n} r={r} p={p} are out of range")
                bytes.fromhex(entry["salt"])
                bytes.fromhex(entry["hash"])
        except (IdentityError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"policy file {path}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically with mode 0600: the file holds password hashes."""
        path = Path(path)
        data = json.dumps({"format": POLICY_FORMAT, "allow": self.allow, "invites": self.invites,
                           "users": self.users, "revoked": self.revoked}, indent=2, sort_keys=True) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as file:
                os.fchmod(file.fileno(), 0o600)
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # -- changes ----------------------------------------------------------------------------------
    def allow_peer(self, peer_id: str, name: str) -> None:
        try:
            PeerID.from_string(peer_id)
        except IdentityError as e:
            raise PolicyError(str(e)) from None
        self.allow[peer_id] = _check_name(name)

    def add_invite(self, name: str, uses: int = 1) -> str:
        """A new invite code (shown once; only its hash is kept) good for `uses` peers."""
        if uses < 1:
            raise PolicyError("an invite needs at least one use")
        code = secrets.token_urlsafe(INVITE_BYTES)
        self.invites[_hash_invite(code)] = {"name": _check_name(name), "uses_left": int(uses)}
        return code

    def add_user(self, name: str, password: str) -> None:
        if not password or len(password) > MAX_SECRET_CHARS:
            raise PolicyError(f"a password is 1 to {MAX_SECRET_CHARS} characters")
        salt = os.urandom(SCRYPT_SALT_BYTES)
        digest = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
        self.users[_check_name(name)] = {"kdf": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P,
                                         "salt": salt.hex(), "hash": digest.hex()}

    def revoke(self, peer_id: str) -> None:
        try:
            PeerID.from_string(peer_id)
        except IdentityError as e:
            raise PolicyError(str(e)) from None
        if peer_id not in self.revoked:
            self.revoked.append(peer_id)

    def revoked_peers(self) -> list[PeerID]:
        return [PeerID.from_string(p) for p in self.revoked]

    # -- checks -----------------------------------------------------------------------------------
    def admit(self, peer_id: PeerID, credential: Credential) -> tuple[str, bool]:
        """The member name `credential` proves for `peer_id`, and whether the policy changed
        (an invite was used); MembershipError says why not. Password checks take ~50 ms of CPU:
        call this off the event loop."""
        text = str(peer_id)
        if text in self.revoked:
            raise MembershipError(f"peer {text} is revoked in this run; ask the run's organizers")
        if credential.kind == "peer":
            name = self.allow.get(text)
            if name is None:
                raise MembershipError(f"peer {text} is not on the authority's allowlist; present an invite code "
                                      "or a user name and password, or ask the organizers to allow this peer id")
            return name, False
        if credential.kind == "invite":
            invite = self.invites.get(_hash_invite(credential.secret))
            if invite is None or invite["uses_left"] < 1:
                raise MembershipError("the invite code is unknown or used up; ask the organizers for a new one")
            invite["uses_left"] -= 1
            self.allow[text] = invite["name"]
            return invite["name"], True
        if credential.kind == "password":
            entry = self.users.get(credential.name)
            # An unknown user costs the same scrypt as a known one, so timing does not tell them apart.
            salt = bytes.fromhex(entry["salt"]) if entry else b"\0" * SCRYPT_SALT_BYTES
            n, r, p = (entry["n"], entry["r"], entry["p"]) if entry else (SCRYPT_N, SCRYPT_R, SCRYPT_P)
            digest = _scrypt(credential.secret, salt, n, r, p)
            if entry is None or not hmac.compare_digest(digest, bytes.fromhex(entry["hash"])):
                raise MembershipError("wrong user name or password")
            return credential.name, False
        raise MembershipError(f"unknown credential kind {credential.kind!r:.40}")
