"""The sans-IO frame codec: exact round trips, any split of the byte stream, zero-copy receive."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from potluck.core.errors import MalformedMessage, MessageTooLarge, ProtocolError
from potluck.net.address import Multiaddr
from potluck.net.address_book import MAX_ADDRESSES_PER_PEER
from potluck.net.frames import (
    MIN_MAX_FRAME_SIZE,
    PREFIX,
    SCRATCH_SIZE,
    VERSION,
    Frame,
    FrameDecoder,
    Hello,
    Kind,
    encode,
)
from potluck.net.identity import Identity


def wire(frame: Frame) -> bytes:
    return b"".join(bytes(b) for b in encode(frame))


def test_round_trip_at_every_split_point():
    frame = Frame(Kind.REQUEST, 7, {"m": "echo", "t": 1.5}, {"x": torch.arange(10), "s": "hi"})
    data = wire(frame) + wire(Frame(Kind.PING))
    for split in range(len(data) + 1):
        decoder = FrameDecoder()
        frames = decoder.feed(data[:split]) + decoder.feed(data[split:])
        assert [f.kind for f in frames] == [Kind.REQUEST, Kind.PING], split
        first = frames[0]
        assert first.call_id == 7 and first.meta == {"m": "echo", "t": 1.5}
        assert torch.equal(first.body["x"], torch.arange(10)) and first.body["s"] == "hi"
        assert first.size == len(data) - len(wire(Frame(Kind.PING)))


def test_many_frames_in_one_read():
    data = b"".join(wire(Frame(Kind.DATA, i, body=i)) for i in range(1000))
    frames = FrameDecoder().feed(data)
    assert [f.body for f in frames] == list(range(1000))


def test_large_payload_is_received_directly_into_the_tensor():
    tensor = torch.randn(1_000_000)
    data = wire(Frame(Kind.DATA, 1, body=tensor))
    decoder = FrameDecoder()
    # First read: prefix, header and the start of the payload land in scratch space.
    head = decoder.get_buffer()
    n = head.nbytes
    head[:n] = data[:n]
    assert decoder.buffer_updated(n) == []
    # Every later read targets the tensor's own memory.
    pos, target_addresses = n, []
    frames = []
    while pos < len(data):
        buf = decoder.get_buffer()
        target_addresses.append(np.frombuffer(buf, np.uint8).ctypes.data)
        k = min(buf.nbytes, 1 << 20, len(data) - pos)
        buf[:k] = data[pos:pos + k]
        pos += k
        frames += decoder.buffer_updated(k)
    (frame,) = frames
    received = frame.body
    start, end = received.data_ptr(), received.data_ptr() + received.numel() * 4
    assert all(start <= a < end for a in target_addresses)
    assert torch.equal(received, tensor)
    assert n <= SCRATCH_SIZE


def test_headers_bigger_than_scratch_space_are_parsed():
    body = {"blob": b"x" * (3 * SCRATCH_SIZE)}
    frames = FrameDecoder().feed(wire(Frame(Kind.RESPONSE, 3, body=body)))
    assert frames[0].body == body


@pytest.mark.parametrize("data, error, words", [
    (PREFIX.pack(VERSION + 1, Kind.PING, 0, 0, 0), ProtocolError, "version"),
    (PREFIX.pack(VERSION, 200, 0, 0, 0), ProtocolError, "kind"),
    (PREFIX.pack(VERSION, Kind.PING, 0, 2**31, 0), MessageTooLarge, "max_frame_size"),
    (PREFIX.pack(VERSION, Kind.PING, 0, 10, 2**62), MessageTooLarge, "max_frame_size"),
    (PREFIX.pack(VERSION, Kind.PING, 0, 3, 0) + b"\xc1\xc1\xc1", ProtocolError, "header"),
    (PREFIX.pack(VERSION, Kind.PING, 0, 1, 0) + b"\x05", ProtocolError, "expected"),
])
def test_bad_frames_raise_clear_errors(data, error, words):
    with pytest.raises(error, match=words):
        FrameDecoder(max_frame_size=2**20).feed(data)


def test_payload_length_must_match_tensor_specs():
    good = wire(Frame(Kind.DATA, 1, body=torch.zeros(4)))
    version, kind, flags, hlen, plen = PREFIX.unpack_from(good)
    forged = PREFIX.pack(version, kind, flags, hlen, plen + 8) + good[PREFIX.size:] + b"\x00" * 8
    with pytest.raises(ProtocolError, match="payload"):
        FrameDecoder().feed(forged)


def test_sender_refuses_frames_over_the_peer_limit():
    with pytest.raises(MessageTooLarge, match="stream"):
        encode(Frame(Kind.DATA, 1, body=torch.zeros(1000)), max_frame_size=1000)


def test_one_at_a_time_lets_the_caller_raise_the_limit_between_frames():
    """The handshake's small cap ends with the handshake: frames after the last handshake frame,
    received in the same read, are parsed under the limit set after it (net.tcp relies on this)."""
    small = b"".join(bytes(b) for b in encode(Frame(Kind.AUTH, meta={"sig": b"x" * 64})))
    big = b"".join(bytes(b) for b in encode(Frame(Kind.REQUEST, 1, {"m": "m"}, body=b"y" * 20_000)))
    decoder = FrameDecoder(4096, scratch_size=4096)
    decoder.one_at_a_time = True
    (first,) = decoder.feed(small + big[:3000])  # stops after the AUTH frame
    assert first.kind is Kind.AUTH
    decoder.max_frame_size, decoder.one_at_a_time = 1 << 20, False
    assert decoder.parse_more() == []  # the rest is incomplete, and no longer too large
    (second,) = decoder.feed(big[3000:])
    assert second.body == b"y" * 20_000
    with pytest.raises(MessageTooLarge):
        FrameDecoder(4096).feed(big)


def test_a_hello_keeps_its_keys_and_sends_no_more_addresses_than_a_receiver_reads():
    me = Identity.generate().peer_id
    hello = Hello(me, (Multiaddr.parse("/ip4/10.0.0.1/tcp/1"),), False, 2**20, True, None)
    meta = hello.to_wire()
    assert meta == {"id": me.to_bytes(), "addrs": ["/ip4/10.0.0.1/tcp/1"], "client": False, "max_frame": 2**20,
                    "bulk": True, "token": None}
    assert Hello.from_wire(meta) == hello
    for change, key in [({"max_frame": MIN_MAX_FRAME_SIZE - 1}, "'max_frame'"), ({"bulk": None}, "'bulk'"),
                        ({"id": str(me)}, "'id'"), ({"token": "text"}, "'token'")]:
        with pytest.raises(MalformedMessage) as caught:
            Hello.from_wire({**meta, **change})
        assert caught.value.field.startswith(key)
    many = tuple(Multiaddr.parse(f"/ip4/10.0.0.{i}/tcp/1") for i in range(MAX_ADDRESSES_PER_PEER + 3))
    sent = Hello(me, many, False, 2**20, False, b"token").to_wire()
    assert Hello.from_wire(sent).addresses == many[:MAX_ADDRESSES_PER_PEER]
