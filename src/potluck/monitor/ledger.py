"""The contribution ledger: what a monitor saw of a run, in one SQLite file that survives restarts.

A monitor (`potluck.monitor.follower`) hands the ledger what it reads from the DHT every poll:
the peers' progress records and their round records (`potluck.optim.progress.RoundRecord`). The
ledger keeps peers, their credit per epoch, epochs, metrics and the swarm's history, and answers
the `MonitorView` queries of the dashboard and the CLI.

**Credit.** A peer is credited for an epoch with the samples it was really averaged with, as its
group's members recorded them (the samples its round note gave the group, which scaled the
group's update), never with what it says of itself. Records are free to make up (two identities
that record each other look like an honest pair), so the monitor credits what its *witnesses*
recorded (`witnesses`: by default the peers it joined through, `potluck.monitor.follower`): only
rounds a witness recorded count, each member with the samples the witnesses' records give it,
and a short round's keeper is the one they name. An identity is then credited only for rounds it
averaged in with a witness, with what its note gave that group. docs/security.md states the bound.

Without witnesses (a ledger given none), every member's records count, one vote each: a peer is
credited with the lower median of the *other* members' records of it and its own, never more
than the highest of theirs nor than its own; only members that list each other count (when the
peer published a record of that round; if it did not, at least MIN_WITNESSES_WITHOUT_RECORD
others must record it). A claim nobody else confirms earns nothing, but identities that record
each other credit each other anything. Either way, a short round's samples (sync mode: the round
did not fill the batch) are credited to their members and taken off the member that carried
their sum into the epoch's next round (its note there includes them): its *keeper*, a confirmed
member that a strict majority of the round's confirmed members name, or that names itself
(against its own interest); one liar naming another member takes nothing from it.

A peer that a witness caught lying in verified training (`potluck.optim.verified`: the witness
recomputed its gradients, or checked the evidence itself) is credited nothing, in any epoch:
its credits so far are taken back when the witness's word comes.

Anyone can publish progress and round records under made-up ids, so what the ledger keeps of
strangers is bounded: with witnesses, only their round records are stored (nothing else is
credited or counted); and past MAX_PEERS peers, those never credited that were seen least
recently are forgotten, with their metrics and failure counts.

Rounds are told apart by epoch, part and the id their members record them under (moshpit
members meet whatever their epochs, and record the group's median). Writes are idempotent (keyed
by reporter, epoch, part, round id, member; metrics by peer, epoch, name and the report's time):
a record read twice, or again after a restart, changes nothing. Every query is bounded, and what
is kept grows with the epochs and the peers, not with the polls: a metric is each peer's sum and
count of reports per epoch.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from potluck.core.errors import PotluckError
from potluck.monitor.views import Contributor, EpochRow, HistoryPoint, PeerState, SwarmNow
from potluck.optim.progress import PeerProgress, RoundRecord

# The database layout this code writes (`PRAGMA user_version`); a file with a newer one is refused
# (an older potluck would misread it), an older one would be migrated here.
SCHEMA_VERSION = 2
# Schema 1 kept a row per metric per report (every poll whose report was new): with peers that
# report every step, about 2 GB a day for 50 peers; 2 keeps each peer's sum and count per epoch.
_MIGRATE_1_TO_2 = """
CREATE TABLE metrics_2 (
    peer_id TEXT NOT NULL, epoch INTEGER NOT NULL, name TEXT NOT NULL, total REAL NOT NULL, count INTEGER NOT NULL,
    time REAL NOT NULL, PRIMARY KEY (peer_id, epoch, name));
INSERT INTO metrics_2 SELECT peer_id, epoch, name, SUM(value), COUNT(*), MAX(time) FROM metrics
    GROUP BY peer_id, epoch, name;
