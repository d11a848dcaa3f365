"""Model tensors on any device and in any float dtype: the host staging path (`core.staging`),
mixed precision, and no `.numpy()` on a model tensor.

torch's CPU build (2.13 here) offers no computational device other than the CPU: xpu, mps, hpu,
mtia, xla, ipu, ve, lazy and maia all refuse to allocate, `privateuseone` needs a C++ backend, and
`meta` tensors hold no values. So the device path runs here on CPU tensors: it is the one path
for every device (queued copies into host buffers, one wait per device), and
`scripts/gpu_check.py` runs it on CUDA.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

import potluck
from potluck.averaging import Averager
from potluck.averaging.allreduce.buffers import BufferPool
from potluck.core.staging import gather_into, host_slices, scatter_from, wants_pinned
from potluck.core.virtual_time import run_virtual
from potluck.optim import Optimizer
from potluck.optim.state import tensor_digest
from tests.emulated_swarm import make_swarm

SRC = Path(__file__).resolve().parent.parent / "src" / "potluck"

# Every `.numpy()` in the library, and why its tensor is in host memory. A new one fails the
# test until it is checked to be on a host copy (or goes through `core.staging.host_slices`).
NUMPY_CALLS = {
    "core/staging.py": 2,  # host_slices: a CPU tensor, or a slice just copied to the host
    "core/serialization.py": 2,  # tensor_memory refuses non-CPU tensors; decoded buffers
    "averaging/accountability.py": 1,  # the chunk moved .to("cpu") on the same line
    "averaging/robust.py": 2,  # CenteredClip's sums of squares (senders x blocks), .cpu() on the same line
    "averaging/state_transfer/server.py": 1,  # the snapshot: a host copy of the state
    "averaging/state_transfer/download.py": 1,  # a chunk as received from the network
    "cli/ps.py": 1,  # the command builds its models on the CPU
}


def test_numpy_is_called_only_on_host_copies():
    found = {}
    for path in SRC.rglob("*.py"):
        count = len(re.findall(r"\.numpy\(\)", path.read_text()))
        if count:
            found[path.relative_to(SRC).as_posix()] = count
    assert found == NUMPY_CALLS, "a .numpy() call was added or removed: check that its tensor is in host memory"


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(33, generator=g).to(torch.bfloat16), torch.randn(4, 5, generator=g).to(torch.float16),
            torch.randn(7, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g).t(),  # not contiguous
            torch.tensor(float(seed))]  # 0-d


def test_staging_round_trips_every_dtype_and_layout_through_a_float32_host_vector():
    tensors = mixed_tensors(1)
    vector = torch.full((sum(t.numel() for t in tensors) + 5,), float("nan"))
    gather_into(tensors, vector)
    expected = torch.cat([t.reshape(-1).float() for t in tensors])
    assert torch.equal(vector[:expected.numel()], expected)
    copies = [torch.zeros_like(t) for t in tensors]
    scatter_from(vector, copies)
    # exact for every dtype float32 holds exactly; float64 comes back as its float32 rounding
    assert all(torch.equal(a, b.float().to(b.dtype)) for a, b in zip(copies, tensors, strict=True))


def test_digests_read_any_layout_and_stay_exact_to_the_bit():
    t = torch.randn(6, 4).t()
    assert tensor_digest([t]) == tensor_digest([t.contiguous()])
    assert b"".join(host_slices(t)) == t.contiguous().numpy().tobytes()
    nudged = t.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1e9))
    assert tensor_digest([t]) != tensor_digest([nudged])


def test_host_buffers_are_pinned_only_for_cuda_tensors_on_a_machine_with_cuda():
    assert not wants_pinned([torch.zeros(3)])
    assert not wants_pinned([torch.zeros(3, device="meta")])
    pool = BufferPool()
    pool.pin_memory = True
    huge = pool.take(pool.max_bytes)  # beyond what the pool keeps: never pinned
    assert not huge.is_pinned()


@pytest.mark.timeout(60)
def test_mixed_precision_tensors_average_in_float32_and_come_back_in_their_dtype():
    """bfloat16, float16, float64, a transposed view and a scalar, averaged in place
    (copy=False): each result is the float32 mean rounded once to the tensor's dtype."""
    async def main():
        net, peers = await make_swarm(3)
        tensors = [mixed_tensors(i) for i in range(3)]
        expected = [sum(ts[k].float() for ts in tensors) / 3 for k in range(len(tensors[0]))]
        avgs = [Averager(p, ts, "mixed", matchmaking_time=1.0, copy=False) for p, ts in zip(peers, tensors, strict=True)]
        results = await asyncio.gather(*(a.astep() for a in avgs))
        assert {r.group_size for r in results} == {3}
        for ts in tensors:
            for t, mean in zip(ts, expected, strict=True):
                assert t.dtype in (torch.bfloat16, torch.float16, torch.float64, torch.float32)
                torch.testing.assert_close(t, mean.to(t.dtype), rtol=0, atol=1e-6)
        assert not tensors[0][3].is_contiguous()  # averaged in place, where the caller keeps it
    run_virtual(main())


@pytest.mark.timeout(120)
def test_bfloat16_model_trains_with_float32_accumulators_and_peers_end_identical():
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    peers, models, opts = [], [], []
    try:
        for i in range(2):
            peers.append(potluck.Peer(host="127.0.0.1", initial_peers=peers[0].addresses if peers else []))
            torch.manual_seed(0)
            models.append(torch.nn.Linear(8, 3).to(torch.bfloat16))
            opts.append(Optimizer(peers[i], "bf16", models[i].parameters(), lambda p: torch.optim.SGD(p, 0.1),
                                  target_batch_size=64, batch_size_per_step=16, load_state=False,
                                  matchmaking_time=0.5))
        sums = opts[0].training.grad_averager._tensors
        assert {t.dtype for t in sums} == {torch.float32}

        def train(i: int) -> None:
            g = torch.Generator().manual_seed(i)
            while opts[i].local_epoch < 3:
                batch = torch.randint(0, 256, (16,), generator=g)
                torch.nn.functional.cross_entropy(models[i](x[batch].bfloat16()).float(), y[batch]).backward()
                opts[i].step()
        import threading
        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads)
        assert all(p.dtype == torch.bfloat16 for m in models for p in m.parameters())
        assert tensor_digest(list(models[0].parameters())) == tensor_digest(list(models[1].parameters()))
    finally:
        for o in opts:
            o.shutdown()
        for p in peers:
            p.shutdown()


def test_verified_training_turns_tf32_off_for_a_model_on_cuda():
    """A member's TF32 gradient is off by up to 2.7e-2 from a CPU validator's recomputation (8.4e-5
    under torch's default), so honest GPU peers would be banned: verified mode computes in float32."""
    from types import SimpleNamespace

    from potluck.optim.verified import strict_float32
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        strict_float32([torch.zeros(3)])  # a CPU model: nothing to change
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        strict_float32([torch.zeros(3), SimpleNamespace(is_cuda=True)])  # (this CPU build has no CUDA tensor)
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
