"""Foundations used by every layer: errors, serialization and the per-process event loop.

Imports nothing else from potluck.
"""