DROP TABLE metrics;
ALTER TABLE metrics_2 RENAME TO metrics;
"""
# Rows one query returns at most: the dashboard and the CLI show a run's peers, contributors and
# recent epochs; a run with more peers than this shows the top ones.
MAX_ROWS = 10_000
# History points one query returns at most (the newest): a day at HISTORY_INTERVAL is 17,280, a
# chart needs far fewer.
MAX_HISTORY_POINTS = 2_000
# The swarm is sampled into the history at most this often (seconds): a point every few seconds
# draws a smooth chart and grows the file by about a megabyte a day.
HISTORY_INTERVAL = 5.0
# A peer seen in two polls at most this far apart (seconds) was online in between; a longer gap
# (it left, or the monitor was down) adds nothing to its online time.
MAX_ONLINE_GAP = 10.0
# A member that published no record of a round (it died right after it, or never existed: a name
# a liar made up) is credited only if this many other members record it: one liar alone cannot
# credit a peer of its invention.
MIN_WITNESSES_WITHOUT_RECORD = 2
# Peers kept at most: past it, peers never credited are forgotten, least recently seen first.
# Made-up ids reporting progress (2,000 new ones a poll: about 9 MiB) otherwise grew the file
# without end; a real run's peers are credited within an epoch of joining, and stay.
MAX_PEERS = 10_000
# Distinct metric names shown per epoch at most (a peer publishes at most MAX_METRICS at a time,
# but may change names over time).
MAX_METRIC_NAMES = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, name TEXT, first_seen REAL NOT NULL, last_seen REAL NOT NULL,
    client_mode INTEGER NOT NULL DEFAULT 0, epoch INTEGER NOT NULL DEFAULT 0, sps REAL NOT NULL DEFAULT 0,
    online_seconds REAL NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS rounds (
    reporter TEXT NOT NULL, epoch INTEGER NOT NULL, part INTEGER NOT NULL, round TEXT NOT NULL, keeper TEXT,
    time REAL NOT NULL, PRIMARY KEY (reporter, epoch, part, round));
CREATE TABLE IF NOT EXISTS confirmations (
    reporter TEXT NOT NULL, epoch INTEGER NOT NULL, part INTEGER NOT NULL, round TEXT NOT NULL, member TEXT NOT NULL,
    samples INTEGER NOT NULL, PRIMARY KEY (reporter, epoch, part, round, member));
CREATE TABLE IF NOT EXISTS credits (
    peer_id TEXT NOT NULL, epoch INTEGER NOT NULL, samples INTEGER NOT NULL, PRIMARY KEY (peer_id, epoch));
CREATE INDEX IF NOT EXISTS credits_by_epoch ON credits (epoch);
CREATE TABLE IF NOT EXISTS epochs (
    epoch INTEGER PRIMARY KEY, time REAL NOT NULL, samples INTEGER NOT NULL DEFAULT 0,
    group_sizes TEXT NOT NULL DEFAULT '[]', failed_rounds INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS failures (
    peer_id TEXT NOT NULL, epoch INTEGER NOT NULL, count INTEGER NOT NULL, PRIMARY KEY (peer_id, epoch));
CREATE TABLE IF NOT EXISTS metrics (
    peer_id TEXT NOT NULL, epoch INTEGER NOT NULL, name TEXT NOT NULL, total REAL NOT NULL, count INTEGER NOT NULL,
    time REAL NOT NULL, PRIMARY KEY (peer_id, epoch, name));
CREATE INDEX IF NOT EXISTS metrics_by_epoch ON metrics (epoch);
CREATE TABLE IF NOT EXISTS caught (
    peer_id TEXT NOT NULL, reporter TEXT NOT NULL, time REAL NOT NULL, PRIMARY KEY (peer_id, reporter));
CREATE TABLE IF NOT EXISTS history (
    time REAL PRIMARY KEY, epoch INTEGER NOT NULL, peers_online INTEGER NOT NULL, sps REAL NOT NULL, loss REAL);
"""


class LedgerError(PotluckError):
    """The database cannot be used (e.g. a newer potluck wrote it)."""


@dataclass(frozen=True)
class Round:
    """One member's record of one round (`reporter` says: these `members` had these samples)."""

    reporter: str
    part: int
    round: str  # the id its members record it under
    keeper: str | None
    members: Mapping[str, int]


