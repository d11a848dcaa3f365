"""`Coordinator`: turns the members' reports into the step's decisions, on the member that coordinates.

The coordinator is the first member that can be dialed and is alive (`Group.coordinators`); every
member runs one, active only while its member coordinates. It decides the senders every shard
averages (the intersection of what the reducers received, checked against the senders' own
roots), gives the shards of dead reducers to survivors, and commits once every live receiver
holds every shard final and has checked it (or had its checks answered), or aborts. It reaches
its member through `CoordinatorHost`, which that member implements.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Collection
from typing import Any, Protocol

from potluck.averaging.accountability import final_message, shard_digest
from potluck.averaging.allreduce.group import Group
from potluck.averaging.allreduce.messages import Equivocation, MemberState, Outcome, SyncReply
from potluck.averaging.role import Role
from potluck.core.errors import NetworkError, PotluckError

__all__ = ["DEATH_PROBE_TIMEOUT", "MAX_REPAIRS", "QUERY_TIMEOUT", "Coordinator", "CoordinatorHost"]

logger = logging.getLogger(__name__)

# Rounds of reassigning the shards of reducers that died after the first decision.
MAX_REPAIRS = 2
# A member that another member reports dead is asked where it stands, and counts as dead only if
# it does not answer within this long: the report is the reporter's word, and a false one would
# leave a live member out (and move its shard, maybe onto the reporter). Long enough for a loaded
# peer to answer one small request, short next to SENDER_TIMEOUT: a real death is acted on soon.
DEATH_PROBE_TIMEOUT = 2.0
# A coordinator that took over asks each member where it stands within this long.
QUERY_TIMEOUT = 5.0


class CoordinatorHost(Protocol):
    """What a coordinator knows of, and asks of, the member it runs on."""

    me: int
    group: Group
    deadline: float  # loop time the step must end by
    sender_timeout: float
    dead: set[int]  # members this member knows dead (the coordinator adds reducers that never reported)
    outcome: Outcome  # the decision this member follows
    state_changed: asyncio.Event  # set when this member has news for its coordinator

    def current_coordinator(self) -> int | None: ...

    def state(self) -> MemberState: ...

    def spawn(self, coro: Any) -> asyncio.Task: ...

    def mark_dead(self, member: int) -> None: ...

    def apply(self, outcome: Outcome) -> None:
        """Follow a decision."""

    async def query(self, member: int, timeout: float) -> MemberState | None:
        """Where `member` stands (None: it has no such step)."""

    def ban(self, member: int, evidence: str) -> None:
        """Put `member` on this peer's ban list."""

    def sign(self, message: bytes) -> bytes:
        """This member's signature of `message`."""


