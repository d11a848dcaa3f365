"""The rules of potluck's own kinds of key, enforced by every node: how long a record may live,
and whether the key holds only owner-signed per-peer entries.

- **Lifetime.** The DHT keeps the later-expiring of two competing records, so a record that asks
  for the DHT's 24-hour maximum outlives every honest re-store written after it: three long-lived
  matchmaking declarations kept every averaging group from forming for a day. Each kind below is
  capped at a few times the lifetime its honest writer uses, so what a squatter (or a
  misconfigured peer) writes is gone soon after.
- **Owned entries only.** Keys that hold one entry per peer (donors, declarations, progress,
  round records, profiles, sweep leases and results) take only subkeys carrying an
  `[owner:<peer id>]` marker, which the DHT accepts only with that peer's signature. A plain
  record or an unsigned subkey is refused: a plain record expiring later than the dictionary
  would displace every entry and block the owners' re-stores for its whole lifetime.

A kind matches the whole key's text: its pattern is built from the template that names those
keys (`potluck.core.names`, where every key of a run is derived from its run id); other keys keep
the DHT-wide `Limits.max_ttl` and any shape. Peer records have their own rules (`dht.peer_records`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from potluck.core import names
from potluck.core.dht_time import Clock
from potluck.core.names import pattern
from potluck.dht.errors import ExpirationTooFar, RecordRejected
from potluck.dht.records import Record, owners_of
from potluck.dht.validation import CLOCK_SKEW_ALLOWANCE

__all__ = ["KEY_KINDS", "KeyKind", "KeyKinds"]


@dataclass(frozen=True)
class KeyKind:
    """Keys whose text matches `pattern` may expire at most `max_ttl` seconds ahead; with
    `owned_entries`, they hold only owner-marked subkeys."""

    name: str
    pattern: re.Pattern[str]
    max_ttl: float
    owned_entries: bool = True


# Matchmaking declarations (`averaging.matchmaking`) live one gathering window, seconds to a
# minute; 10 min is ten of the longest windows potluck uses.
DECLARATION_MAX_TTL = 600.0
# Progress records (`optim.progress`) are re-stored every step and live 3 s (PROGRESS_TTL).
PROGRESS_MAX_TTL = 60.0
# State donor records (`averaging.averager`) live 10 min and are re-announced after every step; an
# hour is six of their lifetimes.
DONOR_MAX_TTL = 3600.0
# Pipeline node profiles live 5 min and cluster layouts 2 min (`pipeline.profiling`, `.layout`).
PIPELINE_MAX_TTL = 1800.0
# Sweep leases live one lease period (30 s by default, `ps.sweep`); readers also ignore leases
# further ahead than a few periods. Results live 20 h: the DHT's own 24 h cap applies.
LEASE_MAX_TTL = 3600.0
RESULT_MAX_TTL = 24 * 3600.0
# Relay announcements (`nat.relays`) live 10 min and are re-stored every third of it.
RELAY_MAX_TTL = 3600.0
# Shard server announcements (`ps.discovery`) live 30 s and are renewed every 10 s; ten minutes
# is twenty of their lifetimes.
PS_SERVERS_MAX_TTL = 600.0
# Round records (`optim.progress.RoundRecord`, for monitors) live a minute (ROUNDS_TTL) and are
# re-stored after every round; ten minutes is ten of their lifetimes.
ROUNDS_MAX_TTL = 600.0
# Keys whose matching kinds a node remembers (every record stored or read is checked, and a
# run's few keys recur): at most MAX_KEY_BYTES (1 KiB) each, so a few MiB at most.
KINDS_OF_KEYS_CACHED = 4096

KEY_KINDS: tuple[KeyKind, ...] = (
    KeyKind("matchmaking declarations", pattern(names.DECLARATIONS), DECLARATION_MAX_TTL),
    KeyKind("progress records", pattern(names.PROGRESS), PROGRESS_MAX_TTL),
    KeyKind("state donor records", pattern(names.DONORS), DONOR_MAX_TTL),
    KeyKind("pipeline profiles", pattern(names.PIPELINE_PROFILES), PIPELINE_MAX_TTL),
    KeyKind("pipeline layouts", pattern(names.PIPELINE_LAYOUT), PIPELINE_MAX_TTL),
    KeyKind("pipeline plans", pattern(names.PIPELINE_PLAN), PIPELINE_MAX_TTL),
    KeyKind("sweep leases", pattern(names.SWEEP_LEASES), LEASE_MAX_TTL),
    KeyKind("sweep results", pattern(names.SWEEP_RESULTS), RESULT_MAX_TTL),
    KeyKind("relay announcements", pattern(names.RELAYS), RELAY_MAX_TTL),
    KeyKind("shard server announcements", pattern(names.PS_SERVERS), PS_SERVERS_MAX_TTL),
    KeyKind("round records", pattern(names.ROUNDS), ROUNDS_MAX_TTL),
)


class KeyKinds:
    """A `RecordValidator` applying `KEY_KINDS` (expirations with `CLOCK_SKEW_ALLOWANCE`, as for
    every expiration a node checks)."""

    def __init__(self, clock: Clock, kinds: tuple[KeyKind, ...] = KEY_KINDS):
        self.clock = clock
        self.kinds = kinds
        self._kinds_of: dict[str, tuple[KeyKind, ...]] = {}  # key -> the kinds it matches
        # Whether a key matches any kind, in one search (most keys match none).
        self._any = re.compile("|".join(f"(?:{kind.pattern.pattern})" for kind in kinds))

    def validate(self, record: Record, value: Any) -> None:
        if not isinstance(record.key, str):
            return
        for kind in self._matching(record.key):
            if kind.owned_entries and (record.subkey is None or owners_of("", record.subkey) is None):
                raise RecordRejected(f"{kind.name} ({record.key!r:.80}) hold only owner-signed entries: "
                                     "store under own_subkey(your peer id)")
            ahead = record.expiration_time - self.clock()
            if ahead > kind.max_ttl + CLOCK_SKEW_ALLOWANCE:
                raise ExpirationTooFar(
                    f"{kind.name} may live at most {kind.max_ttl:.0f} s; this one asks for {ahead:.0f} s "
                    f"({record.key!r:.80}): re-store it before it expires instead")

    def _matching(self, key: str) -> tuple[KeyKind, ...]:
        """The kinds `key` matches, searched once per key (oldest forgotten first past
        KINDS_OF_KEYS_CACHED)."""
        kinds = self._kinds_of.get(key)
        if kinds is None:
            kinds = () if self._any.search(key) is None else tuple(
                kind for kind in self.kinds if kind.pattern.search(key) is not None)
            if len(self._kinds_of) >= KINDS_OF_KEYS_CACHED:
                del self._kinds_of[next(iter(self._kinds_of))]
            self._kinds_of[key] = kinds
        return kinds
