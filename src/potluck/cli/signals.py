"""Ctrl-C and SIGTERM for the long-running commands, without deadlocks."""

from __future__ import annotations

import signal
import time

# How often `StopSignal.wait` looks at the flag: the delay between a signal and the clean exit.
POLL_SECONDS = 0.1


class StopSignal:
    """Set by SIGINT or SIGTERM, at any moment (start-up included).

    A Python signal handler runs in the main thread between two bytecodes, possibly while that
    thread holds a lock: `threading.Event.set()` in a handler that interrupts `Event.wait()` takes
    the lock `wait` holds, and the process hangs for good. The handler therefore only sets a flag,
    and `wait` polls it.
    """

    def __init__(self) -> None:
        self.stopped = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_: object) -> None:
        self.stopped = True
        StopSignal.received = True

    # Whether any stop signal has come (the command is ending because the user asked).
    received = False

    @staticmethod
    def exiting() -> None:
        """Called once the command has returned: if the user has asked it to stop, ignore further
        stop signals. Python resets its handlers to the default while it shuts down (torch's
        teardown and the threads take a moment), so an impatient second Ctrl-C then killed a
        process that had saved its work and printed its final row, with exit status -2."""
        if StopSignal.received:
            StopSignal.received = False
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)

    def is_set(self) -> bool:
        return self.stopped

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True as soon as a stop signal has come."""
        deadline = time.monotonic() + seconds
        while not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(POLL_SECONDS, left))
        return self.stopped
