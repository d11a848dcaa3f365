"""Codecs for tensors on the wire, and gradient compressors with error feedback.

Owns the `Codec` interface, the registry that names codecs by string (`get_codec("fp16")`,
`get_codec({"name": "blockwise8", "block": 4096})`), the built-in codecs (none, fp16,
scaled_fp16, uniform8, quantile8, blockwise8, blockwise4, topk, sparse) and `PowerSGD`, the two-round low-rank
compressor an averager drives between its all-reduce rounds.

Imports only from `potluck.core`.
"""

from potluck.compression.codec import Codec, get_codec, known_codecs, register_codec
from potluck.compression.powersgd import PowerSGD
from potluck.compression.quantizers import (
    Blockwise4Bit,
    Blockwise8Bit,
    Float16,
    NoCompression,
    Quantile8Bit,
    ScaledFloat16,
    Uniform8Bit,
)
from potluck.compression.topk import Sparse, TopK

__all__ = [
    "Blockwise4Bit",
    "Blockwise8Bit",
    "Codec",
    "Float16",
    "NoCompression",
    "PowerSGD",
    "Quantile8Bit",
    "ScaledFloat16",
    "Sparse",
    "TopK",
    "Uniform8Bit",
    "get_codec",
    "known_codecs",
    "register_codec",
]
