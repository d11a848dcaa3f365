"""Streaming DiLoCo (`potluck.optim.streaming`) on the emulated network under the virtual clock.

What stays identical across a fragment round's group is the fragment's *outer* parameters and
outer momentum: every member applies the same averaged pseudo-gradient to them (or, if their
outer points differed, averages those right after). The local parameters are not: with
`outer_delay` > 0 each member mixes its own inner progress of the delayed steps into them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import potluck
from potluck.averaging.matchmaking import Matchmaker
from potluck.compression import get_codec
from potluck.core.dht_time import event_loop_clock
from potluck.core.runner import acquire_runner, release_runner
from potluck.core.virtual_time import virtual_time_loop
from potluck.net.emulated import EmulatedNetwork
from potluck.optim import Optimizer
from potluck.optim.modes import DiLoCo
from potluck.optim.state import tensor_digest
from potluck.optim.streaming import ErrorFeedback, Fragment, StreamingDiLoCo, cut, split_fragments

BATCH = 8
WIDE = 16384  # the hidden layer of the model whose rounds' bytes are counted
COMPUTE_SECONDS = 0.02


def make_model(seed: int, width: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same start on every peer
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH * 4, 16, generator=generator)[:BATCH]
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


async def swarm(peers: int, epochs: int, options: dict[str, Any], *, width: int = 32, apart: bool = False,
                kill: Callable[[Optimizer], bool] | None = None, upload: float | None = None,
                step_seconds: tuple[float, ...] | None = None) -> dict:
    """Train `peers` peers until `epochs` fragment rounds (from different starting points if
    `apart`); peer 0 is crashed when `kill(its optimizer)` says so after a step. Records, per fragment round that a group completed, each
    member's digest of that fragment's outer parameters and momentum once it is applied. `upload`:
    each peer's upload rate, bytes/s. `step_seconds`: each peer's compute time a step (else
    COMPUTE_SECONDS)."""
    network = EmulatedNetwork(latency=0.01, seed=1)
    nodes: list[potluck.Peer] = []
    for _ in range(peers):
        nodes.append(await potluck.Peer.create(nodes[0].addresses if nodes else [],
                                               transport=network.transport(upload=upload), clock=event_loop_clock()))
    models = [make_model(index if apart else 0, width) for index in range(peers)]
    optimizers = [Optimizer(peer, "stream", model.parameters(), lambda p: torch.optim.SGD(p, 0.3),
                            target_batch_size=64, batch_size_per_step=BATCH, mode="diloco",
                            matchmaking_time=0.5, load_state=False, start=False, **{"local_steps": 4, **options})
                  for peer, model in zip(nodes, models, strict=True)]
    rounds: dict[bytes, dict[int, str]] = {}  # group id -> member -> outer digest after the round
    round_bytes: list[tuple[int, int]] = []  # (fragment, bytes peer 1 sent) per completed fragment round
    for index, opt in enumerate(optimizers):
        await opt.astart()
        _record(index, opt, nodes[index], rounds, round_bytes if index == 1 else None)
    await asyncio.sleep(1)  # the peers see each other's progress: no first rounds alone
    held_out = batch(torch.Generator().manual_seed(999))
    losses = [_loss(models[1], held_out)]
    crashed: list[int] = []

    async def train(index: int) -> None:
        model, opt = models[index], optimizers[index]
        generator = torch.Generator().manual_seed(100 + index)
        while opt.local_epoch < epochs:
            x, y = batch(generator)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            await asyncio.sleep(COMPUTE_SECONDS if step_seconds is None else step_seconds[index])
            await opt.astep()
            if index == 0 and kill is not None and kill(opt):
                network.crash(nodes[0].transport.peer_id)
                crashed.append(opt.local_epoch)
                return

    try:
        await asyncio.wait_for(asyncio.gather(*(train(i) for i in range(peers))), 600)
        losses.append(_loss(models[1], held_out))
        return {"rounds": rounds, "epochs": [o.local_epoch for o in optimizers], "losses": losses,
                "round_bytes": round_bytes, "crashed": crashed, "failed": [o.context.failed_rounds for o in optimizers],
                "aggregations": {f.averager.aggregation for o in optimizers for f in o.training.fragments}, "per_sample": optimizers[1].bytes_per_sample(),
                "params": [tensor_digest(list(m.parameters())) for m in models],
                "records": [list(o.tracker.rounds) for o in optimizers],
                "peers": [str(n.peer_id) for n in nodes],
                "outer": [tensor_digest(o.training.outer) for o in optimizers]}
    finally:
        for opt in optimizers:
            opt.shutdown()
        for peer in nodes:
            await peer.ashutdown()


def _loss(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(data[0]), data[1]))


def _record(index: int, opt: Optimizer, node: potluck.Peer, rounds: dict,
            round_bytes: list[tuple[int, int]] | None) -> None:
    engine = opt.training
    assert isinstance(engine, StreamingDiLoCo)
    groups: list[bytes] = []
    landed: list[Fragment] = []  # the fragment whose round a step applied
    for fragment in engine.fragments:
        advance, astep = fragment.averager._advance, fragment.averager.astep

        def recording_advance(me: int, group_id: bytes, _advance=advance) -> None:  # a completed all-reduce
            groups.append(group_id)
            _advance(me, group_id)

        async def counting_astep(*args, _astep=astep, _index=fragment.index, **kwargs):
            sent = node.stats.bytes_sent
            result = await _astep(*args, **kwargs)
            if round_bytes is not None:
                round_bytes.append((_index, node.stats.bytes_sent - sent))
            return result
        fragment.averager._advance, fragment.averager.astep = recording_advance, counting_astep
    opt.register_epoch_hook(lambda event: landed.append(engine.fragments[(event.epoch - 1) % len(engine.fragments)])
                            if event.how == "update" else None)
    step = engine.step

    async def recording_step() -> None:  # a round is applied (and repaired if need be) within a step
        groups.clear()
        landed.clear()
        await step()
        if groups and landed:
            fragment = landed[-1]
            rounds.setdefault(groups[0], {})[index] = tensor_digest(fragment.outer + fragment.momentum)
    engine.step = recording_step


def run(*args: Any, **kwargs: Any) -> dict:
    runner = acquire_runner(virtual_time_loop)
    try:
        return runner.run(swarm(*args, **kwargs), timeout=300)
    finally:
        release_runner()


@pytest.mark.timeout(120)
def test_fragment_outer_parameters_are_identical_across_each_round_and_local_ones_mix():
    # The peers start from different points: the first round of each fragment finds their
    # digests differ, and averages their outer points.
    # A robust aggregation applies to the fragment rounds as to any: each member gets the same result.
    result = run(3, 12, dict(fragments=2, outer_delay=1, mixing=0.5, outer_compression="blockwise4",
                             aggregation="centered_clip"), apart=True)
    assert result["epochs"] == [12, 12, 12] and result["aggregations"] == {"centered_clip"}, result
    rounds = result["rounds"]
    for group_id, digests in rounds.items():
        assert len(set(digests.values())) == 1, f"round {group_id.hex()}: outer points differ after it: {digests}"
    together = [group for group in rounds.values() if len(group) == 3]
    assert len(together) >= 8, rounds  # all but the first rounds (before the peers saw each other)
    # The whole outer state ends identical (the last two rounds covered both fragments), the
    # local parameters not: each mixed its own last inner steps in.
    assert len(set(result["outer"])) == 1, result["outer"]
    assert len(set(result["params"])) == 3, result["params"]
    assert result["losses"][1] < 0.8 * result["losses"][0], result["losses"]
    # Every member records every fragment round for monitors' credit: each contributor's samples
    # since its previous round began (2 inner steps: an interval; with the delay, the step after
    # a round began counts towards the next), so every sample is credited once.
    for records in result["records"]:
        full = [r for r in records if len(r.samples) == 3]
        assert len(full) >= 8, records
        assert all(dict(r.samples) == dict.fromkeys(result["peers"], 2 * BATCH) for r in full), full


@pytest.mark.timeout(120)
def test_a_repair_meets_the_rounds_group_over_slow_links():
    """Peers that start apart repair each fragment's outer point after its first round, over
    slow links (20 KB/s up). Each repair declared itself in the DHT, and every member gathered
    alone: the outer points stayed apart to the end (three of them). A repair now meets the
    round's group as the next round does."""
    result = run(3, 12, dict(fragments=2, local_steps=16, outer_delay=6, outer_compression="blockwise4"),
                 apart=True, upload=20_000)
    assert result["epochs"] == [12] * 3 and len(set(result["outer"])) == 1, result
    for group_id, digests in result["rounds"].items():
        assert len(set(digests.values())) == 1, f"round {group_id.hex()}: outer points differ after it: {digests}"


