"""The seat-based placement, the controller's: which nodes serve each partition, preferred replica first.

A pure function of (stores, live nodes, zones, previous assignment), in time about linear in the number of
replicas (benchmarks/placement.py measures it at 1,000 nodes and 100,000 partitions).

1. An assignment that still meets every guarantee below for the current stores and nodes is kept as it is.
2. Replica targets. Store s has R = partitions x min(rf, nodes) replicas: every node gets floor(R / n) of
   them, and R mod n nodes one more. Which nodes take a store's extra replicas is decided over all stores
   at once (`Seats`), so that every node's total is within one of every other's too: nodes that
   held more than the floor keep their extra, zones take turns, and nodes that will have to take an extra
   preferred replica of the store get an extra replica of it.
3. Replicas. Each partition keeps its live previous replicas, except on nodes above target, which give up
   the ones that cost least (in a zone the partition holds twice first). Every missing replica goes to the
   node below target that needs the most, in a zone the partition lacks when one can, and to one that holds
   the partition's files already (`holds`: a node back after its partitions were moved away) rather than
   one that would fetch them, where the zones allow; when every such node already holds the partition, a
   node that does not takes it and passes another replica on.
4. Preferred replicas, among each partition's replicas: targets as in 2 (stores with fewer replicas per
   partition first: they have the fewest choices); the previous preferred replica stays while under target,
   the others are matched by augmenting paths. When the replica sets allow no balanced choice, the store is
   placed the other way round: preferred replicas first (balanced by construction), the others around them.
5. Zones: moves and swaps that keep every count's balance and give a partition a zone it lacks
   (`keyroute.state_node.placement.zones`, its search bounded).
6. Small clusters whose stores the seats could not balance (or balanced only by moving more than needed)
   get the exact placement (`keyroute.state_node.placement.exact`).

Everything iterates in sorted order: identical inputs give identical output.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

from keyroute.cluster.partition_map import Assignment
from keyroute.state_node.placement.exact import assign_exact
from keyroute.state_node.placement.leaders import choose_leaders
from keyroute.state_node.placement.replicas import in_previous_order, moved_replicas
from keyroute.state_node.placement.seats import Seats
from keyroute.state_node.placement.shape import StoreShape, check_shapes
from keyroute.state_node.placement.zones import SEATED_SEARCH, Tally, ZoneCounts, spread_over_zones, zone_map

# Up to this many replicas in all, a placement the seats cannot balance is made by min-cost flows instead.
EXACT_LIMIT = 5000


def assign(
    stores: Mapping[str, StoreShape],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
    zones: Mapping[str, str] | None = None,
    holds: Holds | None = None,
) -> Assignment:
    """The desired placement of every partition of `stores` on `nodes` (see the module's description), as
    assignment generation `generation`.

    Guarantees (tests/property/ checks each on random inputs and histories):
      - partition p gets min(replication_factor, len(nodes)) distinct nodes, or () without nodes;
      - replicas per node differ by at most 1, per store and over all stores together;
      - preferred replicas per node differ by at most 1 over all stores together and, wherever the replica
        sets allow it, per store;
      - identical inputs give identical output, whatever their order;
      - an unchanged cluster keeps its assignment exactly; a node that leaves moves only the replicas that
        must move to keep the counts balanced: its own, and at most as many again;
      - with zones (`zones`: node -> failure domain; none or "" is a domain of its own), a missing replica
        goes to a zone its partition lacks whenever a node below target is in one;
      - `holds` (store -> node -> partitions whose current version the node has on disk) only chooses among
        the nodes below target that step 3 would take alike for their zones: a missing replica goes to one
        that holds the partition when one of those can take it. Every other guarantee is unchanged.
    """
    check_shapes(stores)
    members = sorted(set(nodes))
    names = sorted(stores)
    if not members:
        return Assignment(generation, {name: ((),) * stores[name][0] for name in names})
    if previous is not None and _meets_guarantees(stores, members, previous):
        return Assignment(generation, {name: tuple(previous.stores[name]) for name in names})
    zone_of = zone_map(members, zones)
    placements = _place_stores(stores, members, previous, zone_of, zoned=bool(zones), holds=holds or {})
    result = Assignment(generation, _written(placements, names))
    return _exact_when_better(stores, members, previous, generation, zones, result)


@dataclass(frozen=True, slots=True)
class _StorePlacement:
    """One store's placement in progress (its lists and targets are changed in place by the later steps)."""

    placed: list[list[str]]  # replicas per partition, preferred first
    kept: list[list[str]]  # the live previous replicas the placement started from
    before: list[tuple[str, ...]]  # the previous replicas, () for a partition new to the store
    target: dict[str, int]  # replicas per node
    lead_target: dict[str, int]  # preferred replicas per node


@dataclass(frozen=True, slots=True)
class _PreviousLoad:
    """Per live node, over all stores of the previous assignment: the preferred replicas it led and the
    replicas it held (zero without a previous assignment)."""

    leading: dict[str, int]
    holding: dict[str, int]

    @classmethod
    def of(cls, stores: Mapping[str, StoreShape], members: Sequence[str], previous: Assignment | None) -> _PreviousLoad:
        leading, holding = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
        if previous is not None:
            alive = set(members)
            led: Counter[str] = Counter()
            held: Counter[str] = Counter()
            for name in sorted(stores):
                per = previous.stores.get(name, ())[: stores[name][0]]
                led.update(reps[0] for reps in per if reps)
                held.update(chain.from_iterable(per))
            leading.update((m, c) for m, c in led.items() if m in alive)
            holding.update((m, c) for m, c in held.items() if m in alive)
        return cls(leading, holding)


def _place_stores(
    stores: Mapping[str, StoreShape],
    members: Sequence[str],
    previous: Assignment | None,
    zone_of: Mapping[str, str],
    zoned: bool,
    holds: Holds,
) -> dict[str, _StorePlacement]:
    """Every store placed, one after the other (steps 2 to 5). Guarantees: every partition has its replica
    count of distinct live nodes; replicas per node are within one per store and, unless a store had to be
    placed preferred replicas first and even `_even_out_totals` could not make up for it, in total;
    preferred replicas per node are within one in total (handed out as seats) and per store wherever the
    replica sets allow; a partition lacks a zone only where no balanced step could give it one."""
    n = len(members)
    # Stores with fewer replicas per partition first: their preferred replicas have the fewest choices, and
    # the seats of both kinds are handed out in this order.
    order = sorted(stores, key=lambda s: (min(stores[s][1], n), s))
    load = _PreviousLoad.of(stores, members, previous)
    replica_seats, leader_seats = Seats(members), Seats(members)
    placements: dict[str, _StorePlacement] = {}
    uneven = False  # whether some node's replicas ended above its target (see _even_out_totals)
    for name in order:
        partitions, rf = stores[name]
        r = min(rf, n)
        had = previous.stores.get(name, ()) if previous is not None else ()
        before = list(had[:partitions]) + [()] * (partitions - len(had))
        kept = _kept_replicas(before, r, set(members))
        target = _replica_targets(partitions, r, kept, members, replica_seats, leader_seats, load, zone_of, zoned)
        holders = _holders(holds.get(name, {}), partitions, set(members))
        job = _StoreJob(kept, r, target, members, zone_of, holders)
        placement, leader_seats, over = _place_store(job, before, leader_seats)
        uneven = uneven or over
        placements[name] = placement
    if uneven:
        _even_out_totals(placements, members, zone_of)
    if zoned and len(set(zone_of.values())) > 1:
        _spread_stores_over_zones(placements, order, members, zone_of)
    return placements


# Per store, node -> the partitions whose current version the node has on disk (a placement hint).
Holds = Mapping[str, Mapping[str, Iterable[int]]]


def _holders(held: Mapping[str, Iterable[int]], partitions: int, alive: set[str]) -> list[frozenset[str]]:
    """Per partition of a store, the live nodes that hold its files."""
    per: list[set[str]] = [set() for _ in range(partitions)]
    for node, parts in held.items():
        if node in alive:
            for p in parts:
                if 0 <= p < partitions:
                    per[p].add(node)
    return [frozenset(nodes) for nodes in per]


def _kept_replicas(before: Sequence[tuple[str, ...]], r: int, alive: set[str]) -> list[list[str]]:
    """Per partition, the previous replicas that may stay: all of them when they are r or fewer distinct live
    nodes, else the live ones, each once, the first r (the replication factor came down)."""
    return [
        list(reps)
        if len(reps) <= r and alive.issuperset(reps) and len(set(reps)) == len(reps)
        # a replica gone or named twice, or more than r (the replication factor came down)
        else list(dict.fromkeys(m for m in reps if m in alive))[:r]
        for reps in before
    ]


def _replica_targets(
    partitions: int,
    r: int,
    kept: Sequence[Sequence[str]],
    members: Sequence[str],
    replica_seats: Seats,
    leader_seats: Seats,
    load: _PreviousLoad,
    zone_of: Mapping[str, str],
    zoned: bool,
) -> dict[str, int]:
    """Replicas per node for one store (step 2): floor(R / n) for every node and one more for R mod n of
    them, chosen as seats over all stores so far, so that every node's total stays within one of every
    other's. Takes the store's seats from `replica_seats`."""
    n = len(members)
    counts = _counts(kept, members)
    floor, extra = divmod(partitions * r, n)
    # Other things equal, extra replicas go to nodes with few preferred replicas so far (they are the
    # ones that must take the next preferred replicas), then to nodes that led little before.
    # (then to nodes that held few replicas of any store: the others keep theirs.)
    scale = 1 + sum(load.holding.values())
    seats = leader_seats.counts
    busy = {m: (seats[m] * scale + load.holding[m]) * scale + load.leading[m] for m in members}
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
        zone_need=_zones_lacking(kept, r, zone_of) if zoned else None,
    )
    return {m: floor + (1 if m in extras else 0) for m in members}


