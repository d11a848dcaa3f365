"""The DHT's shared clock: what record expiration times are measured against.

Peers compare expiration times written by other peers, so the clock must mean the same thing
everywhere: wall-clock seconds since the Unix epoch (`time.time()`), kept in step by NTP. Code that
needs another notion of "now" (the virtual clock of emulated tests) passes its own `Clock`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["Clock", "event_loop_clock", "get_dht_time"]

# A source of "now" in seconds; the DHT takes one so tests can run it on virtual time.
Clock = Callable[[], float]


def get_dht_time() -> float:
    """Seconds since the Unix epoch: the time every peer's DHT expirations are compared with."""
    return time.time()


def event_loop_clock(loop: asyncio.AbstractEventLoop | None = None) -> Clock:
    """A clock that reads the event loop's time: under a virtual-time loop, records expire in
    virtual seconds. Only for swarms that share one loop (emulated networks); real peers in
    different processes must use `get_dht_time`."""
    loop = loop or asyncio.get_running_loop()
    return loop.time
