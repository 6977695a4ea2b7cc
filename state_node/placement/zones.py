"""Zones (failure domains) in the placement, and the zone pass both engines end with: moves and swaps of replicas
that give a partition a zone it lacks while every count keeps its balance."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


def zone_map(members: Sequence[str], zones: Mapping[str, str] | None) -> dict[str, str]:
    """Each member's failure domain: its zone, or (none or "") a domain of its own."""
    return {m: (zones or {}).get(m) or f"\0{m}" for m in members}


@dataclass(frozen=True, slots=True)
class ZoneSearch:
    """How far the zone pass looks for a step. The seat-based engine places large clusters and bounds the
    search; the exact engine places small ones and looks at every node.

    candidates: nodes tried per replica it would move, from a place that depends on the partition (so that
        partitions do not all look at the same nodes); None: every node, in name order.
    passes: passes over the partitions still short of a zone; None: until a pass changes nothing.
    enough: a step of at most this cost (replicas that no node held before) ends the search for a replica
        at once; None: the cheapest step found, swaps before moves at equal cost.
    moves_from_fuller: a move is taken only from a node that holds more than the receiver in every count it
        changes (else: whenever the count's spread ends no worse than before, or within 1).
    first_in_zone_stays: the replicas tried are those after the first of their zone in the partition's list
        (else: every replica in a zone the partition holds twice, the preferred one last).
    """

    candidates: int | None
    passes: int | None
    enough: int | None
    moves_from_fuller: bool
    first_in_zone_stays: bool


# Bounded work in large clusters: 64 nodes tried per replica, 4 passes.
SEATED_SEARCH = ZoneSearch(candidates=64, passes=4, enough=1, moves_from_fuller=True, first_in_zone_stays=False)
EXACT_SEARCH = ZoneSearch(candidates=None, passes=None, enough=None, moves_from_fuller=False, first_in_zone_stays=True)


class Tally:
    """Counts per node with how many nodes have each count: the spread (max - min) in time independent of
    the number of nodes."""

    def __init__(self, members: Sequence[str], counts: Mapping[str, int]) -> None:
        self.count = {m: counts.get(m, 0) for m in members}
        self._nodes_at = dict(Counter(self.count.values()))

    def add(self, m: str, delta: int) -> None:
        old = self.count[m]
        self.count[m] = old + delta
        left = self._nodes_at[old] - 1
        if left:
            self._nodes_at[old] = left
        else:
            del self._nodes_at[old]
        self._nodes_at[old + delta] = self._nodes_at.get(old + delta, 0) + 1

    def spread(self) -> int:
        return max(self._nodes_at) - min(self._nodes_at)


@dataclass(frozen=True, slots=True)
class ZoneCounts:
    """The counts a zone step must keep balanced. `store_replicas` and `store_preferred` hold, per
    partition of the pass (in its order), the tally of that partition's store: partitions of one store share
    one tally object."""

    replicas: Tally  # replicas per node over all stores
    preferred: Tally  # preferred replicas per node over all stores
    store_replicas: Sequence[Tally]
    store_preferred: Sequence[Tally]


class _Step(NamedTuple):
    """A step for one replica: give it to `node`; for a swap (`kind` 0) `node`'s replica at `other_pos` of
    partition `other` comes back in exchange; a move (`kind` 1) has other = -1."""

    cost: int  # replicas placed on a node that did not hold the partition before
    kind: int
    node: str
    other: int
    other_pos: int


