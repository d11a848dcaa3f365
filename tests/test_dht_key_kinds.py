"""The rules of potluck's kinds of key (`dht.key_kinds`) must match the keys the protocols really
write, leave room for the lifetimes their honest writers use, and refuse what breaks them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from potluck.averaging.averager import STATE_RECORD_TTL
from potluck.averaging.matchmaking import Matchmaker
from potluck.core.names import RunNames
from potluck.core.serialization import dumps
from potluck.dht import ExpirationTooFar, RecordRejected
from potluck.dht.key_kinds import KEY_KINDS, KeyKinds
from potluck.dht.records import Record, own_subkey
from potluck.dht.validation import CLOCK_SKEW_ALLOWANCE
from potluck.net.identity import Identity
from potluck.optim.progress import PROGRESS_TTL, ROUNDS_TTL, ProgressTracker
from potluck.pipeline.layout import LAYOUT_TTL, LayoutDirectory
from potluck.pipeline.planning import PLAN_TTL
from potluck.pipeline.profiling import PROFILE_TTL
from potluck.ps.discovery import ANNOUNCE_TTL
from potluck.ps.sweep import LEASE_SECONDS, RESULT_TTL

NOW = 1000.0
LONGEST_MATCHMAKING_WINDOW = 60.0


def rules_for(key: str) -> list:
    return [r for r in KEY_KINDS if r.pattern.search(key)]


def test_every_rule_matches_the_key_its_protocol_writes_and_fits_its_honest_lifetime():
    matchmaker = Matchmaker.__new__(Matchmaker)  # only its key builder is used
    matchmaker.names = RunNames("run").averager("grads")
    progress = ProgressTracker(None, SimpleNamespace(add_handler=lambda *a: None), "run", Identity.generate().peer_id, 1)
    layouts = LayoutDirectory(SimpleNamespace(dht=None), "run")
    writers = {
        matchmaker._dht_key("0"): LONGEST_MATCHMAKING_WINDOW,
        progress.key: PROGRESS_TTL,
        RunNames("run").averager("state").donors: STATE_RECORD_TTL,
        RunNames("run").pipeline.profiles: PROFILE_TTL,
        layouts.key: LAYOUT_TTL,
        RunNames("run").pipeline.plan: PLAN_TTL,
        RunNames("run").sweep_leases("abc"): LEASE_SECONDS,
        RunNames("run").sweep_results("abc"): RESULT_TTL,
        RunNames("run").ps_servers: ANNOUNCE_TTL,
        progress.rounds_key: ROUNDS_TTL,
    }
    for key, ttl in writers.items():
        [rule] = rules_for(key)
        assert rule.max_ttl >= min(4 * ttl, 24 * 3600.0), key
    for other in ("run", "expert.3.14", "bench/7", "_peer.x", "matchmaking", "run.states", "run.progress.x",
                  "sweep.s.leases", "run.state", "r.match.g"):
        assert rules_for(other) == [], other


KEY_OF = {"matchmaking declarations": "r.avg.a.match.g", "progress records": "r.progress", "state donor records": "r.avg.a.donors",
          "pipeline profiles": "r.pipeline.profiles", "pipeline layouts": "r.pipeline.layout",
          "pipeline plans": "r.pipeline.plan",
          "sweep leases": "r.sweep.s.leases", "sweep results": "r.sweep.s.results", "relay announcements": "nat.relays",
          "shard server announcements": "r.ps.servers", "round records": "r.rounds"}


@pytest.mark.parametrize("rule", KEY_KINDS, ids=lambda r: r.name)
def test_a_record_past_its_kinds_lifetime_is_refused_and_one_within_is_not(rule):
    key, subkey = KEY_OF[rule.name], own_subkey(Identity.generate().peer_id)
    check = KeyKinds(lambda: NOW)
    check.validate(Record(key, subkey, dumps(1), NOW + rule.max_ttl + CLOCK_SKEW_ALLOWANCE), 1)
    with pytest.raises(ExpirationTooFar, match=f"{rule.name} may live at most"):
        check.validate(Record(key, subkey, dumps(1), NOW + rule.max_ttl + CLOCK_SKEW_ALLOWANCE + 1), 1)


@pytest.mark.parametrize("rule", [r for r in KEY_KINDS if r.owned_entries], ids=lambda r: r.name)
def test_per_peer_kinds_take_only_owner_marked_entries(rule):
    key, peer = KEY_OF[rule.name], Identity.generate().peer_id
    check = KeyKinds(lambda: NOW)
    for subkey in (None, str(peer), 7, b"x"):
        with pytest.raises(RecordRejected, match="only owner-signed entries"):
            check.validate(Record(key, subkey, dumps(1), NOW + 1), 1)
    check.validate(Record(key, f"3{own_subkey(peer)}", dumps(1), NOW + 1), 1)
