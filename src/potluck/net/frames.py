"""The wire format: length-prefixed frames, decoded without any I/O (the h11 shape).

A frame is a 16-byte prefix, a msgpack header and a raw payload:

    prefix  = version:u8 kind:u8 flags:u16 header_len:u32 payload_len:u64   (little endian)
    header  = msgpack [call_id, meta, specs, body]   (meta: small protocol fields; body: user data)
    payload = the raw bytes of every tensor in the body, back to back (see core.serialization)

`FrameDecoder` tells its caller where the next received bytes should go (`get_buffer`), so a
large tensor payload is received straight into the tensor that will be handed to the user.
`Hello` is the meta of the first frame each side of a connection sends.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np
import torch

from potluck.core import serialization
from potluck.core.errors import MessageTooLarge, ProtocolError, SerializationError
from potluck.core.wire import Bool, Bytes, Int, Message
from potluck.net.address import Multiaddr
from potluck.net.identity import PeerID
from potluck.net.membership import MAX_TOKEN_BYTES
from potluck.net.wire import AddressesField, PeerIdField

VERSION = 1
PREFIX = struct.Struct("<BBHIQ")

# 64 MiB: big enough for one unary call with a large activation batch (an expert's 2048 x 1024
# float32 input is 8 MiB), small enough that a forged length cannot make a peer allocate much.
# Bulk data travels as streams of 1-4 MiB chunks, so this is rarely the limit that matters.
DEFAULT_MAX_FRAME_SIZE = 64 * 2**20

# Receive scratch space. Frames that fit are parsed in place; bigger payloads bypass it. The
# scratch grows (doubling) only as bytes arrive: what a frame's prefix announces is never allocated
# ahead of its bytes, so 16 bytes announcing a 64 MiB header cost nothing until 64 MiB are sent.
SCRATCH_SIZE = 256 * 2**10

# A frame on its way must come at this average rate at least once it has been arriving for
# FRAME_GRACE_SECONDS: any byte is proof of life for the keepalive, so a peer trickling a byte now
# and then held a large frame half-received (and its buffer) for good. 16 KiB/s (128 kbit/s) is
# below any link that can take part in training; a 64 MiB frame at that rate takes 68 minutes.
MIN_FRAME_RATE = 16 * 2**10
FRAME_GRACE_SECONDS = 30.0

# A payload up to this size is sent in one piece with its header: each piece is a write (a TLS
# record and a system call), which costs more than copying a small payload once.
JOIN_PAYLOAD = 64 * 2**10

# What each tensor of a frame costs its receiver in memory, counted against the frame's size limit
# (with the frame's bytes): a spec takes as little as 10 header bytes, but the tensor built for it
# takes ~630 bytes while the frame is on its way (measured), so 1.7 MB of header announcing 100,000
# one-element tensors held +59 MiB (+76 MiB for 60,000 with the views then made up front). Counted
# so, a frame under way holds at most about its limit; 5,000 scalars still fit 64 MiB frames.
TENSOR_COST = 1024

# The smallest frame limit a peer may announce: below 1 KiB it could not take an ordinary call.
MIN_MAX_FRAME_SIZE = 1024


class Kind(IntEnum):
    """Frame kinds. Only the protocol's own verbs live here; codecs and methods are strings."""

    HELLO = 1
    AUTH = 2
    REQUEST = 3
    RESPONSE = 4
    ERROR = 5
    CANCEL = 6
    OPEN = 7
    DATA = 8
    END = 9
    WINDOW = 10
    PING = 11
    PONG = 12
    GOAWAY = 13


@dataclass(slots=True)
class Frame:
    kind: Kind
    call_id: int = 0
    meta: dict[str, Any] | None = None
    body: Any = None
    size: int = 0  # bytes on the wire; set by encode() and by the decoder


