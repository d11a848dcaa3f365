"""Safe wire encoding: a msgpack body plus raw out-of-band tensor buffers. Never pickle.

`pack` turns a message into a msgpack *body* in which every tensor / ndarray is replaced by
an ext-type reference (its index into *buffers*), a list of *specs* (dtype name and shape of
each buffer) and the *buffers* themselves (flat uint8 views, no copy for contiguous CPU
tensors). A receiver validates the specs, `allocate`s empty tensors, reads the payload
straight into `tensor_memory(t)` and calls `unpack`. `dumps` / `loads` wrap all of that in
one self-contained byte string for DHT values and files.

Decoding is strict: every malformed or hostile input raises `SerializationError`.
Tuples decode as lists (msgpack has one array type).
"""

from __future__ import annotations

import struct
import types
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import msgpack
import numpy as np
import torch

from potluck.core.errors import SerializationError

__all__ = [
    "BYTES_PER_CONTAINER",
    "DECODE_FREE_CONTAINERS",
    "MAX_BODY_BYTES",
    "MAX_DEPTH",
    "WIRE_DTYPES",
    "Packed",
    "allocate",
    "dumps",
    "loads",
    "nbytes_of",
    "pack",
    "tensor_memory",
    "unpack",
    "unpackb_bounded",
]

# Ext type code of a reference to a buffer decoded as a torch.Tensor.
EXT_TENSOR = 1
# Ext type code of a reference to a buffer decoded as a numpy.ndarray.
EXT_NDARRAY = 2
# Containers nested deeper than this are refused: no legitimate message needs it, and it
# bounds recursion on both ends.
MAX_DEPTH = 64
# Default cap on a msgpack body (tensor payloads travel outside it, so bodies stay small).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Decoding budget: the arrays and maps one msgpack document may make us build. A 1-byte empty
# array becomes a ~60-byte Python list (a map ~60-230 bytes), so a document of nothing else was the
# cheapest way to make a receiver spend memory and CPU (issue 14: a 16 MiB HELLO of empty arrays,
# 5 s of CPU and +1.2 GB). A document may build DECODE_FREE_CONTAINERS, plus one per
# BYTES_PER_CONTAINER bytes it has: containers then cost at most ~8x the document's size, and
# decoding stops as soon as the budget is spent. Real messages stay well below: a DHT entry, an
# address list or an optimizer's per-parameter state has a container per ~20-30 bytes or more. The
# one dense structure, tensor specs (two containers in as little as 7 bytes), gets an allowance of
# its own in a frame header (`extra_containers`). Scalars need no budget of their own: each takes
# at least one byte, and msgpack already caps every container's length at the document's size.
DECODE_FREE_CONTAINERS = 4096
BYTES_PER_CONTAINER = 8
# Torch tensors have at most this many dims in practice; more is a sign of a hostile spec.
MAX_DIMS = 32
# Per-message tensor count cap: each buffer costs a tensor allocation, so a flood of tiny
# specs would be a cheap amplification attack. Larger state dicts should be split.
MAX_BUFFERS = 100_000
# Torch sizes and byte counts are signed 64-bit.
_MAX_INT64 = 2**63 - 1
# msgpack integers span int64 and uint64.
_MIN_MSGPACK_INT = -(2**63)
_MAX_MSGPACK_INT = 2**64 - 1
# Prefix of spec dtype names for buffers that decode as numpy arrays.
_NP_PREFIX = "np:"
# dumps framing: magic, then a little-endian u32 header length.
_MAGIC = b"PLK1"
_HEADER_LEN = struct.Struct("<I")
_PREFIX_BYTES = len(_MAGIC) + _HEADER_LEN.size


class Packed(NamedTuple):
    """A message split into a msgpack body and raw tensor buffers."""

    body: bytes
    specs: list
    buffers: list[memoryview]


