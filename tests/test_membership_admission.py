"""The authority's admission rules without a network: password limits per origin and per name, the
queue of password checks, and the live identities a user name may hold."""

from __future__ import annotations

import json

import pytest

from potluck.cli import build_parser
from potluck.core.errors import MembershipError
from potluck.membership.admission import (
    KNOWN_SUBNETS_PER_NAME,
    MAX_WAITING_PASSWORD_CHECKS,
    PASSWORDS_PER_IP,
    PASSWORDS_PER_NAME,
    PASSWORDS_PER_NAME_PER_SUBNET,
    PASSWORDS_PER_SUBNET,
    WAITING_PER_SUBNET,
    PasswordChecks,
    PasswordLimits,
    TooManyAttempts,
    WindowCounts,
)
from potluck.membership.policy import MAX_REPLACED_PER_NAME, IdentityReplaced, Policy, PolicyError
from potluck.net.identity import Identity
from potluck.net.origins import origin_of

NOW = 1_800_000_000.0
LIFE = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_window_counts_forget_old_events_and_least_recent_keys_but_never_kept_ones():
    clock = Clock()
    counts = WindowCounts(3, 60.0, clock, max_keys=2, keep=lambda key: key == "alice")
    for _ in range(5):
        counts.add("alice")
    assert counts.count("alice") == 3 and counts.full("alice")
    clock.now += 30
    counts.add("alice")
    clock.now += 31  # the first three are out of the window
    assert counts.count("alice") == 1
    for key in ("a", "b", "c"):
        counts.add(key)
    assert counts.count("a") == 0 and counts.count("c") == 1  # "a" forgotten: only 2 keys are kept
    assert counts.count("alice") == 1  # a kept key is never forgotten


def test_password_limits_per_address_and_subnet():
    limits = PasswordLimits(Clock())
    for i in range(PASSWORDS_PER_IP):
        limits.check(origin_of("203.0.113.7"), f"user{i}")
        limits.count(origin_of("203.0.113.7"), f"user{i}")
    with pytest.raises(TooManyAttempts, match="from 203.0.113.7"):
        limits.check(origin_of("203.0.113.7"), "someone")
    for i in range(PASSWORDS_PER_SUBNET - PASSWORDS_PER_IP):
        neighbour = origin_of(f"203.0.113.{100 + i // PASSWORDS_PER_IP}")
        limits.check(neighbour, f"user{i}")
        limits.count(neighbour, f"user{i}")
    with pytest.raises(TooManyAttempts, match="from 203.0.113.0/24"):
        limits.check(origin_of("203.0.113.200"), "someone")
    limits.check(origin_of("198.51.100.1"), "someone")  # other subnets keep their own