def spread_over_zones(
    sets: list[list[str]],
    kept: Sequence[Sequence[str]],
    zone_of: Mapping[str, str],
    counts: ZoneCounts,
    short: Sequence[int],
    search: ZoneSearch,
) -> None:
    """Moves or swaps replicas of the partitions `sets` (preferred replica first; changed in place) until none
    of `short` (the partitions that may lack a zone; the others are never given one) can gain a zone that
    way, within the bounds of `search`. For partition p with a replica on node a in a zone p already holds,
    and a node b in a zone p lacks:
      - a move gives a's replica of p to b;
      - a swap also gives b's replica of another partition q to a, when q keeps as many zones as it had.
    Either is taken only when every count (`counts`: replicas and preferred replicas, over all stores and of
    each store a step touches) keeps its spread across nodes within 1, or no worse than before: the
    placement's balance is kept. A swap within one store and role changes no count at all. A step costs the
    replicas it places on a node that was not in `kept` (the partition's previous replicas still alive).
    Each step adds a zone to a partition and takes none from another, so the passes end.

    A partition whose zones are all different never becomes short of one: only `short` is worked on."""
    members = sorted(zone_of)
    store_replicas, store_preferred = counts.store_replicas, counts.store_preferred
    # Which (partition, position) each node holds, for the swaps. When every partition has one replica per
    # zone there is (as many replicas as zones), a partition with all of them is never swapped with: giving
    # up b's replica would take b's zone, the only one of it there, and bring a's, which it has. So only
    # the partitions short of a zone (a step never makes another one short) are looked at.
    available = len(set(zone_of.values()))
    indexed = short if all(len(reps) == available for reps in sets) else range(len(sets))
    holding: dict[str, set[tuple[int, int]]] = {}
    for p in indexed:
        for pos, node in enumerate(sets[p]):
            held = holding.get(node)
            if held is None:
                holding[node] = {(p, pos)}
            else:
                held.add((p, pos))

    def transfers(p: int, pos: int, a: str, b: str) -> list[tuple[Tally, str, str]]:
        if pos == 0:
            return [(t, a, b) for t in (counts.replicas, store_replicas[p], counts.preferred, store_preferred[p])]
        return [(counts.replicas, a, b), (store_replicas[p], a, b)]

    def apply(changes: list[tuple[Tally, str, str]], sign: int = 1) -> None:
        for tally, a, b in changes:
            tally.add(a, -sign)
            tally.add(b, sign)

    def balanced(changes: list[tuple[Tally, str, str]]) -> bool:
        touched = list({id(t): t for t, _, _ in changes}.values())
        before = [t.spread() for t in touched]
        apply(changes)
        after = [t.spread() for t in touched]
        apply(changes, -1)
        return all(new <= max(1, old) for old, new in zip(before, after, strict=True))

    def doubled(reps: Sequence[str]) -> list[int]:
        """The positions of `reps` a step may move (see ZoneSearch.first_in_zone_stays)."""
        if search.first_in_zone_stays:
            seen: set[str] = set()
            later = []
            for pos, node in enumerate(reps):
                if zone_of[node] in seen:
                    later.append(pos)
                seen.add(zone_of[node])
            return later
        held = Counter(zone_of[node] for node in reps)
        found = [pos for pos, node in enumerate(reps) if held[zone_of[node]] > 1]
        return found[1:] + found[:1] if found and found[0] == 0 else found

    def best_step(p: int, pos: int) -> _Step | None:
        a, reps = sets[p][pos], sets[p]
        mine = {zone_of[n] for n in reps}
        best: _Step | None = None
        if search.candidates is None:
            candidates = members
        else:
            start = (p * 7919) % len(members)
            candidates = members[start:] + members[:start]
        tried = 0
        for b in candidates:
            if zone_of[b] in mine:
                continue
            tried += 1
            if search.candidates is not None and tried > search.candidates:
                break
            gain_cost = int(b not in kept[p])
            if best is not None and best.cost < gain_cost:
                continue
            for q, qpos in sorted(holding.get(b, ())):
                if a in sets[q]:
                    continue
                cost = gain_cost + int(a not in kept[q])
                if best is not None and (cost, 0) >= best[:2]:
                    continue
                rest = {zone_of[n] for k, n in enumerate(sets[q]) if k != qpos}
                if zone_of[a] in rest and zone_of[b] not in rest:
                    continue  # q would lose b's zone and gain none
                same_counts = store_replicas[q] is store_replicas[p] and (qpos == 0) == (pos == 0)
                if not same_counts and not balanced(transfers(p, pos, a, b) + transfers(q, qpos, b, a)):
                    continue
                best = _Step(cost, 0, b, q, qpos)
            moving = transfers(p, pos, a, b)
            if (
                (best is None or (gain_cost, 1) < best[:2])
                # A move keeps counts within one only from a node holding more than b (checked first: cheap).
                and (not search.moves_from_fuller or all(t.count[b] < t.count[a] for t, _, _ in moving))
                and balanced(moving)
            ):
                best = _Step(gain_cost, 1, b, -1, -1)
            if search.enough is not None and best is not None and best.cost <= search.enough:
                break
        return best

    # A step never takes a zone from a partition, nor gives one a second replica in a zone, so only the
    # partitions short of zones at the start are ever worked on; passes repeat while one of them gains a zone.
    pending = [p for p in short if doubled(sets[p])]
    changed, passes = True, 0
    while changed and (search.passes is None or passes < search.passes):
        changed, passes = False, passes + 1
        for p in pending:
            for pos in doubled(sets[p]):
                step = best_step(p, pos)
                if step is None:
                    continue
                a, b, q, qpos = sets[p][pos], step.node, step.other, step.other_pos
                changes = transfers(p, pos, a, b)
                holding.setdefault(a, set()).discard((p, pos))
                holding.setdefault(b, set()).add((p, pos))
                sets[p][pos] = b
                if q >= 0:
                    changes += transfers(q, qpos, b, a)
                    holding[b].discard((q, qpos))
                    holding.setdefault(a, set()).add((q, qpos))
                    sets[q][qpos] = a
                apply(changes)
                changed = True
                break  # p changed: its doubled positions are found again on the next pass
        pending = [p for p in pending if doubled(sets[p])]
