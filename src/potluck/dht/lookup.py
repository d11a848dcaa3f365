"""The iterative lookup as a state machine: which peers to ask next, and when it is done.

No I/O: a driver (`DHTNode`) asks `next_requests()`, sends them, and feeds back `on_response` /
`on_failure`. One `Lookup` serves several targets at once (`get_many`, `store_many`): a peer that
is among the next to ask for several targets gets one request that names them all.

Per target (Kademlia, section 2.3): keep the candidates sorted by XOR distance; keep up to
`alpha` requests in flight among the `k` closest not-yet-failed candidates; the target is done
when each of its `k` closest live candidates has answered, or, when `stop_on_value`, as soon as
one answered with records. A request the driver reports as slow (`on_slow`) stops holding one
of the alpha slots and stops counting among the closest, but its answer is still used if it
comes. Each candidate remembers its hop count: 1 for peers from our own routing table, and one
more than the peer that told us about it.

Made-up contacts: ids are free, so a hostile answerer can name dozens of contacts ground close to
the target, at an address that never answers; each held a slot until the driver gave up on it
(SLOW_AFTER), so one such answerer made every lookup of an 8-node swarm take 22 s, not 0.03 s.
So a lookup takes at most k contacts from one answer, remembers who named each candidate, and
stops trusting an answerer whose contacts, named by nobody else, keep failing (constants below).

Who named a candidate is counted by network origin, not by id ("voices"): ids are free, so several
hostile ids on one host that all named the same made-up contacts vouched for each other and were
never discredited (in a 40-node swarm, stores and gets took 7 s with 3 such ids, up to 15 s with 6
naming contacts in pairs). The driver gives each answerer's subnet (`on_response(subnet=...)`): all
answerers of one subnet are one voice, whose contacts count as corroborated only once another
voice names them too, and whose failed introductions count together, so past
MAX_FAILED_INTRODUCTIONS the lookup ignores what only that subnet named, however many ids it has
(1.1 s in the swarm above). An answerer with no subnet (None: our own network, loopback or private
addresses, where a lab or a test swarm shares one host; or an origin the transport cannot tell) is
a voice of its own, as every answerer was before. The cost falls on honest peers that share one
public subnet: they too are one voice, so two fresh dead peers that only they named end the
lookup's interest in what only they name (it still asks what our table or other subnets named).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from potluck.core.bounded import drop_oldest
from potluck.dht.records import Record
from potluck.net.identity import PeerID

__all__ = ["Answer", "Backoff", "Lookup", "TargetResult"]

# Unresponsive peers are put aside for BACKOFF_BASE * 2^(failures - 1) seconds: one missed
# answer costs a few seconds, a dead peer is soon asked only every few minutes.
BACKOFF_BASE = 5.0
BACKOFF_MAX = 300.0
# Peers whose backoff is tracked; beyond this the oldest records are forgotten (bounded memory).
MAX_TRACKED_PEERS = 10_000

# Contacts a lookup takes from one answer about one target: the k (bucket size) closest. An honest
# node names at most its k closest; the protocol lets a hostile one name 64 (MAX_PEERS_PER_ID).
# After this many of the contacts an answerer introduced failed or went slow while nobody else had
# named them, the lookup ignores what only that answerer named (in flight or waiting): made-up
# contacts are fresh ids no one else knows, while an honest table's dead peers are mostly known to
# several answerers (and once failed, they sit in backoff and are not asked). Two made-up contacts
# then cost a lookup one SLOW_AFTER (1 s), not one per contact.
# Failed introductions are counted per voice (an answerer's subnet, see the module docstring), so a
# host's many ids together get these two.
MAX_FAILED_INTRODUCTIONS = 2
# Peers one lookup asks about one target, in k's: an honest lookup asks its k closest and a few
# more on the way (k = 20: at most 32 in an emulated 1,000-peer swarm, 39 in a 300-peer one with
# 30% of peers silent); a chain of hostile answerers naming new contacts is cut here (and by the
# deadline).
MAX_ASKED_IN_KS = 4

_WAITING, _ASKING, _ANSWERED, _FAILED, _SLOW = range(5)

# Who named a candidate: an answerer's subnet (str), the node id (int) of an answerer that counts on
# its own, or None for our own routing table.
_Voice = str | int | None


@dataclass
class Answer:
    """What one peer said about one target: peers closer to it, and records it holds."""

    nearest: list[tuple[PeerID, int]]  # (peer id, node id)
    records: list[Record] = field(default_factory=list)


@dataclass
class TargetResult:
    """Everything a lookup learned about one target."""

    target: int
    nearest: list[PeerID]  # peers that answered, closest first
    records: list[tuple[PeerID, list[Record]]]  # (who answered, what it holds), in arrival order
    hops: int | None  # hop count of the first peer that answered with records
    without_value: list[PeerID]  # peers that answered without records, closest first


class _Target:
    """Per-target state, keyed by node id (ints hash much faster than PeerIDs)."""

    __slots__ = ("asked", "done", "found_hops", "hops", "records", "state", "target")

    def __init__(self, target: int):
        self.target = target
        self.state: dict[int, int] = {}  # node id -> _WAITING / _ASKING / _ANSWERED / _FAILED
        self.hops: dict[int, int] = {}
        self.records: list[tuple[PeerID, list[Record]]] = []
        self.found_hops: int | None = None
        self.done = False
        self.asked = 0  # requests sent about it (MAX_ASKED_IN_KS)


class Lookup:
    """Iterative parallel lookup of several target ids (see the module docstring)."""

    def __init__(self, seeds: Mapping[int, Iterable[tuple[PeerID, int]]], *, k: int, alpha: int,
                 stop_on_value: bool, self_id: int | None = None,
                 usable: Callable[[PeerID], bool] = lambda peer: True):
        """`seeds`: target id -> (peer id, node id) pairs to start from (our closest known peers).
        `self_id` (our node id) is never asked; `usable(peer)` False puts a peer aside (e.g. in
        backoff) as if it had failed."""
        self.k, self.alpha = k, alpha
        self.stop_on_value = stop_on_value
        self.self_id = self_id
        self.usable = usable
        self.targets: dict[int, _Target] = {t: _Target(t) for t in seeds}
        self.peers: dict[int, PeerID] = {}  # node id -> peer id of every candidate
        self.node_ids: dict[PeerID, int] = {}
        self.failed: set[int] = set()
        # Which voices named each candidate (see `_Voice`), the introducer first; each voice's
        # failed introductions, and the voices past MAX_FAILED_INTRODUCTIONS.
        self.named_by: dict[int, list[_Voice]] = {}
        self.strikes: dict[_Voice, int] = {}
        self.discredited: set[_Voice] = set()
        self.max_asked = MAX_ASKED_IN_KS * k
        for target_id, peers in seeds.items():
            for peer, node_id in peers:
                self._add(self.targets[target_id], peer, node_id, hops=1, by=None)

    @property
    def done(self) -> bool:
        return all(t.done for t in self.targets.values())

    def _add(self, target: _Target, peer: PeerID, node_id: int, hops: int, by: _Voice) -> None:
        if node_id == self.self_id:
            return
        named_by = self.named_by.setdefault(node_id, [])
        if by not in named_by:
            named_by.append(by)
        state = target.state.get(node_id)
        if state is not None:
            if state == _WAITING and hops < target.hops[node_id]:
                target.hops[node_id] = hops
            return
        if node_id not in self.peers:
            self.peers[node_id] = peer
            self.node_ids[peer] = node_id
            if not self.usable(peer):
                self.failed.add(node_id)
        target.hops[node_id] = hops
        target.state[node_id] = _FAILED if node_id in self.failed else _WAITING

    def _ignored(self, node_id: int) -> bool:
        """Whether only discredited voices named this candidate."""
        return all(by in self.discredited for by in self.named_by[node_id])

    def _strike(self, node_id: int) -> None:
        """A candidate we asked failed or went slow (called before its state says so)."""
        named_by = self.named_by[node_id]
        if len(named_by) > 1 or named_by[0] is None or node_id in self.failed or any(
                t.state.get(node_id) == _SLOW for t in self.targets.values()):
            return  # corroborated (two voices), from our own table, or counted already
        introducer = named_by[0]
        self.strikes[introducer] = strikes = self.strikes.get(introducer, 0) + 1
        if strikes == MAX_FAILED_INTRODUCTIONS:
            self.discredited.add(introducer)
            for target in self.targets.values():  # free the slots its other contacts hold
                for n, s in target.state.items():
                    if s == _ASKING and n != node_id and self._ignored(n):
                        target.state[n] = _SLOW

    def _closest_live(self, target: _Target) -> list[int]:
        state = target.state
        live = [n for n, s in state.items()
                if s != _FAILED and s != _SLOW and not (self.discredited and s == _WAITING and self._ignored(n))]
        if len(live) <= self.k:
            return live
        return heapq.nsmallest(self.k, live, key=target.target.__xor__)

    def next_requests(self) -> dict[PeerID, list[int]]:
        """Requests to send now: peer -> target ids to ask it about. Marks them in flight."""
        plan: dict[PeerID, list[int]] = {}
        for target in self.targets.values():
            if target.done:
                continue
            state = target.state
            in_flight = sum(1 for s in state.values() if s == _ASKING)
            closest = self._closest_live(target)
            if all(state[n] == _ANSWERED for n in closest):
                target.done = True
                continue
            if in_flight < self.alpha and target.asked < self.max_asked:
                for node_id in sorted(closest, key=target.target.__xor__):
                    if state[node_id] == _WAITING:
                        state[node_id] = _ASKING
                        plan.setdefault(self.peers[node_id], []).append(target.target)
                        in_flight += 1
                        target.asked += 1
                        if in_flight >= self.alpha or target.asked >= self.max_asked:
                            break
            if in_flight == 0:
                target.done = True  # nothing left to ask
        return plan

    def on_response(self, peer: PeerID, asked: Iterable[int], answers: dict[int, Answer],
                    subnet: str | None = None) -> None:
        """`peer` answered a request about `asked`; targets missing from `answers` count as empty.
        `subnet`: where `peer` answered from; every answerer of one subnet is one voice (see the
        module docstring). None: `peer` is a voice of its own (our own network, or unknown)."""
        node_id = self.node_ids.get(peer)
        if node_id is None:
            return
        voice: _Voice = node_id if subnet is None else subnet
        for target_id in asked:
            target = self.targets.get(target_id)
            if target is None or target.state.get(node_id) not in (_ASKING, _SLOW):
                continue
            target.state[node_id] = _ANSWERED
            answer = answers.get(target_id)
            if answer is None:
                continue
            hops = target.hops[node_id] + 1
            nearest = answer.nearest
            if len(nearest) > self.k:
                nearest = heapq.nsmallest(self.k, nearest, key=lambda c: c[1] ^ target_id)
            for other, other_id in nearest:
                self._add(target, other, other_id, hops, by=voice)
            if answer.records:
                target.records.append((peer, answer.records))
                if target.found_hops is None:
                    target.found_hops = target.hops[node_id]
                if self.stop_on_value:
                    target.done = True

    def on_failure(self, peer: PeerID) -> None:
        """`peer` did not answer (timeout, unreachable, malformed answer): never ask it again here."""
        node_id = self.node_ids.get(peer)
        if node_id is None:
            return
        self._strike(node_id)
        self.failed.add(node_id)
        for target in self.targets.values():
            if node_id in target.state:
                target.state[node_id] = _FAILED

    def on_slow(self, peer: PeerID, asked: Iterable[int]) -> None:
        """A request to `peer` about `asked` is taking long: free its slot, keep its answer."""
        node_id = self.node_ids.get(peer)
        if node_id is None:
            return
        self._strike(node_id)
        for target_id in asked:
            target = self.targets.get(target_id)
            if target is not None and target.state.get(node_id) == _ASKING:
                target.state[node_id] = _SLOW

    def still_needed(self, asked: Iterable[int]) -> bool:
        """Whether a request in flight about `asked` can still matter."""
        return any(not self.targets[t].done for t in asked if t in self.targets)

    def result(self, target_id: int) -> TargetResult:
        target = self.targets[target_id]
        answered = sorted((n for n, s in target.state.items() if s == _ANSWERED), key=target_id.__xor__)
        with_records = {p for p, _ in target.records}
        nearest = [self.peers[n] for n in answered]
        return TargetResult(target_id, nearest, list(target.records), target.found_hops,
                            [p for p in nearest if p not in with_records])


class Backoff:
    """Peers that failed to answer, put aside for exponentially growing times."""

    def __init__(self, base: float = BACKOFF_BASE, cap: float = BACKOFF_MAX):
        self.base, self.cap = base, cap
        self._state: dict[PeerID, tuple[int, float]] = {}  # peer -> (failures, retry after)

    def failed(self, peer: PeerID, now: float) -> int:
        """Count a failure; returns the peer's consecutive failures."""
        failures = self._state.pop(peer, (0, 0.0))[0] + 1
        self._state[peer] = (failures, now + min(self.cap, self.base * 2 ** (failures - 1)))
        drop_oldest(self._state, MAX_TRACKED_PEERS)
        return failures

    def succeeded(self, peer: PeerID) -> None:
        self._state.pop(peer, None)

    def blocked(self, peer: PeerID, now: float) -> bool:
        state = self._state.get(peer)
        return state is not None and now < state[1]

    def failures(self, peer: PeerID) -> int:
        state = self._state.get(peer)
        return 0 if state is None else state[0]