@pytest.mark.timeout(120)
def test_peers_whose_steps_outlast_the_matchmaking_window_still_meet():
    """A peer joins a round only between two of its steps. Peers with 0.6 s steps, one at 1.2 s,
    in the run's 0.5 s window: the slow one missed every round (each of peer 0's had 3 members). A
    round's window now covers two of the slowest training peer's steps (`RunContext.round_window`)."""
    result = run(4, 8, dict(fragments=2, local_steps=16, outer_delay=4), step_seconds=(0.6, 0.6, 1.2, 0.6))
    assert result["epochs"] == [8] * 4 and result["failed"] == [0] * 4, result
    sizes = [len(record.samples) for record in result["records"][0]]  # each round peer 0 completed
    assert len(sizes) == 8 and set(sizes) == {4}, sizes


@pytest.mark.timeout(120)
def test_a_peer_killed_mid_fragment_leaves_the_others_training_and_identical():
    # Peer 0 crashes while a fragment's round is in flight (started, not yet applied).
    result = run(3, 14, dict(fragments=2, outer_delay=1, outer_compression={"name": "topk", "ratio": 0.1}),
                 kill=lambda opt: opt.local_epoch >= 5 and opt.training.flight is not None)
    assert result["crashed"] and result["epochs"][1:] == [14, 14], result
    after = [group for group in result["rounds"].values() if set(group) == {1, 2}]
    assert len(after) >= 5, result["rounds"]
    for group in after:
        assert group[1] == group[2], result["rounds"]
    assert result["outer"][1] == result["outer"][2]
    assert result["losses"][1] < 0.8 * result["losses"][0], result["losses"]


