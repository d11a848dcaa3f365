"""Foundations used by every layer: errors, serialization, the field checks of wire messages
(`wire`) and the per-process event loop.

Imports nothing else from potluck at run time (`peer_like` names upper-layer types in annotations only).
"""
