"""Membership tokens, revocation lists and the policy: parsing hostile bytes, and every refusal."""

from __future__ import annotations

import json

import msgpack
import pytest

from potluck.core.errors import MalformedMessage, MembershipError, MembershipRefused
from potluck.membership.authority import TokenRequest
from potluck.membership.policy import Credential, Policy, PolicyError
from potluck.net.identity import Identity
from potluck.net.membership import (
    MAX_REVOKED_PEERS,
    MAX_TOKEN_BYTES,
    MembershipGate,
    MembershipToken,
    RevocationList,
)

AUTHORITY = Identity.generate()
MEMBER = Identity.generate()
NOW = 1_800_000_000.0


def token(peer=MEMBER, run="run", expires=NOW + 100, signer=AUTHORITY, name="alice") -> MembershipToken:
    return MembershipToken.issue(signer, peer.peer_id, name, run, expires)


def wire(**changes) -> bytes:
    obj = msgpack.unpackb(token().to_wire(), raw=False)
    obj.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del obj[key]
    return msgpack.packb(obj, use_bin_type=True)


def test_token_round_trips_and_verifies():
    parsed = MembershipToken.from_wire(token().to_wire())
    assert parsed == token()  # Ed25519 signatures are deterministic
    parsed.verify(AUTHORITY.peer_id, MEMBER.peer_id, NOW, run_id="run")
    assert len(parsed.to_wire()) < MAX_TOKEN_BYTES // 2


@pytest.mark.parametrize("data, field", [
    (b"\xc1garbage", "not msgpack"),
    (b"x" * (MAX_TOKEN_BYTES + 1), "more than"),
    ("text", "is bytes"),
    (msgpack.packb([1, 2]), "msgpack map"),
    (wire(extra=1), "exactly the keys"),
    (wire(sig=...), "exactly the keys"),
    (wire(peer=b"short"), "'peer'"),
    (wire(name=""), "'name'"),
    (wire(name="x" * 65), "'name'"),
    (wire(name="a\nb"), "'name'"),
    (wire(run=7), "'run'"),
    (wire(exp=float("nan")), "'exp'"),
    (wire(exp=True), "'exp'"),
    (wire(sig=b"\0" * 63), "'sig'"),
])
def test_malformed_token_fields_are_named(data, field):
    with pytest.raises(MalformedMessage) as info:
        MembershipToken.from_wire(data)
    assert field in str(info.value)


@pytest.mark.parametrize("bad, words", [
    (lambda: token(signer=Identity.generate()), "not signed by this run's authority"),
    (lambda: token(peer=Identity.generate()), "issued to peer"),
    (lambda: token(run="other"), "for run 'other'"),
    (lambda: token(expires=NOW - 5), "expired 5 s ago"),
])
def test_each_invalid_token_says_what_is_wrong(bad, words):
    with pytest.raises(MembershipError, match=words):
        bad().verify(AUTHORITY.peer_id, MEMBER.peer_id, NOW, run_id="run")


def test_a_tampered_field_breaks_the_signature():
    forged = MembershipToken.from_wire(wire(exp=NOW + 10_000))
    with pytest.raises(MembershipError, match="not signed"):
        forged.verify(AUTHORITY.peer_id, MEMBER.peer_id, NOW)


def test_revocation_list_round_trip_and_revokes():
    revoked = RevocationList.issue(AUTHORITY, "run", 3, NOW + 60, [MEMBER.peer_id])
    parsed = RevocationList.from_wire(revoked.to_wire())
    parsed.verify(AUTHORITY.peer_id, "run", NOW)
    with pytest.raises(MembershipError, match="revoked"):
        token().verify(AUTHORITY.peer_id, MEMBER.peer_id, NOW, revocations=parsed)


def revocation_wire(**changes) -> bytes:
    obj = msgpack.unpackb(RevocationList.issue(AUTHORITY, "run", 1, NOW + 60, [MEMBER.peer_id]).to_wire(), raw=False)
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("data, field", [
    (revocation_wire(ver=-1), "'ver'"),
    (revocation_wire(ver=1.5), "'ver'"),
    (revocation_wire(revoked=b"x"), "'revoked'"),
    (revocation_wire(revoked=[b"x" * 31]), "'revoked'"),
    (revocation_wire(revoked=[MEMBER.peer_id.to_bytes()] * 2), "without repeats"),
    (revocation_wire(revoked=[b"\1" * 32] * (MAX_REVOKED_PEERS + 1)), "'revoked'"),
    (revocation_wire(exp="soon"), "'exp'"),
])
def test_malformed_revocation_fields_are_named(data, field):
    with pytest.raises(MalformedMessage) as info:
        RevocationList.from_wire(data)
    assert field in str(info.value)


