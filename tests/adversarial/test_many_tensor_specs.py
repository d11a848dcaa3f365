"""A frame header announcing tens of thousands of tiny tensors cannot make its receiver hold
many times the frame's size while the payload is on its way.

A tensor spec takes as little as 10 header bytes, and the receiver builds each tensor (and, on the
old code, a numpy view of it) as soon as the header is in: 1.7 MB of header announcing 100,000
one-element tensors held +59 MiB and 1.3 s of CPU, per connection, for as long as the sender
trickled the payload. Now each tensor counts `frames.TENSOR_COST` bytes against the frame's size
limit, so such a frame is refused at its header; senders get the same rule as a local error."""

from __future__ import annotations

import msgpack
import pytest
import torch

from potluck.core import serialization
from potluck.core.errors import MessageTooLarge
from potluck.net.frames import PREFIX, TENSOR_COST, VERSION, Frame, FrameDecoder, Kind, encode

MiB = 2**20
LIMIT = 64 * MiB


def _frame_of(tensors: list[torch.Tensor]) -> tuple[bytes, bytes]:
    packed = serialization.pack(tensors)
    header = msgpack.packb([1, {"m": "echo", "t": 5}, packed.specs, packed.body], use_bin_type=True)
    payload = b"".join(bytes(b) for b in packed.buffers)
    return PREFIX.pack(VERSION, Kind.REQUEST, 0, len(header), len(payload)) + header, payload


def test_a_header_of_a_hundred_thousand_tiny_tensors_is_refused_before_any_is_built(monkeypatch):
    built = []
    allocate = serialization.allocate
    monkeypatch.setattr(serialization, "allocate", lambda specs: built.append(len(specs)) or allocate(specs))
    head, _ = _frame_of([torch.zeros(1) for _ in range(100_000)])
    assert len(head) < 2 * MiB  # far below the frame limit by its bytes alone
    with pytest.raises(MessageTooLarge, match="100000 tensors"):
        FrameDecoder(LIMIT).feed(head)
    assert built == []


def test_a_sender_is_told_before_sending_a_frame_its_peer_would_refuse():
    frame = Frame(Kind.REQUEST, 1, {"m": "echo"}, [torch.zeros(1) for _ in range(70_000)])
    with pytest.raises(MessageTooLarge, match="each tensor counts"):
        encode(frame, max_frame_size=LIMIT)
    assert encode(Frame(Kind.REQUEST, 1, {"m": "echo"}, [torch.zeros(1)] * 1000), max_frame_size=LIMIT)


def test_frames_of_many_small_tensors_within_the_limit_arrive_whole_in_any_pieces():
    tensors = [torch.arange(i % 7, dtype=torch.float32) + i for i in range(LIMIT // TENSOR_COST // 8)]
    head, payload = _frame_of(tensors)
    decoder = FrameDecoder(LIMIT)
    data = head + payload
    frames = []
    for start in range(0, len(data), 4093):  # pieces that end inside headers and tensors alike
        frames += decoder.feed(data[start:start + 4093])
    (frame,) = frames
    assert len(frame.body) == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(frame.body, tensors, strict=True))
    assert not decoder.partial