def _byte_addressable(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` can be allocated, copied and viewed as raw bytes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. complex32 is "experimental"
            probe = torch.empty((2, 2), dtype=dtype)
            probe.t().contiguous().view(torch.uint8)
            torch.empty((0,), dtype=dtype).view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _discover_dtypes() -> dict[str, torch.dtype]:
    """Every byte-addressable torch dtype, by its canonical name ("float32", "bfloat16")."""
    found: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype) and value.itemsize >= 1 and _byte_addressable(value):
            found[str(value).removeprefix("torch.")] = value
    return dict(sorted(found.items()))


WIRE_DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType(_discover_dtypes())
_DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
# numpy dtypes we carry, by the name of their torch equivalent (numeric and bool only).
_NUMPY_NAMES = {
    np.dtype(name): name
    for name in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
    if name in WIRE_DTYPES
}  # fmt: skip
_NUMPY_CAPABLE = frozenset(_NUMPY_NAMES.values())


def _type_name(obj: object) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A writable flat uint8 view of a contiguous CPU tensor's bytes (receive straight into it)."""
    if not isinstance(t, torch.Tensor):
        raise SerializationError(f"expected a torch.Tensor, got {_type_name(t)}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise SerializationError(f"tensor_memory needs a CPU tensor, got {t.layout} on {t.device}")
    if not t.is_contiguous():
        raise SerializationError("tensor_memory needs a contiguous tensor")
    if t.is_conj() or t.is_neg():
        raise SerializationError("tensor_memory needs a tensor without lazy conj/neg bits")
    try:
        flat = t.detach().reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy())  # the array keeps the tensor (and its memory) alive
    except (RuntimeError, TypeError) as exc:
        raise SerializationError(f"cannot view a {t.dtype} tensor as bytes: {exc}") from exc


def _tensor_buffer(t: torch.Tensor) -> tuple[list, memoryview]:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise SerializationError(f"cannot serialize tensors of dtype {t.dtype}")
    if t.layout != torch.strided:
        raise SerializationError(f"cannot serialize {t.layout} tensors; convert to dense first")
    t = t.detach()
    try:
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.contiguous()  # a no-op (no copy) when already contiguous
    except (RuntimeError, NotImplementedError) as exc:
        raise SerializationError(f"cannot bring a {t.dtype} tensor to the CPU: {exc}") from exc
    return [name, list(t.shape)], tensor_memory(t)


def _ndarray_buffer(a: np.ndarray) -> tuple[list, memoryview]:
    if isinstance(a, np.ma.MaskedArray):
        raise SerializationError("cannot serialize masked arrays (the mask would be lost)")
    a = np.asarray(a)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    name = _NUMPY_NAMES.get(a.dtype)
    if name is None:
        raise SerializationError(
            f"cannot serialize numpy arrays of dtype {a.dtype} (numeric and bool only)"
        )
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return [_NP_PREFIX + name, list(a.shape)], memoryview(flat)


# Values of exactly these types pack as they are (subclasses, ints and arrays take `_convert`'s
# checks). Every frame is packed, and most of a message is such leaves: skipping the call and the
# isinstance chain for them makes packing several times cheaper.
_PLAIN = frozenset({type(None), bool, float, str, bytes})


def _convert(obj: object, specs: list, buffers: list, depth: int) -> object:
    """Copy `obj` into plain msgpack types, moving arrays out into `buffers`."""
    cls = type(obj)
    if cls in _PLAIN or (cls is int and _MIN_MSGPACK_INT <= obj <= _MAX_MSGPACK_INT):
        return obj
    if cls is list or cls is tuple:
        if depth >= MAX_DEPTH:
            raise SerializationError(f"containers nested deeper than {MAX_DEPTH} levels")
        return [item if type(item) in _PLAIN else _convert(item, specs, buffers, depth + 1) for item in obj]
    if cls is dict:
        if depth >= MAX_DEPTH:
            raise SerializationError(f"containers nested deeper than {MAX_DEPTH} levels")
        if all(type(key) is str or type(key) is bytes for key in obj):
            return {key: value if type(value) in _PLAIN else _convert(value, specs, buffers, depth + 1)
                    for key, value in obj.items()}
    return _convert_checked(obj, specs, buffers, depth)


def _convert_checked(obj: object, specs: list, buffers: list, depth: int) -> object:
    """`_convert` for what its fast paths leave: ints (range), subclasses, arrays, other keys."""
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        if not _MIN_MSGPACK_INT <= obj <= _MAX_MSGPACK_INT:
            raise SerializationError(f"int {obj} is outside the msgpack range (int64/uint64)")
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return obj
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if isinstance(obj, memoryview):
        return obj.tobytes()
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        if isinstance(obj, torch.Tensor):
            code, (spec, buffer) = EXT_TENSOR, _tensor_buffer(obj)
        else:
            code, (spec, buffer) = EXT_NDARRAY, _ndarray_buffer(obj)
        specs.append(spec)
        buffers.append(buffer)
        return msgpack.ExtType(code, msgpack.packb(len(buffers) - 1))
    if depth >= MAX_DEPTH:
        raise SerializationError(f"containers nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, (list, tuple)):
        return [_convert(item, specs, buffers, depth + 1) for item in obj]
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, (str, int, bytes)):
                raise SerializationError(
                    f"dict keys must be str, int or bytes, got {_type_name(key)}"
                )
            out[_convert(key, specs, buffers, depth + 1)] = _convert(
                value, specs, buffers, depth + 1
            )
        return out
    raise SerializationError(f"cannot serialize values of type {_type_name(obj)}")


def pack(obj: object) -> Packed:
    """Split `obj` into a msgpack body and zero-copy tensor buffers."""
    specs: list = []
    buffers: list[memoryview] = []
    tree = _convert(obj, specs, buffers, 0)
    try:
        body = msgpack.packb(tree, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. unencodable surrogates
        raise SerializationError(f"cannot encode message: {exc}") from exc
    return Packed(body, specs, buffers)


class _Spec(NamedTuple):
    dtype: torch.dtype
    shape: list[int]
    nbytes: int


def _check_spec(spec: object) -> _Spec:
    if not isinstance(spec, (list, tuple)) or len(spec) != 2:
        what = f"a {len(spec)}-item list" if isinstance(spec, (list, tuple)) else _type_name(spec)
        raise SerializationError(f"a buffer spec must be a [dtype, shape] list, got {what}")
    name, shape = spec
    if not isinstance(name, str):
        raise SerializationError(f"spec dtype must be a str, got {_type_name(name)}")
    numpy_spec = name.startswith(_NP_PREFIX)
    base = name.removeprefix(_NP_PREFIX)
    dtype = WIRE_DTYPES.get(base)
    if dtype is None or (numpy_spec and base not in _NUMPY_CAPABLE):
        raise SerializationError(f"unknown or unsupported dtype {name!r:.100} in buffer spec")
    if not isinstance(shape, (list, tuple)):
        raise SerializationError(f"spec shape must be a list, got {_type_name(shape)}")
    if len(shape) > MAX_DIMS:
        raise SerializationError(f"spec shape has {len(shape)} dims (max {MAX_DIMS})")
    numel = 1
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise SerializationError(f"spec shape entries must be ints, got {_type_name(dim)}")
        if not 0 <= dim <= _MAX_INT64:
            raise SerializationError(f"spec shape entry {dim} is out of range")
        numel *= dim
    nbytes = numel * dtype.itemsize
    if nbytes > _MAX_INT64:
        raise SerializationError(f"spec shape {list(shape)} is too large")
    return _Spec(dtype, list(shape), nbytes)


def spec_containers(nbytes: int, max_buffers: int = MAX_BUFFERS) -> int:
    """The decoding allowance for the tensor specs a document of `nbytes` can hold: each tensor
    takes two containers and at least 10 bytes (a 7-byte spec and a 3-byte reference)."""
    return 2 * min(max_buffers, nbytes // 10)


def _check_specs(specs: object) -> list[_Spec]:
    if not isinstance(specs, (list, tuple)):
        raise SerializationError(f"specs must be a list, got {_type_name(specs)}")
    if len(specs) > MAX_BUFFERS:
        raise SerializationError(f"{len(specs)} buffers in one message (max {MAX_BUFFERS})")
    return [_check_spec(spec) for spec in specs]


def nbytes_of(specs: list) -> list[int]:
    """Byte size of each buffer spec, so a receiver can check budgets before allocating."""
    return [spec.nbytes for spec in _check_specs(specs)]


def allocate(specs: list) -> list[torch.Tensor]:
    """Empty CPU tensors matching validated specs, ready to receive payload bytes.

    Callers receiving from the network should check `nbytes_of` against their budget first.
    """
    tensors = []
    for dtype, shape, _ in _check_specs(specs):
        try:
            tensors.append(torch.empty(shape, dtype=dtype))
        except (RuntimeError, MemoryError) as exc:
            raise SerializationError(f"cannot allocate a {dtype} tensor of shape {shape}") from exc
    return tensors


def unpackb_bounded(data: bytes | memoryview, extra_containers: int = 0, *, raw: bool = False,
                    strict_map_key: bool = True, ext_hook: Callable[[int, bytes], object] = msgpack.ExtType,
                    max_ext_len: int = -1) -> object:
    """`msgpack.unpackb` within the decoding budget (see DECODE_FREE_CONTAINERS): raises
    SerializationError as soon as `data` has built more containers than its size allows.
    msgpack's other length limits are its defaults: each at most the document's size.
    Every message goes through here (frame headers, bodies, DHT messages), so the common case, a
    document too small to overspend, is one call with named options (forwarding **kwargs to
    msgpack costs more than decoding a small message)."""
    size = len(data) if type(data) is bytes else memoryview(data).nbytes
    left = DECODE_FREE_CONTAINERS + size // BYTES_PER_CONTAINER + extra_containers
    if size <= left:  # every container takes a byte: it cannot overspend
        return msgpack.unpackb(data, raw=raw, strict_map_key=strict_map_key, ext_hook=ext_hook,
                               max_ext_len=max_ext_len)

    def count(container: object) -> object:
        nonlocal left
        left -= 1
        if left < 0:
            raise SerializationError(
                f"a {size}-byte message builds more than {DECODE_FREE_CONTAINERS} + 1 per "
                f"{BYTES_PER_CONTAINER} bytes arrays and maps (send large numeric data as tensors)")
        return container

    return msgpack.unpackb(data, list_hook=count, object_hook=count, raw=raw, strict_map_key=strict_map_key,
                           ext_hook=ext_hook, max_ext_len=max_ext_len)


# Decoded values that need no further check (containers and ext results are checked below).
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _check_depth(obj: object, depth: int) -> None:
    """Refuse over-deep nesting and any decoded value that is not a supported type."""
    if isinstance(obj, list):
        if depth >= MAX_DEPTH:
            raise SerializationError(f"containers nested deeper than {MAX_DEPTH} levels")
        for item in obj:
            if type(item) not in _SCALARS:
                _check_depth(item, depth + 1)
    elif isinstance(obj, dict):
        if depth >= MAX_DEPTH:
            raise SerializationError(f"containers nested deeper than {MAX_DEPTH} levels")
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, (str, int, bytes)):
                raise SerializationError(f"dict key of type {_type_name(key)} is not allowed")
            _check_depth(value, depth + 1)
    elif not (
        obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor, np.ndarray))
    ):
        raise SerializationError(f"decoded a value of unsupported type {_type_name(obj)}")


def _buffer_nbytes(data: object) -> int:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SerializationError(f"expected bytes, got {_type_name(data)}")
    return memoryview(data).nbytes


def unpack(
    body: bytes, tensors: list[torch.Tensor], *, max_body_bytes: int = MAX_BODY_BYTES
) -> object:
    """Rebuild a message from its body and the tensors its buffers were read into."""
    size = _buffer_nbytes(body)
    if size > max_body_bytes:
        raise SerializationError(f"message body of {size} bytes is over {max_body_bytes}")
    used = [False] * len(tensors)

    def ext_hook(code: int, data: bytes) -> object:
        if code not in (EXT_TENSOR, EXT_NDARRAY):
            raise SerializationError(f"unknown ext type code {code}")
        try:
            index = msgpack.unpackb(data)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise SerializationError("malformed buffer reference") from exc
        if isinstance(index, bool) or not isinstance(index, int):
            raise SerializationError(f"buffer reference must be an int, got {_type_name(index)}")
        if not 0 <= index < len(tensors):
            raise SerializationError(f"buffer index {index} out of range (have {len(tensors)})")
        if used[index]:
            raise SerializationError(f"buffer index {index} referenced twice")
        used[index] = True
        tensor = tensors[index]
        if code == EXT_TENSOR:
            return tensor
        try:
            return tensor.numpy()
        except (RuntimeError, TypeError) as exc:
            raise SerializationError(f"a {tensor.dtype} buffer cannot decode as numpy") from exc

    try:
        obj = unpackb_bounded(body, raw=False, strict_map_key=False, ext_hook=ext_hook)
    except SerializationError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise SerializationError(f"malformed message body: {exc}") from exc
    _check_depth(obj, 0)
    if not all(used):
        raise SerializationError(f"{used.count(False)} buffer(s) not referenced by the body")
    return obj


def dumps(obj: object) -> bytes:
    """One self-contained byte string: magic, header length, header, body, buffers."""
    packed = pack(obj)
    header = msgpack.packb([len(packed.body), packed.specs])
    parts = [_MAGIC, _HEADER_LEN.pack(len(header)), header, packed.body, *packed.buffers]
    return b"".join(parts)


def loads(data: bytes | memoryview, *, max_body_bytes: int = MAX_BODY_BYTES, max_buffers: int = MAX_BUFFERS,
          ) -> object:
    """Decode `dumps` output, checking every length exactly before allocating anything.
    `max_buffers`: the most tensors it may hold (each costs an allocation, and even empty ones
    about 1 KB and 20 us: a 64 KiB DHT value of 4,500 empty tensors took 0.05 s to decode)."""
    total = _buffer_nbytes(data)
    try:
        view = memoryview(data).cast("B")
    except TypeError as exc:
        raise SerializationError("data must be a contiguous byte buffer") from exc
    if total < _PREFIX_BYTES or view[: len(_MAGIC)] != _MAGIC:
        raise SerializationError("not potluck data (bad magic or too short)")
    (header_len,) = _HEADER_LEN.unpack_from(view, len(_MAGIC))
    offset = _PREFIX_BYTES + header_len
    if offset > total:
        raise SerializationError(f"truncated header: need {header_len} bytes")
    try:
        header = unpackb_bounded(view[_PREFIX_BYTES:offset], spec_containers(total, max_buffers), raw=False)
    except SerializationError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise SerializationError(f"malformed header: {exc}") from exc
    if not isinstance(header, list) or len(header) != 2:
        raise SerializationError("malformed header: expected [body_len, specs]")
    body_len, specs = header
    if isinstance(body_len, bool) or not isinstance(body_len, int) or body_len < 0:
        raise SerializationError("malformed header: bad body length")
    if body_len > max_body_bytes:
        raise SerializationError(f"message body of {body_len} bytes is over {max_body_bytes}")
    if isinstance(specs, (list, tuple)) and len(specs) > max_buffers:
        raise SerializationError(f"{len(specs)} tensors in one value (max {max_buffers})")
    sizes = nbytes_of(specs)
    expected = offset + body_len + sum(sizes)
    if expected != total:
        what = "truncated" if expected > total else "trailing bytes after"
        raise SerializationError(f"{what} data: header says {expected} bytes, got {total}")
    body = view[offset : offset + body_len]
    offset += body_len
    tensors = allocate(specs)
    for tensor, size in zip(tensors, sizes, strict=True):
        tensor_memory(tensor)[:] = view[offset : offset + size]
        offset += size
    return unpack(body, tensors, max_body_bytes=max_body_bytes)