@pytest.mark.timeout(120)
def test_only_the_first_round_looks_for_peers_in_the_dht(monkeypatch):
    """Each fragment has its own averager, but they share the memory of the last group: a later
    fragment's first round asks that group's leader directly, as a repeated round does (before,
    each fragment's first round declared itself in the DHT and waited out a matchmaking window)."""
    through_dht = []
    dht_key = Matchmaker._dht_key

    def recording(self, group_key):
        through_dht.append(self.names.name)
        return dht_key(self, group_key)
    monkeypatch.setattr(Matchmaker, "_dht_key", recording)
    result = run(3, 6, dict(fragments=2, outer_compression="blockwise4"))
    assert result["epochs"] == [6, 6, 6] and len(result["rounds"]) == 6, result
    assert all(len(group) == 3 for group in result["rounds"].values()), result["rounds"]
    assert set(through_dht) == {"delta0"}, through_dht


@pytest.mark.timeout(120)
def test_4bit_and_topk_pseudo_gradients_cut_the_bytes_of_a_round():
    per_sample = {}

    def mean_round_bytes(compression: Any) -> float:
        # The mean: under CenteredClip (an open run's default) members check a reducer's work a
        # whole chunk at a time, which doubles a round's bytes whatever the codec.
        result = run(2, 4, dict(fragments=2, outer_compression=compression, aggregation="mean"), width=WIDE)
        sizes = [sent for fragment, sent in result["round_bytes"] if fragment == 0]
        assert len(sizes) >= 2 and min(sizes) > 0, result["round_bytes"]
        per_sample[str(compression)] = result["per_sample"]
        return sum(sizes) / len(sizes)

    # Fragment 0 is the first half of the model's 344,068 values (rows 0-10751 of the first layer's
    # weight, 16384 x 16: fragments are cut between rows), 688,128 bytes at 4 a value. A peer sends
    # the other its half and the average of its own half back, and each round about 35 KB more
    # (matchmaking, and the members' check of a block of 4096 float32 values of each other's
    # result), which no codec shrinks.
    dense = mean_round_bytes("none")
    assert 688_128 < dense < 688_128 + 60_000
    # 4-bit: 1/8 of the values' bytes (and a scale per 4096 of them).
    assert dense / mean_round_bytes("blockwise4") > 5.5
    # Top 1% (error feedback keeps the rest for later): 8 bytes per value kept, 2% of the dense
    # bytes, and the average of two thinned halves back.
    assert dense / mean_round_bytes({"name": "topk", "ratio": 0.01}) > 12
    # The optimizer's own figure (all the peer's traffic, per sample it processed) says the same.
    sent = {codec: figures[0] for codec, figures in per_sample.items()}
    assert min(per_sample["none"]) > 0 and sent["none"] > 4 * max(sent["blockwise4"], sent[str({"name": "topk", "ratio": 0.01})])


