"""What the placement is asked to place: a store's shape, and the error for a shape that cannot be placed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class StoreShape(NamedTuple):
    """A store as the pipeline published it: how many partitions, how many replicas of each. A plain
    (partitions, replication_factor) pair is taken as well."""

    partitions: int
    replication_factor: int


class AssignmentError(ValueError):
    """A store shape that cannot be assigned (negative partitions, replication factor below 1)."""


def check_shapes(stores: Mapping[str, tuple[int, int]]) -> None:
    """Raises AssignmentError for the first store with negative partitions or a replication factor below 1."""
    for name, (partitions, rf) in stores.items():
        if partitions < 0 or rf < 1:
            raise AssignmentError(f"store {name!r}: {partitions} partitions with replication factor {rf}")
