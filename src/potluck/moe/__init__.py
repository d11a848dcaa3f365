"""`potluck.moe`: decentralized mixture-of-experts (DMoE), experts hosted on other peers.

Owns the expert server and its batching runtime and checkpoints (`server`), the typed wire messages
and their checks (`messages`), the client side of an expert call as an autograd function
(`expert`: `RemoteExpert`), uid grids, DHT announcements and
the beam search that finds live experts (`grid`), the mixture layers (`layers`) and the built-in
expert types (`experts`). Imports from `potluck.core`, `potluck.net` and `potluck.dht` only.
"""

from potluck.moe.errors import BadExpertRequest, ExpertError, ExpertNotFound, NotEnoughExperts, StashMissing
from potluck.moe.expert import RemoteExpert
from potluck.moe.experts import (
    FeedForwardExpert,
    TensorSchema,
    TransformerBlockExpert,
    expert_types,
    make_expert,
    register_expert_type,
)
from potluck.moe.grid import ExpertLocation, beam_search, parse_uid
from potluck.moe.layers import RemoteMixtureOfExperts, RemoteSwitchMixtureOfExperts
from potluck.moe.server import ExpertServer, ExpertStats

__all__ = [
    "BadExpertRequest", "ExpertError", "ExpertLocation", "ExpertNotFound", "ExpertServer", "ExpertStats",
    "FeedForwardExpert", "NotEnoughExperts", "RemoteExpert", "RemoteMixtureOfExperts",
    "RemoteSwitchMixtureOfExperts", "StashMissing", "TensorSchema", "TransformerBlockExpert", "beam_search",
    "expert_types", "make_expert", "parse_uid", "register_expert_type",
]