def test_error_feedback_sends_what_it_holds_back_later():
    generator = torch.Generator().manual_seed(7)
    shapes = [(30, 20), (20,)]
    feedback = ErrorFeedback({"name": "topk", "ratio": 0.1}, len(shapes))
    held = [torch.zeros(shape) for shape in shapes]
    sent_total = [torch.zeros(shape) for shape in shapes]
    grads_total = [torch.zeros(shape) for shape in shapes]
    for _ in range(5):
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        deltas = [g.clone() for g in grads]
        feedback.thin(deltas)
        for delta, grad, before, residual in zip(deltas, grads, held, feedback.residuals, strict=True):
            assert (delta != 0).sum() == get_codec({"name": "topk", "ratio": 0.1}).kept(delta.numel())
            # What is sent plus what is held back is the pseudo-gradient plus what was held before.
            assert torch.equal(delta + residual, grad + before)
            assert torch.equal(delta * residual, torch.zeros_like(delta))  # disjoint
        held = [r.clone() for r in feedback.residuals]
        for total, delta, g_total, grad in zip(sent_total, deltas, grads_total, grads, strict=True):
            total += delta
            g_total += grad
    for total, g_total, residual in zip(sent_total, grads_total, held, strict=True):
        assert torch.allclose(total + residual, g_total, atol=1e-5)


def test_fragments_split_parameters_in_order_into_about_equal_parts():
    """Pieces are (parameter, first row, end row). Whole tensors where the shares end between
    them; else a tensor is cut between rows: the lm workload of benchmarks/wan.py is one table of
    6.3M values and 0.1M others, and cut between tensors only, one fragment held 98% of it."""
    assert split_fragments([(10,)] * 8, 4) == [[(0, 0, 10), (1, 0, 10)], [(2, 0, 10), (3, 0, 10)],
                                               [(4, 0, 10), (5, 0, 10)], [(6, 0, 10), (7, 0, 10)]]
    assert split_fragments([(512,), (32,), (128,), (4,)], 2) == [[(0, 0, 338)],
                                                                 [(0, 338, 512), (1, 0, 32), (2, 0, 128), (3, 0, 4)]]
    table = [(24576, 256), (256, 256), (256, 256), (256,)]  # wan.py's lm model: 6.4M values
    fragments = split_fragments(table, 4)
    assert [pieces[0] for pieces in fragments] == [(0, 0, 6272), (0, 6272, 12544), (0, 12544, 18817), (0, 18817, 24576)]
    sizes = [sum((end - first) * math.prod(table[i][1:]) for i, first, end in pieces) for pieces in fragments]
    assert sum(sizes) == sum(math.prod(s) for s in table) and max(sizes) - min(sizes) <= 256
    # every fragment at least one row, scalars (one row each) and tensors without rows (nothing to average)
    assert split_fragments([(1,), (1,), (100,)], 3) == [[(0, 0, 1), (1, 0, 1), (2, 0, 32)], [(2, 32, 66)], [(2, 66, 100)]]
    assert split_fragments([(), (3, 4), ()], 3) == [[(0, 0, 1), (1, 0, 1)], [(1, 1, 2)], [(1, 2, 3), (2, 0, 1)]]
    assert split_fragments([(0, 5), (4,)], 2) == [[(1, 0, 2)], [(1, 2, 4)]]
    assert split_fragments([(5,)], 1) == [[(0, 0, 5)]]
    with pytest.raises(ValueError):
        split_fragments([(2,)], 3)


