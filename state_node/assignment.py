"""The controller's placement rule: which nodes should serve each partition, preferred replica first.

A pure function of (stores, live nodes, previous assignment): balanced, sticky and deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from keyroute_core.partition_map import Assignment

# (partitions, replication_factor) per store, as the pipeline published them.
StoreShape = tuple[int, int]


class AssignmentError(ValueError):
    """A store shape that cannot be assigned (negative partitions, replication factor below 1)."""


def assign(
    stores: Mapping[str, StoreShape],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
) -> Assignment:
    """The desired placement of every partition of `stores` on `nodes`.

    Guarantees (tests/property/test_assignment_props.py checks each on random inputs and histories):
      - partition p gets min(replication_factor, len(nodes)) distinct nodes, or () without nodes;
      - replicas per node, all stores together, differ by at most 1 between any two nodes;
      - preferred replicas (first in each list) per node differ by at most 1;
      - identical inputs give identical output (no dict/set/hash order is ever consulted);
      - sticky: `moved_replicas` is minimised over the candidate placements below. When one node
        leaves, let O = its replicas in partitions that keep their replica count (they must be placed
        somewhere else, so moved >= O). Bound: O <= moved <= 2*O; nothing moves when O = 0.
        Proof for the replica counts: survivors start within 1 of each other. Put each orphan on a
        least-loaded survivor j; if j already holds that partition, put it on a survivor i that does
        not (r <= n - 1 leaves one) and move to j a replica that i holds and j does not (i now holds
        more than j, so one exists, and it is not the orphan's partition, which j holds). That is at
        most 2 new replicas per orphan, and every orphan raises a least-loaded node by one, so the
        counts stay balanced. The replica-first candidate is the cheapest count-balanced placement
        (an exact min-cost flow), so it moves at most 2*O whenever preferred replicas can then be
        balanced within its sets. For O = 0 they always can (the leaving node's partitions are on
        every survivor, so its preferred replicas can go anywhere), hence nothing moves. That the
        preferred replicas balance within 2*O moves in general is checked by the property tests on
        random histories, not proven.

    How: three candidate placements are computed and the valid one that moves least wins (ties go to
    the earlier one, so the choice is deterministic):
      1. replica-first: replica sets as a min-cost balanced flow (keeping a replica costs 0, a new one
         costs 1), then preferred replicas chosen among each set by a second balanced flow;
      2. leader-first: preferred replicas first (sticky, balanced), then the other replicas by a
         min-cost balanced flow that avoids each partition's preferred node;
      3. leader-first, nested: as 2, but preferred replicas balanced within every prefix of partitions
         ordered by replica count. Partitions with few replicas have the fewest placement choices
         (with r=1 the preferred node *is* the whole set); spreading their leaders first is what
         makes balanced totals reachable. Candidate 3 has always succeeded: in the property tests and
         in 50,000 random shapes with arbitrary (not only sticky) nested leader choices; unproven.
         Should all three ever fail, an uneven placement is returned rather than none.
    """
    members = sorted(set(nodes))
    for name, (partitions, rf) in stores.items():
        if partitions < 0 or rf < 1:
            raise AssignmentError(f"store {name!r}: {partitions} partitions with replication factor {rf}")
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

    best: tuple[int, list[tuple[str, ...]]] | None = None
    strategies: tuple[Callable[[Sequence[_Slot], Sequence[str]], list[tuple[str, ...]] | None], ...] = (
        _replica_first,
        lambda s, m: _leader_first(s, m, nested=False),
        lambda s, m: _leader_first(s, m, nested=True),
    )
    for strategy in strategies:
        placed = strategy(slots, members)
        if placed is None:
            continue
        cost = sum(len(set(reps).difference(slot.kept)) for slot, reps in zip(slots, placed, strict=True))
        if best is None or cost < best[0]:
            best = (cost, placed)
    if best is None:  # not reached on any input tried; a slightly uneven placement beats no placement
        best = (0, _leader_first(slots, members, nested=True, balanced=False) or [])

    per_store: dict[str, list[tuple[str, ...]]] = {name: [] for name in names}
    for slot, reps in zip(slots, best[1], strict=True):
        per_store[slot.store].append(reps)
    return Assignment(generation, {name: tuple(per) for name, per in per_store.items()})


def moved_replicas(before: Assignment, after: Assignment) -> int:
    """Replicas `after` places where `before` had none: the partition copies some node must load.
    A change of preferred replica alone moves no data and is not counted."""
    moved = 0
    for store, per_partition in after.stores.items():
        for p, replicas in enumerate(per_partition):
            moved += len(set(replicas).difference(before.replicas(store, p)))
    return moved


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


def _replica_first(slots: Sequence[_Slot], members: Sequence[str]) -> list[tuple[str, ...]] | None:
    sets = _balanced_choice(
        [s.replicas for s in slots],
        [[(m, 0 if m in s.kept else 1) for m in _kept_first(s.kept, members)] for s in slots],
        members,
        dict.fromkeys(members, 0),
    )
    if sets is None:
        return None
    leaders = _balanced_choice(
        [1] * len(slots),
        [
            [(m, 0 if m == s.leader else 1) for m in _kept_first(s.kept, [m for m in members if m in chosen])]
            for s, chosen in zip(slots, sets, strict=True)
        ],
        members,
        dict.fromkeys(members, 0),
    )
    if leaders is None:
        return None
    return [
        _ordered(lead[0], [m for m in chosen if m != lead[0]], s)
        for s, chosen, lead in zip(slots, sets, leaders, strict=True)
    ]


def _leader_first(
    slots: Sequence[_Slot], members: Sequence[str], nested: bool, balanced: bool = True
) -> list[tuple[str, ...]] | None:
    leaders = _place_leaders(slots, members, nested)
    counts = dict.fromkeys(members, 0)
    for node in leaders:
        counts[node] += 1
    followers = _balanced_choice(
        [s.replicas - 1 for s in slots],
        [
            [(m, 0 if m in s.kept else 1) for m in _kept_first(s.kept, members) if m != lead]
            for s, lead in zip(slots, leaders, strict=True)
        ],
        members,
        counts,
        balanced=balanced,
    )
    if followers is None:
        return None
    return [_ordered(lead, chosen, s) for s, lead, chosen in zip(slots, leaders, followers, strict=True)]


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
) -> list[list[str]] | None:
    """Pick wants[i] distinct nodes for item i from options[i] ((node, cost) pairs, cost 0 or 1) so
    that base + picks is balanced over members (floor or ceil of the total) at least cost; None if
    impossible. With balanced=False only the floor is aimed for (used as a last resort)."""
    n = len(members)
    demand = sum(wants)
    floor, extra = divmod(sum(base.values()) + demand, n)
    ceiling = floor + (1 if extra else 0) if balanced else floor + demand

    flow = _MinCostFlow()
    source, sink = flow.add_vertex(), flow.add_vertex()
    vertex = {m: flow.add_vertex() for m in members}
    # Up to `floor` a node's picks are mandatory: a cost below any saving stickiness could bring makes
    # the flow fill every node's floor first.
    mandatory = -(demand + 1)
    must: dict[str, int] = {}
    for m in members:
        lower = max(0, floor - base[m])
        upper = max(0, ceiling - base[m])
        must[m] = flow.add_edge(vertex[m], sink, lower, mandatory)
        flow.add_edge(vertex[m], sink, upper - lower, 0)

    item_edges: list[list[tuple[str, int]]] = []
    for want, opts in zip(wants, options, strict=True):
        edges: list[tuple[str, int]] = []
        if want:
            v = flow.add_vertex()
            feed = flow.add_edge(source, v, want, 0)
            for m, cost in opts:
                edges.append((m, flow.add_edge(v, vertex[m], 1, cost)))
            # Seed with free picks up to each node's mandatory share: those units cost the least any
            # unit can, so the seeded flow is min-cost for its value and the search may go on from it.
            for m, e in edges:
                if flow.cost(e) == 0 and flow.residual(feed) and flow.residual(must[m]):
                    flow.push((feed, e, must[m]))
        item_edges.append(edges)

    flow.run(source, sink)
    if flow.total != demand or any(flow.residual(e) for e in must.values()):
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