@dataclass(frozen=True, slots=True)
class _StoreJob:
    """What one store's replicas and preferred replicas (steps 3 and 4) are placed from."""

    kept: list[list[str]]  # per partition, the live previous replicas that may stay
    r: int  # replicas per partition
    target: Mapping[str, int]  # replicas per node (step 2)
    members: Sequence[str]
    zone_of: Mapping[str, str]
    holders: Sequence[frozenset[str]]  # per partition, the live nodes that hold its files


def _place_store(
    job: _StoreJob, before: Sequence[tuple[str, ...]], leader_seats: Seats
) -> tuple[_StorePlacement, Seats, bool]:
    """One store's replicas and preferred replicas (steps 3 and 4), the preferred replicas' seats after it,
    and whether a node ended above its replica target. Guarantees: every node holds exactly `job.target`
    replicas of the store, unless (the flag) its preferred replicas had to take one past it; preferred
    replicas per node are within one over all stores so far."""
    kept, target, members = job.kept, job.target, job.members
    alive = set(members)
    previous_leaders = [reps[0] if reps and reps[0] in alive else None for reps in before]
    # Replicas first (they move data), then preferred replicas among them (they do not): unless no
    # balanced choice of preferred replicas exists among those sets.
    sets = _place([list(reps) for reps in kept], job.r, target, job.zone_of, fixed=0, holders=job.holders)
    chosen = _leaders_among_replicas(sets, previous_leaders, members, leader_seats)
    if chosen is not None:
        placed, lead_target, seats = chosen
        return _StorePlacement(placed, kept, list(before), dict(target), lead_target), seats, False
    placed, lead_target = _replicas_around_leaders(job, previous_leaders, leader_seats)
    follower_target = {m: target[m] - lead_target[m] for m in members}
    # A preferred replica on a node beyond its replica target: that node ends above it.
    over = any(v < 0 for v in follower_target.values())
    return _StorePlacement(placed, kept, list(before), dict(target), lead_target), leader_seats, over