def test_a_fragment_cut_inside_a_tensor_steps_that_tensor_in_place():
    """A fragment's pieces of a tensor are views of its rows: the outer step and the mixing
    reach the parameters themselves, and each fragment's round moves only its own rows."""
    params = [torch.zeros(6, 2), torch.zeros(2)]
    pieces = split_fragments([p.shape for p in params], 2)
    assert pieces == [[(0, 0, 4)], [(0, 4, 6), (1, 0, 2)]]
    first = [cut(params[i], piece) for piece in pieces[0] for i in (piece[0],)]
    torch._foreach_add_(first, 1.0)
    assert params[0][:4].eq(1).all() and params[0][4:].eq(0).all() and params[1].eq(0).all()
    assert cut(params[1], (1, 0, 2)) is params[1]  # whole tensors are the tensors themselves


def test_streaming_options_are_checked_when_the_optimizer_is_built():
    DiLoCo(local_steps=4, fragments=2, outer_delay=1, outer_compression="blockwise4").check(rows=4)
    for options in [DiLoCo(local_steps=4, fragments=3), DiLoCo(local_steps=4, fragments=2, outer_delay=2),
                    DiLoCo(local_steps=5, fragments=5), DiLoCo(local_steps=4, fragments=2, mixing=1.5),
                    DiLoCo(local_steps=4, fragments=0)]:
        with pytest.raises(ValueError):
            options.check(rows=4)
    from potluck.core.errors import CompressionError
    with pytest.raises(CompressionError):
        DiLoCo(local_steps=4, outer_compression="blockwise3").check(4)
    assert not DiLoCo().streaming and DiLoCo(outer_compression="blockwise4").streaming
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="diloco options"):
        Optimizer(None, "x", model.parameters(), lambda p: torch.optim.SGD(p, 0.1), 8, 8, fragments=2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        Optimizer(None, "x", model.parameters(), lambda p: torch.optim.SGD(p, 0.1), 8, 8, fragment=2)


@pytest.mark.timeout(120)
def test_the_schema_of_a_run_with_fragments_names_how_they_are_cut():
    """Peers whose versions cut fragments differently must not average them (the same shapes can
    hold other rows): runs with fragments carry `diloco.fragment_split`; others keep their schema.
    Fragments are bounded by rows, not tensors: one 8 x 2 table can be cut in 8."""
    from potluck.optim.modes import FRAGMENT_SPLIT
    assert DiLoCo(local_steps=4, fragments=2).shared_settings()["diloco.fragment_split"] == FRAGMENT_SPLIT
    assert "diloco.fragment_split" not in DiLoCo(local_steps=4).shared_settings()
    DiLoCo(local_steps=8, fragments=8).check(rows=8)
    assert len(split_fragments([(8, 2)], 8)) == 8


def test_moshpit_grid_groups_apply_to_the_fragment_rounds():
    # Four peers on a 2x2 grid: each fragment round averages within pairs (cells from the peers'
    # ranks, the dimension turning each round), and each pair leaves it with one outer point.
    result = run(4, 6, dict(fragments=2, outer_delay=1, outer_compression="blockwise8", grid=(2, 2)))
    assert result["epochs"] == [6, 6, 6, 6], result
    groups = list(result["rounds"].values())
    assert len(groups) >= 10 and all(len(group) == 2 for group in groups), groups
    assert all(len(set(group.values())) == 1 for group in groups), groups