def credit_epoch(rounds: Iterable[Round], witnesses: Collection[str] | None = None) -> dict[str, int]:
    """Each peer's credit for one epoch from its members' records (see the module docstring).
    With `witnesses`: only rounds a witness recorded count, each member credited with what the
    witnesses recorded for it. Without: in each round, the lower median of the others' records of
    it and its own (one vote), at most the highest other record and its own."""
    by_round: dict[tuple[int, str], dict[str, Round]] = defaultdict(dict)
    for r in rounds:
        by_round[r.part, r.round][r.reporter] = r
    credit: dict[str, int] = defaultdict(int)
    for records in by_round.values():
        if witnesses is None:
            confirmed = _confirmed(records)
            keeper = _keeper(records, confirmed)
        else:
            told = [r for reporter, r in records.items() if reporter in witnesses]
            confirmed = {peer: _lower_median([r.members[peer] for r in told if peer in r.members])
                         for peer in {m for r in told for m in r.members}}
            keeper = _most_said([r.keeper for r in told], confirmed)
        for peer, samples in confirmed.items():
            credit[peer] += samples
        if keeper is not None:  # a short round: its keeper's next note includes all of it
            credit[keeper] -= sum(confirmed.values())
    return {peer: max(0, samples) for peer, samples in credit.items()}


def _confirmed(records: Mapping[str, Round]) -> dict[str, int]:
    """A round's members that others confirm, each with its credit (the rule without witnesses)."""
    confirmed = {}
    for peer in {m for r in records.values() for m in r.members}:
        own = records.get(peer)
        claim = None if own is None else own.members.get(peer)
        votes = [r.members[peer] for reporter, r in records.items()
                 if reporter != peer and peer in r.members and (own is None or reporter in own.members)]
        if not votes or (own is None and len(votes) < MIN_WITNESSES_WITHOUT_RECORD):
            continue  # nobody else confirms it
        most = max(votes) if claim is None else min(max(votes), claim)
        confirmed[peer] = min(_lower_median(votes if claim is None else [*votes, claim]), most)
    return confirmed


def _keeper(records: Mapping[str, Round], confirmed: Mapping[str, int]) -> str | None:
    """A short round's keeper, the member whose credit its samples are taken off: a confirmed
    member that a strict majority of the confirmed members' records name, else one whose own
    record names itself (against its own interest: never another's word alone). None if neither."""
    said = [records[peer].keeper for peer in confirmed if peer in records]
    keeper = _most_said(said, confirmed)
    if keeper is not None:
        return keeper
    own = [peer for peer in confirmed if peer in records and records[peer].keeper == peer]
    return own[0] if len(own) == 1 else None


def _most_said(said: list[str | None], members: Collection[str]) -> str | None:
    """The keeper a strict majority of `said` names, if it is one of `members`."""
    for keeper in set(said) - {None}:
        if 2 * said.count(keeper) > len(said) and keeper in members:
            return keeper
    return None


def group_sizes(rounds: Iterable[Round], witnesses: Collection[str] | None = None) -> list[int]:
    """The sizes of the groups of an epoch's rounds: those a witness recorded (with `witnesses`),
    else those that at least two of their members recorded alike."""
    rounds = list(rounds)
    if witnesses is not None:
        told = {(r.part, r.round): frozenset(r.members) for r in rounds if r.reporter in witnesses}
        return sorted((len(members) for members in told.values()), reverse=True)
    groups = Counter((r.part, r.round, frozenset(r.members)) for r in rounds if r.reporter in r.members)
    return sorted((len(members) for (_, _, members), count in groups.items() if count >= 2), reverse=True)


