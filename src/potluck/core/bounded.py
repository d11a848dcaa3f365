"""Caps on remembered things: a cache or a memory of peers that grows with what others send
keeps at most a fixed number of entries."""

from __future__ import annotations

from typing import Any

__all__ = ["drop_oldest"]


def drop_oldest(mapping: dict[Any, Any], most: int) -> None:
    """Delete `mapping`'s first-inserted keys until it holds at most `most`.

    A dict (an OrderedDict too) keeps insertion order, so its first key is its oldest entry: the
    oldest go first. A caller that re-inserts a key when it is used (pop, then set; or
    `move_to_end`) makes that order least recently used.
    """
    while len(mapping) > most:
        del mapping[next(iter(mapping))]
