"""Tests for potluck.core.serialization: round trips, zero-copy, and refusal of bad input."""

from __future__ import annotations

import contextlib
import random
import re
import struct

import msgpack
import numpy as np
import pytest
import torch

from potluck.core.errors import SerializationError
from potluck.core.serialization import (
    EXT_NDARRAY,
    EXT_TENSOR,
    MAX_DEPTH,
    WIRE_DTYPES,
    allocate,
    dumps,
    loads,
    nbytes_of,
    pack,
    tensor_memory,
    unpack,
)


def transfer(obj: object) -> object:
    """Simulate the wire: specs through msgpack, payload read straight into allocated tensors."""
    packed = pack(obj)
    specs = msgpack.unpackb(msgpack.packb(packed.specs))
    assert nbytes_of(specs) == [buf.nbytes for buf in packed.buffers]
    tensors = allocate(specs)
    for tensor, buf in zip(tensors, packed.buffers, strict=True):
        assert buf.format == "B" and buf.ndim == 1
        tensor_memory(tensor)[:] = bytes(buf)
    return unpack(bytes(packed.body), tensors)


def both_ways(obj: object) -> list[object]:
    return [transfer(obj), loads(dumps(obj)), loads(memoryview(dumps(obj)))]


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` filled with random bytes (works for every byte-addressable dtype)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def ext(code: int, index: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(index))


# ---------------------------------------------------------------- round trips


def test_nested_roundtrip() -> None:
    obj = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "floats": [0.0, -1.5, float("inf")],
        "text": "héllo ✓",
        "blob": b"\x00\xff",
        "barr": bytearray(b"ab"),
        "mv": memoryview(b"cd"),
        7: {"nested": [[1, [2, {"deep": b"x"}]]]},
        b"k": "bytes key",
        "weights": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    }
    for got in both_ways(obj):
        assert got["none"] is None and got["flags"] == [True, False]
        assert got["ints"] == obj["ints"] and got["floats"] == obj["floats"]
        assert got["text"] == obj["text"]
        assert got["blob"] == b"\x00\xff" and got["barr"] == b"ab" and got["mv"] == b"cd"
        assert type(got["barr"]) is bytes and type(got["mv"]) is bytes
        assert got[7] == {"nested": [[1, [2, {"deep": b"x"}]]]}
        assert got[b"k"] == "bytes key"
        assert torch.equal(got["weights"], obj["weights"])


def test_nan_survives() -> None:
    got = loads(dumps([float("nan")]))
    assert got[0] != got[0]


def test_tuples_become_lists() -> None:
    for got in both_ways((1, (2, 3), [4, (5,)])):
        assert got == [1, [2, 3], [4, [5]]]
        assert type(got) is list and type(got[1]) is list


@pytest.mark.parametrize("name", list(WIRE_DTYPES))
def test_every_dtype_byte_exact(name: str) -> None:
    dtype = WIRE_DTYPES[name]
    cases = [
        random_tensor(dtype, (3, 4), seed=1),
        random_tensor(dtype, (), seed=2),  # 0-dim
        random_tensor(dtype, (0, 5), seed=3),  # empty
        random_tensor(dtype, (4, 3), seed=4).t(),  # non-contiguous
        random_tensor(dtype, (2, 3, 4), seed=5)[:, 1],  # strided slice
    ]
    for original in cases:
        for got in both_ways(original):
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
            assert got.dtype == dtype and got.shape == original.shape
            assert got.is_contiguous()
            assert raw_bytes(got) == raw_bytes(original)


def test_required_dtypes_are_supported() -> None:
    for name in ("float32", "float64", "float16", "bfloat16", "bool", "complex64",
                 "complex128", "int8", "int16", "int32", "int64", "uint8"):  # fmt: skip
        assert name in WIRE_DTYPES
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            assert name in WIRE_DTYPES


def test_requires_grad_parameter_and_lazy_bits() -> None:
    leaf = torch.randn(3, 2, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(4))
    conj = torch.randn(3, dtype=torch.complex64).conj()
    neg = torch.randn(3, dtype=torch.complex64).conj().imag  # a view with the neg bit
    for original in (leaf, leaf * 2, param, conj, neg):
        for got in both_ways(original):
            assert type(got) is torch.Tensor and not got.requires_grad
            assert torch.equal(got, original.detach().resolve_conj().resolve_neg())


def test_numpy_roundtrip_and_memory_sharing() -> None:
    cases = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(3.5),  # 0-dim
        np.zeros((0, 3), dtype=np.int64),
        np.array([True, False, True]),
        np.arange(10, dtype=np.uint16)[::3],  # non-contiguous
        np.arange(6, dtype=">f8"),  # big-endian, decoded native
        np.array([1 + 2j, 3 - 4j], dtype=np.complex128),
        np.arange(4, dtype=np.uint64),
    ]
    for original in cases:
        for got in both_ways(original):
            assert type(got) is np.ndarray
            assert got.dtype == original.dtype.newbyteorder("=") and got.shape == original.shape
            np.testing.assert_array_equal(got, original)
    packed = pack({"a": np.arange(5, dtype=np.int32)})
    assert packed.specs == [["np:int32", [5]]]
    tensors = allocate(packed.specs)
    memory = tensor_memory(tensors[0])
    memory[:] = bytes(packed.buffers[0])
    got = unpack(packed.body, tensors)["a"]
    assert got.ctypes.data == np.frombuffer(memory, np.uint8).ctypes.data  # no copy


def test_numpy_bad_dtypes_refused() -> None:
    bad_arrays = [
        np.array([object()]),
        np.array(["str"]),
        np.zeros(2, dtype="M8[s]"),
        np.zeros(2, dtype=[("a", "i4")]),
        np.ma.masked_array([1, 2], mask=[0, 1]),
    ]
    for bad in bad_arrays:
        with pytest.raises(SerializationError):
            pack(bad)


def test_pack_does_not_copy_contiguous_tensor() -> None:
    t = torch.randn(64, 32)
    packed = pack({"t": t, "again": [t[1:]]})
    assert np.frombuffer(packed.buffers[0], np.uint8).ctypes.data == t.data_ptr()
    assert np.frombuffer(packed.buffers[1], np.uint8).ctypes.data == t[1:].data_ptr()
    assert packed.buffers[0].nbytes == t.numel() * 4
    assert packed.specs == [["float32", [64, 32]], ["float32", [63, 32]]]
    bf = torch.randn(8, dtype=torch.bfloat16)
    assert np.frombuffer(pack(bf).buffers[0], np.uint8).ctypes.data == bf.data_ptr()


def test_pack_copies_non_contiguous_tensor() -> None:
    t = torch.randn(4, 8).t()
    buf = pack(t).buffers[0]
    assert np.frombuffer(buf, np.uint8).ctypes.data != t.data_ptr()


def test_tensor_memory_writes_land_in_tensor() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    memory = tensor_memory(t)
    assert memory.format == "B" and not memory.readonly and memory.nbytes == 16
    memory[4:8] = struct.pack("<f", 1.5)
    assert t.tolist() == [0.0, 1.5, 0.0, 0.0]
    for dtype in (torch.bfloat16, torch.bool, torch.complex64, torch.float64):
        for shape in ((), (0,), (2, 3)):
            t = torch.zeros(shape, dtype=dtype)
            memory = tensor_memory(t)
            assert memory.nbytes == t.numel() * dtype.itemsize
            memory[:] = b"\x01" * memory.nbytes
            assert raw_bytes(t) == b"\x01" * memory.nbytes


def test_tensor_memory_refuses_unsuitable_tensors() -> None:
    with pytest.raises(SerializationError, match="contiguous"):
        tensor_memory(torch.zeros(3, 4).t())
    with pytest.raises(SerializationError, match="conj"):
        tensor_memory(torch.zeros(3, dtype=torch.complex64).conj())
    with pytest.raises(SerializationError, match=r"torch\.Tensor"):
        tensor_memory(b"abc")  # type: ignore[arg-type]


# ---------------------------------------------------------------- refusals on encode


def _a_function() -> None:
    return None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({1, 2}, "set"),
        (object(), "object"),
        (_a_function, "function"),
        (lambda: 0, "function"),
        (np.float32(1.0), "numpy.float32"),
        ({1.5: "x"}, "dict keys"),
        ({True: "x"}, "dict keys"),
        ({(1, 2): "x"}, "dict keys"),
        (2**64, "msgpack range"),
        (-(2**63) - 1, "msgpack range"),
        (torch.zeros(2).to_sparse(), "sparse"),
        (["\ud800"], "encode"),
    ],
)
def test_unsupported_values_refused(value: object, words: str) -> None:
    with pytest.raises(SerializationError, match=words):
        pack(value)
    with pytest.raises(SerializationError):
        dumps(value)


def test_depth_limit_on_encode() -> None:
    ok: object = 1
    for _ in range(MAX_DEPTH):
        ok = [ok]
    assert loads(dumps(ok)) == ok
    with pytest.raises(SerializationError, match="nested deeper"):
        pack([ok])
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(SerializationError, match="nested deeper"):
        pack(cycle)


# ---------------------------------------------------------------- refusals on decode


@pytest.mark.parametrize(
    ("body", "n_tensors", "words"),
    [
        (msgpack.packb(ext(7, 0)), 1, "unknown ext type code 7"),
        (msgpack.packb(ext(EXT_TENSOR, 1)), 1, "out of range"),
        (msgpack.packb(ext(EXT_TENSOR, -1)), 1, "out of range"),
        (msgpack.packb(ext(EXT_TENSOR, 0)), 0, "out of range"),
        (msgpack.packb([ext(EXT_TENSOR, 0), ext(EXT_NDARRAY, 0)]), 1, "referenced twice"),
        (msgpack.packb(ext(EXT_TENSOR, "0")), 1, "must be an int"),
        (msgpack.packb(ext(EXT_TENSOR, True)), 1, "must be an int"),
        (msgpack.packb(msgpack.ExtType(EXT_TENSOR, b"\xc1")), 1, "malformed buffer reference"),
        (msgpack.packb(msgpack.ExtType(EXT_TENSOR, b"")), 1, "malformed buffer reference"),
        (msgpack.packb([1, 2]), 1, "not referenced"),
        (b"\xd6\xff\x00\x00\x00\x00", 0, "unsupported type"),  # msgpack Timestamp
        (b"\xc1", 0, "malformed"),
        (b"", 0, "malformed"),
        (b"\x93\x01\x02", 0, "malformed"),  # truncated array
        (msgpack.packb([1, 2]) + b"\x00", 0, "malformed"),  # extra data
        (b"\xa2\xff\xfe", 0, "malformed"),  # invalid utf-8
        (b"\x81\x91\x01\x02", 0, "malformed"),  # unhashable (list) map key
        (msgpack.packb({1.5: 1}), 0, "dict key"),
        (msgpack.packb({None: 1}), 0, "dict key"),
        (b"\x91" * (MAX_DEPTH + 1) + b"\x00", 0, "nested deeper"),
        (b"\x91" * 5000 + b"\x00", 0, "malformed"),  # beyond msgpack's own stack
    ],
)
def test_malicious_bodies_refused(body: bytes, n_tensors: int, words: str) -> None:
    tensors = [torch.zeros(2) for _ in range(n_tensors)]
    with pytest.raises(SerializationError, match=words):
        unpack(body, tensors)


def test_tensor_as_map_key_refused() -> None:
    body = b"\x81" + msgpack.packb(ext(EXT_TENSOR, 0)) + b"\x01"
    with pytest.raises(SerializationError, match="dict key"):
        unpack(body, [torch.zeros(1)])
    body = b"\x81" + msgpack.packb(ext(EXT_NDARRAY, 0)) + b"\x01"
    with pytest.raises(SerializationError):
        unpack(body, [torch.zeros(1)])


def test_ndarray_ref_to_non_numpy_dtype_refused() -> None:
    with pytest.raises(SerializationError, match="numpy"):
        unpack(msgpack.packb(ext(EXT_NDARRAY, 0)), [torch.zeros(1, dtype=torch.bfloat16)])


def test_body_size_limit() -> None:
    body = msgpack.packb(b"x" * 1000)
    assert unpack(body, []) == b"x" * 1000
    with pytest.raises(SerializationError, match="over 100"):
        unpack(body, [], max_body_bytes=100)
    with pytest.raises(SerializationError, match="over 100"):
        loads(dumps(b"x" * 1000), max_body_bytes=100)


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        ("float32", "specs must be a list"),
        ([["float33", [1]]], "unknown or unsupported dtype"),
        ([["torch.float32", [1]]], "unknown or unsupported dtype"),
        ([["np:bfloat16", [1]]], "unknown or unsupported dtype"),
        ([["qint8", [1]]], "unknown or unsupported dtype"),
        ([[5, [1]]], "dtype must be a str"),
        ([["float32", [-1]]], "out of range"),
        ([["float32", [1] * 40]], "40 dims"),
        ([["float32", [True, 2]]], "must be ints"),
        ([["float32", [1.0]]], "must be ints"),
        ([["float32", "12"]], "shape must be a list"),
        ([["float32", [2**62, 2**62]]], "too large"),
        ([["float32", [2**64]]], "out of range"),
        ([["float32"]], "[dtype, shape]"),
        ([["float32", [1], 0]], "[dtype, shape]"),
        (["float32"], "[dtype, shape]"),
        ([[[[[]]]]], "[dtype, shape]"),
    ],
)
def test_bad_specs_refused(specs: object, words: str) -> None:
    with pytest.raises(SerializationError, match=re.escape(words)):
        allocate(specs)  # type: ignore[arg-type]
    with pytest.raises(SerializationError):
        nbytes_of(specs)  # type: ignore[arg-type]


def test_good_specs() -> None:
    specs = [["bfloat16", [2, 3]], ["np:float64", []], ["bool", [0, 7]], ["complex64", [2]]]
    assert nbytes_of(specs) == [12, 8, 0, 16]
    tensors = allocate(specs)
    dtypes = [torch.bfloat16, torch.float64, torch.bool, torch.complex64]
    assert [t.dtype for t in tensors] == dtypes
    assert [tuple(t.shape) for t in tensors] == [(2, 3), (), (0, 7), (2,)]


def _dumps_parts(header: object, body: bytes = b"\xc0", payload: bytes = b"") -> bytes:
    head = msgpack.packb(header)
    return b"PLK1" + struct.pack("<I", len(head)) + head + body + payload


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "bad magic or too short"),
        (b"PLK1", "bad magic or too short"),
        (b"PLK2" + b"\x00" * 10, "bad magic"),
        (b"PLK1\xff\xff\xff\xff\x90", "truncated header"),
        (_dumps_parts({"a": 1}), "expected \\[body_len, specs\\]"),
        (_dumps_parts([1]), "expected \\[body_len, specs\\]"),
        (_dumps_parts([-1, []]), "bad body length"),
        (_dumps_parts([True, []]), "bad body length"),
        (_dumps_parts([1, "specs"]), "specs must be a list"),
        (_dumps_parts([1, [["float32", [2]]]], payload=b"\x00" * 7), "truncated"),
        (_dumps_parts([1, [["float32", [2]]]], payload=b"\x00" * 9), "trailing"),
        (b"PLK1\x01\x00\x00\x00\xc1", "malformed header"),
    ],
)
def test_loads_refuses_bad_framing(data: bytes, words: str) -> None:
    with pytest.raises(SerializationError, match=words):
        loads(data)


def test_loads_trailing_junk_and_truncation() -> None:
    good = dumps({"w": torch.randn(5, 5), "n": np.arange(3), "s": "text"})
    with pytest.raises(SerializationError, match="trailing"):
        loads(good + b"\x00")
    for cut in range(len(good)):
        with pytest.raises(SerializationError):
            loads(good[:cut])


def test_loads_refuses_non_bytes() -> None:
    with pytest.raises(SerializationError, match="expected bytes"):
        loads("PLK1")  # type: ignore[arg-type]


def test_dumps_layout() -> None:
    data = dumps({"t": torch.tensor([1.0, 2.0])})
    assert data[:4] == b"PLK1"
    (header_len,) = struct.unpack_from("<I", data, 4)
    body_len, specs = msgpack.unpackb(data[8 : 8 + header_len])
    assert specs == [["float32", [2]]]
    assert len(data) == 8 + header_len + body_len + 8
    assert data[-8:] == struct.pack("<2f", 1.0, 2.0)


# ---------------------------------------------------------------- fuzz


def _must_not_crash(data: bytes) -> None:
    with contextlib.suppress(SerializationError):
        loads(data)


def test_fuzz_loads_random_bytes() -> None:
    rng = random.Random(1234)
    for i in range(500):
        size = rng.randrange(0, 300)
        data = bytes(rng.randrange(256) for _ in range(size))
        if i % 2:  # get past the magic check half the time
            data = b"PLK1" + struct.pack("<I", rng.randrange(0, size + 8)) + data
        _must_not_crash(data)


def test_fuzz_loads_mutations() -> None:
    rng = random.Random(5678)
    sample = {
        "w": torch.randn(3, 4),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "n": np.arange(6, dtype=np.int16).reshape(2, 3),
        "meta": [1, "two", b"three", {"four": 4.0, 5: None}, (True, False)],
    }
    good = dumps(sample)
    for _ in range(500):
        data = bytearray(good)
        choice = rng.randrange(4)
        if choice == 0:
            data = data[: rng.randrange(len(data))]
        elif choice == 1:
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 2:
            pos = rng.randrange(len(data))
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        else:
            pos = rng.randrange(len(data))
            del data[pos : pos + rng.randrange(1, 8)]
        _must_not_crash(bytes(data))


def test_fuzz_unpack_random_bodies() -> None:
    rng = random.Random(91011)
    for _ in range(500):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        tensors = [torch.zeros(1) for _ in range(rng.randrange(3))]
        with contextlib.suppress(SerializationError):
            unpack(body, tensors)


def test_tensor_memory_refuses_sparse_and_meta() -> None:
    with pytest.raises(SerializationError, match="CPU tensor"):
        tensor_memory(torch.zeros(3).to_sparse())
    with pytest.raises(SerializationError, match="CPU tensor"):
        tensor_memory(torch.empty(3, device="meta"))
    with pytest.raises(SerializationError):
        pack(torch.empty(3, device="meta"))