def _leaders_among_replicas(
    sets: list[list[str]], previous_leaders: Sequence[str | None], members: Sequence[str], leader_seats: Seats
) -> tuple[list[list[str]], dict[str, int], Seats] | None:
    """The store's replica sets with a preferred replica chosen among each (first), the preferred replicas per
    node, and the seats after them; None when the sets allow no choice balanced over all stores so far
    (`leader_seats` is then untouched). The previous preferred replica stays while its node is under target."""
    n = len(members)
    partitions = len(sets)
    holding = _counts(sets, members)
    leading = _counts([[lead] for lead in previous_leaders if lead is not None], members)
    lead_floor, lead_extra = divmod(partitions, n)
    attempt = leader_seats.copy()
    if lead_floor == 0 and lead_extra:
        # Fewer partitions than nodes: each preferred replica on its own node, the matching itself
        # choosing which nodes (among those balance allows) take them.
        forced, allowed = attempt.options(lead_extra)
        cap = {m: 1 if m in allowed else 0 for m in members}
        leaders = choose_leaders(sets, previous_leaders, cap, strict=True, must=forced)
        if leaders is None:
            return None
        attempt.take_exactly(set(leaders))
        lead_target = {m: int(m in leaders) for m in members}
    else:
        lead_target = _lead_target(attempt, members, holding, leading, lead_floor, lead_extra)
        leaders = choose_leaders(sets, previous_leaders, lead_target, strict=True)
        if leaders is None:
            return None
    return [_led_by(reps, lead) for reps, lead in zip(sets, leaders, strict=True)], lead_target, attempt


