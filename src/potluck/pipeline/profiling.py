"""Node profiling: what a node can compute, hold and move, measured rather than configured.

A `NodeProfile` carries achieved matmul FLOP/s, free memory, and bandwidth / latency to other
nodes (probes over the transport). Profiles are published in the DHT under
`RunNames(run_id).pipeline.profiles` (one subkey per peer: `own_subkey(its peer id)`, owner-signed, and a
profile is read only if it is about its signer) so every node sees the same inputs to clustering
and partitioning. Any field may be overridden (e.g. `--memory`), nothing has to be.

A profile also names the node's model (`model`: its schema's fingerprint, and the schema where it
fits, `potluck.optim.schema`): `fetch_profiles(model=...)` leaves out nodes of another model, so
they are never planned in, taken as standbys or handed layers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from potluck.core.errors import MalformedMessage
from potluck.core.names import RunNames
from potluck.core.peer_like import PeerLike
from potluck.core.wire import Field, Int, Message, Nested, Number, Text, number_value
from potluck.dht.records import own_subkey, owned_entries
from potluck.net.identity import PeerID
from potluck.optim.schema import ModelSignature
from potluck.pipeline.messages import MAX_COUNTER, MAX_NAME_CHARS, ProbeRequest

__all__ = ["LayerCost", "NodeProfile", "measure_flops", "free_memory_bytes", "profile_layers",
           "serve_probes", "probe_link", "publish_profile", "fetch_profiles"]

logger = logging.getLogger(__name__)

PROBE_METHOD = "pipeline.probe"
# Bandwidth probe payload: 1 MiB is long enough to dominate a loopback round trip (~0.2 ms) and
# short enough to cost little on a slow home uplink (~1 s at 1 MB/s).
PROBE_BYTES = 2**20
# The largest probe a node answers, so a stranger cannot make it allocate without bound.
MAX_PROBE_BYTES = 8 * 2**20
# Each probe call gets this deadline: a node that cannot answer a 1 MiB probe within it is unfit
# to hold a pipeline stage anyway.
PROBE_TIMEOUT = 10.0
# Profiles are republished by the caller; this TTL makes a departed node's profile vanish.
PROFILE_TTL = 300.0
# Matmul size for the FLOP/s probe: big enough to reach the BLAS's steady speed on a CPU core.
MATMUL_SIZE = 256
# Links in one profile: one per peer probed; a pipeline run has tens of nodes, not thousands.
MAX_PROFILE_LINKS = 1024
# Profiles read from the DHT at once (one per node of the run).
MAX_PROFILES = 4096


class Links(Field):
    """{node id: measure} of a profile: bounded, every measure finite and non-negative (a bad one
    is named by its node id)."""

    def __init__(self, key: str):
        super().__init__(key, default_factory=dict)

    def check(self, value: Any, key: str, what: str, context: Mapping[str, Any]) -> dict[str, float]:
        if not isinstance(value, dict) or len(value) > MAX_PROFILE_LINKS:
            raise MalformedMessage(what, f"{key!r} must map at most {MAX_PROFILE_LINKS} node ids to numbers")
        for peer in value:
            if not isinstance(peer, str) or len(peer) > MAX_NAME_CHARS:
                raise MalformedMessage(what, f"{key!r} keys must be node ids")
        return {peer: number_value(measure, peer, what) for peer, measure in value.items()}


class NodeProfile(Message, what="node profile", frozen=False):
    """What clustering and partitioning need to know about one node. In the DHT or a plan file,
    node ids may be any label (plans of imagined nodes), so they are bounded but not parsed as
    peer ids."""

    peer_id: str = Text("peer_id", MAX_NAME_CHARS)
    flops: float = Number("flops", positive=True)  # achieved FLOP/s (matmul)
    memory: int = Int("memory", 0, MAX_COUNTER)  # bytes free for model state
    bandwidth: dict[str, float] = Links("bandwidth")  # peer id -> bytes/s measured
    latency: dict[str, float] = Links("latency")  # peer id -> seconds one way
    default_bandwidth: float = Number("default_bandwidth", default=100e6)  # assumed for links never probed
    model: ModelSignature | None = Nested("model", ModelSignature, default=None)  # the model it trains

    def bandwidth_to(self, other: str) -> float:
        return self.bandwidth.get(other, self.default_bandwidth)


def measure_flops(size: int = MATMUL_SIZE, seconds: float = 0.2) -> float:
    """Achieved FLOP/s of a float32 matmul on this process's threads (2 n^3 per product)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: the first call pays for allocation and thread start
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size**3 * count / elapsed


def free_memory_bytes() -> int:
    """Memory available for model state: free GPU memory if there is a GPU, else MemAvailable."""
    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class LayerCost(Message, what="layer cost", frozen=False):
    """Measured cost of one layer for one sample: what partitioning balances (also read from a
    plan's costs file, `potluck pipeline plan --layer-costs`)."""

    seconds: float = Number("seconds")  # forward + backward time per sample on the measuring node
    param_bytes: int = Int("param_bytes", 0, MAX_COUNTER)  # weights
    # output per sample (what crosses a stage boundary after this layer)
    activation_bytes: int = Int("activation_bytes", 0, MAX_COUNTER)


