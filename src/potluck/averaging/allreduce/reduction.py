"""The all-reduce's math: a chunk reduced over its senders, as every reducer computes it and every
member that checks a reducer recomputes it, and the forms chunks take on the wire.

Reduction: the senders' weights are bounded (`bounded_weights`), then the group's aggregation
combines their pieces: a running weighted mean (`weighted_chunk`: bit-identical wherever it is
computed), or a robust one (`potluck.averaging.robust`). `blatant_senders` names the senders whose
contribution is blatantly not an honest one. Codec forms: a chunk encoded and decoded by the
group's codec (refusing anything malformed or non-finite), and what a member that checks a
reducer is sent of a sender's piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from potluck.averaging.accountability import VERIFY_BLOCK
from potluck.averaging.robust import aggregate, far_pieces
from potluck.compression.codec import Codec
from potluck.core.errors import AveragingError, PotluckError
from potluck.core.tensors import all_finite

__all__ = [
    "ARITHMETIC", "BLOCKWISE_CODECS", "MAX_WEIGHT_OVER_MEDIAN", "NAMED_WEIGHT_OVER_MEDIAN", "VALUEWISE_CODECS",
    "as_received", "blatant_senders", "bounded_weights", "decode_chunk", "encode_chunk", "encode_received",
    "encodes_blocks_alone",
    "reduce_chunk", "weighted_chunk", "wire_form",
]

# What the members of a group must compute alike, bit for bit: the chunks' sizes
# (`member.chunk_elements`) and the reductions (`potluck.averaging.robust`). Part of every
# averager's schema, so that peers of versions that differ there form groups apart instead of
# failing each other's checks (and banning each other); raise it with any change to either.
# 2: chunks sized by their bytes on the wire.
ARITHMETIC = 2
# A sender's weight (its own claim, e.g. its samples) counts for at most this many times the
# median weight of the senders of the chunk: a member claiming 1e30 weighs as much as two typical
# members, not all of them. Honest peers twice as fast as the median lose a little weight (in
# averaging, a slightly different mix of members that are all honest), nothing else.
MAX_WEIGHT_OVER_MEDIAN = 2.0
# A reducer names a sender (logs a warning: `ShardReducer`) whose claimed weight is above this many
# times that median. Honest weights are counts of the same kind (samples) over the same stretch
# of time: a thousand-fold is not a faster peer. Among fewer than 3 positive weights none is named
# (with two, a liar claiming almost nothing would be the median and make the honest one look huge).
NAMED_WEIGHT_OVER_MEDIAN = 1000.0
# Codecs under which a block of a chunk encodes alone as it does inside the chunk: those that
# encode each value alone, and the blockwise ones whose blocks tile VERIFY_BLOCK. The others
# (scaled_fp16, uniform8, quantile8 scale by the whole chunk; codecs unknown here) are checked a
# chunk at a time: a block re-encoded alone would differ, and accuse honest reducers.
VALUEWISE_CODECS = ("none", "fp16", "sparse")
BLOCKWISE_CODECS = ("blockwise8", "blockwise4")


def weighted_chunk(pieces: Mapping[int, Any], weights: Mapping[int, float], senders: tuple[int, ...], c: int,
                   out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Write into `out` the average of chunk `c` over `senders`, computed the same way on every peer.

    A running mean in a fixed order: every peer that re-reduces gets the same bits, and peers
    that all hold the same values get exactly those values back (so averaging never makes
    identical replicas drift apart by rounding). `scratch` (at least `out`'s size) holds the
    intermediate terms, so nothing is allocated per chunk.
    """
    equal = sum(weights[s] for s in senders) <= 0  # all weights zero: a plain mean
    term = scratch[:out.numel()]
    mean: torch.Tensor | None = None  # the first piece itself until a second one comes
    seen = 0.0
    for s in senders:
        weight = 1.0 if equal else weights[s]
        if weight <= 0:
            continue
        piece = pieces[s][c]
        if mean is None:
            mean = piece
        else:  # separate ops (no fused multiply-add) for identical bits everywhere
            torch.sub(piece, mean, out=term)
            term.mul_(weight / (seen + weight))
            mean = torch.add(mean, term, out=out)
        seen += weight
    if mean is None:
        out.zero_()
    elif mean is not out:
        out.copy_(mean)