def test_forged_or_stale_revocation_lists_are_not_adopted():
    gate = MembershipGate(AUTHORITY.peer_id, "run", clock=lambda: NOW)
    assert not gate.update_revocations(RevocationList.issue(Identity.generate(), "run", 5, NOW + 60, []))
    assert not gate.update_revocations(RevocationList.issue(AUTHORITY, "run", 5, NOW - 1, []))
    assert not gate.update_revocations(RevocationList.issue(AUTHORITY, "other", 5, NOW + 60, []))
    assert gate.update_revocations(RevocationList.issue(AUTHORITY, "run", 5, NOW + 60, [MEMBER.peer_id]))
    assert not gate.update_revocations(RevocationList.issue(AUTHORITY, "run", 4, NOW + 60, []))
    assert gate.revocations.is_revoked(MEMBER.peer_id)


def test_gate_refuses_missing_or_unreadable_tokens_and_admits_the_authority():
    gate = MembershipGate(AUTHORITY.peer_id, "run", clock=lambda: NOW)
    with pytest.raises(MembershipRefused, match="presented no membership token"):
        gate.check(MEMBER.peer_id, None)
    with pytest.raises(MembershipRefused, match="unreadable membership token"):
        gate.check(MEMBER.peer_id, b"\x00junk")
    assert gate.check(AUTHORITY.peer_id, None) is None
    assert gate.check(MEMBER.peer_id, token().to_wire()).name == "alice"


def test_policy_admits_by_allowlist_invite_and_password(tmp_path):
    path = tmp_path / "policy.json"
    policy = Policy()
    policy.allow_peer(str(MEMBER.peer_id), "member")
    code = policy.add_invite("guest", uses=1)
    policy.add_user("bob", "correct horse")
    policy.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert code not in path.read_text() and "correct horse" not in path.read_text()
    policy = Policy.load(path)
    assert policy.admit(MEMBER.peer_id, Credential()) == ("member", False)
    newcomer = Identity.generate().peer_id
    assert policy.admit(newcomer, Credential.parse(f"invite:{code}")) == ("guest", True)
    assert policy.admit(newcomer, Credential()) == ("guest", False)  # the invite allowlisted it
    with pytest.raises(MembershipError, match="used up"):
        policy.admit(Identity.generate().peer_id, Credential.parse(f"invite:{code}"))
    assert policy.admit(newcomer, Credential.parse("password:bob:correct horse"))[0] == "bob"
    with pytest.raises(MembershipError, match="wrong user name or password"):
        policy.admit(newcomer, Credential.parse("password:bob:wrong"))
    with pytest.raises(MembershipError, match="wrong user name or password"):
        policy.admit(newcomer, Credential.parse("password:nobody:x"))
    policy.revoke(str(MEMBER.peer_id))
    with pytest.raises(MembershipError, match="revoked"):
        policy.admit(MEMBER.peer_id, Credential())


def test_policy_records_scrypt_parameters_and_refuses_absurd_ones(tmp_path):
    policy = Policy()
    policy.add_user("bob", "pw")
    entry = policy.users["bob"]
    assert entry["kdf"] == "scrypt" and entry["n"] >= 2**14 and entry["r"] == 8
    path = tmp_path / "p.json"
    policy.save(path)
    obj = json.loads(path.read_text())
    obj["users"]["bob"]["n"] = 2**30
    path.write_text(json.dumps(obj))
    with pytest.raises(PolicyError, match="out of range"):
        Policy.load(path)
    path.write_text("{}")
    with pytest.raises(PolicyError, match="format"):
        Policy.load(path)


def test_credential_strings():
    assert Credential.parse(None).kind == "peer"
    assert Credential.parse("password:ann:a:b") == Credential("password", "ann", "a:b")
    with pytest.raises(MembershipError, match="invite:CODE"):
        Credential.parse("token:abc")


