"""How the authority rations password checks: per network origin and per user name, never in one
bucket that everyone shares.

Only passwords need rationing: a person chose them, so they can be guessed online, and each check
costs an scrypt (16 MiB, ~50 ms). An allowlisted key is proved by the connection's signature and
an invite code has 128 random bits: neither can be guessed, and checking one costs a dictionary
look-up (and a SHA-256), so they are never counted here and never refused because strangers are
guessing passwords. Renewals present a token, which is checked by its signature: not counted either.

`PasswordLimits` counts attempts over a sliding `GUESS_WINDOW` per IP, per subnet
(`potluck.net.origins`), per user name from each subnet, and per user name from all origins, and
says why an attempt is refused before any scrypt is spent on it. Subnets a name logged in from
recently skip the per-name total, so strangers guessing a name from many origins cannot lock its
owner out of the places they log in from. `PasswordChecks` bounds how many scrypt checks run at
once and how many wait, with each origin's share of the waiting room.

This module is plain logic over a clock (no sockets), so each rule is tested without a network.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from potluck.core.bounded import drop_oldest
from potluck.core.dht_time import Clock
from potluck.core.errors import MembershipError
from potluck.net.origins import Origin, Shares

__all__ = [
    "GUESS_WINDOW", "KNOWN_SUBNETS_PER_NAME", "MAX_CONCURRENT_PASSWORD_CHECKS", "MAX_WAITING_PASSWORD_CHECKS",
    "PASSWORDS_PER_IP", "PASSWORDS_PER_NAME", "PASSWORDS_PER_NAME_PER_SUBNET", "PASSWORDS_PER_SUBNET",
    "PasswordChecks", "PasswordLimits", "TooManyAttempts", "WindowCounts",
]

# The window every password limit counts over: a person who mistyped waits a minute, not an hour.
GUESS_WINDOW = 60.0
# Password attempts from one IP address per window: a person retyping needs a few; a script on one
# host gets 10 a minute (14,400 a day) over all the names it tries. Like fail2ban's default of 5
# failures per address, counted over every name, but per minute rather than per 10 minutes, because
# an honest address (a NAT) may hold several people.
PASSWORDS_PER_IP = 10
# From one subnet (/24 or /48) per window: three addresses' worth, for a lab or office behind a few
# addresses where several people log in at once; a host with a whole /24 gets no more than this.
PASSWORDS_PER_SUBNET = 30
# For one user name from one subnet per window: the owner mistyping 5 times in a minute is plenty.
# A quarter of PASSWORDS_PER_NAME, so one origin can never use up a name's budget by itself.
PASSWORDS_PER_NAME_PER_SUBNET = 5
# For one user name from all origins per window: 20 a minute (28,800 a day) is what a botnet gets
# against one name, however many addresses it has; against an scrypt hash of any password worth
# the name that is years of guessing (OWASP's guidance: throttle per account, not only per address).
PASSWORDS_PER_NAME = 20
# Subnets a name logged in from with the right password, remembered (most recent first) so that
# they skip PASSWORDS_PER_NAME: guessing a name from many origins then locks out only new places,
# never the ones its owner uses (the "known device" exemption of account-lockout guidance).
KNOWN_SUBNETS_PER_NAME = 4
# Keys each counter remembers (least recently used forgotten first): bounds the limiter's memory to
# about 10,000 x (key + up to 30 times) per counter. Forgetting a key only forgets its count; the
# counts of the policy's own user names are never forgotten (they are as many as its users).
MAX_TRACKED_KEYS = 10_000
# scrypt checks that run at once (each in a thread): 2 x 16 MiB, and half of a 4-core authority
# host; more would not check faster on a small machine, only hold more memory.
MAX_CONCURRENT_PASSWORD_CHECKS = 2
# Password checks that may wait for a thread: 32 x ~50 ms is under a second of queue per thread.
# Each subnet and each IP may hold 4 of them (an eighth), each peer id one: a flood from one origin
# waits behind itself, and the others keep their places.
MAX_WAITING_PASSWORD_CHECKS = 32
WAITING_PER_SUBNET = 4
WAITING_PER_IP = 4


T = TypeVar("T")


class TooManyAttempts(MembershipError):
    """A password attempt over one of the limits above (the text says which, and what to do)."""


class WindowCounts:
    """Events per key over the last `window` seconds, at most `limit` kept per key. Keys beyond
    `max_keys` are forgotten least recently used first, except those `keep` says to keep."""

    def __init__(self, limit: int, window: float, clock: Clock, *, max_keys: int = MAX_TRACKED_KEYS,
                 keep: Callable[[Hashable], bool] | None = None):
        self.limit, self.window, self.clock, self.max_keys = limit, window, clock, max_keys
        self._keep = keep or (lambda key: False)
        self._counts: OrderedDict[Hashable, deque[float]] = OrderedDict()
        self._kept: dict[Hashable, deque[float]] = {}

    def count(self, key: Hashable) -> int:
        """Events of `key` within the window."""
        times = self._times(key, create=False)
        return 0 if times is None else len(times)

    def full(self, key: Hashable) -> bool:
        return self.count(key) >= self.limit

    def add(self, key: Hashable) -> None:
        times = self._times(key, create=True)
        times.append(self.clock())
        while len(times) > self.limit:
            times.popleft()

    def _times(self, key: Hashable, create: bool) -> deque[float] | None:
        kept = self._keep(key)
        table = self._kept if kept else self._counts
        times = table.get(key)
        if times is None:
            if not create:
                return None
            times = table[key] = deque()
        horizon = self.clock() - self.window
        while times and times[0] <= horizon:
            times.popleft()
        if not kept:
            self._counts.move_to_end(key)
            drop_oldest(self._counts, self.max_keys)
        return times


class PasswordLimits:
    """The password-guessing limits of one authority (see the module docstring). `check` says
    why an attempt is refused (TooManyAttempts) before it is counted; `count` counts it; `logged_in`
    remembers the subnet a name logged in from. `known_name` tells the policy's user names apart,
    whose counts are never forgotten."""

    def __init__(self, clock: Clock, known_name: Callable[[str], bool] | None = None):
        self.clock = clock
        self.per_ip = WindowCounts(PASSWORDS_PER_IP, GUESS_WINDOW, clock)
        self.per_subnet = WindowCounts(PASSWORDS_PER_SUBNET, GUESS_WINDOW, clock)
        self.per_name_subnet = WindowCounts(PASSWORDS_PER_NAME_PER_SUBNET, GUESS_WINDOW, clock)
        self.per_name = WindowCounts(PASSWORDS_PER_NAME, GUESS_WINDOW, clock, keep=known_name)
        self._known_subnets: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def check(self, origin: Origin, name: str) -> None:
        """Raise TooManyAttempts (saying which limit, and what to do) if a password attempt for
        `name` from `origin` is over a limit now."""
        window = f"{GUESS_WINDOW:g} s"
        if self.per_ip.full(origin.ip):
            raise TooManyAttempts(f"too many password attempts from {origin.ip} (at most {PASSWORDS_PER_IP} per "
                                  f"{window} from one address); wait a minute and check the user name and password")
        if self.per_subnet.full(origin.subnet):
            raise TooManyAttempts(f"too many password attempts from {origin.subnet} (at most {PASSWORDS_PER_SUBNET} "
                                  f"per {window} from one subnet); wait a minute, or use an invite or allowlisted key")
        if self.per_name_subnet.full((name, origin.subnet)):
            raise TooManyAttempts(f"too many password attempts for this user name from {origin.subnet} (at "
                                  f"most {PASSWORDS_PER_NAME_PER_SUBNET} per {window}); wait a minute and check "
                                  "the password")
        if self.per_name.full(name) and not self.known_subnet(name, origin):
            raise TooManyAttempts(f"too many password attempts for this user name from many addresses (at most "
                                  f"{PASSWORDS_PER_NAME} per {window}); wait a minute, or log in from an address "
                                  "that logged in before, or use an invite or allowlisted key")

    def count(self, origin: Origin, name: str) -> None:
        self.per_ip.add(origin.ip)
        self.per_subnet.add(origin.subnet)
        self.per_name_subnet.add((name, origin.subnet))
        self.per_name.add(name)

    def known_subnet(self, name: str, origin: Origin) -> bool:
        known = self._known_subnets.get(name)
        return known is not None and origin.subnet in known

    def logged_in(self, name: str, origin: Origin) -> None:
        """`name` logged in with the right password from `origin`: its subnet skips PASSWORDS_PER_NAME."""
        known = self._known_subnets.pop(name, None) or OrderedDict()
        known.pop(origin.subnet, None)
        known[origin.subnet] = None
        drop_oldest(known, KNOWN_SUBNETS_PER_NAME)
        self._known_subnets[name] = known
        drop_oldest(self._known_subnets, MAX_TRACKED_KEYS)


class PasswordChecks:
    """At most MAX_CONCURRENT_PASSWORD_CHECKS scrypt checks at once; at most
    MAX_WAITING_PASSWORD_CHECKS waiting or running, with each origin's share (`net.origins.Shares`)."""

    def __init__(self) -> None:
        self.places = Shares("password checks waiting at the authority", MAX_WAITING_PASSWORD_CHECKS,
                             per_subnet=WAITING_PER_SUBNET, per_ip=WAITING_PER_IP, per_peer=1)
        self._running = asyncio.Semaphore(MAX_CONCURRENT_PASSWORD_CHECKS)

    def claim(self, origin: Origin, peer: Hashable) -> None:
        """Take a place in the queue (TooManyAttempts if `origin` or everybody holds all its
        places); `run` gives it back."""
        refusal = self.places.refusal(origin, peer)
        if refusal is not None:
            raise TooManyAttempts(f"the authority is busy checking passwords ({refusal}); retry in a minute "
                                  "(invites, allowlisted keys and renewals are not affected)")
        self.places.claim(origin, peer)

    async def run(self, origin: Origin, peer: Hashable, check: Callable[..., T], *args: Any) -> T:
        """Run `check(*args)` in a thread once one is free, with the place `claim` took."""
        try:
            async with self._running:
                return await asyncio.to_thread(check, *args)
        finally:
            self.places.release(origin, peer)