def _lead_target(
    seats: Seats,
    members: Sequence[str],
    replicas: Mapping[str, int],
    leading: Mapping[str, int],
    lead_floor: int,
    lead_extra: int,
) -> dict[str, int]:
    """Preferred replicas per node: `lead_floor` each, and the `lead_extra` extra ones (their seats taken from
    `seats`) to nodes with more `replicas` than `lead_floor` first, the previous leaders among them first."""
    n = len(members)
    extras = seats.hand_out(
        lead_extra,
        prefer=[m for m in members if replicas[m] > lead_floor],
        rank={m: leading[m] + n * replicas[m] for m in members},
    )
    return {m: lead_floor + (1 if m in extras else 0) for m in members}


def _replicas_around_leaders(
    job: _StoreJob, previous_leaders: Sequence[str | None], leader_seats: Seats
) -> tuple[list[list[str]], dict[str, int]]:
    """The store placed the other way round: preferred replicas first, balanced by construction (their seats
    taken from `leader_seats`), the other replicas placed around them; and the preferred replicas per node.
    Every node holds its `target` of replicas unless its preferred replicas alone pass it."""
    kept, target, members = job.kept, job.target, job.members
    n = len(members)
    partitions = len(kept)
    leading = _counts([[lead] for lead in previous_leaders if lead is not None], members)
    lead_floor, lead_extra = divmod(partitions, n)
    # A node may lead only as many partitions as it holds replicas: the extra preferred replicas go to nodes
    # with more replicas than the floor of preferred ones first (with one replica per partition, exactly the
    # nodes with the extra replicas), the previous leaders among them first.
    lead_target = _lead_target(leader_seats, members, target, leading, lead_floor, lead_extra)
    chosen = choose_leaders(kept, previous_leaders, lead_target, strict=False)
    assert chosen is not None
    around = [_led_by(reps, lead) for reps, lead in zip(kept, chosen, strict=True)]
    follower_target = {m: target[m] - lead_target[m] for m in members}
    return _place(around, job.r, follower_target, job.zone_of, fixed=1, holders=job.holders), lead_target


def _spread_stores_over_zones(
    placements: Mapping[str, _StorePlacement], order: Sequence[str], members: Sequence[str], zone_of: Mapping[str, str]
) -> None:
    """Step 5, store after store in placement order: the zone pass, its search bounded, over the partitions
    short of a zone. Guarantees: every count's balance as it was; no partition loses a zone."""
    # Every count is its target now: the tallies start from the targets.
    totals = Tally(members, _sum(pl.target for pl in placements.values()))
    leaders = Tally(members, _sum(pl.lead_target for pl in placements.values()))
    available = len(set(zone_of.values()))
    zone = zone_of.__getitem__
    for name in order:
        pl = placements[name]
        short = [p for p, reps in enumerate(pl.placed) if len(set(map(zone, reps))) < min(len(reps), available)]
        if short:
            partitions = len(pl.placed)
            counts = ZoneCounts(
                totals, leaders, [Tally(members, pl.target)] * partitions, [Tally(members, pl.lead_target)] * partitions
            )
            spread_over_zones(pl.placed, pl.kept, zone_of, counts, short, SEATED_SEARCH)


