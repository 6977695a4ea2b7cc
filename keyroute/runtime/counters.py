"""Counts of things in progress per key (requests per node URL, per caller), kept in a plain dict whose keys
leave when their count drops to zero: a dict that never grows with keys seen once and gone."""

from __future__ import annotations


def count_up(counts: dict[str, int], key: str) -> int:
    """One more under `key`; the count before it."""
    held = counts.get(key, 0)
    counts[key] = held + 1
    return held


def count_down(counts: dict[str, int], key: str) -> None:
    """One less under `key` (gone at zero; a key not counted is left alone)."""
    held = counts.get(key, 0)
    if held > 1:
        counts[key] = held - 1
    else:
        counts.pop(key, None)
