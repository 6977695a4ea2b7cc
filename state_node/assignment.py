"""The controller's placement rule: which nodes should serve each partition, preferred replica first.

A pure function of (stores, live nodes, previous assignment): balanced, sticky and deterministic.

How it works (and why in two stages):

1. Preferred replicas (leaders). Partitions are taken in classes of ascending replica count r; after
   each class, every node leads floor or ceil of (partitions of classes <= r) / nodes. Within those
   caps a partition keeps its previous leader, else moves to a previous holder, else to the least
   loaded node. This nesting is what makes stage 2 always solvable: partitions with few replicas have
   the fewest placement choices, and spreading their leaders first is what leaves room for balanced
   totals (with r=1 stores the leader *is* the whole replica set).
2. Other replicas (followers): a min-cost flow from partitions to nodes (never the partition's own
   leader, at most once per node) in which every node ends with floor or ceil of R / nodes replicas in
   total (R = replicas of all stores). Keeping a replica where the previous assignment had it costs 0,
   placing one anywhere else costs 1, so among balanced placements the one that moves least wins.

Everything is ordered by store name, partition number and node id, never by set or dict hash order,
so identical inputs give identical output in every process.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from keyroute_core.partition_map import Assignment

# (partitions, replication_factor) per store, as the pipeline published them.
StoreShape = tuple[int, int]


class AssignmentError(ValueError):
    """A store shape that cannot be assigned (negative partitions, replication factor below 1)."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """One partition of one store, with the replicas it should get and the ones it had."""

    store: str
    partition: int
    replicas: int  # min(replication factor, live nodes)
    previous: tuple[str, ...]  # previous replicas still alive, preferred first, deduplicated
    previous_leader: str | None  # the previous preferred replica, if it is still alive


def assign(
    stores: Mapping[str, StoreShape],
    nodes: Sequence[str],
    previous: Assignment | None,
    generation: int,
) -> Assignment:
    """The desired placement of every partition of `stores` on `nodes`.

    Guarantees, for every input (see tests/property/test_assignment_props.py):
      - partition p gets min(replication_factor, len(nodes)) distinct nodes (none when there are none);
      - replicas per node (all stores together) differ by at most 1 between any two nodes;
      - preferred replicas (first in each list) per node differ by at most 1;
      - the same inputs give the same output;
      - sticky: when only one node leaves, no replica on a surviving node moves (see `moved_replicas`).
    """
    members = sorted(set(nodes))
    for name, (partitions, rf) in stores.items():
        if partitions < 0 or rf < 1:
            raise AssignmentError(f"store {name!r}: {partitions} partitions with replication factor {rf}")
    if not members:
        return Assignment(generation, {name: ((),) * stores[name][0] for name in sorted(stores)})

    alive = set(members)
    slots: list[_Slot] = []
    for name in sorted(stores):
        partitions, rf = stores[name]
        for p in range(partitions):
            before = previous.replicas(name, p) if previous is not None else ()
            kept = tuple(dict.fromkeys(n for n in before if n in alive))
            leader = before[0] if before and before[0] in alive else None
            slots.append(_Slot(name, p, min(rf, len(members)), kept, leader))

    best = None
    for nested in (False, True):
        leaders = _place_leaders(slots, members, nested)
        followers = _place_followers(slots, members, leaders)
        if followers is None:
            continue
        cost = sum(len(set(f) | {l}) - len((set(f) | {l}) & set(s.previous)) for s, l, f in zip(slots, leaders, followers))
        if best is None or cost < best[0]:
            best = (cost, leaders, followers)
    assert best is not None
    _, leaders, followers = best

    placed: dict[str, list[tuple[str, ...]]] = {name: [] for name in sorted(stores)}
    for slot, leader, extra in zip(slots, leaders, followers, strict=True):
        # Followers keep their previous order (the next preferred stays next), new ones go last.
        rank = {n: i for i, n in enumerate(slot.previous)}
        ordered = sorted(extra, key=lambda n: (rank.get(n, len(rank)), n))
        placed[slot.store].append((leader, *ordered))
    return Assignment(generation, {name: tuple(per) for name, per in placed.items()})


def moved_replicas(before: Assignment, after: Assignment) -> int:
    """How many (store, partition, node) replicas `after` has that `before` did not: the partitions
    some node must load because of the change. Preferred-replica changes alone move no data."""
    moved = 0
    for store, per_partition in after.stores.items():
        for p, replicas in enumerate(per_partition):
            moved += len(set(replicas) - set(before.replicas(store, p)))
    return moved


def _shares(total: int, members: int) -> tuple[int, int]:
    """Balanced split of `total` over `members`: everyone gets floor, `extra` of them one more."""
    return divmod(total, members)


def _place_leaders(slots: Sequence[_Slot], members: Sequence[str], nested: bool) -> list[str]:
    n = len(members)
    leads = dict.fromkeys(members, 0)
    leader: list[str | None] = [None] * len(slots)
    by_class: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        by_class.setdefault(slot.replicas if nested else 0, []).append(i)

    placed_so_far = 0
    for r in sorted(by_class):
        indices = by_class[r]
        placed_so_far += len(indices)
        floor, extra = _shares(placed_so_far, n)
        # Nodes already at floor+1 from smaller classes keep their extra; the rest compete for the others.
        at_ceiling = sum(1 for m in members if leads[m] > floor)

        def can_take(node: str) -> bool:
            count = leads[node]
            return count < floor or (count == floor and at_ceiling < extra)

        def take(i: int, node: str) -> None:
            nonlocal at_ceiling
            if leads[node] == floor:
                at_ceiling += 1
            leads[node] += 1
            leader[i] = node

        # Three passes, most sticky first, so a previous leader is never displaced by a partition that
        # merely prefers the same node as its second choice.
        for i in indices:
            prev = slots[i].previous_leader
            if prev is not None and can_take(prev):
                take(i, prev)
        for i in indices:
            if leader[i] is None:
                for node in slots[i].previous:
                    if can_take(node):
                        take(i, node)
                        break
        for i in indices:
            if leader[i] is None:
                node = min((m for m in members if can_take(m)), key=lambda m: (leads[m], m))
                take(i, node)
    return [node for node in leader if node is not None]


def _place_followers(slots: Sequence[_Slot], members: Sequence[str], leaders: Sequence[str]) -> list[list[str]] | None:
    n = len(members)
    total = sum(slot.replicas for slot in slots)
    floor, extra = _shares(total, n)
    leads = dict.fromkeys(members, 0)
    for node in leaders:
        leads[node] += 1
    demand = sum(slot.replicas - 1 for slot in slots)

    flow = _MinCostFlow()
    source, sink = flow.add_vertex(), flow.add_vertex()
    node_vertex = {m: flow.add_vertex() for m in members}
    # A node's replicas up to `floor` are mandatory: a large negative cost makes the flow fill those
    # first, ahead of any stickiness saving (which is at most `demand`).
    mandatory_cost = -(demand + 1)
    lower_edges: dict[str, int] = {}
    for m in members:
        lower = max(0, floor - leads[m])
        upper = max(0, floor + (1 if extra else 0) - leads[m])
        lower_edges[m] = flow.add_edge(node_vertex[m], sink, lower, mandatory_cost)
        flow.add_edge(node_vertex[m], sink, upper - lower, 0)

    slot_edges: list[dict[str, int]] = []
    for slot, lead in zip(slots, leaders, strict=True):
        want = slot.replicas - 1
        edges: dict[str, int] = {}
        if want:
            v = flow.add_vertex()
            flow.add_edge(source, v, want, 0)
            kept = set(slot.previous)
            for m in members:
                if m != lead:
                    edges[m] = flow.add_edge(v, node_vertex[m], 1, 0 if m in kept else 1)
        slot_edges.append(edges)

    # Seed with kept replicas that fit under the mandatory share: every such unit already costs the
    # least any unit can, so the seeded flow is min-cost for its value and the search continues from it.
    for slot, lead, edges in zip(slots, leaders, slot_edges, strict=True):
        for m in slot.previous:
            if m in edges and flow.residual(edges[m]) and flow.residual(lower_edges[m]):
                if flow.residual_from_source(edges[m]) == 0:
                    break
                flow.push_path([edges[m], lower_edges[m]], source_edge_of=edges[m])

    sent = flow.run(source, sink)
    if sent != demand - flow.seeded:
        return None
    if any(flow.residual(e) for e in lower_edges.values()):
        return None
    return [[m for m, e in edges.items() if flow.flow_on(e)] for edges in slot_edges]


class _MinCostFlow:
    """Successive shortest paths with Johnson potentials; small graphs, integer costs."""

    def __init__(self) -> None:
        self._adj: list[list[int]] = []
        self._to: list[int] = []
        self._cap: list[int] = []
        self._cost: list[int] = []
        self._from: list[int] = []
        self._source_edge: dict[int, int] = {}  # partition vertex -> its edge from the source
        self.seeded = 0

    def add_vertex(self) -> int:
        self._adj.append([])
        return len(self._adj) - 1

    def add_edge(self, u: int, v: int, cap: int, cost: int) -> int:
        e = len(self._to)
        for a, b, c, w in ((u, v, cap, cost), (v, u, 0, -cost)):
            self._adj[a].append(len(self._to))
            self._from.append(a)
            self._to.append(b)
            self._cap.append(c)
            self._cost.append(w)
        if u == 0:
            self._source_edge[v] = e
        return e

    def residual(self, e: int) -> int:
        return self._cap[e]

    def flow_on(self, e: int) -> int:
        return self._cap[e ^ 1]

    def residual_from_source(self, e: int) -> int:
        return self._cap[self._source_edge[self._from[e]]]

    def push_path(self, edges: Sequence[int], source_edge_of: int) -> None:
        for e in (self._source_edge[self._from[source_edge_of]], *edges):
            self._cap[e] -= 1
            self._cap[e ^ 1] += 1
        self.seeded += 1

    def run(self, source: int, sink: int) -> int:
        size = len(self._adj)
        potential = self._bellman_ford(source)
        sent = 0
        while True:
            dist: list[float] = [float("inf")] * size
            via = [-1] * size
            dist[source] = 0
            heap = [(0.0, source)]
            while heap:
                d, u = heapq.heappop(heap)
                if d > dist[u]:
                    continue
                for e in self._adj[u]:
                    if self._cap[e] <= 0:
                        continue
                    v = self._to[e]
                    nd = d + self._cost[e] + potential[u] - potential[v]
                    if nd < dist[v]:
                        dist[v], via[v] = nd, e
                        heapq.heappush(heap, (nd, v))
            if dist[sink] == float("inf"):
                return sent
            for v in range(size):
                if dist[v] < float("inf"):
                    potential[v] += dist[v]
            push, v = None, sink
            while v != source:
                e = via[v]
                push = self._cap[e] if push is None else min(push, self._cap[e])
                v = self._from[e]
            assert push is not None
            v = sink
            while v != source:
                e = via[v]
                self._cap[e] -= push
                self._cap[e ^ 1] += push
                v = self._from[e]
            sent += push

    def _bellman_ford(self, source: int) -> list[float]:
        # Initial potentials: shortest distances in the residual graph (it may hold negative costs, never
        # a negative cycle, because the current flow is min-cost for its value).
        size = len(self._adj)
        dist: list[float] = [float("inf")] * size
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
                if self._cap[e] > 0 and dist[u] + self._cost[e] < dist[self._to[e]]:
                    v = self._to[e]
                    dist[v] = dist[u] + self._cost[e]
                    if not queued[v]:
                        queued[v] = True
                        queue.append(v)
        return [d if d < float("inf") else 0.0 for d in dist]