def test_one_origin_cannot_use_up_a_names_budget_and_known_places_skip_it():
    limits = PasswordLimits(Clock(), known_name=lambda name: name == "alice")
    limits.logged_in("alice", origin_of("192.0.2.9"))  # her place
    subnets = [f"10.{i}.0.1" for i in range(PASSWORDS_PER_NAME // PASSWORDS_PER_NAME_PER_SUBNET)]
    for host in subnets:
        for _ in range(PASSWORDS_PER_NAME_PER_SUBNET):
            limits.check(origin_of(host), "alice")
            limits.count(origin_of(host), "alice")
        with pytest.raises(TooManyAttempts, match="for this user name from 10"):
            limits.check(origin_of(host), "alice")  # one subnet: a quarter of the name's budget
    with pytest.raises(TooManyAttempts, match="from many addresses"):
        limits.check(origin_of("172.16.0.1"), "alice")  # a new place, once four subnets spent it
    limits.check(origin_of("192.0.2.9"), "alice")  # her own place is not locked out
    limits.check(origin_of("172.16.0.1"), "bob")  # nor are other names
    for i in range(KNOWN_SUBNETS_PER_NAME):
        limits.logged_in("alice", origin_of(f"100.64.{i}.1"))
    assert not limits.known_subnet("alice", origin_of("192.0.2.9"))  # only the latest places are kept


def test_the_password_queue_gives_each_subnet_its_share():
    checks = PasswordChecks()
    for i in range(WAITING_PER_SUBNET):
        checks.claim(origin_of("203.0.113.1"), f"p{i}")
    with pytest.raises(TooManyAttempts, match=r"busy checking passwords .*from 203.0.113.0/24 \(its share: 4 of 32\)"):
        checks.claim(origin_of("203.0.113.2"), "another")
    subnet = 0
    while checks.places.held < MAX_WAITING_PASSWORD_CHECKS:
        subnet += 1
        for i in range(WAITING_PER_SUBNET):
            checks.claim(origin_of(f"10.0.{subnet}.1"), f"q{subnet}.{i}")
    with pytest.raises(TooManyAttempts, match="all 32 are taken"):
        checks.claim(origin_of("198.51.100.1"), "late")


def peer() -> str:
    return str(Identity.generate().peer_id)


def test_a_new_login_beyond_the_bound_replaces_the_oldest_identity():
    policy = Policy()
    policy.add_user("alice", "pw")
    first, second, third = (Identity.generate().peer_id for _ in range(3))
    assert policy.take_identity("alice", first, NOW + LIFE, NOW) == []
    assert policy.take_identity("alice", first, NOW + LIFE + 1, NOW + 1) == []  # the same peer again
    assert policy.take_identity("alice", second, NOW + LIFE + 2, NOW + 2) == [str(first)]
    assert policy.revoked_peers(NOW + 2) == [first]
    with pytest.raises(IdentityReplaced, match="replaced by a newer login of 'alice' .*1 live identity at once"):
        policy.renew_identity("alice", first, NOW + LIFE + 3, NOW + 3)
    assert policy.renew_identity("alice", second, NOW + LIFE + 100, NOW + 100)  # moved: worth saving
    assert not policy.renew_identity("alice", second, NOW + LIFE + 101, NOW + 101)
    policy.set_max_identities(2, "alice")
    assert policy.take_identity("alice", third, NOW + LIFE + 5, NOW + 5) == []
    assert sorted(policy.identities["alice"]) == sorted([str(second), str(third)])
    assert policy.revoked_peers(NOW + LIFE + 1) == []  # the replaced token expired: off the list
    # later, `first` logs in again: the name's oldest (the least recently renewed) makes room
    assert policy.take_identity("alice", first, NOW + 2 * LIFE, NOW + LIFE + 1) == [str(third)]


def test_a_name_replaces_a_bounded_number_of_identities_per_token_lifetime():
    policy = Policy()
    policy.add_user("alice", "pw")
    for i in range(MAX_REPLACED_PER_NAME + 1):
        policy.take_identity("alice", Identity.generate().peer_id, NOW + i + LIFE, NOW + i)
    with pytest.raises(MembershipError, match=f"replaced {MAX_REPLACED_PER_NAME} of its identities .*--identity"):
        policy.take_identity("alice", Identity.generate().peer_id, NOW + 20 + LIFE, NOW + 20)
    assert len(policy.identities["alice"]) == 1 and len(policy.replaced) == MAX_REPLACED_PER_NAME
    policy.take_identity("alice", Identity.generate().peer_id, NOW + 2 * LIFE, NOW + LIFE + 1)  # later: fine


def test_renewals_of_allowlisted_or_invited_names_are_not_counted():
    policy = Policy()
    policy.add_user("alice", "pw")
    lab = Identity.generate().peer_id
    policy.allow_peer(str(lab), "alice")  # an allowlisted machine that carries the same name
    policy.take_identity("alice", Identity.generate().peer_id, NOW + LIFE, NOW)
    assert not policy.renew_identity("alice", lab, NOW + LIFE, NOW)
    assert not policy.renew_identity("volunteers", Identity.generate().peer_id, NOW + LIFE, NOW)
    with pytest.raises(IdentityReplaced, match="already holds its 1 live identity"):
        policy.renew_identity("alice", Identity.generate().peer_id, NOW + LIFE, NOW)  # a token from before


def test_identities_and_limits_survive_a_restart(tmp_path):
    path = tmp_path / "run.policy"
    policy = Policy()
    policy.add_user("alice", "pw")
    policy.set_max_identities(2, "alice")
    policy.set_max_identities(3)
    a, b, c = (Identity.generate().peer_id for _ in range(3))
    for i, p in enumerate((a, b, c)):
        policy.take_identity("alice", p, NOW + LIFE + i, NOW + i)
    policy.add_user("alice", "new password")  # a reset keeps the user's own limit
    policy.save(path)
    again = Policy.load(path)
    assert (again.max_identities, again.identity_limit("alice"), again.identity_limit("bob")) == (3, 2, 3)
    assert again.revoked_peers(NOW) == [a]
    assert again.identities == policy.identities
    for bad in (0, 2000, "2", True):
        with pytest.raises(PolicyError, match="max_identities"):
            again.set_max_identities(bad)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="no user 'bob'"):
        again.set_max_identities(2, "bob")
    obj = json.loads(path.read_text())
    obj["users"]["alice"]["max_identities"] = -1
    path.write_text(json.dumps(obj))
    with pytest.raises(PolicyError, match="max_identities"):
        Policy.load(path)


def test_the_command_sets_the_bound_for_the_run_and_per_user(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "run.policy")
    monkeypatch.setenv("POTLUCK_PASSWORD", "pw")

    def run(*argv: str) -> None:
        args = build_parser().parse_args(["authority", *argv])
        assert args.run(args) == 0

    run("add-user", "--policy", path, "alice", "--max-identities", "4")
    run("max-identities", "--policy", path, "2")
    run("add-user", "--policy", path, "bob")
    policy = Policy.load(path)
    assert (policy.identity_limit("alice"), policy.identity_limit("bob")) == (4, 2)
    run("max-identities", "--policy", path, "1", "--user", "alice")
    assert Policy.load(path).identity_limit("alice") == 1
    assert "a new login beyond that replaces the oldest" in capsys.readouterr().out
