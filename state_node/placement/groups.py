"""Co-location groups: stores whose partition p is placed on the same replicas, so one node answers a key of
all of them (a multi-store read is one hop).

A store names the store it is co-located with (`colocate_with` in its spec and record); the groups are the
connected stores (`colocation_groups`). Stores of one group share partition count and partitioner (the
build checks), so a key is in partition p of every one of them.

The placement places a group as one store (`assign_grouped`): the group's shape is its partition count with
the largest replication factor of its stores; it is placed with every other store by `assign` (so joins,
leaves, zones, holds and the balance guarantees apply to it as to a store), then every store of the group is
given the group's replica lists, preferred replica first. A member whose partition count differs from its
group's (a record changed under the group) is placed on its own. The group's previous lists are those of
its first member (by name) that has them: every member had the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keyroute.cluster.partition_map import Assignment
from keyroute.state_node.placement.seated import Holds, assign
from keyroute.state_node.placement.shape import StoreShape

# The name a group is placed under: no store name holds '~' or ':'.
GROUP_PREFIX = "~group:"


def assign_grouped(
    stores: Mapping[str, StoreShape],
    groups: Mapping[str, str],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
    zones: Mapping[str, str] | None = None,
    holds: Holds | None = None,
) -> Assignment:
    """`assign`, with every group of `groups` (store -> group name, as `colocation_groups` gives) placed as
    one store and its stores given identical replica lists."""
    members = _members(stores, groups)
    if not members:
        return assign(stores, nodes, previous, generation, zones=zones, holds=holds)
    grouped = {name for names in members.values() for name in names}
    collapsed: dict[str, StoreShape] = {name: shape for name, shape in stores.items() if name not in grouped}
    for group, names in members.items():
        collapsed[GROUP_PREFIX + group] = StoreShape(stores[names[0]][0], max(stores[name][1] for name in names))
    placed = assign(
        collapsed,
        nodes,
        None if previous is None else _collapsed_previous(previous, stores, members, grouped),
        generation,
        zones=zones,
        holds=None if holds is None else _collapsed_holds(holds, members, grouped),
    )
    expanded = {name: lists for name, lists in placed.stores.items() if not name.startswith(GROUP_PREFIX)}
    for group, names in members.items():
        lists = placed.stores[GROUP_PREFIX + group]
        for name in names:
            expanded[name] = lists
    return Assignment(generation, {name: expanded[name] for name in sorted(expanded)})


def _members(stores: Mapping[str, StoreShape], groups: Mapping[str, str]) -> dict[str, list[str]]:
    """group -> its stores (sorted) among `stores` that share the group's partition count (that of the
    group's first store); groups of one store are none."""
    by_group: dict[str, list[str]] = {}
    for name in sorted(stores):
        group = groups.get(name)
        if group is not None:
            by_group.setdefault(group, []).append(name)
    members: dict[str, list[str]] = {}
    for group, names in by_group.items():
        partitions = stores[names[0]][0]
        same = [name for name in names if stores[name][0] == partitions]
        if len(same) > 1:
            members[group] = same
    return members


def _collapsed_previous(
    previous: Assignment, stores: Mapping[str, StoreShape], members: Mapping[str, list[str]], grouped: set[str]
) -> Assignment:
    lists = {name: placed for name, placed in previous.stores.items() if name not in grouped}
    for group, names in members.items():
        partitions = stores[names[0]][0]
        for name in names:
            placed = previous.stores.get(name)
            if placed is not None and len(placed) == partitions:
                lists[GROUP_PREFIX + group] = placed
                break
    return Assignment(previous.generation, lists)


def _collapsed_holds(holds: Holds, members: Mapping[str, list[str]], grouped: set[str]) -> Holds:
    """Holds per group: a node holds a group's partition when it holds it of every store of the group (it
    then fetches nothing to serve it)."""
    collapsed: dict[str, Mapping[str, tuple[int, ...]] | Mapping[str, object]] = {
        name: held for name, held in holds.items() if name not in grouped
    }
    for group, names in members.items():
        per_node: dict[str, tuple[int, ...]] = {}
        nodes = set.intersection(*(set(holds.get(name, {})) for name in names))
        for node in sorted(nodes):
            common = set.intersection(*(set(holds[name][node]) for name in names))
            if common:
                per_node[node] = tuple(sorted(common))
        if per_node:
            collapsed[GROUP_PREFIX + group] = per_node
    return collapsed  # type: ignore[return-value]
