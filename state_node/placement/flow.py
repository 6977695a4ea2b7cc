"""Balanced choices by min-cost flow: pick nodes for items so that every node's count (over all items, and per
group of items) ends at the floor or the ceiling, at least cost. The exact placement's engine."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def balanced_choice(
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

    flow = MinCostFlow()
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


class MinCostFlow:
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