class Coordinator:
    """Turns members' reports into decisions; active only on the current coordinator.

    Owned by its member's run, it reaches the run through a weak proxy, so the two form no cycle.
    """

    def __init__(self, run: CoordinatorHost):
        self.run = weakref.proxy(run)
        self.active = False
        self.states: dict[int, MemberState] = {}
        self.outcome = Outcome.first(dict(run.outcome.assignment))
        self.repairs = 0
        self.late = False  # the report deadline passed: decide with what came in
        self.newer = asyncio.Event()
        self._probes: dict[int, asyncio.Task] = {}  # member reported dead -> the check that it is
        self._refuted: set[tuple[int, int]] = set()  # (reporter, member) reports found false here
        self._timer: asyncio.TimerHandle | None = None

    def maybe_take_over(self) -> None:
        if self.run.current_coordinator() == self.run.me and not self.active:
            self.active = True
            if self.run.outcome.version > self.outcome.version:
                self.outcome = self.run.outcome
            loop = asyncio.get_running_loop()
            # Reports must come in while senders can still be waited for; then decide without them.
            self._timer = loop.call_at(min(self.run.deadline, loop.time() + 2 * self.run.sender_timeout + 5),
                                       self._report_deadline)
            if self.run.me != self.run.group.coordinators()[0]:
                self.run.spawn(self._query_everyone())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def poke(self) -> None:
        self.maybe_take_over()
        if self.active:
            self.update(self.run.state())

    async def _query_everyone(self) -> None:
        """A coordinator that took over asks the listening members where they stand (members in
        client mode cannot be dialed; they sync on their own). A failed query proves nothing."""
        async def ask(i: int) -> None:
            try:
                state = await self.run.query(i, QUERY_TIMEOUT)
            except (NetworkError, PotluckError):
                return
            if state is not None:
                self.update(state)
        await asyncio.gather(*(ask(i) for i in self.run.group.coordinators() if i != self.run.me))

    async def wait_newer(self, version: int, known: Collection[int]) -> SyncReply:
        """Wait for a decision newer than `version`, or a death not among `known` (the waiter's
        dead and itself: a member presumed dead must not be woken by its own death)."""
        while not (self.outcome.version > version or self.outcome.committed or self.outcome.aborted
                   or not self.run.dead <= set(known)):
            self.newer.clear()
            await self.newer.wait()
        return SyncReply(self.outcome, tuple(sorted(self.run.dead)))

    def update(self, state: MemberState) -> None:
        """Merge a member's state and decide what can be decided."""
        self.newer.set()  # waiters check again: a death may be news to them
        self.states[state.member] = state
        self.maybe_take_over()
        order = self.run.group.coordinators()
        ahead = order[:order.index(self.run.me)] if self.run.me in order else []
        for member in state.dead:
            # Until I coordinate, only deaths that would make me the coordinator concern me: my
            # coordinator tells me the others (and a client-mode member cannot be asked from here).
            if member != self.run.me and member not in self.run.dead and (self.active or member in ahead) \
                    and (state.member, member) not in self._refuted and member not in self._probes:
                self._probes[member] = self.run.spawn(self._probe(member, state.member))
        if not self.active:
            return
        adopted = state.outcome
        if state.member != self.run.me and not adopted.decided_by(self.run.group, self.run.me):
            # Members show me the last decision they follow, which I must carry on if I took
            # over; only a coordinator before me (or I) may have made it, never a member.
            adopted = self.outcome
        if adopted.committed and not self.outcome.committed:
            self._publish(adopted)
            return
        if adopted.version > self.outcome.version:
            self.outcome = adopted
        # A failed repair ends the step if the reporter holds one. A report that comes once the step
        # is over (an honest reducer's, racing an abort that moved its shard away) decides nothing,
        # and our own member's is true: only another member's report of a part it does not hold
        # under a live decision is a lie (a member once excluded itself for the rest of a run).
        if state.failure and not (self.outcome.committed or self.outcome.aborted):
            if self._holds_repair(state.member):
                self._publish(Outcome.aborting(self.outcome.version + 1, state.failure))
                return
            if state.member != self.run.me:
                self.run.ban(state.member, f"reported a failed repair of a part it does not hold: {state.failure!r}")
        self._decide()

    async def _probe(self, member: int, reporter: int) -> None:
        """Act on `reporter`'s word that `member` is dead only once `member` fails to say where it
        stands: every member must converge on one coordinator, so a real death counts everywhere,
        but a false report must not leave a live member out or move its shard. A report found
        false is dropped (an honest reporter may have lost only its own link to the member, or
        been sent garbage by it: no ban), and that reporter's word on that member is not asked
        for again in this step (see `_cut_off` for what it costs the reporter)."""
        try:
            alive = await self.run.query(member, DEATH_PROBE_TIMEOUT) is not None
        except (NetworkError, PotluckError, TimeoutError):
            alive = False
        finally:
            self._probes.pop(member, None)
        if alive:
            self._refuted.add((reporter, member))
            logger.warning("member %d (%s) reported member %d (%s) dead, but it answered: it stays in the step",
                           reporter, self.run.group.peers[reporter], member, self.run.group.peers[member])
            self.poke()  # the reporter may no longer be waited for
        else:
            self.run.mark_dead(member)

    def _holds_repair(self, member: int) -> bool:
        """Whether `member` reduces a shard given to it by a repair: only such a reducer can find
        a sender missing after the decision, so only its failure report may end the step."""
        out = self.outcome
        return out.version > 0 and any(r == member and r != j for j, r in out.assignment.items())

    def _report_deadline(self) -> None:
        self._timer = None  # a fired handle still holds this bound method: drop the cycle
        self.late = True
        if self.outcome.version == 0 and not (self.outcome.committed or self.outcome.aborted):
            for j, reducer in self.outcome.assignment.items():
                if not self._reported(j) and reducer != self.run.me:
                    self.run.dead.add(reducer)
            self._decide()

    def _reported(self, shard: int) -> bool:
        return any(shard in s.reports for s in self.states.values())

    def _decide(self) -> None:
        out = self.outcome
        if out.committed or out.aborted:
            return
        dead = self.run.dead
        live_reducers = [j for j in self.run.group.shards if j not in dead and self.run.group.roles[j] != Role.CLIENT]
        if out.version == 0:
            if not all(self._reported(j) or out.assignment[j] in dead for j in out.assignment):
                return
            if not live_reducers:
                self._publish(Outcome.aborting(1, "every reducer died"))
                return
            complete: set[int] | None = None
            for s in self.states.values():
                for j, c in s.reports.items():
                    if out.assignment.get(j) not in dead:
                        complete = set(c) if complete is None else complete & set(c)
            agreed = self._agreed(tuple(sorted((complete or set()) - dead)))
            if agreed is None:
                return  # senders' roots are still on their way
            senders, digests = agreed
            if not senders:
                self._publish(Outcome.aborting(1, "no sender delivered to every reducer"))
                return
            assignment = self._reassign(dict(out.assignment), live_reducers)
            self._publish(Outcome(1, senders, assignment, False, digests=digests))
            return
        # After a decision: commit once every live receiver holds every shard, and has checked
        # them or had its checks answered (it then finishes them before using the result).
        cut = self._cut_off()
        receivers = [i for i in self.run.group.receivers if i not in dead and i not in cut]
        holding = [i for i in receivers if i in self.states and self._holds(i)
                   and (self.states[i].checked >= out.version or self._answered(i))]
        if len(holding) == len(receivers):
            proof = self._equivocation(receivers)
            if proof is not None:
                self._publish(Outcome.aborting(out.version + 1, f"member {proof.reducer} sent members different "
                                                                f"results of shard {proof.shard}", proof))
                return
            self._publish(Outcome(out.version, out.senders, out.assignment, True, digests=out.digests))
            return
        lost = {j for j, r in out.assignment.items() if r in dead}
        if lost:
            if self.repairs >= MAX_REPAIRS or not live_reducers:
                self._publish(Outcome.aborting(out.version + 1, "reducers kept dying"))
                return
            if any(s in dead for s in out.senders):
                self._publish(Outcome.aborting(out.version + 1, "a reducer and a sender it needed both died"))
                return
            self.repairs += 1
            self._publish(Outcome(out.version + 1, out.senders, self._reassign(dict(out.assignment), live_reducers),
                                  False, digests=out.digests))

    def _holds(self, member: int) -> bool:
        """Whether `member` holds every shard final: so it says, or it holds the early FINAL of a
        shard its first reducer still reduces, over the senders decided (the commit settles it
        there, so the commit need not wait for the decision to reach the member and its word)."""
        state, out = self.states[member], self.outcome
        for j, reducer in out.assignment.items():
            final = state.finals.get(j)
            if j not in state.final and (final is None or final.version != 0 or final.senders != out.senders
                                         or reducer != j):
                return False
        return True

    def _answered(self, member: int) -> bool:
        """Whether the reducer of every shard `member` holds from another answered its check of
        the FINAL it holds. A reducer's word for it: one that says so falsely leaves that member
        to fail its check after the commit, as one that does not answer does before it."""
        for j, reducer in self.outcome.assignment.items():
            final, state = self.states[member].finals.get(j), self.states.get(reducer)
            if reducer == member:
                continue
            if final is None or state is None:
                return False
            version, members = state.answered.get(j, (-1, ()))
            if version != final.version or member not in members:
                return False
        return True

    def _cut_off(self) -> set[int]:
        """Receivers not waited for: each reported a reducer dead that answered me, and lacks its
        shard (a liar, or a member that lost its link to that reducer: it fails alone, at once,
        rather than holding everyone up until the deadline)."""
        out = self.outcome
        return {reporter for reporter, member in self._refuted if reporter in self.states and any(
            r == member and j not in self.states[reporter].final for j, r in out.assignment.items())}

    def _equivocation(self, receivers: list[int]) -> Equivocation | None:
        """Proof that a reducer signed different results of one shard for different receivers, from
        the FINALs they show me (a receiver showing a signature that does not hold is lying: it is
        banned, and what it showed is ignored)."""
        group, out = self.run.group, self.outcome
        for j, r in sorted(out.assignment.items()):
            seen: dict[tuple[int, tuple[int, ...]], dict[bytes, bytes]] = {}  # (version, senders) -> root -> sig
            for i in receivers:
                final = self.states[i].finals.get(j)
                if final is None or self.states[i].version < out.version and r != j:
                    continue  # it may not know yet that the shard moved to `r`
                message = final_message(group.group_id, j, final.version, final.senders, final.root)
                if not group.peers[r].verify(final.signature, message):
                    self.run.ban(i, f"it showed a FINAL of shard {j} that its reducer {group.peers[r]} did not sign")
                    continue
                seen.setdefault((final.version, final.senders), {}).setdefault(final.root, final.signature)
            for (version, senders), roots in seen.items():
                if len(roots) < 2:
                    continue
                (a, sig_a), (b, sig_b) = list(roots.items())[:2]
                proof = Equivocation(r, j, version, senders, (a, b), (sig_a, sig_b))
                self.run.ban(r, f"as reducer of shard {j}, it signed two different results of it")
                return proof
        return None

    def _agreed(self, senders: tuple[int, ...]) -> tuple[tuple[int, ...], dict[int, bytes]] | None:
        """The senders whose own roots match what every reporting reducer received from them, and
        per reported shard the digest of those roots; None while a sender's roots may still come.
        A mismatch means the sender or the reducer lies; either way the sender is left out (as a
        reducer could already leave it out by calling it incomplete), and it is logged."""
        received: dict[int, dict[int, bytes]] = {}
        for state in self.states.values():
            for j in state.reports:
                if self.outcome.assignment.get(j) == state.member and state.member not in self.run.dead:
                    received[j] = state.received.get(j, {})
        agreed = []
        for s in senders:
            sent = self.states[s].sent if s in self.states else {}
            if not set(received) <= set(sent):
                if not self.late:
                    return None
                continue
            disputed = [j for j in received if received[j].get(s) != sent[j]]
            if disputed:
                logger.warning("member %d (%s) and the reducers of shards %s disagree on what it sent; "
                               "it is left out of this step", s, self.run.group.peers[s], disputed)
                continue
            agreed.append(s)
        digests = {j: shard_digest({s: self.states[s].sent[j] for s in agreed}) for j in received}
        return tuple(agreed), digests

    def _reassign(self, assignment: dict[int, int], live: list[int]) -> dict[int, int]:
        """Give each dead reducer's shard to the next live reducer after it (deterministic)."""
        n = len(self.run.group.peers)
        for j, r in assignment.items():
            if r in self.run.dead:
                for step in range(1, n + 1):
                    candidate = (r + step) % n
                    if candidate in live:
                        assignment[j] = candidate
                        break
        return assignment

    def _publish(self, outcome: Outcome) -> None:
        outcome.by = self.run.me  # mine now (a decision carried on from my predecessor too)
        outcome.signature = self.run.sign(outcome.message(self.run.group.group_id))
        logger.debug("coordinator %d decides %s (dead: %s)", self.run.me, outcome, sorted(self.run.dead))
        self.outcome = outcome
        self.newer.set()
        if outcome.committed or outcome.aborted:
            self.close()
        if outcome.version > self.run.outcome.version or outcome.committed or outcome.aborted:
            self.run.apply(outcome)
            self.run.state_changed.set()
