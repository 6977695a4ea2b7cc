"""The controller's placement rule: which nodes serve each partition, preferred replica first.

A pure function of (stores, live nodes, zones, previous assignment), in time about linear in the number of
replicas (benchmarks/control_plane.py measures it at 1,000 nodes and 100,000 partitions).

1. An assignment that still meets every guarantee below for the current stores and nodes is kept as it is.
2. Replica targets. Store s has R = partitions x min(rf, nodes) replicas: every node gets floor(R / n) of
   them, and R mod n nodes one more. Which nodes take a store's extra replicas is decided over all stores
   at once (seats, `_Seats`), so that every node's total is within one of every other's too: nodes that
   held more than the floor keep their extra, zones take turns, and nodes that will have to take an extra
   preferred replica of the store get an extra replica of it.
3. Replicas. Each partition keeps its live previous replicas, except on nodes above target, which give up
   the ones that cost least (in a zone the partition holds twice first). Every missing replica goes to the
   node below target that needs the most, in a zone the partition lacks when one can; when every such node
   already holds the partition, a node that does not takes it and passes another replica on.
4. Preferred replicas, among each partition's replicas: targets as in 2 (stores with fewer replicas per
   partition first: they have the fewest choices); the previous preferred replica stays while under target,
   the others are matched by augmenting paths. When the replica sets allow no balanced choice, the store is
   placed the other way round: preferred replicas first (balanced by construction), the others around them.
5. Zones: moves and swaps that keep every count's balance and give a partition a zone it lacks.

Everything iterates in sorted order: identical inputs give identical output.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

from keyroute.core.partition_map import Assignment

# (partitions, replication_factor) per store, as the pipeline published them.
StoreShape = tuple[int, int]
# Up to this many replicas in all, a placement the seats cannot balance is made by min-cost flows instead.
EXACT_LIMIT = 5000


class AssignmentError(ValueError):
    """A store shape that cannot be assigned (negative partitions, replication factor below 1)."""


def assign(
    stores: Mapping[str, StoreShape],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
    zones: Mapping[str, str] | None = None,
) -> Assignment:
    """The desired placement of every partition of `stores` on `nodes` (see the module's description).

    Guarantees (tests/property/ checks each on random inputs and histories):
      - partition p gets min(replication_factor, len(nodes)) distinct nodes, or () without nodes;
      - replicas per node differ by at most 1, per store and over all stores together;
      - preferred replicas per node differ by at most 1 over all stores together and, wherever the replica
        sets allow it, per store;
      - identical inputs give identical output, whatever their order;
      - an unchanged cluster keeps its assignment exactly; a node that leaves moves only the replicas that
        must move to keep the counts balanced: its own, and at most as many again;
      - with zones (`zones`: node -> failure domain; none or "" is a domain of its own), a missing replica
        goes to a zone its partition lacks whenever a node below target is in one.
    """
    for name, (partitions, rf) in stores.items():
        if partitions < 0 or rf < 1:
            raise AssignmentError(f"store {name!r}: {partitions} partitions with replication factor {rf}")
    members = sorted(set(nodes))
    names = sorted(stores)
    if not members:
        return Assignment(generation, {name: ((),) * stores[name][0] for name in names})
    zone_of = {m: (zones or {}).get(m) or f"\0{m}" for m in members}
    alive = set(members)
    n = len(members)
    if previous is not None and _balanced(stores, members, previous):
        return Assignment(generation, {name: tuple(previous.stores[name]) for name in names})

    # Stores with fewer replicas per partition first: their preferred replicas have the fewest choices, and
    # the seats of both kinds are handed out in this order.
    order = sorted(names, key=lambda s: (min(stores[s][1], n), s))
    replica_seats, leader_seats = _Seats(members), _Seats(members)
    # Previous preferred replicas per node, all stores: a store's extra replica goes, other things equal,
    # to a node that leads little, so that the previous preferred replicas of later stores can stay.
    leading_anywhere, holding_anywhere = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
    if previous is not None:
        led: Counter[str] = Counter()
        held: Counter[str] = Counter()
        for name in names:
            per = previous.stores.get(name, ())[: stores[name][0]]
            led.update(reps[0] for reps in per if reps)
            held.update(chain.from_iterable(per))
        leading_anywhere.update((m, c) for m, c in led.items() if m in alive)
        holding_anywhere.update((m, c) for m, c in held.items() if m in alive)
    # per store: replica sets, kept replicas, previous replicas, replica and preferred-replica targets
    uneven = False  # whether some node's replicas ended above its target (see _even_out_totals)
    placed_of: dict[
        str, tuple[list[list[str]], list[list[str]], list[tuple[str, ...]], dict[str, int], dict[str, int]]
    ] = {}
    for name in order:
        partitions, rf = stores[name]
        r = min(rf, n)
        had = previous.stores.get(name, ()) if previous is not None else ()
        before = list(had[:partitions]) + [()] * (partitions - len(had))
        kept = [
            list(reps) if len(reps) <= r and alive.issuperset(reps) and len(set(reps)) == len(reps)
            # a replica gone or named twice, or more than r (the replication factor came down)
            else list(dict.fromkeys(m for m in reps if m in alive))[:r]
            for reps in before
        ]
        counts = _counts(kept, members)
        floor, extra = divmod(partitions * r, n)
        # Other things equal, extra replicas go to nodes with few preferred replicas so far (they are the
        # ones that must take the next preferred replicas), then to nodes that led little before.
        # (then to nodes that held few replicas of any store: the others keep theirs.)
        scale = 1 + sum(holding_anywhere.values())
        seats = leader_seats.counts
        busy = {m: (seats[m] * scale + holding_anywhere[m]) * scale + leading_anywhere[m] for m in members}
        # When the store's replicas per node are as few as its preferred replicas per node (floor), only nodes
        # with an extra replica can take an extra preferred one: the nodes that will have to (they are below
        # the preferred replicas' floor over all stores) get an extra replica first.
        rank = dict(counts)
        if floor == partitions // n:
            for m in leader_seats.forced(partitions % n):
                rank[m] = partitions * n + 1
        extras = replica_seats.hand_out(
            extra,
            prefer=[m for m in members if rank[m] > floor],
            rank=rank,
            busy=busy,
            zone_of=zone_of,
            zone_need=_zones_lacking(kept, r, zone_of) if zones else None,
        )
        target = {m: floor + (1 if m in extras else 0) for m in members}

        previous_leaders = [reps[0] if reps and reps[0] in alive else None for reps in before]
        leading = _counts([[lead] for lead in previous_leaders if lead is not None], members)
        lead_floor, lead_extra = divmod(partitions, n)

        # Replicas first (they move data), then preferred replicas among them (they do not): unless no
        # balanced choice of preferred replicas exists among those sets.
        sets = _place([list(reps) for reps in kept], r, target, zone_of, fixed=0)
        holding = _counts(sets, members)
        attempt = leader_seats.copy()
        leaders = None
        if lead_floor == 0 and lead_extra:
            # Fewer partitions than nodes: each preferred replica on its own node, the matching itself
            # choosing which nodes (among those balance allows) take them.
            forced, allowed = attempt.options(lead_extra)
            cap = {m: 1 if m in allowed else 0 for m in members}
            leaders = _choose_leaders(sets, previous_leaders, cap, strict=True, must=forced)
            if leaders is not None:
                attempt.take_exactly(set(leaders))
                lead_target = {m: int(m in leaders) for m in members}
        else:
            lead_extras = attempt.hand_out(
                lead_extra,
                prefer=[m for m in members if holding[m] > lead_floor],
                rank={m: leading[m] + n * holding[m] for m in members},
            )
            lead_target = {m: lead_floor + (1 if m in lead_extras else 0) for m in members}
            leaders = _choose_leaders(sets, previous_leaders, lead_target, strict=True)
        if leaders is not None:
            leader_seats = attempt
            placed = [_led_by(reps, lead) for reps, lead in zip(sets, leaders, strict=True)]
        else:
            # Preferred replicas first, balanced by construction; the other replicas placed around them.
            # A node may lead only as many partitions as it holds replicas: the extra preferred replicas go
            # to nodes with more replicas than the floor of preferred ones first (with one replica per
            # partition, exactly the nodes with the extra replicas), the previous leaders among them first.
            lead_extras = leader_seats.hand_out(
                lead_extra,
                prefer=[m for m in members if target[m] > lead_floor],
                rank={m: leading[m] + n * target[m] for m in members},
            )
            lead_target = {m: lead_floor + (1 if m in lead_extras else 0) for m in members}
            chosen = _choose_leaders(kept, previous_leaders, lead_target, strict=False)
            assert chosen is not None
            around = [_led_by(reps, lead) for reps, lead in zip(kept, chosen, strict=True)]
            follower_target = {m: target[m] - lead_target[m] for m in members}
            # A preferred replica on a node beyond its replica target: that node ends above it.
            uneven = uneven or any(v < 0 for v in follower_target.values())
            placed = _place(around, r, follower_target, zone_of, fixed=1)
        placed_of[name] = (placed, kept, before, target, lead_target)
    if uneven:
        _even_out_totals(placed_of, members, zone_of)
    if zones and len(set(zone_of.values())) > 1:
        # Then, where balance allows, moves and swaps that give a partition a zone it lacks. Every count is
        # its target now: the tallies start from the targets.
        totals = _Tally(members, _sum(t for _, _, _, t, _ in placed_of.values()))
        leaders = _Tally(members, _sum(lt for _, _, _, _, lt in placed_of.values()))
        available = len(set(zone_of.values()))
        for name in order:
            placed, kept, _, target, lead_target = placed_of[name]
            zone = zone_of.__getitem__
            short = [p for p, reps in enumerate(placed) if len(set(map(zone, reps))) < min(len(reps), available)]
            if short:
                tallies = (totals, _Tally(members, target), leaders, _Tally(members, lead_target))
                _spread_over_zones(placed, kept, zone_of, tallies, short)
    out = {
        name: tuple(_final(reps, before[p]) for p, reps in enumerate(placed))
        for name, (placed, _, before, _, _) in placed_of.items()
    }
    result = Assignment(generation, {name: out[name] for name in names})
    if sum(p * min(rf, n) for p, rf in stores.values()) > EXACT_LIMIT:
        return result
    # Seats handed out store by store can paint themselves into a corner when a store has fewer replicas than
    # nodes (its extra preferred replicas must sit on its extra replicas, which earlier stores' seats may have
    # ruled out), or balance the counts only by moving more than twice what had to move. Small clusters,
    # where that happens, get the exact placement instead (when unbalanced, or when it moves fewer); in large
    # ones a count may then be two apart rather than one.
    balanced = _balanced(stores, members, result)
    if balanced and (previous is None or moved_replicas(previous, result) <= 2 * _must_move(stores, previous, result)):
        return result
    from keyroute.state_node.assignment_exact import assign_exact

    exact = assign_exact(stores, members, previous, generation, zones)
    if not balanced or previous is None or moved_replicas(previous, exact) < moved_replicas(previous, result):
        return exact
    return result


# Nodes the zone pass tries per replica it would move, and passes over the partitions still short of a zone
# (see _spread_over_zones): bounded work in large clusters.
_ZONE_CANDIDATES = 64
_ZONE_PASSES = 4


def _spread_over_zones(
    sets: list[list[str]],
    kept: Sequence[Sequence[str]],
    zone_of: Mapping[str, str],
    tallies: tuple[_Tally, _Tally, _Tally, _Tally],
    short: Sequence[int],
) -> None:
    """Moves or swaps replicas of one store's partitions (`sets`, preferred replica first; changed in place)
    until no partition can gain a zone that way. For partition p with a replica on node a in a zone p
    already holds, and a node b in a zone p lacks:
      - a move gives a's replica of p to b;
      - a swap also gives b's replica of another partition q of the store to a, when q keeps as many zones
        as it had.
    `short`: the partitions that lack a zone (the others are never touched).
    Either is taken only when every count (`tallies`: replicas over all stores, of this store, preferred
    replicas over all stores, of this store) keeps its spread across nodes within 1, or no worse than
    before: the placement's balance is kept. A swap in the same role changes no count at all. Of at most
    _ZONE_CANDIDATES nodes tried, the first step that moves at most one replica nobody held before is taken,
    else the cheapest. Each step adds a zone to a partition and takes none from another, so the passes end."""
    members = sorted(zone_of)
    totals, store_totals, leaders, store_leaders = tallies
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

    def transfers(pos: int, a: str, b: str) -> list[tuple[_Tally, str, str]]:
        return [
            (t, a, b) for t in ((totals, store_totals, leaders, store_leaders) if pos == 0 else (totals, store_totals))
        ]

    def apply(changes: list[tuple[_Tally, str, str]], sign: int = 1) -> None:
        for tally, a, b in changes:
            tally.add(a, -sign)
            tally.add(b, sign)

    def balanced(changes: list[tuple[_Tally, str, str]]) -> bool:
        touched = list({id(t): t for t, _, _ in changes}.values())
        before = [t.spread() for t in touched]
        apply(changes)
        after = [t.spread() for t in touched]
        apply(changes, -1)
        return all(new <= max(1, old) for old, new in zip(before, after, strict=True))

    def doubled(reps: Sequence[str]) -> list[int]:
        """Positions of replicas in a zone another replica of the same partition is in, the preferred
        replica last (moving it changes more counts)."""
        held = Counter(zone_of[node] for node in reps)
        found = [pos for pos, node in enumerate(reps) if held[zone_of[node]] > 1]
        return found[1:] + found[:1] if found and found[0] == 0 else found

    def best_step(p: int, pos: int) -> tuple[int, int, str, int, int] | None:
        """(cost, 0 for a swap or 1 for a move, b, q, q's position); q = -1 for a move."""
        a, reps = sets[p][pos], sets[p]
        mine = {zone_of[n] for n in reps}
        best: tuple[int, int, str, int, int] | None = None
        # From a place that depends on the partition, so that partitions do not all look at the same nodes.
        start = (p * 7919) % len(members)
        tried = 0
        for b in members[start:] + members[:start]:
            if zone_of[b] in mine:
                continue
            tried += 1
            if tried > _ZONE_CANDIDATES:
                break
            gain_cost = int(b not in kept[p])
            for q, qpos in sorted(holding.get(b, ())):
                if a in sets[q]:
                    continue
                cost = gain_cost + int(a not in kept[q])
                if best is not None and (cost, 0) >= best[:2]:
                    continue
                rest = {zone_of[n] for k, n in enumerate(sets[q]) if k != qpos}
                if zone_of[a] in rest and zone_of[b] not in rest:
                    continue  # q would lose b's zone and gain none
                if (qpos == 0) != (pos == 0) and not balanced(transfers(pos, a, b) + transfers(qpos, b, a)):
                    continue
                best = (cost, 0, b, q, qpos)
            # A move keeps counts within one only from a node holding more than b (checked first: cheap).
            moving = transfers(pos, a, b)
            if (
                (best is None or (gain_cost, 1) < best[:2])
                and all(t.count[b] < t.count[a] for t, _, _ in moving)
                and balanced(moving)
            ):
                best = (gain_cost, 1, b, -1, -1)
            if best is not None and best[0] <= 1:
                break  # as cheap as a step can be but for a node that held the partition before
        return best

    # A step never takes a zone from a partition, so only the partitions short of zones at the start are
    # ever worked on; passes repeat while one of them gains a zone.
    pending = [p for p in short if doubled(sets[p])]
    changed, passes = True, 0
    while changed and passes < _ZONE_PASSES:
        changed, passes = False, passes + 1
        for p in pending:
            for pos in doubled(sets[p]):
                step = best_step(p, pos)
                if step is None:
                    continue
                _, _, b, q, qpos = step
                a = sets[p][pos]
                changes = transfers(pos, a, b)
                holding.setdefault(a, set()).discard((p, pos))
                holding.setdefault(b, set()).add((p, pos))
                sets[p][pos] = b
                if q >= 0:
                    changes += transfers(qpos, b, a)
                    holding[b].discard((q, qpos))
                    holding.setdefault(a, set()).add((q, qpos))
                    sets[q][qpos] = a
                apply(changes)
                changed = True
                break  # p changed: its doubled positions are found again on the next pass
        pending = [p for p in pending if doubled(sets[p])]


class _Tally:
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


def _even_out_totals(
    placed_of: Mapping[str, tuple[list[list[str]], Any, Any, dict[str, int], dict[str, int]]],
    members: Sequence[str],
    zone_of: Mapping[str, str],
) -> None:
    """Where a store had to be placed preferred replicas first and its preferred replicas took a node past
    its replica target, totals over all stores can end more than one apart: move other replicas (never a
    preferred one) from the fullest nodes to the emptiest, each within a store where the giver holds more
    than the taker (the store's own balance is kept), into a zone the partition lacks when one can. The
    targets in `placed_of` are brought up to date."""
    totals: Counter[str] = Counter(dict.fromkeys(members, 0))
    per_store: dict[str, Counter[str]] = {}
    # node -> (store, partition, position) of the replicas it holds that are not preferred
    follows: dict[str, set[tuple[str, int, int]]] = {m: set() for m in members}
    for name, (placed, _, _, _, _) in placed_of.items():
        counts = per_store[name] = Counter(dict.fromkeys(members, 0))
        for p, reps in enumerate(placed):
            counts.update(reps)
            for pos, m in enumerate(reps[1:], start=1):
                follows[m].add((name, p, pos))
        totals.update(counts)
    while max(totals.values()) - min(totals.values()) > 1:
        high = max(totals.values())
        low = min(totals.values())
        givers = [m for m in members if totals[m] == high]
        takers = [m for m in members if totals[m] == low]
        step = None
        for a in givers:
            for name, p, pos in sorted(follows[a]):
                counts, reps = per_store[name], placed_of[name][0][p]
                here = {zone_of[o] for o in reps if o != a}
                options = [b for b in takers if counts[b] < counts[a] and b not in reps]
                if options:
                    b = min(options, key=lambda b: (zone_of[b] in here, b))
                    step = (a, b, name, p, pos)
                    break
            if step is not None:
                break
        if step is None:
            return  # nothing can move without unbalancing a store: leave it
        a, b, name, p, pos = step
        placed_of[name][0][p][pos] = b
        follows[a].discard((name, p, pos))
        follows[b].add((name, p, pos))
        for c in (totals, per_store[name]):
            c[a] -= 1
            c[b] += 1
    for name, counts in per_store.items():
        placed_of[name][3].update(counts)


def _balanced(stores: Mapping[str, StoreShape], members: Sequence[str], a: Assignment) -> bool:
    """Whether `a` already places every partition of `stores` on `members` with every guarantee met: then
    it stays as it is (a recomputation for an unrelated change moves nothing)."""
    alive = set(members)
    totals, leaders = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
    for name, (partitions, rf) in stores.items():
        per = a.stores.get(name)
        if per is None or len(per) != partitions:
            return False
        r = min(rf, len(members))
        counts, leading = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
        for reps in per:
            if len(reps) != r or len(set(reps)) != r or not alive.issuperset(reps):
                return False
            for m in reps:
                counts[m] += 1
            if reps:
                leading[reps[0]] += 1
        for per_node, total in ((counts, totals), (leading, leaders)):
            if max(per_node.values()) - min(per_node.values()) > 1:
                return False
            for m, c in per_node.items():
                total[m] += c
    return max(totals.values()) - min(totals.values()) <= 1 and max(leaders.values()) - min(leaders.values()) <= 1


def _must_move(stores: Mapping[str, StoreShape], before: Assignment, after: Assignment) -> int:
    """Replicas no placement from `before` to `after`'s nodes can keep: those of nodes gone, in partitions
    that keep their replica count, and the ones nodes new in `after` take."""
    placed_before = {m for per in before.stores.values() for reps in per for m in reps}
    placed_after = {m for per in after.stores.values() for reps in per for m in reps}
    gone, new = placed_before - placed_after, placed_after - placed_before
    must = 0
    for name, per in after.stores.items():
        had = before.stores.get(name, ())
        for p, reps in enumerate(per):
            was = had[p] if p < len(had) else ()
            if len(was) == len(reps):
                must += sum(1 for m in was if m in gone)
            must += sum(1 for m in reps if m in new)
    return must


def moved_replicas(before: Assignment, after: Assignment) -> int:
    """Replicas `after` places where `before` had none: the partition copies some node must load.
    A change of preferred replica alone moves no data and is not counted."""
    moved = 0
    for store, per_partition in after.stores.items():
        for p, replicas in enumerate(per_partition):
            moved += len(set(replicas).difference(before.replicas(store, p)))
    return moved


def _sum(counts: Iterable[Mapping[str, int]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return total


def _counts(sets: Iterable[Sequence[str]], members: Sequence[str]) -> dict[str, int]:
    """Replicas per node of `members` (every node in `sets` is one)."""
    counts = dict.fromkeys(members, 0)
    counts.update(Counter(chain.from_iterable(sets)))
    return counts


def _led_by(reps: list[str], lead: str) -> list[str]:
    """`reps` with `lead` first (the list itself when it already is)."""
    return reps if reps and reps[0] == lead else [lead, *(m for m in reps if m != lead)]


def _final(reps: list[str], before: tuple[str, ...]) -> tuple[str, ...]:
    """A partition's replicas as written: the very tuple it had when nothing changed (readers comparing two
    assignments then find it unchanged at once), else in `_ordered` order."""
    placed = tuple(reps)
    return before if placed == before else tuple(_ordered(reps, before))


def _ordered(reps: Sequence[str], before: Sequence[str]) -> list[str]:
    """The preferred replica (first) first, then the others in their previous order (the next preferred
    stays next), new ones last by name."""
    if not reps:
        return []
    if tuple(reps) == tuple(before):
        return list(reps)  # unchanged (most partitions, after a change elsewhere)
    rank = {m: i for i, m in enumerate(before)}
    return [reps[0], *sorted(reps[1:], key=lambda m: (rank.get(m, len(rank)), m))]


class _Seats:
    """Hands out, store after store, which nodes take a store's extra (ceiling) share, so that over all
    stores so far every node holds floor or ceiling of the seats handed out: totals stay within one."""

    def __init__(self, members: Sequence[str]) -> None:
        self._members = members
        self._count = dict.fromkeys(members, 0)
        self._handed = 0

    @property
    def counts(self) -> Mapping[str, int]:
        """Seats per node so far (read only)."""
        return self._count

    def forced(self, k: int) -> list[str]:
        """The nodes that the next `hand_out(k)` must give a seat to (they would fall below the floor)."""
        floor = (self._handed + k) // len(self._members)
        return [m for m in self._members if self._count[m] < floor]

    def options(self, k: int) -> tuple[set[str], set[str]]:
        """For the next k seats: the nodes that must take one, and the nodes that may (including those)."""
        floor, extra = divmod(self._handed + k, len(self._members))
        above = sum(1 for c in self._count.values() if c > floor)
        forced = {m for m in self._members if self._count[m] < floor}
        room = extra - above - sum(1 for m in forced if self._count[m] + 1 > floor)
        allowed = forced | ({m for m in self._members if self._count[m] == floor} if room > 0 else set())
        return forced, allowed

    def take_exactly(self, chosen: set[str]) -> None:
        """Give one seat to each of `chosen` (drawn from `options(len(chosen))`)."""
        self._handed += len(chosen)
        for m in chosen:
            self._count[m] += 1

    def copy(self) -> _Seats:
        other = _Seats(self._members)
        other._count = dict(self._count)
        other._handed = self._handed
        return other

    def hand_out(
        self,
        k: int,
        prefer: Sequence[str],
        rank: Mapping[str, int],
        busy: Mapping[str, int] | None = None,
        zone_of: Mapping[str, str] | None = None,
        zone_need: Mapping[str, int] | None = None,
    ) -> set[str]:
        """k distinct nodes (k < number of nodes): those below the new floor, then the `prefer`red ones (in
        `rank` order, highest first) where balance allows, then as many in each zone as `zone_need` asks
        (the zones the store's missing replicas lack: a node that leaves is replaced in its own zone), then
        the ones with the fewest seats, zones taking turns, the least `busy` first."""
        if k == 0:
            return set()
        self._handed += k
        floor, extra = divmod(self._handed, len(self._members))
        above = sum(1 for c in self._count.values() if c > floor)
        chosen: set[str] = set()

        def free(m: str) -> bool:
            c = self._count[m]
            return m not in chosen and (c < floor or (c == floor and above < extra))

        def take(m: str) -> None:
            nonlocal above
            if self._count[m] == floor:
                above += 1
            self._count[m] += 1
            chosen.add(m)

        for m in self._members:
            if self._count[m] < floor:
                take(m)
        for m in sorted(prefer, key=lambda m: (-rank.get(m, 0), m)):
            if len(chosen) < k and free(m):
                take(m)
        if len(chosen) < k:
            turns = _taking_turns(self._members, lambda m: self._count[m], busy, zone_of)
            if zone_need and zone_of:
                need = dict(zone_need)
                for m in turns:
                    if len(chosen) >= k:
                        break
                    if need.get(zone_of[m], 0) > 0 and free(m):
                        take(m)
                        need[zone_of[m]] -= 1
            for m in turns:
                if len(chosen) < k and free(m):
                    take(m)
        return chosen


def _zones_lacking(kept: Sequence[Sequence[str]], replicas: int, zone_of: Mapping[str, str]) -> dict[str, int]:
    """Per zone, how many of a store's missing replicas must go there for their partitions to hold as many
    zones as they can (counted where a partition lacks no more zones than it misses replicas)."""
    zones = set(zone_of.values())
    need: dict[str, int] = {}
    for reps in kept:
        missing = replicas - len(reps)
        if missing <= 0:
            continue
        lacking = zones.difference(zone_of[m] for m in reps)
        if len(lacking) <= missing:
            for zone in lacking:
                need[zone] = need.get(zone, 0) + 1
    return need


def _taking_turns(
    nodes: Sequence[str],
    level: Callable[[str], int],
    busy: Mapping[str, int] | None,
    zone_of: Mapping[str, str] | None,
) -> list[str]:
    """`nodes` by `level`, zones taking turns within a level, then by `busy` and name."""
    busy, zone_of = busy or {}, zone_of or {}
    turn: dict[tuple[int, str], int] = {}
    ordered = []
    for lv, b, m in sorted((level(m), busy.get(m, 0), m) for m in nodes):
        key = (lv, zone_of.get(m, m))
        t = turn.get(key, 0)
        turn[key] = t + 1
        ordered.append((lv, t, b, m))
    ordered.sort()
    return [m for _, _, _, m in ordered]


def _place(
    sets: list[list[str]], replicas: int, target: Mapping[str, int], zone_of: Mapping[str, str], fixed: int
) -> list[list[str]]:
    """Replica sets of one store (live previous replicas; with `fixed` = 1 the preferred one first, which
    stays) changed as little as possible so that every node holds exactly `target` of the replicas not
    fixed, and every partition `replicas` replicas."""
    sets = [list(reps) for reps in sets]
    counts = dict.fromkeys(target, 0)
    counts.update(Counter(chain.from_iterable(reps[fixed:] for reps in sets) if fixed else chain.from_iterable(sets)))

    def give_up_cost(p: int, m: str) -> tuple[int, int, int]:
        reps = sets[p]
        doubled = sum(1 for o in reps if zone_of[o] == zone_of[m]) > 1
        return (int(not doubled), counts[m] <= target[m], -p)

    # A partition with more followers than it needs (its preferred replica is new) drops the costliest.
    for p, reps in enumerate(sets):
        while len(reps) > replicas:
            m = min(reps[fixed:], key=lambda m: (counts[m] - target[m] <= 0, *give_up_cost(p, m)[::2], m))
            reps.remove(m)
            counts[m] -= 1
    # Nodes above target give up followers: first in a zone the partition holds twice, then the last ones.
    for m in sorted(target):
        excess = counts[m] - target[m]
        if excess <= 0:
            continue
        holding = [p for p, reps in enumerate(sets) if m in reps and (not fixed or reps[0] != m)]
        for p in sorted(holding, key=lambda p, m=m: give_up_cost(p, m))[:excess]:
            sets[p].remove(m)
        counts[m] -= excess

    wanting = _Wanting({m: target[m] - counts[m] for m in target if target[m] > counts[m]})
    for p, reps in enumerate(sets):
        while len(reps) < replicas:
            best = wanting.best_for(reps, zone_of)
            if best is not None:
                reps.append(best)
                continue
            # Every node below target holds p already: a node without p takes it and passes one of its
            # other followers to a node below target.
            _place_through_another(sets, p, wanting, fixed)
    return sets


class _Wanting:
    """Nodes below target with how many replicas each still needs; the best one for a partition first."""

    def __init__(self, deficit: dict[str, int]) -> None:
        self.deficit = deficit
        self._heap = [(-d, m) for m, d in sorted(deficit.items())]
        heapq.heapify(self._heap)

    def best_for(self, reps: Sequence[str], zone_of: Mapping[str, str]) -> str | None:
        """Among the nodes that do not hold the partition, the one in the zone `reps` hold least, then the one
        that needs the most replicas (ties by name); taken. None when every one holds it."""
        here = Counter(zone_of[o] for o in reps)
        popped: list[tuple[int, str]] = []
        best: tuple[int, tuple[int, str]] | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self.deficit.get(entry[1]) != -entry[0]:
                continue  # stale
            popped.append(entry)
            if entry[1] in reps:
                continue
            held = here[zone_of[entry[1]]]
            if best is None or held < best[0]:
                best = (held, entry)
            if held == 0 or len(popped) > 4 * len(reps) + 8:
                break  # a zone the partition lacks, or past the nodes of the zones already here
        chosen = best[1] if best is not None else None
        for entry in popped:
            if entry is not chosen:
                heapq.heappush(self._heap, entry)
        if chosen is None:
            return None
        self.take(chosen[1])
        return chosen[1]

    def take(self, m: str) -> None:
        left = self.deficit[m] - 1
        if left:
            self.deficit[m] = left
            heapq.heappush(self._heap, (-left, m))
        else:
            del self.deficit[m]


def _place_through_another(sets: list[list[str]], p: int, wanting: _Wanting, fixed: int) -> None:
    reps = sets[p]
    holders: dict[str, list[int]] = {}
    for q, others in enumerate(sets):
        for m in others[fixed:]:
            holders.setdefault(m, []).append(q)
    for via in sorted(holders):
        if via in reps:
            continue
        for q in holders[via]:
            for b in sorted(wanting.deficit):
                if b not in sets[q]:
                    sets[q][sets[q].index(via)] = b
                    reps.append(via)
                    wanting.take(b)
                    return
    raise AssertionError("no node can take the partition")  # counting says one always can


def _choose_leaders(
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
