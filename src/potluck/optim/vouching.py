"""Who vouches for whom: the evidence a peer weighs others by, never by how many identities agree.

Identities cost nothing, and neither do records: any identity can publish a live progress record,
and any set of identities can publish round records that list each other (a clique of made-up
identities' records look exactly like an honest group's). What they cannot make up is a round
that a peer the reader trusts took part in and recorded: the reader's *witnesses* (`witnesses_of`):
the reader itself (the rounds it averaged in) and the peers its user configured to join through
(`initial_peers`: whoever joins through a peer trusts it with its view of the run already). Their
round records (`<run>.rounds`, owner-signed, so nobody records for them) are the evidence.

**State donors** (`DonorElection`, the Optimizer's `elect` for `download_state`): when donors
disagree on the state, each state is backed by (`Backing`, compared in this order):
1. `rounds`: the distinct rounds the witnesses recorded with one of the state's holders as a
   member. A round counts once however many holders were in it, so identities add nothing; to
   back a state, its holders must have averaged, as members a witness recorded, in the witnesses'
   own rounds (each record holds a peer's latest rounds: at most MAX_RECORDED_ROUNDS, 60 s).
2. `users` (authority-governed runs only): the users (token names) whose identities hold the state
   and are confirmed members of some round by another user's record: one user, one vote.
3. Still tied: the state a witness holds, if exactly one does (nothing a candidate chooses: the
   user's configuration), or else a peer whose state the reader took last (`followed`: it
   trusted that peer with its parameters already; a run's first peer, which trained alone while
   the reader downloaded it, is one). Else no state is chosen and the reader keeps its own.
What candidates say of themselves (version, epoch, headcount) never decides. docs/security.md
states the bound: how much an attacker must average with the witnesses to outvote the honest.

**Credit** (`potluck.monitor.ledger`) weighs members by the same witnesses' records.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from potluck.core.errors import IdentityError, MalformedMessage, MembershipError
from potluck.net.identity import PeerID
from potluck.net.membership import MembershipToken
from potluck.optim.progress import RoundRecord, fetch_rounds

__all__ = ["Backing", "DonorElection", "RoundKey", "back", "confirmed_partners", "elect", "key_of", "verified_names",
           "witnessed", "witnesses_of"]

logger = logging.getLogger(__name__)

RoundKey = tuple[int, int, str]  # (epoch, part, round id): how every member records a round alike


def witnesses_of(peer: Any) -> frozenset[str]:
    """The peers whose round records `peer` trusts: itself and its initial peers (by id)."""
    ids = {str(peer.peer_id)}
    for address in getattr(peer, "initial_peers", ()) or ():
        if getattr(address, "peer_id", None) is not None:
            ids.add(str(address.peer_id))
    return frozenset(ids)


def key_of(record: RoundRecord) -> RoundKey:
    return record.epoch, record.part, record.round


def witnessed(published: Mapping[str, Iterable[RoundRecord]], witnesses: Collection[str],
              own: Iterable[RoundRecord] = ()) -> dict[RoundKey, frozenset[str]]:
    """The rounds the `witnesses` recorded (in `published`, by signer, and `own`: the reader's own
    records, which it holds even if the DHT lost them) and the members each record lists."""
    rounds: dict[RoundKey, set[str]] = defaultdict(set)
    for signer, records in published.items():
        if signer in witnesses:
            for record in records:
                rounds[key_of(record)].update(p for p, _ in record.samples)
    for record in own:
        rounds[key_of(record)].update(p for p, _ in record.samples)
    return {key: frozenset(members) for key, members in rounds.items()}


def confirmed_partners(published: Mapping[str, Iterable[RoundRecord]]) -> dict[str, set[str]]:
    """Each member's partners: the members of some round with it whose records of it list both."""
    lists: dict[RoundKey, dict[str, frozenset[str]]] = defaultdict(dict)
    for signer, records in published.items():
        for record in records:
            members = frozenset(p for p, _ in record.samples)
            if signer in members:
                lists[key_of(record)][signer] = members
    partners: dict[str, set[str]] = defaultdict(set)
    for records in lists.values():
        for a, members in records.items():
            for b in members:
                if b != a and a in records.get(b, ()):
                    partners[a].add(b)
    return partners


def verified_names(published: Mapping[str, tuple[Any, bytes | None]], gate: Any) -> dict[str, str]:
    """The name each signer's membership token gives it, where the token admits that very peer to
    the run now (`gate`: the transport's membership check; None, an open run: nobody has a name)."""
    if gate is None:
        return {}
    names = {}
    for peer, (_, token) in published.items():
        if token is None:
            continue
        try:
            parsed = MembershipToken.from_wire(token)
            gate.verify(PeerID.from_string(peer), parsed)
        except (MalformedMessage, MembershipError, IdentityError) as e:
            logger.debug("no name for %s: %s", peer, e)
            continue
        names[peer] = parsed.name
    return names