def _written(placements: Mapping[str, _StorePlacement], names: Sequence[str]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """The replica tuples as the assignment holds them, stores in name order: a partition's very previous tuple
    when nothing changed, else preferred replica first, the others in their previous order."""
    return {
        name: tuple(_final(reps, placements[name].before[p]) for p, reps in enumerate(placements[name].placed))
        for name in names
    }


def _exact_when_better(
    stores: Mapping[str, StoreShape],
    members: Sequence[str],
    previous: Assignment | None,
    generation: int,
    zones: Mapping[str, str] | None,
    result: Assignment,
) -> Assignment:
    """`result`, or the exact placement where it is better (step 6). Guarantee: up to EXACT_LIMIT replicas, the
    assignment returned is balanced whenever the exact placement is, and moves no more than twice what must
    move, or no more than the exact placement does."""
    if sum(p * min(rf, len(members)) for p, rf in stores.values()) > EXACT_LIMIT:
        return result
    # Seats handed out store by store can paint themselves into a corner when a store has fewer replicas than
    # nodes (its extra preferred replicas must sit on its extra replicas, which earlier stores' seats may have
    # ruled out), or balance the counts only by moving more than twice what had to move. Small clusters,
    # where that happens, get the exact placement instead (when unbalanced, or when it moves fewer); in large
    # ones a count may then be two apart rather than one.
    balanced = _meets_guarantees(stores, members, result)
    if balanced and (previous is None or moved_replicas(previous, result) <= 2 * _must_move(stores, previous, result)):
        return result
    exact = assign_exact(stores, members, previous, generation, zones)
    if not balanced or previous is None or moved_replicas(previous, exact) < moved_replicas(previous, result):
        return exact
    return result


def _even_out_totals(
    placements: Mapping[str, _StorePlacement],
    members: Sequence[str],
    zone_of: Mapping[str, str],
) -> None:
    """Where a store had to be placed preferred replicas first and its preferred replicas took a node past
    its replica target, totals over all stores can end more than one apart: move other replicas (never a
    preferred one) from the fullest nodes to the emptiest, each within a store where the giver holds more
    than the taker (the store's own balance is kept), into a zone the partition lacks when one can. The
    targets in `placements` are brought up to date."""
    totals: Counter[str] = Counter(dict.fromkeys(members, 0))
    per_store: dict[str, Counter[str]] = {}
    # node -> (store, partition, position) of the replicas it holds that are not preferred
    follows: dict[str, set[tuple[str, int, int]]] = {m: set() for m in members}
    for name, placement in placements.items():
        counts = per_store[name] = Counter(dict.fromkeys(members, 0))
        for p, reps in enumerate(placement.placed):
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
                counts, reps = per_store[name], placements[name].placed[p]
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
        placements[name].placed[p][pos] = b
        follows[a].discard((name, p, pos))
        follows[b].add((name, p, pos))
        for c in (totals, per_store[name]):
            c[a] -= 1
            c[b] += 1
    for name, counts in per_store.items():
        placements[name].target.update(counts)


def _meets_guarantees(stores: Mapping[str, StoreShape], members: Sequence[str], a: Assignment) -> bool:
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
    assignments then find it unchanged at once), else the preferred replica first, the others in their
    previous order (the next preferred stays next), new ones last by name."""
    placed = tuple(reps)
    if placed == before:
        return before
    return in_previous_order(reps[0], reps[1:], before) if reps else ()


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


def _place(
    sets: list[list[str]],
    replicas: int,
    target: Mapping[str, int],
    zone_of: Mapping[str, str],
    fixed: int,
    holders: Sequence[frozenset[str]] = (),
) -> list[list[str]]:
    """Replica sets of one store (live previous replicas; with `fixed` = 1 the preferred one first, which
    stays) changed as little as possible so that every node holds exactly `target` of the replicas not
    fixed, and every partition `replicas` replicas; a missing replica to a node of `holders[p]` (those
    with the partition's files) when the zones allow."""
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
    # Nodes above target give up followers: first in a zone the partition holds twice, then ones a node below
    # target has the files of (it takes them without fetching), then the last ones.
    below = {m for m in target if counts[m] < target[m]}

    def cost(p: int, m: str) -> tuple[int, ...]:
        zoned, *rest = give_up_cost(p, m)
        # 0: a node below target has the partition's files, and no replica of it was given up yet.
        from_disk = p < len(holders) and len(sets[p]) >= replicas and bool((holders[p] & below).difference(sets[p]))
        return (zoned, int(not from_disk), *rest)

    for m in sorted(target):
        excess = counts[m] - target[m]
        if excess <= 0:
            continue
        holding = [p for p, reps in enumerate(sets) if m in reps and (not fixed or reps[0] != m)]
        for _, p in sorted((cost(p, m), p) for p in holding)[:excess]:  # `holding` is in order: ties stay so
            sets[p].remove(m)
        counts[m] -= excess

    wanting = _Wanting({m: target[m] - counts[m] for m in target if target[m] > counts[m]})
    for p, reps in enumerate(sets):
        while len(reps) < replicas:
            best = wanting.best_for(reps, zone_of, holders[p] if p < len(holders) else frozenset())
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

    def best_for(
        self, reps: Sequence[str], zone_of: Mapping[str, str], holders: frozenset[str] = frozenset()
    ) -> str | None:
        """Among the nodes that do not hold the partition, the one in the zone `reps` hold least, then one of
        `holders` (its files are on that node's disk: nothing to fetch), then the one that needs the most
        replicas (ties by name); taken. None when every one holds it."""
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
        if holders and (chosen is None or chosen[1] not in holders):
            # A node below target with the partition's files, in a zone held no more often, takes it instead.
            candidates = [
                (here[zone_of[m]], -self.deficit[m], m)
                for m in holders
                if m in self.deficit and m not in reps and (best is None or here[zone_of[m]] <= best[0])
            ]
            if candidates:
                _, _, m = min(candidates)
                chosen = (-self.deficit[m], m)
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