class Hello(Message, what="HELLO"):
    """The meta of a HELLO, the first frame each way: who the sender is and how to talk to it (its
    addresses, at most MAX_ADDRESSES_PER_PEER; whether it is in client mode; the largest frame it
    takes; whether this connection is for one bulk stream; its membership token, if any). A
    relayed emulated link's whole handshake; `net.tcp` adds what proves the id."""

    peer_id: PeerID = PeerIdField("id", raw=True)
    addresses: tuple[Multiaddr, ...] = AddressesField("addrs", parsed=True)
    client_mode: bool = Bool("client")
    max_frame_size: int = Int("max_frame", MIN_MAX_FRAME_SIZE, 2**64)
    bulk: bool = Bool()
    token: bytes | None = Bytes(max_bytes=MAX_TOKEN_BYTES, optional=True)


def encode(frame: Frame, max_frame_size: int | None = None) -> list[bytes | memoryview]:
    """Serialize a frame into buffers to write in order; sets `frame.size`."""
    packed = serialization.pack(frame.body)
    header = msgpack.packb([frame.call_id, frame.meta, packed.specs, packed.body], use_bin_type=True)
    payload_len = sum(b.nbytes for b in packed.buffers)
    frame.size = PREFIX.size + len(header) + payload_len
    if max_frame_size is not None and frame.size + len(packed.specs) * TENSOR_COST > max_frame_size:
        raise MessageTooLarge(
            f"a {frame.size}-byte frame of {len(packed.specs)} tensors exceeds the peer's max frame size of "
            f"{max_frame_size} bytes (each tensor counts {TENSOR_COST} bytes more); send large data as a stream "
            "of smaller chunks")
    prefix = PREFIX.pack(VERSION, frame.kind, 0, len(header), payload_len)
    if payload_len <= JOIN_PAYLOAD:
        return [b"".join([prefix, header, *packed.buffers])]
    return [prefix + header, *[b for b in packed.buffers if b.nbytes]]


# What a frame's header costs on the wire, roughly (call id, meta, specs), in `estimated_size`.
HEADER_ESTIMATE = 64


def estimated_size(body: Any) -> int:
    """About the bytes a frame carrying `body` takes on the wire, without encoding it: what a
    loopback frame is charged (so a stream's byte window bounds it as on a wire), and what an
    answer waiting to be written counts against its caller (`net.connection`)."""
    return PREFIX.size + HEADER_ESTIMATE + _payload_size(body)


def _payload_size(body: Any, depth: int = 0) -> int:
    """About the bytes `body` would take on the wire: its buffers in full, its structure roughly."""
    if isinstance(body, torch.Tensor):
        return body.numel() * body.element_size()
    if isinstance(body, np.ndarray):
        return body.nbytes
    if isinstance(body, (bytes, bytearray, str)):
        return len(body)
    if isinstance(body, memoryview):
        return body.nbytes
    if depth > 32:  # deeper than any valid message: the size no longer matters
        return 0
    if isinstance(body, dict):
        return sum(_payload_size(k, depth + 1) + _payload_size(v, depth + 1) for k, v in body.items())
    if isinstance(body, (list, tuple)):
        return sum(_payload_size(v, depth + 1) for v in body) + 1
    return 8


