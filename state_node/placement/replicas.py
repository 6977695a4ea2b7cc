"""Replica lists as both placement engines write them, and what a change of assignment moves."""

from __future__ import annotations

from collections.abc import Sequence

from keyroute.cluster.partition_map import Assignment


def in_previous_order(lead: str, others: Sequence[str], previous: Sequence[str]) -> tuple[str, ...]:
    """`lead` (the preferred replica) first, then `others` in their order in `previous` (the next preferred
    stays next), new ones last by name."""
    rank = {m: i for i, m in enumerate(previous)}
    return (lead, *sorted(others, key=lambda m: (rank.get(m, len(rank)), m)))


def moved_replicas(before: Assignment, after: Assignment) -> int:
    """Replicas `after` places where `before` had none: the partition copies some node must load.
    A change of preferred replica alone moves no data and is not counted."""
    moved = 0
    for store, per_partition in after.stores.items():
        for p, replicas in enumerate(per_partition):
            moved += len(set(replicas).difference(before.replicas(store, p)))
    return moved