@dataclass(frozen=True)
class Backing:
    """What backs one state in a vote (see the module docstring)."""

    rounds: int  # distinct rounds the witnesses recorded one of its holders in
    users: int  # governed runs: users holding it, confirmed members of a round by another user
    witness: bool  # a witness holds it
    followed: bool = False  # a peer whose state the reader took last holds it


def back(groups: Sequence[Sequence[str]], rounds: Mapping[RoundKey, frozenset[str]], witnesses: Collection[str],
         partners: Mapping[str, Collection[str]] | None = None,
         names: Mapping[str, str] | None = None) -> list[Backing]:
    """What backs each state, given each one's holders (`groups`), the rounds the witnesses
    recorded (`witnessed`), and in a governed run the verified `names` and each identity's
    `partners` (`confirmed_partners`)."""
    user_votes: dict[int, int] = defaultdict(int)
    if names:
        held: dict[str, set[int]] = defaultdict(set)  # user -> the states its confirmed identities hold
        for i, group in enumerate(groups):
            for donor in group:
                user = names.get(donor)
                if user is not None and any(names.get(b) not in (None, user) for b in (partners or {}).get(donor, ())):
                    held[user].add(i)
        for states in held.values():
            if len(states) == 1:  # a user whose identities hold two states has no single word
                user_votes[next(iter(states))] += 1
    backings = []
    for i, group in enumerate(groups):
        holders = set(group)
        backings.append(Backing(sum(1 for members in rounds.values() if members & holders), user_votes[i],
                                bool(holders & set(witnesses))))
    return backings


def elect(backings: Sequence[Backing]) -> int | None:
    """The index of the best backed state, or None if two tie all the way (see the module docstring)."""
    best = max((b.rounds, b.users) for b in backings)
    tied = [i for i, b in enumerate(backings) if (b.rounds, b.users) == best]
    if len(tied) > 1:
        tied = [i for i in tied if backings[i].witness] or tied
    if len(tied) > 1:
        tied = [i for i in tied if backings[i].followed]
    return tied[0] if len(tied) == 1 else None


class DonorElection:
    """Chooses among the states donors disagree on, for `download_state`'s `elect`: reads the run's
    round records (only then: donors that agree cost no read) and weighs each state by them.
    `taken`: the holders of the state chosen (the Optimizer follows their epoch afterwards)."""

    def __init__(self, dht: Any, run_id: str, witnesses: Collection[str], own: Sequence[RoundRecord] = (),
                 gate: Any = None, followed: Collection[str] = ()):
        self.dht = dht
        self.run_id = run_id
        self.witnesses = frozenset(witnesses)
        self.followed = frozenset(followed)
        self.own = tuple(own)
        self.gate = gate
        self.taken: list[PeerID] = []

    async def __call__(self, groups: list[list[PeerID]]) -> int | None:
        chosen = 0 if len(groups) == 1 else await self._vote(groups)
        self.taken = [] if chosen is None else list(groups[chosen])
        return chosen

    async def _vote(self, groups: list[list[PeerID]]) -> int | None:
        published = await fetch_rounds(self.dht, self.run_id)
        if published is None:
            logger.warning("state download: could not read the run's round records to choose among %d states; "
                           "keeping ours", len(groups))
            return None
        records = {signer: rounds for signer, (rounds, _) in published.items()}
        names = verified_names(published, self.gate)
        holders = [[str(d) for d in group] for group in groups]
        backings = back(holders, witnessed(records, self.witnesses, self.own), self.witnesses,
                        confirmed_partners(records) if names else None, names)
        backings = [replace(b, followed=bool(self.followed.intersection(group)))
                    for b, group in zip(backings, holders, strict=True)]
        chosen = elect(backings)
        said = "; ".join(_described(group, b, bool(names)) for group, b in zip(holders, backings, strict=True))
        if chosen is None:
            logger.warning("state download: the donors disagree and no state is backed by more than another (%s); "
                           "keeping ours", said)
        else:
            logger.info("state download: the donors disagree; taking the best backed state (%s)", said)
        return chosen


def _described(holders: list[str], backing: Backing, governed: bool) -> str:
    return (f"{', '.join(holders)}: {backing.rounds} witnessed round(s)" + (f", {backing.users} user(s)" if governed
                                                                             else "")
            + (", holds a witness" if backing.witness else ""))