class FrameDecoder:
    """Turns received bytes into frames; raises ProtocolError / MessageTooLarge on bad input."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, scratch_size: int = SCRATCH_SIZE):
        self.max_frame_size = max_frame_size
        # While True, parsing stops after each frame so the caller can change `max_frame_size`
        # before the next one is looked at (the handshake's cap ends with the handshake); the
        # caller then asks for the rest with `parse_more()`.
        self.one_at_a_time = False
        self._scratch = bytearray(scratch_size)
        self._base_size = scratch_size
        self._start = 0  # first unparsed byte in scratch
        self._end = 0  # end of received bytes in scratch
        # While receiving a large payload directly: the frame being built and where bytes go.
        self._pending: tuple[Kind, int, Any, bytes, list, int] | None = None
        self._targets: list[torch.Tensor] = []  # tensors still to fill, last first
        self._target: memoryview | None = None  # the bytes of the one being filled
        self._target_offset = 0
        self._since: float | None = None  # when the frame now on its way began to arrive (see `paced`)
        self._received = 0  # its bytes so far (about: those of the reads since then)

    # -- the BufferedProtocol side -------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Writable memory for the next received bytes."""
        if self._target is not None:
            return self._target[self._target_offset:]
        if self._end == len(self._scratch):
            unparsed = self._end - self._start
            if unparsed <= len(self._scratch) // 2:
                self._make_room(len(self._scratch) - unparsed)  # moving the tail frees enough
            else:
                # At least double what is unparsed, so a large header costs O(n) copying and
                # never more than twice its received bytes.
                self._make_room(max(self._base_size, unparsed))
        return memoryview(self._scratch)[self._end:]

    def grow_scratch(self, size: int) -> None:
        """Make the scratch at least `size` bytes (after the handshake: a small scratch until then)."""
        self._base_size = max(self._base_size, size)
        if len(self._scratch) < size:
            self._make_room(size - (self._end - self._start))

    def parse_more(self) -> list[Frame]:
        """Frames already received but held back by `one_at_a_time`."""
        frames: list[Frame] = []
        if self._target is None:
            self._parse_scratch(frames)
        return frames

    def paced(self, frames: list[Frame], nbytes: int, now: float) -> list[Frame]:
        """`frames`, the result of `buffer_updated(nbytes)` at loop time `now`, once it is checked
        that a frame still on its way comes at MIN_FRAME_RATE (ProtocolError otherwise)."""
        if not self.partial:
            self._since = None
        elif self._since is None or frames:
            self._since, self._received = now, 0
        else:
            self._received += nbytes
            elapsed = now - self._since
            if elapsed > FRAME_GRACE_SECONDS and self._received < MIN_FRAME_RATE * elapsed:
                raise ProtocolError(f"a frame arriving at {self._received / elapsed:.0f} bytes/s for {elapsed:.0f} s "
                                    f"(at least {MIN_FRAME_RATE} are expected)")
        return frames

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for `nbytes` written into the last buffer; returns the frames now complete."""
        frames: list[Frame] = []
        if self._target is not None:
            self._target_offset += nbytes
            if self._target_offset == self._target.nbytes:
                self._next_target()
            if self._target is not None:
                return frames
            frames.append(self._finish_pending())
        else:
            self._end += nbytes
        self._parse_scratch(frames)
        return frames

    @property
    def partial(self) -> bool:
        """Whether part of a frame has come and the rest not yet."""
        return self._target is not None or self._end > self._start

    def feed(self, data: bytes) -> list[Frame]:
        """Convenience for tests and non-buffered links: copy `data` in and parse."""
        frames: list[Frame] = []
        view = memoryview(data)
        while view.nbytes:
            buf = self.get_buffer()
            n = min(buf.nbytes, view.nbytes)
            buf[:n] = view[:n]
            view = view[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    # -- parsing -------------------------------------------------------------------------------
    def _make_room(self, need: int) -> None:
        """Move unparsed bytes to the front of scratch, growing it so `need` more bytes fit."""
        unparsed = self._end - self._start
        size = max(len(self._scratch), unparsed + need)
        if size > len(self._scratch) or self._start:
            new = bytearray(size)
            new[:unparsed] = self._scratch[self._start:self._end]
            self._scratch = new
            self._start, self._end = 0, unparsed

    def _parse_scratch(self, frames: list[Frame]) -> None:
        while True:
            avail = self._end - self._start
            if avail < PREFIX.size:
                break
            version, kind, _flags, header_len, payload_len = PREFIX.unpack_from(self._scratch, self._start)
            if version != VERSION:
                raise ProtocolError(f"unknown frame version {version} (expected {VERSION}); "
                                    "the other side does not speak the potluck protocol")
            try:
                kind = Kind(kind)
            except ValueError:
                raise ProtocolError(f"unknown frame kind {kind}") from None
            total = PREFIX.size + header_len + payload_len
            if total > self.max_frame_size:
                raise MessageTooLarge(f"received a frame of {total} bytes; the limit is "
                                      f"{self.max_frame_size} bytes (max_frame_size)")
            head_end = PREFIX.size + header_len
            if avail < head_end:
                break  # wait for the rest; get_buffer grows the scratch as the bytes come
            header = bytes(self._scratch[self._start + PREFIX.size:self._start + head_end])
            call_id, meta, body, tensors, sizes = _parse_header(
                header, payload_len, (self.max_frame_size - total) // TENSOR_COST)
            self._targets = [t for t, n in zip(reversed(tensors), reversed(sizes), strict=True) if n]
            self._next_target()
            # Copy whatever part of the payload is already in scratch.
            pos = self._start + head_end
            present = min(payload_len, self._end - pos)
            while self._target is not None and present:
                n = min(self._target.nbytes, present)
                self._target[:n] = self._scratch[pos:pos + n]
                pos, present = pos + n, present - n
                if n == self._target.nbytes:
                    self._next_target()
                else:
                    self._target_offset = n
            self._start = pos
            self._pending = (kind, call_id, meta, body, tensors, total)
            if self._target is not None:
                # The rest of the payload is received directly into the tensors.
                if self._start == self._end:
                    self._start = self._end = 0
                return
            frames.append(self._finish_pending())
            if self.one_at_a_time:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _next_target(self) -> None:
        """Receive into the next tensor of the pending frame (a view made only when its turn comes)."""
        self._target = serialization.tensor_memory(self._targets.pop()) if self._targets else None
        self._target_offset = 0

    def _finish_pending(self) -> Frame:
        assert self._pending is not None
        kind, call_id, meta, body, tensors, total = self._pending
        self._pending = None
        try:
            value = serialization.unpack(body, tensors, max_body_bytes=self.max_frame_size)
        except SerializationError as e:
            raise ProtocolError(f"malformed message body: {e}") from None
        return Frame(kind, call_id, meta, value, total)


def _parse_header(header: bytes, payload_len: int, max_tensors: int) -> tuple[int, dict | None, bytes, list, list[int]]:
    try:
        # msgpack caps every length at the header's size by default; no ext types in a header.
        parsed = serialization.unpackb_bounded(header, serialization.spec_containers(len(header)), max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - any failure here is the peer's malformed header
        raise ProtocolError(f"malformed frame header: {e}") from None
    if not (isinstance(parsed, list) and len(parsed) == 4):
        raise ProtocolError("malformed frame header: expected [call_id, meta, specs, body]")
    call_id, meta, specs, body = parsed
    if not (isinstance(call_id, int) and not isinstance(call_id, bool) and call_id >= 0):
        raise ProtocolError("malformed frame header: call id must be a non-negative integer")
    if meta is not None and not isinstance(meta, dict):
        raise ProtocolError("malformed frame header: meta must be a map")
    if not isinstance(specs, list) or not isinstance(body, bytes):
        raise ProtocolError("malformed frame header: bad tensor specs or body")
    if len(specs) > max_tensors:
        raise MessageTooLarge(f"received a frame of {len(specs)} tensors; with its bytes it exceeds the limit of "
                              f"{max_tensors} (each tensor counts {TENSOR_COST} bytes of max_frame_size)")
    try:
        sizes = serialization.nbytes_of(specs)
        if sum(sizes) != payload_len:
            raise ProtocolError(f"frame payload is {payload_len} bytes but its tensors need {sum(sizes)}")
        tensors = serialization.allocate(specs)
    except SerializationError as e:
        raise ProtocolError(f"malformed tensor description: {e}") from None
    return call_id, meta, body, tensors, sizes

