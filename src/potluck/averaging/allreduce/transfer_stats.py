"""`TransferStats`: what one member sent and received in a step, for its bandwidth estimates."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DOWNLOAD_BINS", "TransferStats", "payload_bytes"]

# Stretches a step's receiving time is cut into for the download estimate: enough that the
# stretch where fast senders fill our link stands out from a slow sender's tail, few enough that
# each holds several chunks (a burst of chunks that sat in buffers is not a rate).
DOWNLOAD_BINS = 8
# A paced link (`TransferStats.pace`) with at most this many bytes unacknowledged is idle: control
# frames (stream windows, seals, FINALs) wait there a round trip too, and counting those links
# took the busy ones' share for most of a round. A chunk of data is larger (256K elements).
PACE_IDLE_BYTES = 64 * 2**10
# No link is paced below this (bytes/s): the kernel spaces a link's next packet by the rate it was
# sent at, and lifting the pace does not bring that time forward, so a crawl would hold the
# connection after the round (a 1 Mbit/s uplink split six ways is 20 KB/s).
MIN_LINK_PACE = 16 * 2**10


@dataclass
class TransferStats:
    """This member's uploads to and downloads from other peers during one step, for its
    bandwidth estimates.

    Upload, over links that send as they are handed bytes (the emulated network: a send returns
    once this peer's upload of it is done): bytes sent over `busy_seconds`, the time during which
    at least one send to another peer was in flight. Waiting for data to reduce or for slower
    peers is not busy time, so it measures this peer's own upload, not the group's pace.

    Over TCP a send returns once buffers (the transport's, up to 8 MiB, and the kernel's) take
    the bytes, which can be a whole round's: timing sends measured 13-50x the link. So a TCP
    link counts what it wrote and what its peer has not acknowledged yet (`written`,
    `unsent()`), and the upload is the bytes acknowledged while some were waiting, over that
    time: sampled at every send and every chunk received, each stretch between two samples that
    ends with bytes still waiting counts (the link was busy all of it).
    Sends to itself (a member reducing its own shard) count for none of this.

    `pace`: this peer's upload in bytes/s, if it is known (configured, not measured). The links
    with data waiting then share it evenly (`TCPLink.pace`, split again whenever how many wait
    changes) instead of each sending as fast as its congestion control dares: the round's flows
    together fill the uplink without overfilling its queue, where the acknowledgements of the
    round's incoming data wait too. Over emulated 100 Mbit/s links with a 0.5 s queue, plain TCP
    moving an all-reduce's bytes took 1.26x the bandwidth bound unpaced and 1.03x paced
    (docs/benchmarks.md). Evenly, not pieces first: a flow held back and then let go regains
    its speed only slowly (BBR probes up a quarter per cycle), which cost more than it saved.
    `unpace()` lifts the pace when the step is over.
    """

    sent_bytes: int = 0
    busy_seconds: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0
    # TCP: the links sent on in this step (by id), and the last sample of them: (time, bytes they
    # have delivered, whether bytes were waiting or a send was in flight)
    links: dict[int, Any] = field(default_factory=dict)
    last_sample: tuple[float, int, bool] | None = None
    acked_bytes: int = 0
    backlog_seconds: float = 0.0
    received_bytes: int = 0
    # (previous arrival, this arrival, bytes) of each chunk received from another peer after the
    # first of its stream: how long that chunk was on its way to us. One per chunk of the step.
    arrivals: list[tuple[float, float, int]] = field(default_factory=list)
    pace: float | None = None
    paced: int = 0  # how many links had data waiting when `pace` was last split (0: not split yet)

    @property
    def delivered_bytes(self) -> int:
        """Bytes this peer's upload measurably delivered (what `upload` counts)."""
        return self.acked_bytes if self.links else self.sent_bytes

    @property
    def upload(self) -> float | None:
        """Measured bytes/s, or None if nothing was measured."""
        nbytes, seconds = (self.acked_bytes, self.backlog_seconds) if self.links else \
            (self.sent_bytes, self.busy_seconds)
        return nbytes / seconds if nbytes > 0 and seconds > 0 else None

    def _sample(self) -> None:
        """Read the TCP links (see the class docstring)."""
        if not self.links:
            return
        now = asyncio.get_running_loop().time()
        delivered, busy, waiting = 0, 0, self.in_flight > 0
        for link in self.links.values():
            unsent = link.unsent()
            delivered += link.written - unsent
            busy += unsent > PACE_IDLE_BYTES
            waiting = waiting or unsent > 0
        if self.pace is not None and max(1, busy) != self.paced:
            self.paced = max(1, busy)  # (idle links too: one that gets data is counted at the next sample)
            for link in self.links.values():
                link.pace(max(MIN_LINK_PACE, self.pace / self.paced))
        last = self.last_sample
        if last is not None and waiting and now > last[0] and last[2]:
            self.acked_bytes += max(0, delivered - last[1])
            self.backlog_seconds += now - last[0]
        self.last_sample = (now, delivered, waiting)

    def unpace(self) -> None:
        """Lift the links' pacing for good (they go back to the pool, for other streams)."""
        self.pace = None
        if self.paced:
            for link in self.links.values():
                link.pace(None)
            self.paced = 0

    def received(self, channel: Any, previous: float | None, nbytes: int) -> float | None:
        """Count a chunk that just arrived on `channel`, whose last chunk arrived at `previous`
        (None: this is its first, and how long that one took is unknown); returns the time to
        pass as `previous` next time. Chunks from ourselves count for nothing."""
        if getattr(channel, "loopback", False):
            return None
        now = asyncio.get_running_loop().time()
        if previous is not None:
            self.received_bytes += nbytes
            self.arrivals.append((previous, now, nbytes))
        self._sample()
        return now

    @property
    def download(self) -> float | None:
        """Measured bytes/s received: the busiest stretch of the step. Each chunk after its
        stream's first is spread evenly over the time since the previous one (how long it was
        on its way); the step is cut into DOWNLOAD_BINS stretches, and the fullest one gives
        the rate. A slow sender stretches the step but not the stretch where fast senders
        filled our link; waiting for a stream to start is not counted."""
        if not self.received_bytes or not self.arrivals:
            return None
        begin = min(a for a, _, _ in self.arrivals)
        width = (max(b for _, b, _ in self.arrivals) - begin) / DOWNLOAD_BINS
        if width <= 0:
            return None
        filled = [0.0] * DOWNLOAD_BINS
        for start, stop, nbytes in self.arrivals:
            if stop <= start:
                continue  # arrived with the previous chunk: its bytes show in no stretch
            rate = nbytes / (stop - start)
            first, last = int((start - begin) / width), min(DOWNLOAD_BINS - 1, int((stop - begin) / width))
            for k in range(first, last + 1):
                overlap = min(stop, begin + (k + 1) * width) - max(start, begin + k * width)
                filled[k] += rate * max(0.0, overlap)
        return max(filled) / width if max(filled) > 0 else None

    async def send(self, channel: Any, message: Any) -> None:
        if channel.loopback:  # this member's own shard: it never leaves the process
            await channel.send(message)
            return
        loop = asyncio.get_running_loop()
        link = getattr(getattr(channel, "connection", None), "link", None)
        if hasattr(link, "unsent") and id(link) not in self.links:  # a link with buffers of its own (TCP)
            self._sample()  # (the stretch before counts the links it knew)
            self.links[id(link)] = link
            self.last_sample = None
            self.paced = 0  # split the pace again, with this link
        self._sample()
        if self.in_flight == 0:
            self.busy_since = loop.time()
        self.in_flight += 1
        try:
            await channel.send(message)
            self.sent_bytes += payload_bytes(message)
        finally:
            self._sample()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_seconds += loop.time() - self.busy_since


def payload_bytes(message: Any) -> int:
    """Bytes of the tensors in a (possibly nested) message dict; small fields are ignored."""
    if isinstance(message, torch.Tensor):
        return message.numel() * message.element_size()
    if isinstance(message, dict):
        return sum(payload_bytes(v) for v in message.values() if isinstance(v, (dict, torch.Tensor)))
    return 0