@pytest.mark.parametrize("request_obj, field", [
    ({}, "exactly one"),
    ({"cred": {}, "renew": b""}, "exactly one"),
    ({"cred": {"kind": "root", "name": "", "secret": ""}}, "'cred': 'kind'"),
    ({"cred": {"kind": "password", "name": "x" * 65, "secret": ""}}, "'cred': 'name'"),
    ({"cred": {"kind": "password", "name": "a", "secret": "s" * 257}}, "'cred': 'secret'"),
    ({"renew": "text"}, "'renew'"),
])
def test_malformed_token_requests_are_named(request_obj, field):
    with pytest.raises(MalformedMessage, match=field):
        TokenRequest.from_wire(request_obj)


def _record(owner: Identity, token: MembershipToken | None, key: str = "progress"):
    from potluck.core.serialization import dumps
    from potluck.dht.records import Record, owner_marker
    from potluck.dht.validation import sign_record
    return sign_record(Record(f"{key}{owner_marker(owner.peer_id)}", None, dumps(1), NOW + 60), owner,
                       None if token is None else token.to_wire())


def test_owned_dht_records_need_their_owners_token():
    from potluck.dht.errors import NotOwner, RecordRejected
    from potluck.dht.records import Record
    from potluck.dht.validation import Limits, check_record
    from potluck.membership.records import RECORD_TOKEN_GRACE, MembershipRecordValidator

    now = [NOW]
    gate = MembershipGate(AUTHORITY.peer_id, "run", clock=lambda: now[0])
    rules = [MembershipRecordValidator(gate)]
    check = lambda record: check_record(record, Limits(), now[0], rules)  # noqa: E731
    check(_record(MEMBER, token()))
    check(_record(AUTHORITY, None))  # the authority needs no token
    stranger = Identity.generate()
    with pytest.raises(RecordRejected, match="attached no membership token"):
        check(_record(stranger, None))
    with pytest.raises(RecordRejected, match="issued to peer"):
        check(_record(stranger, token()))  # a member's token on a stranger's record
    with pytest.raises(RecordRejected, match="not signed by this run's authority"):
        check(_record(stranger, MembershipToken.issue(stranger, stranger.peer_id, "me", "run", NOW + 60)))
    good = _record(MEMBER, token())
    lifted = Record(good.key, good.subkey, good.value, good.expiration_time, good.signature,
                    token(expires=NOW + 10_000).to_wire())
    with pytest.raises(NotOwner, match="does not verify"):
        check(lifted)  # the signature covers the token: it cannot be swapped
    with pytest.raises(RecordRejected, match="carry a signature or a membership token"):
        check(Record("plain", None, good.value, NOW + 60, None, token().to_wire()))
    now[0] = NOW + 100 + RECORD_TOKEN_GRACE / 2  # token expired, record signed while it was valid
    check_record(_record(MEMBER, token()), Limits(), now[0] - RECORD_TOKEN_GRACE / 2, rules)
    gate.update_revocations(RevocationList.issue(AUTHORITY, "run", 1, now[0] + 60, [MEMBER.peer_id]))
    with pytest.raises(RecordRejected, match="revoked"):
        check_record(_record(MEMBER, token()), Limits(), now[0] - RECORD_TOKEN_GRACE / 2, rules)


def test_gate_uses_the_later_of_a_presented_and_a_handshake_token():
    now = [NOW]
    gate = MembershipGate(AUTHORITY.peer_id, "run", clock=lambda: now[0])
    early, late = token(expires=NOW + 100), token(expires=NOW + 5000)
    gate.present(MEMBER.peer_id, late.to_wire())
    assert gate.current(MEMBER.peer_id, early.to_wire()) == late
    gate.present(MEMBER.peer_id, early.to_wire())  # an older token shown later
    assert gate.current(MEMBER.peer_id, late.to_wire()) == late  # a reconnect with a newer one wins
    now[0] = NOW + 200
    assert gate.still_admitted(MEMBER.peer_id, late.to_wire()) is None
    assert "expired" in gate.still_admitted(MEMBER.peer_id, early.to_wire())
    with pytest.raises(MembershipError, match="issued to peer"):
        gate.present(Identity.generate().peer_id, late.to_wire())
