"""Who the authority admits: the policy file and the credentials peers present.

The policy is a JSON file the authority reads at start and rewrites (atomically, mode 0600) when it
changes (an invite is used, a peer is revoked, `potluck authority add-user` ...)::

    {
      "format": "potluck-membership-policy/1",
      "allow":   {"<peer id>": "<name>"},                          # admitted on their key alone
      "invites": {"<sha256 hex of the code>": {"name": "<name>", "uses_left": 1}},
      "users":   {"<user name>": {"kdf": "scrypt", "n": 16384, "r": 8, "p": 1,
                                  "salt": "<hex>", "hash": "<hex>"}},
      "revoked": ["<peer id>", ...],
      "max_identities": 1,                                        # optional; also per user
      "identities": {"<user name>": {"<peer id>": <token expiry>}},  # kept by the authority
      "replaced":   {"<peer id>": {"name": "<user name>", "until": <token expiry>}}
    }

Invite codes are random 128-bit strings, so a plain SHA-256 of them is as good as a slow hash;
passwords are chosen by people, so they get scrypt (memory-hard; standard library). A peer that
redeems an invite is added to "allow" under the invite's name, so it can come back later without
the code (a single-use invite binds the first peer id that uses it).

A user name holds at most `max_identities` live identities (peer ids with an unexpired token from a
password login; default 1, for the run or per user). A login of a new peer id beyond that *replaces*
the name's oldest identity: its peer id goes on the revocation list until its token expires, so
every member drops it, and its renewals are refused with `IdentityReplaced`. The authority records
these in "identities" and "replaced", so a restart keeps them. A name replaces at most
MAX_REPLACED_PER_NAME identities per token lifetime (see docs/security.md for why replace rather
than refuse).
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
from potluck.core.wire import Choice, Message, Text
from potluck.net.identity import PeerID
from potluck.net.membership import MAX_NAME_CHARS, MAX_REVOKED_PEERS

__all__ = [
    "DEFAULT_MAX_IDENTITIES", "MAX_REPLACED_PER_NAME", "Credential", "IdentityReplaced", "Policy", "PolicyError",
    "SCRYPT_N", "SCRYPT_P", "SCRYPT_R",
]

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
# What a credential may be (see `Credential`).
CREDENTIAL_KINDS = ("peer", "invite", "password")
# The policy file is a list of members, not data: refuse to read something absurdly large.
MAX_POLICY_BYTES = 16 * 2**20
# Live identities (peer ids with unexpired tokens) one user name may hold through password logins,
# unless the policy says otherwise for the run or the user: one person, one peer. Every identity
# counts as a separate peer wherever potluck counts peers (robust aggregation's f, state votes), so
# this is what keeps one password from raising those counts at will. Raise it per user for someone
# who runs several machines (`potluck authority max-identities N --user NAME`).
DEFAULT_MAX_IDENTITIES = 1
# The largest max_identities the policy accepts: a person with more machines than this should
# have them allowlisted one by one (each then is accountable to its own entry).
MAX_IDENTITIES_LIMIT = 1024
# Identities one user name may have replaced (and so put on the revocation list) within a token
# lifetime: a person restarting a peer with a fresh identity each time may do it 8 times an hour;
# a member logging in in a loop cannot grow the revocation list (at most MAX_REVOKED_PEERS entries,
# manual revocations included) by more than 8 per user name.
MAX_REPLACED_PER_NAME = 8
# A renewal moves a password identity's recorded expiry; the policy file is rewritten only when it
# moved by more than this, so a member renewing in a loop cannot make the authority write its file
# more than once a minute (an honest member renews once per token lifetime).
RENEWAL_SAVE_STEP = 60.0


class PolicyError(MembershipError):
    """The policy file is unreadable or malformed, or a change to it is invalid."""


class IdentityReplaced(MembershipError):
    """This peer id no longer holds a place of its user name: a newer login of the name took it
    (or the name already holds all its places). Its token is not renewed; logging in again with the
    password would only take the place from the other identity, so a client stops instead."""


def _hash_invite(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8")).hexdigest()


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p,
                          maxmem=MAX_SCRYPT_MEMORY + 2**20, dklen=SCRYPT_HASH_BYTES)


def _identities(count: int) -> str:
    return "1 live identity" if count == 1 else f"{count} live identities"


def _check_limit(count: object) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_IDENTITIES_LIMIT:
        raise PolicyError(f"max_identities is a whole number from 1 to {MAX_IDENTITIES_LIMIT}, got {count!r:.40}")
    return count


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise PolicyError(f"a member name is 1 to {MAX_NAME_CHARS} printable characters, got {name!r:.80}")
    return name


class Credential(Message, what="credential"):
    """What a peer presents to the authority: `kind` is "peer" (its allowlisted key alone),
    "invite" (`secret` is the code) or "password" (`name` and `secret`)."""

    kind: str = Choice(choices=CREDENTIAL_KINDS, default="peer")
    name: str = Text(max_chars=MAX_NAME_CHARS, default="")
    secret: str = Text(max_chars=MAX_SECRET_CHARS, default="")

    def __repr__(self) -> str:  # never the secret
        return f"Credential(kind={self.kind!r}, name={self.name!r})"

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


@dataclass
class Policy:
    """The authority's members and how they prove it (see the module docstring)."""

    allow: dict[str, str] = field(default_factory=dict)
    invites: dict[str, dict] = field(default_factory=dict)
    users: dict[str, dict] = field(default_factory=dict)
    revoked: list[str] = field(default_factory=list)
    max_identities: int = DEFAULT_MAX_IDENTITIES
    identities: dict[str, dict[str, float]] = field(default_factory=dict)  # user -> {peer id: token expiry}
    replaced: dict[str, dict] = field(default_factory=dict)  # peer id -> {"name": user, "until": token expiry}

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
                     list(obj.get("revoked", [])), obj.get("max_identities", DEFAULT_MAX_IDENTITIES),
                     dict(obj.get("identities", {})), dict(obj.get("replaced", {})))
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
                _check_limit(entry.get("max_identities", DEFAULT_MAX_IDENTITIES))
            _check_limit(self.max_identities)
            for user, held in self.identities.items():
                _check_name(user)
                for peer, expires in held.items():
                    PeerID.from_string(peer)
                    float(expires)
            for peer, entry in self.replaced.items():
                PeerID.from_string(peer)
                _check_name(entry["name"])
                float(entry["until"])
        except (IdentityError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"policy file {path}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically with mode 0600: the file holds password hashes."""
        path = Path(path)
        data = json.dumps({"format": POLICY_FORMAT, "allow": self.allow, "invites": self.invites,
                           "users": self.users, "revoked": self.revoked, "max_identities": self.max_identities,
                           "identities": self.identities, "replaced": self.replaced},
                          indent=2, sort_keys=True) + "\n"
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
        kept = {k: v for k, v in self.users.get(name, {}).items() if k == "max_identities"}  # a reset keeps it
        self.users[_check_name(name)] = {"kdf": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P,
                                         "salt": salt.hex(), "hash": digest.hex(), **kept}

    def revoke(self, peer_id: str) -> None:
        try:
            PeerID.from_string(peer_id)
        except IdentityError as e:
            raise PolicyError(str(e)) from None
        if peer_id not in self.revoked:
            self.revoked.append(peer_id)

    def set_max_identities(self, count: int, user: str | None = None) -> None:
        """How many live identities a user name may hold: for `user`, or for the run (every user
        without a setting of its own)."""
        count = _check_limit(count)
        if user is None:
            self.max_identities = count
        elif user not in self.users:
            raise PolicyError(f"no user {user!r} in the policy; add it first with `potluck authority add-user`")
        else:
            self.users[user]["max_identities"] = count

    def identity_limit(self, user: str) -> int:
        entry = self.users.get(user)
        return (entry or {}).get("max_identities", self.max_identities)

    def revoked_peers(self, now: float | None = None) -> list[PeerID]:
        """The peers whose tokens are void: those revoked by hand, and the replaced identities
        whose tokens have not expired at `now` (all of them if None)."""
        replaced = [p for p, entry in self.replaced.items() if now is None or entry["until"] > now]
        return [PeerID.from_string(p) for p in [*self.revoked, *replaced]]

    # -- identities of user names ------------------------------------------------------------------
    def take_identity(self, user: str, peer_id: PeerID, expires: float, now: float) -> list[str]:
        """`peer_id` logged in as `user` with its password and gets a token until `expires`: record
        it, replacing the name's oldest identities beyond its limit; returns the replaced peer ids.
        MembershipError (nothing changed) if the name replaced too many within a token lifetime,
        or the revocation list has no room."""
        self._forget_expired(now)
        peer = str(peer_id)
        held = self.identities.get(user, {})
        limit = self.identity_limit(user)
        others = sorted((p for p in held if p != peer), key=lambda p: (held[p], p))
        victims = others[:max(0, len(others) + 1 - limit)]
        if victims:
            already = [e for p, e in self.replaced.items() if e["name"] == user and p != peer]
            if len(already) + len(victims) > MAX_REPLACED_PER_NAME:
                minutes = max(1, round((min(e["until"] for e in already) - now) / 60)) if already else 1
                raise MembershipError(
                    f"user {user!r} replaced {len(already)} of its identities within a token's lifetime (at most "
                    f"{MAX_REPLACED_PER_NAME}; it may hold {_identities(limit)} at once): restart the peer with the "
                    f"same identity (--identity FILE) rather than a new one, or retry in {minutes} min")
            listed = len(self.revoked) + len(self.replaced) - (peer in self.replaced)
            if listed + len(victims) > MAX_REVOKED_PEERS:
                raise MembershipError(f"the authority's revocation list is full ({MAX_REVOKED_PEERS} peers), so "
                                      f"{user!r} cannot replace an identity now; retry within the hour, or stop "
                                      "one of its peers first")
        self.replaced.pop(peer, None)
        held = self.identities.setdefault(user, {})
        for victim in victims:
            self.replaced[victim] = {"name": user, "until": held.pop(victim)}
        held[peer] = expires
        return victims

    def renew_identity(self, user: str, peer_id: PeerID, expires: float, now: float) -> bool:
        """`peer_id`, holding a valid token named `user`, renews it until `expires`. IdentityReplaced
        if a newer login took its place; if `user` is a password user (and the peer is not
        allowlisted under that name), the identity must hold one of the name's places, or get a free
        one. Returns whether the stored expiry moved by more than a minute (worth saving)."""
        self._forget_expired(now)
        peer = str(peer_id)
        limit = self.identity_limit(user)
        if peer in self.replaced:
            raise IdentityReplaced(f"this peer's identity was replaced by a newer login of {user!r} (which may hold "
                                   f"{_identities(limit)} at once): stop this peer, or ask the organizers to raise "
                                   f"max_identities for {user!r}")
        if user not in self.users or self.allow.get(peer) == user:
            return False  # an allowlisted or invited peer: bounded by the allowlist itself
        held = self.identities.setdefault(user, {})
        if peer not in held and len(held) >= limit:
            raise IdentityReplaced(f"user {user!r} already holds its {_identities(limit)}, and this is not one "
                                   f"of them: stop this peer, or ask the organizers to raise max_identities for "
                                   f"{user!r}")
        moved = expires - held.get(peer, 0.0) > RENEWAL_SAVE_STEP
        held[peer] = expires
        return moved

    def readmit(self, peer_id: PeerID) -> bool:
        """`peer_id` was admitted again by its key or an invite: it is no longer a replaced
        identity. Returns whether that changed anything."""
        return self.replaced.pop(str(peer_id), None) is not None

    def _forget_expired(self, now: float) -> None:
        for user in list(self.identities):
            held = {p: e for p, e in self.identities[user].items() if e > now}
            if held:
                self.identities[user] = held
            else:
                del self.identities[user]
        for peer in [p for p, e in self.replaced.items() if e["until"] <= now]:
            del self.replaced[peer]

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
