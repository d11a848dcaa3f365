"""Model tensors on any device, seen from host memory: potluck's network code, codecs and hashes
work on flat float32 (or byte) vectors in host memory, while a model's tensors may live on a GPU.

Device tensors are copied into host buffers (pinned ones where the pool provides them, so the
copies run asynchronously: every tensor's copy is queued before the first is waited for), and
results go back the same way. Nothing here hands a device tensor to numpy; `host_slices`
gives hashes the bytes of any tensor a slice at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = ["HASH_SLICE_BYTES", "devices_of", "gather_into", "host_slices", "module_place", "scatter_from",
           "synchronize", "to_host", "wants_pinned"]

# Bytes of a device tensor copied to the host at a time to be hashed: bounds the host memory a
# digest of a large GPU model needs (one slice, not a model-sized copy), large enough that the
# per-copy cost (tens of microseconds) stays below 1% at PCIe speeds.
HASH_SLICE_BYTES = 64 * 2**20


def devices_of(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The devices other than the CPU that `tensors` live on."""
    return {t.device for t in tensors if t.device.type != "cpu"}


def wants_pinned(tensors: Iterable[torch.Tensor]) -> bool:
    """True when host buffers for these tensors should be pinned (page-locked): some of them are
    on a CUDA device, whose copies to and from pinned memory are asynchronous and about twice as
    fast. Pinning needs an accelerator runtime, so never on a CPU-only machine."""
    return any(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on these devices (nothing to wait for on the CPU)."""
    for device in devices:
        if device.type == "cpu":
            continue
        if hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(device)
        else:  # torch < 2.6
            getattr(torch, device.type).synchronize(device)


def gather_into(tensors: Sequence[torch.Tensor], vector: torch.Tensor) -> torch.Tensor:
    """Copy `tensors` one after the other into the host vector `vector`, converting to its dtype
    (float16/bfloat16 parameters become exact float32 values); returns `vector` once every copy
    is done. Copies from a device are queued at once and waited for together."""
    offset = 0
    for t in tensors:
        n = t.numel()
        vector[offset:offset + n].view(t.shape).copy_(t.detach(), non_blocking=True)
        offset += n
    synchronize(devices_of(tensors))
    return vector


def scatter_from(vector: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The inverse of `gather_into`: copy consecutive parts of the host `vector` into `tensors`
    (rounding to their dtype), and return once the copies are done, so that `vector` may be
    reused at once."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(vector[offset:offset + n].view(t.shape), non_blocking=True)
            offset += n
    synchronize(devices_of(tensors))


def to_host(tensors: Sequence[torch.Tensor], copy: bool = False) -> list[torch.Tensor]:
    """`tensors` (detached) in host memory, in their own dtype: device tensors are copied into
    fresh (pinned, for CUDA) host tensors, all copies queued before the one wait; host tensors are
    returned as they are, or copied the same way with `copy` (a snapshot the caller may keep)."""
    out = []
    for t in tensors:
        t = t.detach()
        if t.device.type == "cpu" and not copy:
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=wants_pinned([t]))
        out.append(host.copy_(t, non_blocking=True))
    synchronize(devices_of(tensors))
    return out


def module_place(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a module computes and in what float dtype, read from its first floating-point
    parameter (or buffer): inputs that arrive from the network in host float32 go there. A
    module without any computes on the CPU in float32."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.float32


def host_slices(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of `t` (in its own dtype, row-major) in host memory: a view of a contiguous
    CPU tensor, else copies of at most HASH_SLICE_BYTES each."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        yield memoryview(flat.contiguous().numpy())
        return
    for start in range(0, flat.numel(), HASH_SLICE_BYTES):
        yield memoryview(flat[start:start + HASH_SLICE_BYTES].cpu().numpy())
