"""A user-space Ethernet switch between TAP devices that shapes each port like a WAN link.

This machine's kernel has no sch_netem (tc can limit a rate, not delay or drop), so delay and
loss are done here: every frame read from one port's TAP device is delayed by its uplink's
serialization (rate), the one-way latency, then the receiver's downlink serialization, dropped
with the link's loss probability, and written to the destination port's TAP device (broadcasts
to every other port). Each port's queue holds at most QUEUE_SECONDS of its rate (a router's
buffer): frames beyond it are dropped, as a full queue drops them.

TAP devices get a large MTU (`MTU`): a frame then carries up to 64 KB, so one Python loop keeps
up with hundreds of Mbit/s at a few thousand frames a second; its CPU time is reported
(`cpu_seconds`) so a benchmark can account for it.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import selectors
import struct
import threading
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MTU = 65000  # bytes per frame at most (TAP allows 65521)
QUEUE_SECONDS = 0.5  # a port's queue holds this much of its rate; frames beyond it are dropped
BROADCAST = b"\xff" * 6


@dataclass
class Port:
    """One peer's link: its TAP device (fd) and shape. Rates in bytes/s; delay one way, in seconds."""

    name: str
    fd: int
    up: float
    down: float
    delay: float
    loss: float = 0.0
    mac: bytes = b""
    up_free: float = 0.0  # when its uplink is next idle
    down_free: float = 0.0


def open_tap(name: str) -> int:
    """Create TAP device `name` (in this namespace) and return its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Switch:
    """Forwards frames between `ports` in a background thread until `close()`."""

    def __init__(self, ports: list[Port], seed: int = 0):
        self.ports = ports
        self.random = random.Random(seed)
        self.queue: list[tuple[float, int, int, bytes]] = []  # (when, order, port index, frame)
        self.order = 0
        self.dropped = 0
        self.forwarded = 0
        self.cpu_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-switch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for i, port in enumerate(self.ports):
            selector.register(port.fd, selectors.EVENT_READ, i)
        start = time.thread_time()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min(0.05, max(0.0, self.queue[0][0] - now)) if self.queue else 0.05
                for key, _ in selector.select(wait):
                    self._read(key.data)
                now = time.monotonic()
                while self.queue and self.queue[0][0] <= now:
                    _, _, index, frame = heapq.heappop(self.queue)
                    try:
                        os.write(self.ports[index].fd, frame)
                    except OSError:
                        self.dropped += 1
        finally:
            self.cpu_seconds = time.thread_time() - start
            selector.close()

    def _read(self, source: int) -> None:
        port = self.ports[source]
        while True:
            try:
                frame = os.read(port.fd, MTU + 64)
            except BlockingIOError:
                return
            except OSError:
                return
            port.mac = frame[6:12]
            destination = frame[:6]
            targets = [i for i, p in enumerate(self.ports) if i != source
                       and (destination == BROADCAST or destination[0] & 1 or p.mac == destination or not p.mac)]
            self._send(source, targets, frame)

    def _send(self, source: int, targets: list[int], frame: bytes) -> None:
        now, size, port = time.monotonic(), len(frame), self.ports[source]
        if port.up_free - now > QUEUE_SECONDS or self.random.random() < port.loss:
            self.dropped += 1
            return
        port.up_free = max(now, port.up_free) + size / port.up
        for index in targets:
            other = self.ports[index]
            arrival = port.up_free + port.delay + other.delay
            if other.down_free - arrival > QUEUE_SECONDS:
                self.dropped += 1
                continue
            other.down_free = max(arrival, other.down_free) + size / other.down
            self.order += 1
            self.forwarded += 1
            heapq.heappush(self.queue, (other.down_free, self.order, index, frame))