def profile_layers(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[LayerCost]:
    """Time forward + backward of each layer on `sample` (a small batch); best of `repeats`."""
    costs, x = [], sample
    batch = max(1, sample.shape[0])
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            best = min(best, time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        costs.append(LayerCost(best / batch, params, out[0].numel() * out.element_size()))
        x = out.detach()
    return costs


def serve_probes(peer: PeerLike) -> None:
    """Answer bandwidth / latency probes from other nodes (the reply is only timed, never read).
    Every reply is a view of one buffer of zeros: each used to be a fresh one, so a caller that
    asked for 8 MiB replies and did not read them held 8 MiB of ours per call (1.6 GB for 200)."""
    zeros = torch.zeros(MAX_PROBE_BYTES, dtype=torch.uint8)

    async def probe(request: Any, ctx: Any) -> Any:
        size = ProbeRequest.from_wire(request, limit=MAX_PROBE_BYTES).reply_bytes
        return {"data": zeros[:size]} if size else {}
    peer.transport.add_handler(PROBE_METHOD, probe)


async def probe_link(peer: PeerLike, other: PeerID, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(download bytes/s from `other`, one-way latency s): a tiny call, then a `nbytes` reply."""
    transport = peer.transport
    loop = asyncio.get_running_loop()
    await transport.call(other, PROBE_METHOD, ProbeRequest().to_wire(), timeout=PROBE_TIMEOUT)  # connect first
    start = loop.time()
    await transport.call(other, PROBE_METHOD, ProbeRequest().to_wire(), timeout=PROBE_TIMEOUT)
    rtt = loop.time() - start
    start = loop.time()
    await transport.call(other, PROBE_METHOD, ProbeRequest(nbytes).to_wire(), timeout=PROBE_TIMEOUT)
    elapsed = max(loop.time() - start - rtt, 1e-6)
    return nbytes / elapsed, rtt / 2


async def profile_node(peer: PeerLike, others: Sequence[PeerID], *, flops: float | None = None,
                       memory: int | None = None) -> NodeProfile:
    """This node's profile; links to `others` are probed one by one (probes must not compete)."""
    profile = NodeProfile(str(peer.transport.peer_id),
                          flops if flops is not None else await asyncio.get_running_loop().run_in_executor(
                              None, measure_flops),
                          memory if memory is not None else free_memory_bytes())
    for other in others:
        try:
            bw, lat = await probe_link(peer, other)
        except Exception as e:  # noqa: BLE001 - an unreachable node is just left unprobed
            logger.warning("could not probe %s: %s", other, e)
            continue
        profile.bandwidth[str(other)], profile.latency[str(other)] = bw, lat
    return profile


async def publish_profile(peer: PeerLike, run_id: str, profile: NodeProfile, ttl: float = PROFILE_TTL) -> bool:
    """Store `profile` in the DHT under this peer's own signed subkey; it must be this peer's."""
    me = peer.transport.peer_id
    if str(profile.peer_id) != str(me):
        raise ValueError(f"a peer publishes only its own profile (this is {me}, the profile is {profile.peer_id}'s): "
                         "others would refuse it")
    dht = peer.dht
    return await dht.astore(RunNames(run_id).pipeline.profiles, profile.to_wire(), dht.get_time() + ttl,
                            subkey=own_subkey(me))


async def fetch_profiles(peer: PeerLike, run_id: str, model: str | None = None) -> list[NodeProfile]:
    """Every live profile of the run, sorted by peer id. Skipped: malformed ones, and any not
    stored by the peer it describes (a subkey that is not its signer's own, or a profile naming
    another peer), so nobody can publish a profile in another node's name; with `model` (a
    fingerprint), those of nodes that name another model."""
    found = await peer.dht.aget(RunNames(run_id).pipeline.profiles, latest=True)
    profiles = []
    if found is not None and isinstance(found.value, dict):
        owned = owned_entries(found)
        if len(owned) < len(found.value):
            logger.warning("skipping %d profiles under subkeys that no peer signed", len(found.value) - len(owned))
        for owner, value in owned[:MAX_PROFILES]:  # unsigned entries cannot crowd out signed ones
            try:
                profile = NodeProfile.from_wire(value)
            except MalformedMessage as e:
                logger.warning("skipping a profile: %s", e)
                continue
            if profile.peer_id != str(owner):
                logger.warning("skipping a profile of %s stored by %s", profile.peer_id[:64], owner)
                continue
            if model is not None and profile.model is not None and profile.model.fingerprint != model:
                continue  # another model's node: not of this run
            profiles.append(profile)
    return sorted(profiles, key=lambda p: p.peer_id)