def bounded_weights(weights: Mapping[int, float], senders: tuple[int, ...]) -> dict[int, float]:
    """The weights `senders` count with: each at most MAX_WEIGHT_OVER_MEDIAN times the lower
    median of their positive weights (zero weights, meaning "leave me out", are no evidence of a
    typical weight). A function of the weights this reducer was told and of `senders` only, so
    every peer that reduces the same chunk over the same senders gets the same bits. A sender
    that tells different reducers different weights is bounded in each shard all the same.
    (Weights are finite and >= 0: PartRequest refuses others.)"""
    positive = sorted(weights[s] for s in senders if weights[s] > 0)
    if not positive:
        return {s: weights[s] for s in senders}
    cap = MAX_WEIGHT_OVER_MEDIAN * positive[(len(positive) - 1) // 2]
    return {s: min(weights[s], cap) for s in senders}


def reduce_chunk(aggregation: str, pieces: Mapping[int, Any], weights: Mapping[int, float], senders: tuple[int, ...],
                 c: int, out: torch.Tensor, scratch: torch.Tensor, measure: bool = False) -> dict[int, float]:
    """Chunk `c` reduced over `senders` into `out`, with their bounded weights, by the group's
    aggregation (see `potluck.averaging.robust`): as every reducer computes it, and every member
    that checks a reducer's work. With `measure` and a robust aggregation: each sender's distance
    from the robust centre (the mean has none, and measuring against it would cost a pass)."""
    bounded = bounded_weights(weights, senders)
    if aggregation == "mean":
        weighted_chunk(pieces, bounded, senders, c, out, scratch)
        return {}
    distances = aggregate(aggregation, [pieces[s][c] for s in senders], [bounded[s] for s in senders], out, measure)
    return {senders[i]: d for i, d in distances.items()}


def blatant_senders(weights: Mapping[int, float], distances: Mapping[int, float],
                    senders: tuple[int, ...]) -> dict[int, str]:
    """Senders of a chunk whose contribution is blatantly not an honest one, with the evidence: a
    claimed weight above NAMED_WEIGHT_OVER_MEDIAN times the lower median of the positive weights,
    or a piece farther from the robust centre than OUTLIER_FACTOR times the median distance
    (`robust.far_pieces`; `distances` as `reduce_chunk` measures them)."""
    named: dict[int, str] = {}
    positive = sorted(weights[s] for s in senders if weights[s] > 0)
    if len(positive) >= 3:
        median = positive[(len(positive) - 1) // 2]
        for s in senders:
            if weights[s] > NAMED_WEIGHT_OVER_MEDIAN * median:
                named[s] = f"it claimed weight {weights[s]:.3g}, {weights[s] / median:.3g} x the median {median:.3g}"
    median, far = far_pieces(distances)
    for s in far:
        evidence = (f"its piece is {distances[s]:.3g} from the robust centre, {distances[s] / median:.3g} x the "
                    f"median distance {median:.3g}")
        named[s] = f"{named[s]}; {evidence}" if s in named else evidence
    return named


def encode_chunk(codec: Any, t: torch.Tensor) -> Any:
    return codec.encode(t)


def decode_chunk(codec: Any, payload: Any, numel: int) -> torch.Tensor:
    """One chunk as a flat float32 tensor, refusing malformed data. No copy when the codec
    sends float32: a received chunk is kept as it came off the wire."""
    t = codec.decode(payload, numel)  # its declared size first: a few bytes can declare a GiB
    if not isinstance(t, torch.Tensor) or t.numel() != numel:
        raise AveragingError(f"chunk has the wrong size (expected {numel} elements)")
    # Codec.decode refuses NaN/inf: one pass over the chunk, not two
    checked = getattr(type(codec), "decode", None) is Codec.decode and t.dtype == torch.float32
    t = t.reshape(-1).to(torch.float32)
    if not checked and not all_finite(t):  # whatever the codec: the all-reduce never spreads NaN/inf
        raise AveragingError("chunk contains NaN or infinity")
    return t


def as_received(codec: Any, t: torch.Tensor) -> torch.Tensor:
    """What a peer decodes from `t` encoded by `codec`: `t` itself for float32 under "none",
    which sends the values as they are (no second pass)."""
    if getattr(codec, "name", None) == "none" and t.dtype == torch.float32:
        return t
    payload, received = encode_received(codec, t)
    return decode_chunk(codec, payload, t.numel()) if received is None else received  # (raises why)


def encode_received(codec: Any, t: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
    """`t` encoded by `codec`, and what a peer decodes from that (flat float32; None if a peer
    refuses it), without checking our own payload as a peer's where the codec can
    (`Codec.encode_received`): a sender digests what it sent."""
    if getattr(codec, "name", None) == "none" and t.dtype == torch.float32:
        return encode_chunk(codec, t), t
    if isinstance(codec, Codec) and not codec.stateful:
        payload, received = codec.encode_received(t)
        return payload, received.reshape(-1)
    payload = encode_chunk(codec, t)
    try:
        return payload, decode_chunk(codec, payload, t.numel())
    except PotluckError:
        return payload, None


def encodes_blocks_alone(codec: Any) -> bool:
    """Whether a VERIFY_BLOCK-aligned block of a chunk decodes alone as it does in the chunk."""
    name = getattr(codec, "name", None)
    return name in VALUEWISE_CODECS or (name in BLOCKWISE_CODECS and VERIFY_BLOCK % codec.block == 0)


def wire_form(codec: Any, values: torch.Tensor) -> tuple[Any, bool]:
    """A block of a sender's piece (as the reducer decoded it), for a member that checks the
    reducer: in the codec's form when that decodes back to exactly these values (a block of a
    blockwise code, a sparse piece), else as float32; and which of the two. The check then costs
    about what the sender sent (1/8 of the float32 values under 4 bits), and binds as before:
    the member decodes and digests the values either way."""
    if getattr(codec, "name", None) != "none" and not getattr(codec, "stateful", False):
        try:
            payload = encode_chunk(codec, values)
            if torch.equal(decode_chunk(codec, payload, values.numel()), values):
                return payload, True
        except PotluckError:
            pass  # not representable in the codec: float32 it is
    return values, False
