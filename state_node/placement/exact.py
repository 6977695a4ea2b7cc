"""The exact placement, by min-cost flows: what the seat-based placement (`keyroute.state_node.placement.seated`)
falls back to when a small cluster's stores are shaped so that its seats cannot balance them (see there).

A pure function of (stores, live nodes, zones, previous assignment): balanced, sticky and deterministic, in time
that grows much faster than the number of replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from keyroute.cluster.partition_map import Assignment
from keyroute.state_node.placement.flow import balanced_choice
from keyroute.state_node.placement.replicas import in_previous_order
from keyroute.state_node.placement.seats import Seats
from keyroute.state_node.placement.shape import StoreShape
from keyroute.state_node.placement.zones import EXACT_SEARCH, Tally, ZoneCounts, spread_over_zones, zone_map


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
    where the placement allows (as Kafka's rack-aware assignment does): see `_spread_slots_over_zones`. Every
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
    zone_of = zone_map(members, zones)
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
        placed = _spread_slots_over_zones(slots, placed, zoned)
    per_store_out: dict[str, list[tuple[str, ...]]] = {name: [] for name in names}
    for slot, reps in zip(slots, placed, strict=True):
        per_store_out[slot.store].append(reps)
    return Assignment(generation, {name: tuple(per) for name, per in per_store_out.items()})


# Balance levels of a placement, best first (see `assign_exact`).
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


def _spread_slots_over_zones(
    slots: Sequence[_Slot], placed: Sequence[tuple[str, ...]], zone_of: Mapping[str, str]
) -> list[tuple[str, ...]]:
    """`placed` after the zone pass (`keyroute.state_node.placement.zones.spread_over_zones`) with no bound on
    its search: every node tried for every replica after the first of its zone in a partition, the step
    that moves least data taken, passes until none helps. Counts are those of `placed` itself."""
    out = [list(reps) for reps in placed]
    members = sorted(zone_of)
    totals, leaders = dict.fromkeys(members, 0), dict.fromkeys(members, 0)
    store_totals: dict[str, dict[str, int]] = {}
    store_leaders: dict[str, dict[str, int]] = {}
    for slot, reps in zip(slots, out, strict=True):
        per_store = store_totals.setdefault(slot.store, {})
        lead = store_leaders.setdefault(slot.store, {})
        for pos, node in enumerate(reps):
            totals[node] += 1
            per_store[node] = per_store.get(node, 0) + 1
            if pos == 0:
                leaders[node] += 1
                lead[node] = lead.get(node, 0) + 1
    store_tallies = {store: Tally(members, counts) for store, counts in store_totals.items()}
    leader_tallies = {store: Tally(members, counts) for store, counts in store_leaders.items()}
    counts = ZoneCounts(
        Tally(members, totals),
        Tally(members, leaders),
        [store_tallies[slot.store] for slot in slots],
        [leader_tallies[slot.store] for slot in slots],
    )
    spread_over_zones(out, [slot.kept for slot in slots], zone_of, counts, range(len(out)), EXACT_SEARCH)
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
    return in_previous_order(leader, others, slot.kept)


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
    sets = balanced_choice(
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
    leaders = balanced_choice([1] * len(slots), leader_options, members, dict.fromkeys(members, 0), groups=groups)
    if leaders is None and groups is not None:
        # The sets allow no per-store balance of preferred replicas: balance them over all stores.
        leaders = balanced_choice([1] * len(slots), leader_options, members, dict.fromkeys(members, 0))
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
    followers = balanced_choice(
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
    for indices in _by_replica_count(slots, nested):
        options = [
            [
                (m, 0 if m == slots[i].leader else 1 if m in slots[i].kept else 2)
                for m in _kept_first(slots[i].kept, members)
            ]
            for i in indices
        ]
        chosen = balanced_choice([1] * len(indices), options, members, counts, groups=[slots[i].store for i in indices])
        if chosen is None:
            return None
        for i, picked in zip(indices, chosen, strict=True):
            leader[i] = picked[0]
            counts[picked[0]] += 1
    return [node for node in leader if node is not None]



def _by_replica_count(slots: Sequence[_Slot], nested: bool) -> list[list[int]]:
    """The slots' indices by replica count, fewest replicas first (all in one class unless `nested`)."""
    classes: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        classes.setdefault(slot.replicas if nested else 0, []).append(i)
    return [classes[r] for r in sorted(classes)]

def _kept_first(kept: Sequence[str], members: Sequence[str]) -> list[str]:
    """Members with the kept ones first (in their previous order): the order stickiness is tried in."""
    keep = set(kept)
    return [m for m in kept if m in members] + [m for m in members if m not in keep]


def _place_leaders(slots: Sequence[_Slot], members: Sequence[str], nested: bool) -> list[str]:
    """Preferred replica per slot: sticky, and balanced over all slots (or over every prefix of slots
    ordered by replica count, when `nested`)."""
    seats = Seats(members)
    leader: list[str | None] = [None] * len(slots)
    for indices in _by_replica_count(slots, nested):
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
