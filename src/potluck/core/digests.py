"""Digests of bulk data: the bytes of tensors, hashed in every all-reduce (each piece, as sent and
as received, and each result), for every state snapshot and every chunk a newcomer downloads.

BLAKE3 (the `blake3` package): as collision-resistant as SHA-256 for our purpose, and 3.5x its
speed on 16 KiB blocks here (4.5 GB/s against 1.3 with SHA-NI; BLAKE2b 0.9). With SHA-256 the
hashing was 23% of a 4-process all-reduce's CPU on 2 cores (benchmarks/allreduce.py, 16M floats);
every peer of a run must hash alike, so this is the one place that chooses.
"""

from __future__ import annotations

from typing import Any

import blake3

__all__ = ["DIGEST_BYTES", "Hasher", "digest"]

DIGEST_BYTES = 32  # (BLAKE3's default output, as SHA-256's)
Hasher = blake3.blake3  # incremental: Hasher().update(data); .digest(), .hexdigest()


def digest(data: Any) -> bytes:
    """The 32-byte digest of a bytes-like object (read in place: a memoryview or numpy array)."""
    return blake3.blake3(data).digest()
