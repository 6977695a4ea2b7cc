"""Co-location groups: stores whose records name each other (`colocate_with`), placed together so partition
p of every store of a group is on the same replicas (keyroute.state_node.placement.groups places them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def colocation_groups(links: Mapping[str, str | None], stores: Sequence[str] | None = None) -> dict[str, str]:
    """store -> its group's name (the least store name of the group), for every store of `stores` (all of
    `links`' when None) in a group of two or more of them. `links`: store -> the store it is co-located
    with (None: none); a link to a store not among `stores` joins nothing."""
    present = set(links if stores is None else stores)
    parent = {name: name for name in present}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name in sorted(present):
        other = links.get(name)
        if other is not None and other in present and other != name:
            a, b = root(name), root(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    members: dict[str, list[str]] = {}
    for name in present:
        members.setdefault(root(name), []).append(name)
    return {name: min(group) for group in members.values() if len(group) > 1 for name in group}
