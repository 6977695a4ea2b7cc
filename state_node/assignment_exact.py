"""The exact placement rule, by min-cost flows: what `keyroute.state_node.assignment.assign` falls back to when a
small cluster's stores are shaped so that its seat-based placement cannot balance them (see there).

A pure function of (stores, live nodes, previous assignment): balanced, sticky and deterministic, in time
that grows much faster than the number of replicas.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from keyroute.core.partition_map import Assignment

# (partitions, replication_factor) per store, as the pipeline published them.
StoreShape = tuple[int, int]


def assign_exact(
    stores: Mapping[str, StoreShape],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
    zones: Mapping[str, str] | None = None,
) -> Assignment:
    """The desired placement of every partition of `stores` on `nodes`.

    `zones` maps nodes to failure domains (availability zones, racks); a node without one ("" or absent) is
    a domain of its own. With two zones or more, replicas of a partition are spread over different zones
    where the placement allows (as Kafka's rack-aware assignment does): see `_spread_over_zones`. Every
    balance guarantee below holds unchanged; the stickiness bound is stated for clusters without zones.

    Guarantees (tests/property/test_assignment_props.py checks each on random inputs and histories):
      - partition p gets min(replication_factor, len(nodes)) distinct nodes, or () without nodes;
      - per store, replicas per node differ by at most 1 between any two nodes, and so do the replicas
        of all stores together (both are always reachable together: pick which nodes take each store's
        surplus replica round-robin, then place each store's replica counts);
      - preferred replicas (first in each list) per node differ by at most 1, all stores together, and
        per store wherever the replica sets allow it (they always have in the property tests);
      - identical inputs give identical output (no dict/set/hash order is ever consulted);
      - sticky: `moved_replicas` is minimised over the candidate placements below that reach the best
        balance. When one node leaves, let O = its replicas in partitions that keep their replica count
        (they must be placed somewhere else, so moved >= O); moved <= 2*O, and nothing moves when O = 0.
        For the balance of all stores together the bound has a proof (below); with per-store balance
        the same argument holds store by store for the counts, and the property tests check the bound
        on random histories.
        Proof for the replica counts: survivors start within 1 of each other. Put each orphan on a
        least-loaded survivor j; if j already holds that partition, put it on a survivor i that does
        not (r <= n - 1 leaves one) and move to j a replica that i holds and j does not (i now holds
        more than j, so one exists, and it is not the orphan's partition, which j holds). That is at
        most 2 new replicas per orphan, and every orphan raises a least-loaded node by one, so the
        counts stay balanced.

    How: candidate placements are computed and the one with the best balance level wins, then the one
    that moves least (ties go to the earlier one, so the choice is deterministic). Levels, best first:
    per-store replicas and preferred replicas balanced; per-store replicas balanced; only the totals
    balanced (the last is reached only when per-store balance was not; kept as a safety net). Candidates:
      1. replica-first: replica sets as a min-cost balanced flow (keeping a replica costs 0, a new one
         costs 1), then preferred replicas chosen among each set by a second balanced flow;
      2. leader-first: preferred replicas first (sticky, balanced), then the other replicas by a
         min-cost balanced flow that avoids each partition's preferred node;
      3. leader-first, nested: as 2, but preferred replicas balanced within every prefix of partitions
         ordered by replica count. Partitions with few replicas have the fewest placement choices
         (with r=1 the preferred node *is* the whole set); spreading their leaders first is what
         makes balanced totals reachable.
    Each is tried with per-store balance constraints in the flows; only if none of those reaches
    per-store replica balance are the three tried with totals only. Should all fail, an uneven placement
    is returned rather than none.
    """
    members = sorted(set(nodes))
    names = sorted(stores)
    if not members:
        return Assignment(generation, {name: ((),) * stores[name][0] for name in names})

    alive = set(members)
    slots: list[_Slot] = []
    for name in names:
        partitions, rf = stores[name]
        for p in range(partitions):
            before = previous.replicas(name, p) if previous is not None else ()
            kept = tuple(dict.fromkeys(n for n in before if n in alive))
            leader = before[0] if before and before[0] in alive else None
            slots.append(_Slot(name, p, min(rf, len(members)), kept, leader))

    # Each node's failure domain; a node without a zone is one of its own. Zones matter with two or more.
    zone_of = {m: (zones or {}).get(m) or f"\0{m}" for m in members}
    zoned = zone_of if zones and len(set(zone_of.values())) > 1 else None

    Strategy = Callable[[Sequence[_Slot], Sequence[str], bool, Mapping[str, str] | None], list[tuple[str, ...]] | None]
    strategies: tuple[Strategy, ...] = (
        _replica_first,
        lambda s, m, per_store, z: _leader_first(s, m, nested=False, per_store=per_store, zone_of=z),
        lambda s, m, per_store, z: _leader_first(s, m, nested=True, per_store=per_store, zone_of=z),
    )
    # Candidates compare by balance level, then by zones missing from partitions' spreads, then by replicas
    # moved. With zones, the candidates placed under per-partition zone limits come first; the ones placed
    # without them are a fallback for placements the limits make impossible or less balanced.
    best: tuple[int, int, int, list[tuple[str, ...]]] | None = None
    for limits in (zoned, None) if zoned is not None else (None,):
        for per_store in (True, False):
            for strategy in strategies:
                placed = strategy(slots, members, per_store, limits)
                if placed is None:
                    continue
                level = _balance_level(slots, placed, members)
                missing = _zones_missing(slots, placed, zoned) if zoned is not None else 0
                cost = sum(len(set(reps).difference(slot.kept)) for slot, reps in zip(slots, placed, strict=True))
                if best is None or (level, missing, cost) < best[:3]:
                    best = (level, missing, cost, placed)
                if strategy is _replica_first and per_store and level == _PER_STORE_ALL and missing == 0:
                    # Its replica sets are a min-cost flow under per-store and total balance (and the zone
                    # limits), so no candidate as balanced and as spread moves fewer replicas.
                    break
            if best is not None and best[0] <= _PER_STORE_REPLICAS:
                break  # the totals-only candidates could only be less balanced
        if best is not None and best[0] == _PER_STORE_ALL and best[1] == 0:
            break
    if best is None:  # not reached on any input tried; a slightly uneven placement beats no placement
        best = (_UNBALANCED, 0, 0, _leader_first(slots, members, nested=True, balanced=False) or [])

    placed = best[3]
    if zoned is not None:
        placed = _spread_over_zones(slots, placed, zoned)
    per_store_out: dict[str, list[tuple[str, ...]]] = {name: [] for name in names}
    for slot, reps in zip(slots, placed, strict=True):
        per_store_out[slot.store].append(reps)
    return Assignment(generation, {name: tuple(per) for name, per in per_store_out.items()})


# Balance levels of a placement, best first (see `assign`).
_PER_STORE_ALL = 0
_PER_STORE_REPLICAS = 1
_TOTALS = 2
_UNBALANCED = 3


def _spread(counts: Mapping[str, int], members: Sequence[str]) -> int:
    values = [counts.get(m, 0) for m in members]
    return max(values) - min(values)


def _balance_level(slots: Sequence[_Slot], placed: Sequence[tuple[str, ...]], members: Sequence[str]) -> int:
    totals: dict[str, int] = {}
    leaders: dict[str, int] = {}
    store_totals: dict[str, dict[str, int]] = {}
    store_leaders: dict[str, dict[str, int]] = {}
    for slot, reps in zip(slots, placed, strict=True):
        per_store = store_totals.setdefault(slot.store, {})
        for node in reps:
            totals[node] = totals.get(node, 0) + 1
            per_store[node] = per_store.get(node, 0) + 1
        if reps:
            leaders[reps[0]] = leaders.get(reps[0], 0) + 1
            lead = store_leaders.setdefault(slot.store, {})
            lead[reps[0]] = lead.get(reps[0], 0) + 1
    if _spread(totals, members) > 1 or _spread(leaders, members) > 1:
        return _UNBALANCED
    if any(_spread(counts, members) > 1 for counts in store_totals.values()):
        return _TOTALS
    if any(_spread(counts, members) > 1 for counts in store_leaders.values()):
        return _PER_STORE_REPLICAS
    return _PER_STORE_ALL


def _zones_missing(slots: Sequence[_Slot], placed: Sequence[tuple[str, ...]], zone_of: Mapping[str, str]) -> int:
    """Over all partitions, the zones a partition's replicas could span but do not."""
    available = len(set(zone_of.values()))
    return sum(min(len(reps), available) - len({zone_of[n] for n in reps}) for reps in placed)


def _spread_over_zones(
    slots: Sequence[_Slot], placed: Sequence[tuple[str, ...]], zone_of: Mapping[str, str]
) -> list[tuple[str, ...]]:
    """`placed` with replicas moved or swapped until no partition can gain a zone that way. For partition p
    with a replica on node a in a zone p already holds, and a node b in a zone p lacks:
      - a move gives a's replica of p to b;
      - a swap also gives b's replica of another partition q to a, when q keeps as many zones as it had.
    Either is taken only when every count (replicas, and preferred replicas for a preferred one; per store
    and over all stores) keeps its spread across nodes within 1, or no worse than before: the placement's
    balance is kept. A swap within one store and role changes no count at all. Among the candidates, the one that
    moves least data wins (a node that held the partition before costs nothing), swaps before moves at
    equal cost. Each step adds a zone to a partition and takes none from another, so the passes end."""
    if len(set(zone_of.values())) < 2:
        return list(placed)
    out = [list(reps) for reps in placed]
    members = sorted(zone_of)
    stores = sorted({slot.store for slot in slots})
    totals, leaders = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
    store_totals = {store: dict.fromkeys(members, 0) for store in stores}
    store_leaders = {store: dict.fromkeys(members, 0) for store in stores}
    # node -> the (slot, position) pairs it holds, kept up to date through the steps
    holding: dict[str, set[tuple[int, int]]] = {m: set() for m in members}
    for i, (slot, reps) in enumerate(zip(slots, out, strict=True)):
        for pos, node in enumerate(reps):
            holding[node].add((i, pos))
            totals[node] += 1
            store_totals[slot.store][node] += 1
            if pos == 0:
                leaders[node] += 1
                store_leaders[slot.store][node] += 1

    def transfers(i: int, pos: int, a: str, b: str) -> list[tuple[dict[str, int], str, str]]:
        """The count changes of slot i's replica at `pos` going from a to b."""
        store = slots[i].store
        counts = [totals, store_totals[store], *((leaders, store_leaders[store]) if pos == 0 else ())]
        return [(c, a, b) for c in counts]

    def apply(changes: list[tuple[dict[str, int], str, str]], sign: int = 1) -> None:
        for counts, a, b in changes:
            counts[a] -= sign
            counts[b] += sign

    def balanced(changes: list[tuple[dict[str, int], str, str]]) -> bool:
        touched = list({id(c): c for c, _, _ in changes}.values())
        before = [max(c.values()) - min(c.values()) for c in touched]
        apply(changes)
        after = [max(c.values()) - min(c.values()) for c in touched]
        apply(changes, -1)
        return all(new <= max(1, old) for old, new in zip(before, after, strict=True))

    def zones(reps: Sequence[str]) -> int:
        return len({zone_of[n] for n in reps})

    def doubled(reps: Sequence[str]) -> list[int]:
        """Positions of replicas in a zone that an earlier replica of the same partition is in."""
        seen: set[str] = set()
        found = []
        for pos, node in enumerate(reps):
            if zone_of[node] in seen:
                found.append(pos)
            seen.add(zone_of[node])
        return found

    def best_step(i: int, pos: int) -> tuple[int, int, str, int, int] | None:
        """(cost, 0 for a swap or 1 for a move, b, q, q's position); q = -1 for a move."""
        a, reps = out[i][pos], out[i]
        mine = {zone_of[n] for n in reps}
        best: tuple[int, int, str, int, int] | None = None
        for b in members:
            if zone_of[b] in mine:
                continue
            gain_cost = int(b not in slots[i].kept)
            if best is not None and best[0] < gain_cost:
                continue
            for j, qpos in sorted(holding[b]):
                if a in out[j]:
                    continue
                cost = gain_cost + int(a not in slots[j].kept)
                if best is not None and (cost, 0) >= best[:2]:
                    continue
                theirs = out[j]
                if zones([a if k == qpos else n for k, n in enumerate(theirs)]) < zones(theirs):
                    continue
                same_counts = slots[j].store == slots[i].store and (qpos == 0) == (pos == 0)
                if not same_counts and not balanced(transfers(i, pos, a, b) + transfers(j, qpos, b, a)):
                    continue
                best = (cost, 0, b, j, qpos)
            if (best is None or (gain_cost, 1) < best[:2]) and balanced(transfers(i, pos, a, b)):
                best = (gain_cost, 1, b, -1, -1)
        return best

    changed = True
    while changed:
        changed = False
        for i in range(len(out)):
            for pos in doubled(out[i]):
                step = best_step(i, pos)
                if step is None:
                    continue
                _, _, b, j, qpos = step
                a = out[i][pos]
                changes = transfers(i, pos, a, b)
                holding[a].discard((i, pos))
                holding[b].add((i, pos))
                out[i][pos] = b
                if j >= 0:
                    changes += transfers(j, qpos, b, a)
                    holding[b].discard((j, qpos))
                    holding[a].add((j, qpos))
                    out[j][qpos] = a
                apply(changes)
                changed = True
                break  # slot i changed: its doubled positions are found again on the next pass
    return [tuple(reps) for reps in out]


@dataclass(frozen=True, slots=True)
class _Slot:
    """One partition of one store: how many replicas it gets and what it had."""

    store: str
    partition: int
    replicas: int  # min(replication factor, live nodes)
    kept: tuple[str, ...]  # previous replicas still alive, preferred first
    leader: str | None  # previous preferred replica, if still alive


def _ordered(leader: str, others: Sequence[str], slot: _Slot) -> tuple[str, ...]:
    # Keep the previous order of the remaining replicas (the next preferred stays next); new ones last.
    rank = {n: i for i, n in enumerate(slot.kept)}
    return (leader, *sorted(others, key=lambda n: (rank.get(n, len(rank)), n)))


def _zone_limits(replicas: int, zone_of: Mapping[str, str], leader: str | None = None) -> dict[str, int]:
    """The most replicas of one partition each zone may hold for the spread to be as even as it can be;
    with `leader` given, what is left of it for the other replicas."""
    zones = sorted(set(zone_of.values()))
    limit = -(-replicas // len(zones))
    return {z: limit - (1 if leader is not None and zone_of[leader] == z else 0) for z in zones}


def _replica_first(
    slots: Sequence[_Slot], members: Sequence[str], per_store: bool, zone_of: Mapping[str, str] | None = None
) -> list[tuple[str, ...]] | None:
    groups = [s.store for s in slots] if per_store else None
    sets = _balanced_choice(
        [s.replicas for s in slots],
        [[(m, 0 if m in s.kept else 1) for m in _kept_first(s.kept, members)] for s in slots],
        members,
        dict.fromkeys(members, 0),
        groups=groups,
        zone_of=zone_of,
        zone_limits=None if zone_of is None else [_zone_limits(s.replicas, zone_of) for s in slots],
    )
    if sets is None:
        return None
    leader_options = [
        [(m, 0 if m == s.leader else 1) for m in _kept_first(s.kept, [m for m in members if m in chosen])]
        for s, chosen in zip(slots, sets, strict=True)
    ]
    leaders = _balanced_choice([1] * len(slots), leader_options, members, dict.fromkeys(members, 0), groups=groups)
    if leaders is None and groups is not None:
        # The sets allow no per-store balance of preferred replicas: balance them over all stores.
        leaders = _balanced_choice([1] * len(slots), leader_options, members, dict.fromkeys(members, 0))
    if leaders is None:
        return None
    return [
        _ordered(lead[0], [m for m in chosen if m != lead[0]], s)
        for s, chosen, lead in zip(slots, sets, leaders, strict=True)
    ]


def _leader_first(
    slots: Sequence[_Slot],
    members: Sequence[str],
    nested: bool,
    per_store: bool = False,
    balanced: bool = True,
    zone_of: Mapping[str, str] | None = None,
) -> list[tuple[str, ...]] | None:
    if per_store:
        found = _place_leaders_per_store(slots, members, nested)
        if found is None:
            return None
        leaders = found
    else:
        leaders = _place_leaders(slots, members, nested)
    counts = dict.fromkeys(members, 0)
    store_counts: dict[str, dict[str, int]] = {}
    for slot, node in zip(slots, leaders, strict=True):
        counts[node] += 1
        per = store_counts.setdefault(slot.store, dict.fromkeys(members, 0))
        per[node] += 1
    followers = _balanced_choice(
        [s.replicas - 1 for s in slots],
        [
            [(m, 0 if m in s.kept else 1) for m in _kept_first(s.kept, members) if m != lead]
            for s, lead in zip(slots, leaders, strict=True)
        ],
        members,
        counts,
        balanced=balanced,
        groups=[s.store for s in slots] if per_store else None,
        group_base=store_counts,
        zone_of=zone_of,
        zone_limits=None
        if zone_of is None
        else [_zone_limits(s.replicas, zone_of, lead) for s, lead in zip(slots, leaders, strict=True)],
    )
    if followers is None:
        return None
    return [_ordered(lead, chosen, s) for s, lead, chosen in zip(slots, leaders, followers, strict=True)]


def _place_leaders_per_store(slots: Sequence[_Slot], members: Sequence[str], nested: bool) -> list[str] | None:
    """Preferred replica per slot, balanced per store and over all stores (or over every prefix of
    slots ordered by replica count, when `nested`; a store's slots all have one replica count).
    Costs: the previous leader 0, another node that holds the data 1, any other node 2."""
    leader: list[str | None] = [None] * len(slots)
    counts = dict.fromkeys(members, 0)
    classes: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        classes.setdefault(slot.replicas if nested else 0, []).append(i)
    for r in sorted(classes):
        indices = classes[r]
        options = [
            [
                (m, 0 if m == slots[i].leader else 1 if m in slots[i].kept else 2)
                for m in _kept_first(slots[i].kept, members)
            ]
            for i in indices
        ]
        chosen = _balanced_choice(
            [1] * len(indices), options, members, counts, groups=[slots[i].store for i in indices]
        )
        if chosen is None:
            return None
        for i, picked in zip(indices, chosen, strict=True):
            leader[i] = picked[0]
            counts[picked[0]] += 1
    return [node for node in leader if node is not None]


def _kept_first(kept: Sequence[str], members: Sequence[str]) -> list[str]:
    """Members with the kept ones first (in their previous order): the order stickiness is tried in."""
    keep = set(kept)
    return [m for m in kept if m in members] + [m for m in members if m not in keep]


def _place_leaders(slots: Sequence[_Slot], members: Sequence[str], nested: bool) -> list[str]:
    """Preferred replica per slot: sticky, and balanced over all slots (or over every prefix of slots
    ordered by replica count, when `nested`)."""
    seats = _Seats(members)
    leader: list[str | None] = [None] * len(slots)
    classes: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        classes.setdefault(slot.replicas if nested else 0, []).append(i)

    for r in sorted(classes):
        indices = classes[r]
        seats.open(len(indices))
        # Most sticky first, so a previous leader is never displaced by a partition that merely has a
        # copy on the same node; then any node that already holds the data; then the least loaded.
        for i in indices:
            prev = slots[i].leader
            if prev is not None and seats.take(prev):
                leader[i] = prev
        for i in indices:
            if leader[i] is None:
                leader[i] = next((m for m in slots[i].kept if seats.take(m)), None)
        for i in indices:
            if leader[i] is None:
                leader[i] = seats.take_least_loaded()
    return [node for node in leader if node is not None]


class _Seats:
    """Leader counts per node, capped so that after each `open(k)` every node ends at floor or ceil."""

    def __init__(self, members: Sequence[str]) -> None:
        self._members = members
        self._count = dict.fromkeys(members, 0)
        self._placed = 0
        self._floor = 0
        self._extra = 0
        self._at_ceiling = 0

    def open(self, more: int) -> None:
        self._placed += more
        self._floor, self._extra = divmod(self._placed, len(self._members))
        # Nodes already above the new floor (from earlier classes) hold some of the `extra` seats.
        self._at_ceiling = sum(1 for c in self._count.values() if c > self._floor)

    def _free(self, node: str) -> bool:
        count = self._count[node]
        return count < self._floor or (count == self._floor and self._at_ceiling < self._extra)

    def take(self, node: str) -> bool:
        if not self._free(node):
            return False
        if self._count[node] == self._floor:
            self._at_ceiling += 1
        self._count[node] += 1
        return True

    def take_least_loaded(self) -> str:
        node = min((m for m in self._members if self._free(m)), key=lambda m: (self._count[m], m))
        self.take(node)
        return node


def _balanced_choice(
    wants: Sequence[int],
    options: Sequence[Sequence[tuple[str, int]]],
    members: Sequence[str],
    base: Mapping[str, int],
    balanced: bool = True,
    groups: Sequence[str] | None = None,
    group_base: Mapping[str, Mapping[str, int]] | None = None,
    zone_of: Mapping[str, str] | None = None,
    zone_limits: Sequence[Mapping[str, int]] | None = None,
) -> list[list[str]] | None:
    """Pick wants[i] distinct nodes for item i from options[i] ((node, cost) pairs, small costs >= 0)
    so that base + picks is balanced over members (floor or ceil of the total) at least cost; None if
    impossible. With `groups` (a group name per item, e.g. its store), the picks of each group plus
    `group_base[group]` are balanced over members as well. With `zone_limits` (per item, the most nodes it
    may pick in each zone of `zone_of`) the picks also respect those. With balanced=False only the floor is
    aimed for (used as a last resort)."""
    n = len(members)
    demand = sum(wants)
    floor, extra = divmod(sum(base.values()) + demand, n)
    ceiling = floor + (1 if extra else 0) if balanced else floor + demand

    flow = _MinCostFlow()
    source, sink = flow.add_vertex(), flow.add_vertex()
    vertex = {m: flow.add_vertex() for m in members}
    # Up to `floor` a node's picks are mandatory: a cost below any saving stickiness could bring makes
    # the flow fill every node's floor first (the min-cost flow saturates as many mandatory units as it
    # can, so when both levels' floors can be met together, they are).
    max_cost = max((c for opts in options for _, c in opts), default=0)
    mandatory = -(max_cost * demand + 1)
    must: list[int] = []
    must_of: dict[str, int] = {}
    for m in members:
        lower = max(0, floor - base[m])
        upper = max(0, ceiling - base[m])
        must_of[m] = flow.add_edge(vertex[m], sink, lower, mandatory)
        must.append(must_of[m])
        flow.add_edge(vertex[m], sink, upper - lower, 0)

    # Per group, a vertex per member in front of the member's own vertex, with the same two-edge
    # floor/ceiling shape for the group's own counts.
    entry: dict[tuple[str, str], int] = {}
    group_must: dict[tuple[str, str], int] = {}
    if groups is not None:
        group_demand: dict[str, int] = {}
        for g, want in zip(groups, wants, strict=True):
            group_demand[g] = group_demand.get(g, 0) + want
        for g in sorted(group_demand):
            gbase = (group_base or {}).get(g, {})
            g_floor, g_extra = divmod(sum(gbase.get(m, 0) for m in members) + group_demand[g], n)
            g_ceiling = g_floor + (1 if g_extra else 0)
            for m in members:
                v = flow.add_vertex()
                entry[(g, m)] = v
                lower = max(0, g_floor - gbase.get(m, 0))
                upper = max(lower, g_ceiling - gbase.get(m, 0))
                group_must[(g, m)] = flow.add_edge(v, vertex[m], lower, mandatory)
                must.append(group_must[(g, m)])
                flow.add_edge(v, vertex[m], upper - lower, 0)

    item_edges: list[list[tuple[str, int]]] = []
    for i, (want, opts) in enumerate(zip(wants, options, strict=True)):
        edges: list[tuple[str, int]] = []
        if want:
            v = flow.add_vertex()
            feed = flow.add_edge(source, v, want, 0)
            group = groups[i] if groups is not None else None
            # With zone limits, the item's picks in each zone pass through one capped edge.
            through: dict[str, tuple[int, int]] = {}
            if zone_of is not None and zone_limits is not None:
                for zone in sorted({zone_of[m] for m, _ in opts}):
                    zv = flow.add_vertex()
                    through[zone] = (zv, flow.add_edge(v, zv, zone_limits[i].get(zone, want), 0))
            via: dict[str, int] = {}
            for m, cost in opts:
                target = entry[(group, m)] if group is not None else vertex[m]
                start = v
                if through:
                    start, via[m] = through[zone_of[m]]  # type: ignore[index]
                edges.append((m, flow.add_edge(start, target, 1, cost)))
            # Seed with free picks up to each node's mandatory share(s): those units cost the least any
            # unit can, so the seeded flow is min-cost for its value and the search may go on from it.
            for m, e in edges:
                path = [feed, *([via[m]] if m in via else []), e]
                path += ([group_must[(group, m)]] if group is not None else []) + [must_of[m]]
                if flow.cost(e) == 0 and all(flow.residual(x) for x in path):
                    flow.push(path)
        item_edges.append(edges)

    flow.run(source, sink)
    if flow.total != demand or any(flow.residual(e) for e in must):
        return None
    return [[m for m, e in edges if flow.flow_on(e)] for edges in item_edges]


class _MinCostFlow:
    """Min-cost flow, primal-dual: a Dijkstra pass (Johnson potentials) per distance, then a Dinic
    blocking flow over the zero-reduced-cost edges, so one pass pushes many units at once."""

    def __init__(self) -> None:
        self._adj: list[list[int]] = []
        self._head: list[int] = []
        self._cap: list[int] = []
        self._cost: list[int] = []
        self.total = 0

    def add_vertex(self) -> int:
        self._adj.append([])
        return len(self._adj) - 1

    def add_edge(self, u: int, v: int, cap: int, cost: int) -> int:
        e = len(self._head)
        for a, b, c, w in ((u, v, cap, cost), (v, u, 0, -cost)):  # edge e, its residual twin e ^ 1
            self._adj[a].append(len(self._head))
            self._head.append(b)
            self._cap.append(c)
            self._cost.append(w)
        return e

    def residual(self, e: int) -> int:
        return self._cap[e]

    def cost(self, e: int) -> int:
        return self._cost[e]

    def flow_on(self, e: int) -> int:
        return self._cap[e ^ 1]

    def push(self, path: Sequence[int], amount: int = 1) -> None:
        for e in path:
            self._cap[e] -= amount
            self._cap[e ^ 1] += amount
        self.total += amount

    def run(self, source: int, sink: int) -> None:
        potential = self._distances(source)
        while True:
            self._reprice(source, potential)
            if potential[sink] >= _UNREACHABLE:
                return
            while self._blocking_flow(source, sink, potential):
                pass

    def _reprice(self, source: int, potential: list[int]) -> None:
        # Dijkstra on reduced costs; adding the distances keeps every residual reduced cost >= 0 and
        # makes the shortest paths exactly the zero-reduced-cost ones.
        size = len(self._adj)
        dist = [_UNREACHABLE] * size
        dist[source] = 0
        heap = [(0, source)]
        while heap:
            d, u = heapq.heappop(heap)
            if d > dist[u]:
                continue
            for e in self._adj[u]:
                if self._cap[e] > 0:
                    v = self._head[e]
                    nd = d + self._cost[e] + potential[u] - potential[v]
                    if nd < dist[v]:
                        dist[v] = nd
                        heapq.heappush(heap, (nd, v))
        for v in range(size):
            potential[v] = potential[v] + dist[v] if dist[v] < _UNREACHABLE else _UNREACHABLE

    def _admissible(self, e: int, u: int, potential: list[int]) -> bool:
        return self._cap[e] > 0 and self._cost[e] + potential[u] - potential[self._head[e]] == 0

    def _blocking_flow(self, source: int, sink: int, potential: list[int]) -> bool:
        # Dinic levels over admissible edges keep each pass acyclic even where zero-cost cycles exist.
        size = len(self._adj)
        level = [-1] * size
        level[source] = 0
        queue = [source]
        for u in queue:
            for e in self._adj[u]:
                v = self._head[e]
                if level[v] < 0 and potential[v] < _UNREACHABLE and self._admissible(e, u, potential):
                    level[v] = level[u] + 1
                    queue.append(v)
        if level[sink] < 0:
            return False
        cursor = [0] * size
        pushed = False
        while True:
            path: list[int] = []
            u = source
            while u != sink:
                edges = self._adj[u]
                while cursor[u] < len(edges):
                    e = edges[cursor[u]]
                    v = self._head[e]
                    if level[v] == level[u] + 1 and self._admissible(e, u, potential):
                        break
                    cursor[u] += 1
                if cursor[u] == len(edges):  # dead end: retreat and never come back this pass
                    if u == source:
                        return pushed
                    level[u] = -1
                    e = path.pop()
                    u = self._head[e ^ 1]
                    cursor[u] += 1
                    continue
                e = edges[cursor[u]]
                path.append(e)
                u = self._head[e]
            self.push(path, min(self._cap[e] for e in path))
            pushed = True

    def _distances(self, source: int) -> list[int]:
        # Initial potentials: shortest distances in the residual graph, which may hold negative costs
        # but no negative cycle, because the current flow is min-cost for its value (Bellman-Ford/SPFA).
        size = len(self._adj)
        dist = [_UNREACHABLE] * size
        dist[source] = 0
        queue = [source]
        queued = [False] * size
        queued[source] = True
        head = 0
        while head < len(queue):
            u = queue[head]
            head += 1
            queued[u] = False
            for e in self._adj[u]:
                v = self._head[e]
                if self._cap[e] > 0 and dist[u] + self._cost[e] < dist[v]:
                    dist[v] = dist[u] + self._cost[e]
                    if not queued[v]:
                        queued[v] = True
                        queue.append(v)
        return dist


# Larger than any path cost here (costs are bounded by the number of edges times the demand).
_UNREACHABLE = 1 << 62