def _lower_median(values: list[int]) -> int:
    """The median, or the lower of the two middle values: a minority's high claims cannot raise it."""
    return sorted(values)[(len(values) - 1) // 2]


class Ledger:
    """The monitor's database at `path` (":memory:" for a throwaway one, as `potluck status` uses).
    Implements `potluck.monitor.views.MonitorView`; safe to call from several threads."""

    def __init__(self, path: str | Path, run_id: str | None = None, history_interval: float = HISTORY_INTERVAL,
                 witnesses: Collection[str] | None = None):
        self.path = str(path)
        self.history_interval = history_interval
        # Whose round records are the truth (see credit_epoch); None: every member's, each one vote.
        self.witnesses = None if witnesses is None else frozenset(witnesses)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        try:
            self._open(run_id)
        except BaseException:
            self._db.close()
            raise
        self._now: SwarmNow | None = None  # the last poll's view (see observe)
        self._online: set[str] = set()  # peers with a current progress record at the last poll
        self._last_history = self._scalar("SELECT MAX(time) FROM history") or 0.0

    def _open(self, run_id: str | None) -> None:
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise LedgerError(f"{self.path} is not a potluck monitor database ({e}); give --db another file") from None
        if version > SCHEMA_VERSION:
            raise LedgerError(f"{self.path} was written by a newer potluck (ledger schema {version}; this one reads "
                              f"up to {SCHEMA_VERSION}): upgrade potluck, or give --db another file")
        self._db.execute("PRAGMA journal_mode=WAL")  # readers (the web page) never wait for a poll's write
        with self._db:
            if version == 1:
                self._db.executescript(_MIGRATE_1_TO_2)
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        stored = self._scalar("SELECT value FROM meta WHERE key = 'run_id'")
        if run_id is not None and stored is not None and stored != run_id:
            raise LedgerError(f"{self.path} holds the ledger of run {stored!r}, not {run_id!r}: give --db another file")
        if run_id is not None and stored is None:
            with self._db:
                self._db.execute("INSERT INTO meta VALUES ('run_id', ?)", (run_id,))
        self.run_id = run_id if run_id is not None else stored or ""

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scalar(self, sql: str, args: tuple = ()) -> object:
        row = self._db.execute(sql, args).fetchone()
        return None if row is None else row[0]

    # -- writes (one transaction per poll) ----------------------------------------------------------
    def observe(self, now: float, reports: Mapping[str, PeerProgress], rounds: Mapping[str, Iterable[RoundRecord]],
                swarm: SwarmNow | None = None, names: Mapping[str, str] | None = None,
                witnesses: Collection[str] | None = None, caught: Mapping[str, Iterable[str]] | None = None) -> None:
        """One poll: the current progress `reports` (by peer), the round records each peer
        published (by signer), the swarm's view then, the members' verified `names`, the
        `witnesses` whose records are the truth from now on (None: those given before), and the
        peers each signer caught lying in verified training (`caught`: a witness's word removes
        a peer's credit, in every epoch)."""
        names = names or {}
        if witnesses is not None:
            self.witnesses = frozenset(witnesses)
        with self._lock, self._db:
            db = self._db
            for peer, r in reports.items():
                self._see_peer(now, r, names.get(peer))
            touched = set()
            for reporter, peers in (caught or {}).items():
                if self.witnesses is None or reporter not in self.witnesses:
                    continue  # anyone can name anyone: only a witness's word counts
                for peer in peers:
                    if db.execute("INSERT OR IGNORE INTO caught VALUES (?, ?, ?)", (peer, reporter, now)).rowcount:
                        touched.update(e for (e,) in db.execute("SELECT epoch FROM credits WHERE peer_id = ?", (peer,)))
            for reporter, records in rounds.items():
                if self.witnesses is not None and reporter not in self.witnesses:
                    continue  # only witnesses' records are credited or counted
                for record in records:
                    if self._add_round(reporter, record, now):
                        touched.add(record.epoch)
            for epoch in sorted(touched):
                self._settle(epoch, now)
            for peer, name in names.items():
                db.execute("UPDATE peers SET name = ? WHERE peer_id = ?", (name, peer))
            self._forget_strangers()
            if swarm is not None and now - self._last_history >= self.history_interval:
                losses = [v for r in reports.values() for k, v in r.metrics if k == "loss"]
                db.execute("INSERT OR IGNORE INTO history VALUES (?, ?, ?, ?, ?)",
                           (now, swarm.epoch, swarm.peers_online, swarm.samples_per_second,
                            sum(losses) / len(losses) if losses else None))
                self._last_history = now
        self._now, self._online = swarm, set(reports)

    def _see_peer(self, now: float, r: PeerProgress, name: str | None) -> None:
        db = self._db
        old = db.execute("SELECT failed FROM peers WHERE peer_id = ?", (r.peer_id,)).fetchone()
        db.execute("""
            INSERT INTO peers (peer_id, name, first_seen, last_seen, client_mode, epoch, sps, failed)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (peer_id) DO UPDATE SET
                online_seconds = online_seconds + CASE WHEN excluded.last_seen - last_seen BETWEEN 0 AND ?
                                                      THEN excluded.last_seen - last_seen ELSE 0 END,
                last_seen = excluded.last_seen, client_mode = excluded.client_mode, epoch = excluded.epoch,
                sps = excluded.sps, failed = excluded.failed""",
                   (r.peer_id, name, now, now, int(r.client_mode), r.epoch, r.samples_per_second, r.failed,
                    MAX_ONLINE_GAP))
        failed = r.failed - (old[0] if old is not None else r.failed)  # a restarted peer counts from 0 again
        if failed > 0:
            db.execute("""INSERT INTO failures VALUES (?, ?, ?)
                          ON CONFLICT (peer_id, epoch) DO UPDATE SET count = count + excluded.count""",
                       (r.peer_id, r.epoch, failed))
            counts = [c for (c,) in db.execute("SELECT count FROM failures WHERE epoch = ? LIMIT ?",
                                              (r.epoch, MAX_ROWS))]
            db.execute("INSERT OR IGNORE INTO epochs (epoch, time) VALUES (?, ?)", (r.epoch, now))
            db.execute("UPDATE epochs SET failed_rounds = ? WHERE epoch = ?", (_lower_median(counts), r.epoch))
        for metric, value in r.metrics:  # a report read again (the same time) adds nothing
            db.execute("""INSERT INTO metrics VALUES (?, ?, ?, ?, 1, ?)
                          ON CONFLICT (peer_id, epoch, name) DO UPDATE SET total = total + excluded.total,
                              count = count + 1, time = excluded.time WHERE excluded.time > metrics.time""",
                       (r.peer_id, r.epoch, metric, value, r.metrics_time))

    def _forget_strangers(self) -> None:
        """Past MAX_PEERS peers, forget those never credited, least recently seen first."""
        db = self._db
        extra = int(self._scalar("SELECT COUNT(*) FROM peers")) - MAX_PEERS  # type: ignore[arg-type]
        if extra <= 0:
            return
        gone = [(p,) for (p,) in db.execute("""SELECT peer_id FROM peers WHERE peer_id NOT IN
                                               (SELECT peer_id FROM credits WHERE samples > 0)
                                               ORDER BY last_seen, peer_id LIMIT ?""", (extra,))]
        for table in ("peers", "metrics", "failures", "credits"):
            db.executemany(f"DELETE FROM {table} WHERE peer_id = ?", gone)

    def _add_round(self, reporter: str, record: RoundRecord, now: float) -> bool:
        """Store `reporter`'s record of a round; False if it was stored already (read again)."""
        added = self._db.execute("INSERT OR IGNORE INTO rounds VALUES (?, ?, ?, ?, ?, ?)",
                                 (reporter, record.epoch, record.part, record.round, record.keeper, now)).rowcount
        if added:
            self._db.executemany("INSERT OR IGNORE INTO confirmations VALUES (?, ?, ?, ?, ?, ?)",
                                 [(reporter, record.epoch, record.part, record.round, m, n) for m, n in record.samples])
        return bool(added)

    def _settle(self, epoch: int, now: float) -> None:
        """Recompute `epoch`'s credits and groups from every record of it stored so far."""
        db = self._db
        members: dict[tuple[str, int, str], dict[str, int]] = defaultdict(dict)
        for reporter, part, round_id, member, samples in db.execute(
                "SELECT reporter, part, round, member, samples FROM confirmations WHERE epoch = ?", (epoch,)):
            members[reporter, part, round_id][member] = samples
        rounds = [Round(reporter, part, round_id, keeper, members[reporter, part, round_id])
                  for reporter, part, round_id, keeper in
                  db.execute("SELECT reporter, part, round, keeper FROM rounds WHERE epoch = ?", (epoch,))]
        credit = credit_epoch(rounds, self.witnesses)
        if self.witnesses is not None:
            liars = {p for p, reporter in db.execute("SELECT peer_id, reporter FROM caught LIMIT ?", (MAX_ROWS,))
                     if reporter in self.witnesses}
            credit = {p: n for p, n in credit.items() if p not in liars}
        db.execute("DELETE FROM credits WHERE epoch = ?", (epoch,))
        db.executemany("INSERT INTO credits VALUES (?, ?, ?)", [(p, epoch, n) for p, n in credit.items()])
        db.executemany("INSERT OR IGNORE INTO peers (peer_id, first_seen, last_seen) VALUES (?, ?, ?)",
                       [(p, now, now) for p in credit])
        db.execute("INSERT OR IGNORE INTO epochs (epoch, time) VALUES (?, ?)", (epoch, now))
        db.execute("UPDATE epochs SET samples = ?, group_sizes = ? WHERE epoch = ?",
                   (sum(credit.values()), json.dumps(group_sizes(rounds, self.witnesses)), epoch))

    # -- MonitorView ------------------------------------------------------------------------------------
    def swarm_now(self) -> SwarmNow:
        if self._now is not None:
            return self._now
        with self._lock:  # before the first poll (e.g. just restarted): the last epoch known, nobody online
            epoch = self._scalar("SELECT MAX(epoch) FROM epochs") or 0
            time = self._scalar("SELECT MAX(last_seen) FROM peers") or 0.0
        return SwarmNow(self.run_id, float(time), 0, 0.0, int(epoch), 0, None, None)

    def peers(self) -> list[PeerState]:
        with self._lock:
            rows = self._db.execute("""SELECT peer_id, name, epoch, sps, client_mode, first_seen, last_seen
                                       FROM peers ORDER BY last_seen DESC, peer_id LIMIT ?""", (MAX_ROWS,)).fetchall()
        online = self._online
        return [PeerState(p, name, p in online, epoch, sps if p in online else 0.0, bool(client), first, last)
                for p, name, epoch, sps, client, first, last in rows]

    def contributors(self) -> list[Contributor]:
        with self._lock:
            total = self._scalar("SELECT SUM(samples) FROM credits") or 0
            rows = self._db.execute("""
                SELECT p.peer_id, p.name, COALESCE(SUM(c.samples), 0) AS credited, COUNT(c.epoch), p.online_seconds
                FROM peers p LEFT JOIN credits c ON c.peer_id = p.peer_id AND c.samples > 0
                GROUP BY p.peer_id ORDER BY credited DESC, p.peer_id LIMIT ?""", (MAX_ROWS,)).fetchall()
        return [Contributor(p, name, samples, seconds / 3600, samples / total if total else 0.0, epochs)
                for p, name, samples, epochs, seconds in rows]

    def epochs(self, limit: int = 100) -> list[EpochRow]:
        with self._lock:
            rows = self._db.execute("""SELECT epoch, time, samples, group_sizes, failed_rounds FROM epochs
                                       ORDER BY epoch DESC LIMIT ?""", (max(0, min(limit, MAX_ROWS)),)).fetchall()
            metrics = {epoch: dict(self._db.execute(
                "SELECT name, SUM(total) / SUM(count) FROM metrics WHERE epoch = ? GROUP BY name ORDER BY name LIMIT ?",
                (epoch, MAX_METRIC_NAMES)).fetchall()) for epoch, *_ in rows}
        return [EpochRow(epoch, time, samples, tuple(json.loads(groups)), failed, metrics[epoch])
                for epoch, time, samples, groups, failed in rows]

    def history(self, since: float | None = None) -> list[HistoryPoint]:
        with self._lock:
            rows = self._db.execute("""SELECT time, epoch, peers_online, sps, loss FROM history WHERE time > ?
                                       ORDER BY time DESC LIMIT ?""",
                                    (-1.0 if since is None else since, MAX_HISTORY_POINTS)).fetchall()
        return [HistoryPoint(*row) for row in reversed(rows)]

    # -- beyond MonitorView -----------------------------------------------------------------------------
    def credits(self, epoch: int | None = None) -> dict[str, int]:
        """Samples credited to each peer, in `epoch` or (None) in all epochs."""
        with self._lock:
            if epoch is None:
                rows = self._db.execute("SELECT peer_id, SUM(samples) FROM credits GROUP BY peer_id LIMIT ?",
                                        (MAX_ROWS,))
            else:
                rows = self._db.execute("SELECT peer_id, samples FROM credits WHERE epoch = ? LIMIT ?",
                                        (epoch, MAX_ROWS))
            return dict(rows.fetchall())
