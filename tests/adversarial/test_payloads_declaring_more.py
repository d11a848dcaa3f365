"""A codec payload of a few bytes must not make a peer build a tensor of its declared size.

Sparse and top-k payloads carry a shape and only the nonzero entries: 65 bytes could declare
2^28 zeros, and the receiver built that 1 GiB tensor before comparing it with the chunk size it
expected (any member of a group: a sender to its reducer, a reducer to every member; Streaming
DiLoCo sends top-k this way). Every codec's payload now has its declared size checked against
the expected one before it is rebuilt (`Codec.decode(payload, numel)`, `most=` for the
pipeline's activations, whose batch varies)."""

from __future__ import annotations

import pytest
import torch

from potluck.averaging.allreduce.reduction import decode_chunk
from potluck.compression import get_codec, topk
from potluck.core.errors import AveragingError, CompressionError

EXPECTED = 1000


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["sparse", "topk"])
def test_a_sparse_payload_declaring_a_huge_tensor_is_refused_before_it_is_built(monkeypatch, codec):
    built: list[int] = []
    scatter = topk._scatter

    def counting(shape, indices, values, name):
        built.append(shape.numel())
        return scatter(shape, indices, values, name)
    monkeypatch.setattr(topk, "_scatter", counting)
    hostile = {"shape": [2**28], "indices": torch.zeros(0, dtype=torch.int32), "values": torch.zeros(0)}
    with pytest.raises((AveragingError, CompressionError)):
        decode_chunk(get_codec(codec), hostile, EXPECTED)
    assert all(n <= EXPECTED for n in built), f"built a tensor of {max(built)} elements for a chunk of {EXPECTED}"
    honest = get_codec(codec).encode(torch.arange(EXPECTED, dtype=torch.float32))
    assert decode_chunk(get_codec(codec), honest, EXPECTED).numel() == EXPECTED


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["none", "fp16", "uniform8", "quantile8", "blockwise8", "blockwise4"])
def test_every_codec_checks_the_declared_size_first(codec):
    payload = get_codec(codec).encode(torch.randn(4 * EXPECTED))
    with pytest.raises(CompressionError, match="stands for 4000 elements"):
        get_codec(codec).decode(payload, EXPECTED)
    with pytest.raises(CompressionError, match="over the"):
        get_codec(codec).decode(payload, most=EXPECTED)
    assert get_codec(codec).decode(payload, 4 * EXPECTED).numel() == 4 * EXPECTED
