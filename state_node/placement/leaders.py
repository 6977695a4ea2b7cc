"""Preferred replicas among replica sets: one per partition, each node leading exactly its target, the
previous preferred replica kept where it can be (augmenting paths where a simple choice is stuck)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence


def choose_leaders(
    sets: Sequence[Sequence[str]],
    previous: Sequence[str | None],
    target: Mapping[str, int],
    strict: bool,
    must: set[str] | None = None,
) -> list[str] | None:
    """One preferred replica per partition, node n leading exactly target[n] (the targets add up to the
    partitions): the previous one while its node is under target, else one of the partition's replicas
    (through augmenting paths among them if need be), else (not `strict`; strict: None) a node under target
    that must load it."""
    leader: list[str | None] = [None] * len(sets)
    load = dict.fromkeys(target, 0)
    # The partitions each node leads: built when an augmenting path first needs it, then kept up to date.
    led_by: dict[str, set[int]] | None = None

    def index() -> dict[str, set[int]]:
        nonlocal led_by
        if led_by is None:
            led_by = {}
            for q, m in enumerate(leader):
                if m is not None:
                    led_by.setdefault(m, set()).add(q)
        return led_by

    def assign_to(p: int, m: str) -> None:
        old = leader[p]
        if old is not None:
            load[old] -= 1
            if led_by is not None:
                led_by[old].discard(p)
        leader[p] = m
        load[m] += 1
        if led_by is not None:
            led_by.setdefault(m, set()).add(p)

    for p, prev in enumerate(previous):
        # assign_to(p, prev), inline: most partitions keep their preferred replica
        if prev is not None and load[prev] < target[prev] and prev in sets[p]:
            leader[p] = prev
            load[prev] += 1
    for p, reps in enumerate(sets):
        if leader[p] is not None or not reps:
            continue
        free = [m for m in reps if load[m] < target[m]]
        if free:
            assign_to(p, min(free, key=lambda m: (load[m] - target[m], m)))
            continue
        path = _augmenting_path(p, sets, index(), load, target)
        if path is not None:
            # From the end, so that no count ever passes its target on the way.
            for q, m in reversed(path):
                assign_to(q, m)
    if must:
        # Nodes that must lead one (with targets of one each): each takes a partition it holds from a node
        # that need not lead.
        for m in sorted(must):
            if load[m]:
                continue
            for p, reps in enumerate(sets):
                old = leader[p]
                if m in reps and (old is None or old not in must):
                    assign_to(p, m)
                    break
            else:
                return None
    if strict:
        return None if None in leader else leader  # type: ignore[return-value]
    # The rest go to nodes under target, which load them: the most wanting first.
    wanting = [(-(target[m] - load[m]), m) for m in sorted(target) if load[m] < target[m]]
    heapq.heapify(wanting)
    for p in range(len(sets)):
        if leader[p] is None:
            deficit, m = heapq.heappop(wanting)
            assign_to(p, m)
            if deficit + 1 < 0:
                heapq.heappush(wanting, (deficit + 1, m))
    return [m for m in leader if m is not None]


def _augmenting_path(
    p: int,
    sets: Sequence[Sequence[str]],
    led_by: Mapping[str, set[int]],
    load: Mapping[str, int],
    target: Mapping[str, int],
) -> list[tuple[int, str]] | None:
    """Partition p takes replica m as leader; m (at target) passes one of its partitions q to another
    replica of q, and so on until a node under target takes one. Breadth-first: the shortest chain."""
    start = sorted(sets[p])
    came: dict[str, tuple[int, str | None]] = {m: (p, None) for m in start}
    queue = deque(start)
    while queue:
        m = queue.popleft()
        for q in sorted(led_by.get(m, ())):
            for o in sorted(sets[q]):
                if o == m or o in came:
                    continue
                came[o] = (q, m)
                if load[o] < target[o]:
                    path: list[tuple[int, str]] = []
                    node: str | None = o
                    while node is not None:
                        part, prev_node = came[node]
                        path.append((part, node))
                        node = prev_node
                    path.reverse()
                    return path
                queue.append(o)
    return None
