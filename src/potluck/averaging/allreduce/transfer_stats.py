"""`TransferStats`: what one member sent and received in a step, for its bandwidth estimates."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DOWNLOAD_BINS", "TransferStats"]

# Stretches a step's receiving time is cut into for the download estimate: enough that the
# stretch where fast senders fill our link stands out from a slow sender's tail, few enough that
# each holds several chunks (a burst of chunks that sat in buffers is not a rate).
DOWNLOAD_BINS = 8


@dataclass
class TransferStats:
    """This member's uploads to and downloads from other peers during one step, for its
    bandwidth estimates.

    `busy_seconds` is the time during which at least one send to another peer was in flight
    (a send returns once the transport has taken the frame: on the emulated network, when this
    peer's upload of it is done). Waiting for data to reduce or for slower peers is not busy
    time, so bytes / busy time measures this peer's own upload, not the group's pace.
    Sends to itself (a member reducing its own shard) count for neither.
    """

    sent_bytes: int = 0
    busy_seconds: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0
    received_bytes: int = 0
    # (previous arrival, this arrival, bytes) of each chunk received from another peer after the
    # first of its stream: how long that chunk was on its way to us. One per chunk of the step.
    arrivals: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def upload(self) -> float | None:
        """Measured bytes/s, or None if nothing was sent."""
        return self.sent_bytes / self.busy_seconds if self.sent_bytes and self.busy_seconds > 0 else None

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
        if self.in_flight == 0:
            self.busy_since = loop.time()
        self.in_flight += 1
        try:
            await channel.send(message)
            self.sent_bytes += _payload_bytes(message)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_seconds += loop.time() - self.busy_since


def _payload_bytes(message: Any) -> int:
    """Bytes of the tensors in a (possibly nested) message dict; small fields are ignored."""
    if isinstance(message, torch.Tensor):
        return message.numel() * message.element_size()
    if isinstance(message, dict):
        return sum(_payload_bytes(v) for v in message.values() if isinstance(v, (dict, torch.Tensor)))
    return 0
