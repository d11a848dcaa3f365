"""`BufferPool`: the float32 host buffers an all-reduce service reuses from round to round
(pinned once an averager of the service holds CUDA tensors: see `pin_memory`)."""

from __future__ import annotations

import torch

__all__ = ["MAX_POOLED_BYTES", "POOL_GRANULE", "BufferPool"]

# Buffers kept for the next rounds: a member's snapshot and result and its reduced shard, for a
# vector of up to 32M floats (128 MiB). Reusing them keeps a long run from allocating (and the
# kernel from zeroing and faulting in, page by page) a model's worth of memory per round: that
# was a third of a 16M-float round's CPU. Larger vectors get fresh buffers every round.
MAX_POOLED_BYTES = 320 * 2**20
# Pooled buffers are sized up to a multiple of this many elements, so shards whose size changes
# a little between rounds (load balancing) still fit the buffers of the last round.
POOL_GRANULE = 2**16


class BufferPool:
    """Float32 buffers reused from round to round (see MAX_POOLED_BYTES), largest kept first."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES):
        self.max_bytes = max_bytes
        # Allocate page-locked buffers from now on (set when an averager's tensors are on a CUDA
        # device): copies between them and the device are asynchronous and about twice as fast.
        # Only buffers the pool may keep are pinned: pinning costs more than the copy it speeds up
        # for a buffer used once.
        self.pin_memory = False
        self._free: list[torch.Tensor] = []
        self._bytes = 0

    def take(self, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements (its contents are arbitrary)."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]  # largest first
        if not fits:
            # The largest buffer that is too small is most likely one this request outgrew (a
            # shard that load balancing made larger): drop it, so that the pool holds what rounds
            # use now rather than filling up to its bound with stale sizes.
            # It grew once, so it may grow again: leave it an eighth more room.
            if self._free:
                self._bytes -= self._free.pop(0).numel() * 4
                numel += numel // 8
            size = -(-max(numel, 1) // POOL_GRANULE) * POOL_GRANULE
            pin = self.pin_memory and size * 4 <= self.max_bytes
            return torch.empty(size, dtype=torch.float32, pin_memory=pin)
        buffer = self._free.pop(fits[-1])  # the smallest that fits
        self._bytes -= buffer.numel() * 4
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take` (or a view of one) once nothing uses it any more."""
        if buffer._base is not None:
            buffer = buffer._base
        self._free.append(buffer)
        self._bytes += buffer.numel() * 4
        self._free.sort(key=torch.Tensor.numel, reverse=True)
        while self._bytes > self.max_bytes:
            self._bytes -= self._free.pop().numel() * 4
